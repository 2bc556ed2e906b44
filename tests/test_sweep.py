"""``neutreno sweep``: a grid of digits runs, tabulated; a restart redoes nothing; subprocess jobs."""

import csv
import json
from pathlib import Path

import pytest
import yaml

from conftest import digits_config
from neutreno.cli.main import main
from neutreno.training import sweep

DIGITS = digits_config(
    model={"name": "vit_digits", "attention": "neutreno", "args": {"depth": 2}},
    train={"epochs": 1, "batch_size": 64},
)


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "digits.yaml"
    path.write_text(yaml.safe_dump(DIGITS))
    return path


def test_sweep_trains_the_grid_tabulates_it_and_restarts_without_redoing(
    config, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "sweep"
    args = ["sweep", str(config), "--grid", "model.lam=0,0.5", "--grid", "train.seed=0,1", "--out", str(out)]
    assert main(args) == 0
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert [(r["model.lam"], r["train.seed"]) for r in rows] == [
        ("0", "0"),
        ("0", "1"),
        ("0.5", "0"),
        ("0.5", "1"),
    ]
    for row in rows:
        run = out / f"model.lam={row['model.lam']},train.seed={row['train.seed']}"
        results = json.loads((run / "results.json").read_text())
        assert results["config"]["model"]["lam"] == float(row["model.lam"])
        assert results["config"]["train"]["seed"] == int(row["train.seed"])
        assert float(row["top1"]) == pytest.approx(results["val"]["model"]["top1"])
    assert json.loads((out / "sweep.json").read_text())["main_metric"] == "top1"
    assert (out / "sweep.md").read_text().startswith("| model.lam | train.seed | top1 |")
    assert (out / "sweep.png").stat().st_size > 0

    # A restart trains only what has not finished: here the one run whose results were removed.
    (out / "model.lam=0.5,train.seed=1" / "results.json").unlink()
    trained = []
    real = sweep.train_to_end
    monkeypatch.setattr(sweep, "train_to_end", lambda cfg: trained.append(cfg.train.out_dir) or real(cfg))
    capsys.readouterr()
    assert main(args) == 0
    assert trained == [str(out / "model.lam=0.5,train.seed=1")]
    assert "4 runs, 3 already finished, 1 to train" in capsys.readouterr().out
    assert list(csv.DictReader((out / "sweep.csv").open())) == rows  # the resumed run ends where it had

    # A finished run trained under torchrun by two processes (another global batch, which no grid value
    # says) was tabulated beside the one-process runs as one experiment.
    path = out / "model.lam=0,train.seed=1" / "results.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "processes": 2}))
    capsys.readouterr()
    assert main(args) == 1
    error = capsys.readouterr().err.strip()
    assert "trained by different numbers of processes (model.lam=0,train.seed=0: 1, " in error, error
    assert "model.lam=0,train.seed=1: 2" in error and "\n" not in error


def test_jobs_run_as_subprocesses_and_failures_are_reported(config, tmp_path, capsys):
    out = tmp_path / "jobs"
    args = ["sweep", str(config), "--grid", "model.lam=0.2,0.4", "--jobs", "2", "--out", str(out)]
    assert main(args) == 0
    assert all((out / f"model.lam={lam}" / "train.log").is_file() for lam in ("0.2", "0.4"))
    assert len(list(csv.DictReader((out / "sweep.csv").open()))) == 2

    bad = [
        "sweep",
        str(config),
        "--grid",
        "data.train=digits,no_such_folder",
        "--jobs",
        "2",
        "--out",
        str(tmp_path / "b"),
    ]
    assert main(bad) == 1
    err = capsys.readouterr().err
    assert "runs failed: data.train=no_such_folder (exit 2" in err


def test_one_job_at_a_time_trains_the_runs_after_a_failed_one(config, tmp_path, capsys):
    """With --jobs 1 the first failure ended the sweep: the runs after it never trained. An earlier
    sweep's report in the folder was left beside the failed one, to be read as its result."""
    out = tmp_path / "one"
    out.mkdir()
    for name in ("sweep.json", "sweep.csv", "sweep.md", "sweep.png"):
        (out / name).write_text("an earlier sweep's")
    args = ["sweep", str(config), "--grid", "optim.lr=1e4,2e-3", "--set", "train.max_steps=5"]
    args += ["--out", str(out)]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "runs failed: optim.lr=1e4 (" in err and "nothing non-finite was saved" in err, err
    assert (out / "optim.lr=2e-3" / "results.json").is_file()
    assert not list(out.glob("sweep.*"))


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        (["model.lam"], "expected KEY=V1,V2,… with distinct values"),
        (["model.lam=0,0"], "with distinct values"),
        # one value spelled twice trained one config into two folders, two rows of the table
        (["model.lam=0.5,0.50"], "--grid points model.lam=0.5 and model.lam=0.50 are one config"),
        # model.args is untyped (2 and 2.0 kept apart), and null is the variant's default λ, 0.6
        (["model.args.mlp_ratio=2,2.0"], "model.args.mlp_ratio=2 and model.args.mlp_ratio=2.0 are one"),
        (["model.lam=null,0.6"], "--grid points model.lam=null and model.lam=0.6 are one config"),
        (["model.lam=0,0.2", "model.lam=0.4"], "give each --grid key once"),
        (["model.lam=0,-1"], "(at grid point model.lam=-1)"),
        (["model.bogus=1,2"], "model.bogus"),
        (["train.finetune=a/b,a_b"], "train.finetune=a/b and train.finetune=a_b would share the folder"),
        # the later key won, while rows, folders and the plot named the earlier's value
        (
            ["model.lam=0.2", "model={lam: 0.6},{lam: 1.0}"],
            "--grid model.lam and --grid model both set model.lam",
        ),
        # ignored (the run went to --out/<point>), or "one config" without why
        (["train.out_dir=elsewhere"], "--grid train.out_dir: sets train.out_dir, which the sweep sets"),
        (["train={out_dir: a},{out_dir: b}"], "--grid train: sets train.out_dir, which the sweep sets"),
        # found when the softmax point started, after the NeuTRENO one had trained
        (
            ["model.attention=neutreno,softmax", "train.lam_warmup_steps=5"],
            "train.lam_warmup_steps: model.attention 'softmax' has no NeuTRENO λ to warm up",
        ),
    ],
)
def test_bad_grids_are_refused_before_training(config, tmp_path, capsys, grid, message):
    args = ["sweep", str(config), *(a for g in grid for a in ("--grid", g)), "--out", str(tmp_path / "o")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("neutreno sweep: error:") and message in err and "\n" not in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        # the sweep sets these after --set: the value given was ignored, exit 0
        (
            ["--set", "train.out_dir=elsewhere"],
            "--set train.out_dir: each run's folder is --out/<grid point>",
        ),
        (["--set", "model.lam=0.3"], "--set model.lam: it is a --grid key"),
        (["--set", "train={out_dir: elsewhere}"], "--set train (its train.out_dir): each run's folder is"),
        (["--set", "model={lam: 0.3}"], "--set model (its model.lam): it is a --grid key"),
        # steps win over epochs given in one place: the points trained alike, labelled otherwise
        (
            ["--grid", "train.epochs=1,3", "--set", "train.total_steps=4"],
            "--grid train.epochs: train.total_steps (4)",
        ),
        # a grid of mappings sets their keys: --set model.args.depth=3 was replaced by each point's
        (
            ["--grid", "model.args={depth: 1},{depth: 2}", "--set", "model.args.depth=3"],
            "--set model.args.depth: it is a --grid key",
        ),
        (
            ["--grid", "train={seed: 0},{seed: 1}", "--set", "train.seed=5"],
            "--set train.seed: it is a --grid",
        ),
        (
            ["--grid", "train={epochs: 1},{epochs: 3}", "--set", "train.total_steps=4"],
            "--grid train.epochs: train.total_steps (4)",
        ),
        (["--grid", "data.mean=[0.3, 0.4],[0.5]"], "--grid data.mean: '[0.3' is not valid YAML"),
    ],
)
def test_a_value_the_sweep_would_ignore_is_refused(config, tmp_path, capsys, options, message):
    args = ["sweep", str(config), "--grid", "model.lam=0,0.5", *options, "--out", str(tmp_path / "o")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err
    assert not (tmp_path / "o").exists() and not (tmp_path / "elsewhere").exists()


def test_an_unfinished_run_of_other_settings_is_refused_not_resumed(config, tmp_path, monkeypatch, capsys):
    """A sweep resumes an interrupted run by itself. One started with another learning rate was resumed
    under the new one (a warning in its log) and reported as if trained with it: a hybrid of two runs."""
    out = tmp_path / "sweep"
    args = ["sweep", str(config), "--grid", "model.lam=0.5", "--out", str(out)]
    assert main(args) == 0
    run = out / "model.lam=0.5"
    (run / "results.json").unlink()  # as if stopped after its last checkpoint
    trained = []
    monkeypatch.setattr(sweep, "train_to_end", lambda cfg: trained.append(cfg) or pytest.fail("trained"))
    capsys.readouterr()
    assert main([*args, "--set", "optim.lr=0.0031", "--set", "train.seed=7"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        "holds an unfinished run of another config (optim.lr, train.seed differ)" in err and "\n" not in err
    )
    assert not trained and not (run / "results.json").exists()
    assert (out / "sweep.csv").is_file()  # the last sweep's report stays (a refused sweep had removed it)


def test_rows_name_the_lam_warm_up_factor_and_the_plot_joins_points_in_the_order_of_x(
    config, tmp_path, monkeypatch
):
    """A run that ends inside the λ warm-up is scored at λ × lam_scale: its row said λ alone. And the
    plot joined the points in the order the grid was typed, so 0.5,0,0.2 drew a V from a straight line."""
    from matplotlib.axes import Axes

    out = tmp_path / "sweep"
    grid = ["--grid", "model.lam=0.5,0,0.2"]
    overrides = ["--set", "train.max_steps=4", "--set", "train.lam_warmup_steps=8"]
    drawn = []
    real_plot = Axes.plot
    monkeypatch.setattr(
        Axes, "plot", lambda self, x, y, **kw: drawn.append(list(x)) or real_plot(self, x, y, **kw)
    )
    assert main(["sweep", str(config), *grid, *overrides, "--out", str(out)]) == 0
    rows = {r["model.lam"]: r for r in csv.DictReader((out / "sweep.csv").open())}
    for lam, row in rows.items():
        results = json.loads((out / f"model.lam={lam}" / "results.json").read_text())
        if lam == "0":  # scores that cannot depend on the factor: none said (found in review: it was)
            assert "lam_scale" not in results and row["lam_scale"] == ""
            continue
        assert 0 < results["lam_scale"] < 1 and float(row["lam_scale"]) == pytest.approx(results["lam_scale"])
    assert [0.0, 0.2, 0.5] in drawn and [0.5, 0.0, 0.2] not in drawn  # (the runs draw their curves too)


def test_the_plot_draws_a_null_lam_at_the_lam_it_runs_and_text_values_by_rank(config, tmp_path, monkeypatch):
    """Found in review: x was the grid's text, so null,0.2,0.1 drew [0.1, 0.2, 'null'], matplotlib's three
    categories evenly spaced, and null (λ 0.6) after 0.9 in null,0.2,0.9. A grid of names is drawn by
    rank, its texts on the ticks."""
    from matplotlib.axes import Axes

    drawn = []
    real_plot = Axes.plot
    monkeypatch.setattr(
        Axes, "plot", lambda self, x, y, **kw: drawn.append(list(x)) or real_plot(self, x, y, **kw)
    )
    runs = sweep.plan_sweep(config, ["model.lam=null,0.2,0.9", "train.seed=0"], tmp_path / "a")
    rows = [{**run.values, "top1": 50.0 + i} for i, run in enumerate(runs)]
    sweep.write_report(tmp_path / "a", runs, rows)
    assert drawn == [[0.2, 0.6, 0.9]]
    drawn.clear()
    runs = sweep.plan_sweep(config, ["model.attention=softmax,neutreno"], tmp_path / "b")
    sweep.write_report(tmp_path / "b", runs, [{**run.values, "top1": 50.0} for run in runs])
    assert drawn == [[0.0, 1.0]]


def test_a_language_models_null_lam_is_its_own_default(tmp_path):
    """λ null is 0.4 for the language model (0.6 for vision): null,0.6 was refused as one config, and
    null,0.4 (one model) trained twice."""
    from neutreno.config import ConfigError

    config = "configs/lm_wt103_mini_neutreno.yaml"
    with pytest.raises(ConfigError, match=r"model\.lam=null and model\.lam=0\.4 are one config"):
        sweep.plan_sweep(config, ["model.lam=null,0.4"], tmp_path / "a")
    assert len(sweep.plan_sweep(config, ["model.lam=null,0.6"], tmp_path / "b")) == 2


def test_a_score_that_is_not_finite_reads_so_in_the_sweep_table(tmp_path):
    """results.json holds a perplexity past float range as null: sweep.md showed it as "None"."""
    import types

    from neutreno.training.sweep import SweepRun, summarize, write_report

    config = types.SimpleNamespace(task="language_model")
    runs = [SweepRun({"model.lam": lam}, tmp_path / lam, config) for lam in ("0", "0.4")]
    results = [
        {"val": {"model": {"ppl": None, "loss": 5538.5}}},
        {"val": {"model": {"ppl": 31.5, "loss": 3.45}}},
    ]
    write_report(tmp_path, runs, summarize(runs, results))
    table = (tmp_path / "sweep.md").read_text()
    assert "| 0 | not finite | 5538 |" in table.replace("  ", " ") and "None" not in table


def test_the_ema_scores_are_in_the_sweep_table():
    """Found in review: the tables held the raw model's scores only, so a sweep over train.ema_decay
    read the same at every point (an EMA does not change training); the EMA's are named as metrics.jsonl
    names them."""
    import types

    from neutreno.training.sweep import SweepRun, summarize

    config = types.SimpleNamespace(task="classification")
    runs = [SweepRun({"train.ema_decay": d}, Path(d), config) for d in ("null", "0.9")]
    results = [
        {"val": {"model": {"top1": 10.0, "count": 360}}},
        {"val": {"model": {"top1": 10.0, "count": 360}, "ema": {"top1": 9.2, "count": 360}}},
    ]
    assert summarize(runs, results) == [
        {"train.ema_decay": "null", "top1": 10.0},
        {"train.ema_decay": "0.9", "top1": 10.0, "ema_top1": 9.2},
    ]
