"""Claims of Dovonon et al., "Setting the Record Straight on Transformer Oversmoothing": smoothing is
not inevitable; the sign of H = W_V W_O's eigenvalues decides it, and LayerNorm's sign can flip it."""

from __future__ import annotations

import math

from neutreno.reporting import metric_name
from neutreno.reproduce.claim import claim, converged, convergence_record, parts_record, scale_note, spread
from neutreno.reproduce.runs import CIFAR_TEST, IMAGENETTE, MINILM, WIKITEXT, Context, Run
from neutreno.reproduce.stats import CONFIDENCE, Interval, mean_interval
from neutreno.reproduce.verdict import AGREES, DISAGREES, INCONCLUSIVE, Part, Verdict

SIGNED = ("eigen_pos", "eigen_neg")
SIGNED_NAMES = {"eigen_pos": "“+”: H = +diag(ψ)², smoothing", "eigen_neg": "“−”: H = −diag(ψ)², sharpening"}


@claim(
    name="smoothing-sharpening",
    title="“+” attention smooths, “−” keeps high frequencies",
    source="Dovonon et al., §5 (Fig. 3)",
    paper="With H = W_V W_O's eigenvalues made positive (“+”) every layer smooths and the high-frequency "
    "part of the tokens fades with depth; made negative (“−”) layers sharpen and it does not.",
    minutes=(0.3, 1.0, 1.5),
    arms={"cifar": SIGNED},
)
def smoothing_sharpening(ctx: Context) -> dict:
    from neutreno.studies.spectrum import measure_variant

    samples = ctx.pick(200, 1000, 1000)
    measured: dict[str, list[dict]] = {arm: [] for arm in SIGNED}
    for arm in SIGNED:
        for seed in ctx.seed_list:
            run = Run("cifar", arm, seed)
            ctx.results(run)  # trained (or reused) before it is measured
            measured[arm].append(measure_variant(ctx.run_dir(run), ctx.data(CIFAR_TEST), None, samples))
    kept = {
        arm: [m["high_frequency"][-1] / m["high_frequency"][0] for m in runs]
        for arm, runs in measured.items()
    }
    expected = {"eigen_pos": "smooth", "eigen_neg": "sharpen"}
    match = {
        arm: sum(r == expected[arm] for m in runs for r in m["regime"]) / sum(len(m["regime"]) for m in runs)
        for arm, runs in measured.items()
    }
    part = Part(
        "“−” keeps more of its input's high-frequency ratio than “+”",
        [n - p for p, n in zip(kept["eigen_pos"], kept["eigen_neg"], strict=True)],
    )
    depth = len(measured["eigen_pos"][0]["high_frequency"])
    return {
        "setting": f"high-frequency ratio ‖res(X)‖/‖1x̄ᵀ‖ of each layer on {samples} CIFAR-10 test images; "
        f"{scale_note(ctx, 'cifar', 'eigen_pos')}",
        "claim": "“−” keeps more high frequencies than “+”",
        "kept": kept,
        "regime_match": match,
        "parts": parts_record([part]),
        "convergence": convergence_record(converged(ctx, "cifar", SIGNED)),
        "ours": f"high-frequency ratio kept to the last layer: + {spread(kept['eigen_pos'], 3)}, − "
        f"{spread(kept['eigen_neg'], 3)}; regimes as predicted: + {match['eigen_pos']:.0%}, "
        f"− {match['eigen_neg']:.0%}",
        "table": [["layer", "+ (mean ± sd)", "− (mean ± sd)"]]
        + [
            [k, *(spread([m["high_frequency"][k] for m in measured[a]], 3) for a in SIGNED)]
            for k in range(depth)
        ]
        + [["kept (last / first)", *(spread(kept[a], 3) for a in SIGNED)]]
        + [["regimes as predicted", *(f"{match[a]:.0%}" for a in SIGNED)]],
        "plot": {
            "kind": "lines",
            "x": list(range(depth)),
            "series": {
                SIGNED_NAMES[a]: [
                    mean_interval([m["high_frequency"][k] for m in measured[a]]).mean for k in range(depth)
                ]
                for a in SIGNED
            },
            "xlabel": "layer (0 = embeddings)",
            "ylabel": f"{metric_name('high_frequency')}, mean over seeds",
        },
    }


@claim(
    name="pretrained-regimes",
    title="Pretrained models do not all smooth; LayerNorm's sign can flip a layer",
    source="Dovonon et al., §4 (Fig. 2) and §4.2",
    paper="Pretrained transformers have layers that sharpen as well as layers that smooth; negating a "
    "layer's LayerNorm gain negates H_eff = diag(γ) W_V W_O and can flip its regime.",
    minutes=(0.3, 0.5, 0.8),
    needs=(f"{WIKITEXT}/wiki.valid.tokens", MINILM, IMAGENETTE),
    judge=lambda m: judge_regimes(m),
    rule="agrees when a MiniLM layer sharpens (its high-frequency change's interval over sentences above "
    "zero at the Bonferroni level) and the sign of the “+” ViT's measured change flips in every layer (its "
    "intervals over images, before and after, on either side of zero); disagrees when every layer keeps "
    "its sign beyond the noise; otherwise inconclusive (one model smoothing everywhere cannot refute "
    "that some pretrained models sharpen)",
)
def pretrained_regimes(ctx: Context) -> dict:
    """Two parts. (1) The real MiniLM, per layer: does its attention sharpen or smooth the sentences it
    reads? The measured change of the high-frequency ratio from the layer's input X to its attention
    update X + A X W_V W_O (math.md §3; BERT's sum before the sublayer's LayerNorm), per sentence (paired
    items), with the regime math.md §3 predicts beside it. (The whole block's change, shown too, adds the
    feed-forward sublayer, which the regimes do not describe: it made layer 5 "sharpen" though its
    attention smooths.) (2) The flip: a "+" (eigen_pos) DeiT-tiny
    at random initialisation, whose H is positive by construction, measured on real images as it is
    and with each layer's LayerNorm sign flipped (W_Q, W_K compensated, so only H changes sign). MiniLM
    is post-norm, where no such compensation exists, so the flip is measured on the pre-norm model."""

    from neutreno.diagnostics.analysis import build_variants, image_batches, probe_for
    from neutreno.diagnostics.spectral import (
        layer_spectra,
        sign_flip_changes,
        terms_beyond_the_rule,
        value_output_maps,
    )
    from neutreno.reproduce.claims.smoothing import _minilm

    samples = ctx.pick(64, 128, 200)
    variant, batches = _minilm(ctx, samples)
    block, update = _attention_updates(variant, batches)
    model = variant.model
    probed = probe_for(variant, attention=True)(batches[0])
    predicted = layer_spectra(value_output_maps(model), probed, terms_beyond_the_rule(model))
    layers = range(1, len(update) + 1)
    parts = [Part(f"layer {k} sharpens", (update[k] - block[k - 1]).tolist()) for k in layers]
    # shown beside it: the whole block, attention and feed-forward
    blocks = [Part(f"block {k}", (block[k] - block[k - 1]).tolist()).interval() for k in layers]
    intervals = [p.interval() for p in parts]
    # "some layer sharpens" has as many chances as layers: each is tested at the Bonferroni level
    strict = [p.interval(1 - 0.05 / len(parts)) for p in parts]
    sharpens = [k for k, i in zip(layers, strict, strict=True) if i.low > 0]
    smooths = [k for k, i in zip(layers, intervals, strict=True) if i.high < 0]

    (plus,) = build_variants("deit_tiny_patch16_224", ["eigen_pos"], [None], ctx.seed)
    images = image_batches(plus, ctx.data(IMAGENETTE), ctx.pick(32, 64, 64), 100, ctx.seed)[0]
    depth = len(plus.model.blocks)
    flip_rows = sign_flip_changes(plus.model, images)
    flipped, kept, unmeasured = flip_outcomes(flip_rows)
    flip_intervals = {k: (_interval(before), _interval(after)) for k, before, after in flip_rows}
    return {
        "setting": f"(1) the pretrained all-MiniLM-L6-v2 on {len(block[0])} WikiText-103 validation "
        "sentences (paired items), each layer's attention update X + A X W_V W_O against its input X "
        "(before the sublayer's LayerNorm; the whole block, with its feed-forward part, shown beside it); "
        f"(2) a “+” DeiT-tiny at random initialisation (seed {ctx.seed}) on "
        f"{len(images)} ImageNet images (paired items), each layer's LayerNorm sign flipped in turn",
        "layers": len(parts),
        "sharpens": sharpens,
        "smooths": smooths,
        "flipped": flipped,
        "kept": kept,
        "unmeasured_flips": unmeasured,
        "depth_flip": depth,
        "ours": f"MiniLM: {len(sharpens)} of {len(parts)} layers sharpen, {len(smooths)} smooth beyond "
        "the noise; "
        f"“+” ViT: flipping LN's sign flips {len(flipped)} of {depth} layers beyond the noise",
        "table": [
            [
                "MiniLM layer",
                "attention update: high-frequency ratio out − in (95% t over sentences)",
                "predicted",
                "whole block (attention + FFN), out − in",
            ]
        ]
        + [
            [k, i.text(3), s.regime, b.text(3)]
            for k, i, s, b in zip(layers, intervals, predicted, blocks, strict=True)
        ]
        + [["“+” ViT layer", "block out − in as it is (95% t over images)", "with LN's sign flipped", ""]]
        + [[k, before.text(3), after.text(3), ""] for k, (before, after) in flip_intervals.items()],
        "plot": {
            "kind": "lines",
            "x": list(flip_intervals),
            "series": {
                "“+” ViT, as it is": [b.mean for b, _ in flip_intervals.values()],
                "“+” ViT, LN sign flipped": [a.mean for _, a in flip_intervals.values()],
                "MiniLM, attention update": [i.mean for i in intervals]
                + [float("nan")] * (depth - len(intervals)),
            },
            "reference": {"no change": 0.0},
            "xlabel": "layer ℓ (block ℓ's output against its input)",
            "ylabel": "high-frequency ratio, output − input (< 0: smooths)",
        },
    }


def _attention_updates(variant, batches: list) -> tuple[dict, dict]:
    """A post-norm BERT's (transformers' ``BertModel``) high-frequency ratio of each sentence (S,), over
    its real tokens: ({layer index: ratio of its hidden states}, 0 = embeddings, k = block k's output,
    {k: ratio of block k's attention update X + A X W_V W_O with the biases}, X = hidden states k − 1,
    the sum that ``attention.output.LayerNorm`` receives), from one pass over the batches."""
    import torch

    from neutreno.diagnostics.analysis import probe_for
    from neutreno.diagnostics.layerwise import HIDDEN_METRICS

    layers = getattr(getattr(variant.model, "encoder", None), "layer", None)
    if layers is None or not all(hasattr(layer, "attention") for layer in layers):
        name = type(variant.model).__name__
        raise ValueError(f"{name} is not a BERT encoder: where its attention updates are is not known")
    metric, probe = HIDDEN_METRICS["high_frequency"], probe_for(variant, attention=False)
    updates: dict[int, torch.Tensor] = {}  # this batch's, by layer

    def keep(k: int):
        return lambda module, args: updates.__setitem__(k, args[0].detach())

    hidden_ratio: dict[int, list] = {}
    update_ratio: dict[int, list] = {}
    handles = [
        layer.attention.output.LayerNorm.register_forward_pre_hook(keep(k))
        for k, layer in enumerate(layers, start=1)
    ]
    try:
        for batch in batches:
            updates.clear()
            seen = probe(batch)
            for index, hidden in enumerate(seen.hidden):
                hidden_ratio.setdefault(index, []).append(metric(hidden, seen.mask).float())
            for k, update in updates.items():
                update_ratio.setdefault(k, []).append(metric(update, seen.mask).float())
    finally:
        for handle in handles:
            handle.remove()
    return (
        {k: torch.cat(v) for k, v in hidden_ratio.items()},
        {k: torch.cat(v) for k, v in update_ratio.items()},
    )


def _interval(values: list[float]) -> Interval:
    """The 95% t interval of per-image changes; NaN where one is not finite (the table shows it as such)."""
    if all(map(math.isfinite, values)):
        return mean_interval(values)
    return Interval(math.nan, math.nan, len(values), math.nan, math.nan, CONFIDENCE, None)


def flip_outcomes(rows: list[tuple[int, list[float], list[float]]]) -> tuple[list[int], list[int], list[int]]:
    """(layers whose regime the LN sign flip changed, layers whose regime it kept, layers whose change is
    not a finite number) of ``sign_flip_changes``' rows (layer, per-image changes as it is, flipped).
    Changed or kept only beyond the noise: both changes' 95% t intervals over the images exclude zero (a
    mean change of −1e-12 becoming +1e-12 was a flip); a layer with either interval holding zero is in
    neither list. A NaN is "not negative", so unchecked it counted as a regime kept, or changed."""
    unmeasured = [k for k, before, after in rows if not all(map(math.isfinite, [*before, *after]))]
    flipped, kept = [], []
    for k, before, after in rows:
        if k in unmeasured:
            continue
        signs = [Part("", values).beyond(CONFIDENCE) for values in (before, after)]
        if 0 not in signs:
            (flipped if signs[0] != signs[1] else kept).append(k)
    return flipped, kept, unmeasured


def judge_regimes(m: dict) -> Verdict:
    """Agrees when some MiniLM layer sharpens beyond the noise (Bonferroni over the layers) and flipping
    LN's sign flips every layer of the “+” model beyond the noise; disagrees when every layer keeps its
    regime beyond the noise (the mechanism fails on the model built to show it); anything else is
    inconclusive. "Pretrained transformers have sharpening layers" is a claim about some models: one
    pretrained model (MiniLM) smoothing in every layer does not refute it, so that is said plainly but
    judged inconclusive, not disagrees. (A record without ``kept``, measured before flips were judged
    against the noise, never disagrees.)"""
    kept = m.get("kept", [])
    said = (
        f"MiniLM: {len(m['sharpens'])} layer(s) sharpen, {len(m['smooths'])} smooth beyond the noise; "
        f"flipping LN's sign flips {len(m['flipped'])} and keeps {len(kept)} of {m['depth_flip']} layers "
        "of the “+” model beyond the noise"
    )
    if m.get("unmeasured_flips"):
        return Verdict(
            INCONCLUSIVE,
            f"{said}: the flip's change is not a finite number in layer(s) {m['unmeasured_flips']}",
        )
    if m["sharpens"] and len(m["flipped"]) == m["depth_flip"]:
        return Verdict(AGREES, f"{said}: not every pretrained layer smooths, and LN's sign decides")
    if len(kept) == m["depth_flip"]:
        return Verdict(DISAGREES, f"{said}: LN's sign decides no layer's regime")
    if len(m["smooths"]) == m["layers"]:
        return Verdict(
            INCONCLUSIVE,
            f"{said}: the one pretrained model measured smooths in every layer, against the paper's "
            "sharpening layers, which one model cannot refute",
        )
    return Verdict(INCONCLUSIVE, f"{said}: partly as claimed")
