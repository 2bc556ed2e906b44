"""Beyond the papers: is a learned λ better than the paper's hand-set one, and where does it settle?

The paper fixes λ by hand (0.6 vision, 0.4 language) and its ablation (Table 13) shows the choice
matters. ``model.args.learn_lam=layer`` learns one λ per layer (``softplus`` of a free parameter,
starting at the fixed λ, math.md §2); ``=head`` one per head. Both are trained on the same seeds as the
fixed-λ arm, so the comparison is paired by seed as every trained claim here.
"""

from __future__ import annotations

from neutreno.reproduce.claim import claim, per_seed, spread
from neutreno.reproduce.claims.accuracy import compare_arms
from neutreno.reproduce.runs import TRAININGS, Context
from neutreno.reproduce.stats import mean_interval

FIXED, LEARNED, LEARNED_HEAD = "neutreno", "neutreno_learned", "neutreno_learned_head"
TRAINED = ("cifar", "lm")
NAMES = {"cifar": "CIFAR-10 ViT", "lm": "WikiText-103 LM"}
SHORT = {"cifar": "ViT", "lm": "LM"}
MEASURED = {"cifar": "top-1 on CIFAR-10 test images", "lm": "validation perplexity of WikiText-103"}


def settled_lams(ctx: Context, training: str, arm: str) -> dict[int, list[float]]:
    """Per layer (1-based) the learned λ of every seed after training (a per-head λ: its heads' mean).
    Block 1 learns none (its term is λ(V⁰ − V⁰) = 0), so it is left out."""
    per_layer: dict[int, list[float]] = {}
    for lams in per_seed(ctx, training, arm, lambda model, seed: model.info["learned_lam"]):
        for layer, lam in enumerate(lams[1:], start=2):
            value = sum(lam) / len(lam) if isinstance(lam, list) else lam
            per_layer.setdefault(layer, []).append(value)
    return per_layer


@claim(
    name="learned-lambda",
    title="A learned λ beats the paper's fixed λ (our question, beyond the paper)",
    source="ours, beyond NeuTRENO Table 13 (App. G.8)",
    paper="Not a claim of the paper: it sets λ by hand (0.6 vision, 0.4 language) and shows in Table 13 "
    "that the choice matters. Asked here: does λ learned per layer (starting at the paper's value) beat "
    "the fixed λ on the CPU CIFAR-10 and WikiText-103 pairs, and where does it settle?",
    minutes=(0.2, 0.3, 0.3),
    arms={training: (FIXED, LEARNED, LEARNED_HEAD) for training in TRAINED},
)
def learned_lambda(ctx: Context) -> dict:
    compared = {
        training: compare_arms(
            ctx,
            training,
            FIXED,
            LEARNED,
            "a learned λ beats the fixed λ",
            {},
            MEASURED[training],
            shown=(LEARNED_HEAD,),
        )
        for training in TRAINED
    }
    settled = {
        training: {arm: settled_lams(ctx, training, arm) for arm in (LEARNED, LEARNED_HEAD)}
        for training in TRAINED
    }
    table = [["", "fixed λ", "learned per layer", "learned per head", "per layer vs fixed (95% t interval)"]]
    for training, result in compared.items():
        scores = result["scores"]
        table.append(
            [f"{NAMES[training]} {TRAININGS[training].metric}", *(spread(scores[a]) for a in scores),
             result["difference"]]  # named: "… top1" or "…'s ppl reduction …"
        )  # fmt: skip
    table.append(["λ after training, mean ± sd over seeds", "", "", "", ""])
    for training, by_arm in settled.items():
        for layer in by_arm[LEARNED]:
            table.append(
                [f"{NAMES[training]}, layer {layer}", f"{TRAININGS[training].lam:g}",
                 spread(by_arm[LEARNED][layer], 3), spread(by_arm[LEARNED_HEAD][layer], 3), ""]
            )  # fmt: skip
    parts = [p for result in compared.values() for p in result["parts"]]
    # each arm named with its training: both trainings have arms of the same names
    checks = [
        {**c, "arm": f"{SHORT[t]} {c['arm']}"}
        for t, result in compared.items()
        for c in result["convergence"]
    ]
    series = {
        f"{SHORT[t]}, per {per} (from {TRAININGS[t].lam:g})": settled[t][arm]
        for t in TRAINED
        for per, arm in (("layer", LEARNED), ("head, mean", LEARNED_HEAD))
    }
    return {
        "setting": "; ".join(f"{NAMES[t]}: {compared[t]['setting']}" for t in TRAINED),
        "claim": "a learned λ beats the fixed λ",
        "scores": {t: compared[t]["scores"] for t in TRAINED},
        "settled": {
            t: {arm: {str(k): v for k, v in by.items()} for arm, by in settled[t].items()} for t in TRAINED
        },
        "parts": parts,
        "convergence": checks,
        "ours": "; ".join(f"{NAMES[t]}: {compared[t]['ours']}" for t in TRAINED),
        "table": table,
        "plot": {
            "kind": "lines",
            "xs": {label: list(by_layer) for label, by_layer in series.items()},
            "x": sorted({layer for by_layer in series.values() for layer in by_layer}),
            "series": {label: [mean_interval(v).mean for v in by.values()] for label, by in series.items()},
            "errors": {
                label: [mean_interval(v).sd if len(v) > 1 else 0.0 for v in by.values()]
                for label, by in series.items()
            },
            "xlabel": "layer (the first learns no λ)",
            "ylabel": "learned λ after training\nmean ± sd over seeds",
        },
    }
