"""Pluggable training loggers (issue 20): metrics.jsonl as before, a logger of one's own in a real run,
TensorBoard, and MLflow / W&B against stand-in modules (their calls) or absent (one line naming the extra)."""

import json
import sys
import types

import pytest
import yaml

from conftest import digits_config
from neutreno.cli.main import main
from neutreno.config import from_dict, to_dict
from neutreno.training import JsonlLogger, Logger, MLflowLogger, WandbLogger, train
from neutreno.training.classification import ClassificationConfig, ClassificationTask
from neutreno.training.loggers import read_metrics

STEP = {"step": 1, "epoch": 0.5, "lr": 0.001, "loss": 2.25, "samples_per_s": 100.0, "grad_norm": 1.5}
VAL = {"step": 2, "epoch": 1.0, "split": "val", "top1": 50.0}


class Recorder(Logger):
    """A logger of one's own: keeps what it is given."""

    def __init__(self):
        self.configs, self.records, self.closed = [], [], 0

    def log_config(self, config):
        self.configs.append(config)

    def log(self, record, step):
        assert step == record["step"]
        self.records.append(record)

    def close(self):
        self.closed += 1


def run(tmp_path, extra=(), resume=False, **train_section) -> list[dict]:
    """A 4-step digits run into tmp_path/run with ``extra`` loggers; the records of its metrics.jsonl."""
    section = {"out_dir": str(tmp_path / "run"), "max_steps": 4, **train_section}
    cfg = from_dict(ClassificationConfig, digits_config(train=section))
    train(lambda: ClassificationTask(cfg), cfg.train, cfg.optim, to_dict(cfg), resume=resume, loggers=extra)
    return read_metrics(tmp_path / "run" / "metrics.jsonl")


def scalars(record):  # what TensorBoard, MLflow and W&B get: "<split>/<key>" without the step
    return {f"{record.get('split', 'train')}/{k}": v for k, v in record.items() if k not in ("step", "split")}


# ---- metrics.jsonl --------------------------------------------------------------------------------------


def test_jsonl_writes_one_json_line_per_record_as_before(tmp_path):
    logger = JsonlLogger(tmp_path)
    logger.log(STEP, 1)
    logger.log(VAL, 2)
    assert (tmp_path / "metrics.jsonl").read_text() == (
        '{"step": 1, "epoch": 0.5, "lr": 0.001, "loss": 2.25, "samples_per_s": 100.0, "grad_norm": 1.5}\n'
        '{"step": 2, "epoch": 1.0, "split": "val", "top1": 50.0}\n'
    )  # flushed per record: readable before close
    logger.close()


def test_jsonl_on_resume_drops_what_came_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in (1, 2)] + [json.dumps(VAL)]
    killed = [json.dumps({"step": 3, "loss": 0.3}), '{"step": 4, "lo']  # after the checkpoint; torn
    path.write_text("\n".join(lines + killed))
    # a new run (not resuming: the folder holds no checkpoint) starts afresh; it appended, and a run
    # that failed before its first checkpoint left its lines mixed with the next run's
    JsonlLogger(tmp_path).close()
    assert path.read_text() == ""
    path.write_text("\n".join(lines + killed))
    logger = JsonlLogger(tmp_path, resume_step=2)
    logger.log({"step": 3, "loss": 0.25}, 3)
    logger.close()
    assert path.read_text() == "".join(line + "\n" for line in [*lines, '{"step": 3, "loss": 0.25}'])


def test_jsonl_is_always_written_and_a_logger_of_ones_own_gets_the_same_records(tmp_path):
    recorder = Recorder()
    records = run(tmp_path, [recorder], loggers=[])
    assert [r["step"] for r in records if "split" not in r] == [1, 2, 3, 4]
    assert [r["split"] for r in records if "split" in r] == ["val"]  # the final evaluation
    assert recorder.records == records and recorder.closed == 1
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    resolved = json.loads((tmp_path / "run" / "results.json").read_text())["resolved"]
    assert recorder.configs == [{**config, "resolved": resolved}]

    # (train.loggers: [] still wrote metrics.jsonl: resuming and curves.png read it.) Resumed, each step is
    # logged once, though the killed run had logged past its checkpoint.
    with (tmp_path / "run" / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 5, "loss": 9.0}) + "\n")
    resumed = Recorder()
    records = run(tmp_path, [resumed], resume=True, max_steps=6)
    assert [r["step"] for r in records if "split" not in r] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in resumed.records] == [5, 6, 6] and resumed.records == records[-3:]


def test_a_logger_must_have_the_three_methods(tmp_path):
    cfg = from_dict(ClassificationConfig, digits_config(train={"out_dir": str(tmp_path / "run")}))
    with pytest.raises(TypeError, match=r"is not a logger: subclass neutreno\.training\.Logger"):
        train(lambda: None, cfg.train, cfg.optim, {}, loggers=[object()])
    assert not (tmp_path / "run").exists()


# ---- TensorBoard ----------------------------------------------------------------------------------------


def test_tensorboard_true_still_writes_event_files_with_the_records(tmp_path):
    pytest.importorskip(
        "tensorboard", reason="tensorboard is not installed (pip install 'neutreno[tensorboard]')"
    )
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = run(tmp_path, tensorboard=True)
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    loss = events.Scalars("train/loss")
    train = [r for r in records if "split" not in r]
    assert [e.step for e in loss] == [r["step"] for r in train]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in train], rel=1e-6)
    assert [e.step for e in events.Scalars("val/top1")] == [4]


# ---- MLflow and Weights & Biases, against stand-ins -----------------------------------------------------


def fake_mlflow(calls: list) -> types.ModuleType:
    mlflow = types.ModuleType("mlflow")

    def start_run(*, run_id=None, run_name=None):
        calls.append(("start_run", run_id, run_name))
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id=run_id or "mlflow-run-1"))

    mlflow.start_run = start_run
    mlflow.log_params = lambda params: calls.append(("log_params", params))
    mlflow.log_metrics = lambda metrics, *, step: calls.append(("log_metrics", metrics, step))
    mlflow.end_run = lambda *, status: calls.append(("end_run", status))
    return mlflow


def fake_wandb(calls: list) -> types.ModuleType:
    wandb = types.ModuleType("wandb")

    class Run:
        id = "wandb-run-1"
        config = types.SimpleNamespace(
            update=lambda config, *, allow_val_change: calls.append(("config.update", config))
        )

        def log(self, data, *, step):
            calls.append(("log", data, step))

        def finish(self, *, exit_code):
            calls.append(("finish", exit_code))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    wandb.init = init
    return wandb


def test_mlflow_logger_calls(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "mlflow", fake_mlflow(calls))
    logger = MLflowLogger(tmp_path / "run-a")
    logger.log_config({"task": "classification", "train": {"epochs": 2, "mean": [0.3]}})
    logger.log(STEP, 1)
    logger.log(VAL, 2)
    logger.close()
    assert calls == [
        ("start_run", None, "run-a"),
        ("log_params", {"task": "classification", "train.epochs": 2, "train.mean": [0.3]}),
        ("log_metrics", {"train/epoch": 0.5, "train/lr": 0.001, "train/loss": 2.25,
                         "train/samples_per_s": 100.0, "train/grad_norm": 1.5}, 1),
        ("log_metrics", {"val/epoch": 1.0, "val/top1": 50.0}, 2),
        ("end_run", "FINISHED"),
    ]  # fmt: skip
    # resumed: the same MLflow run continues, and its params (which MLflow cannot change) are kept
    calls.clear()
    logger = MLflowLogger(tmp_path / "run-a", resume_step=1)
    logger.log_config({"task": "classification"})
    logger.close()
    assert calls == [("start_run", "mlflow-run-1", None), ("end_run", "FINISHED")]


def test_wandb_logger_calls(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    logger = WandbLogger(tmp_path / "run-a", project="neutreno-tests")
    logger.log_config({"train": {"epochs": 2}})
    logger.log(STEP, 1)
    logger.log(VAL, 2)
    logger.close()
    assert calls == [
        ("init", {"dir": str(tmp_path / "run-a"), "project": "neutreno-tests", "name": "run-a"}),
        ("config.update", {"train": {"epochs": 2}}),
        ("log", {"train/epoch": 0.5, "train/lr": 0.001, "train/loss": 2.25, "train/samples_per_s": 100.0,
                 "train/grad_norm": 1.5}, 1),
        ("log", {"val/epoch": 1.0, "val/top1": 50.0}, 2),
        ("finish", 0),
    ]  # fmt: skip
    calls.clear()
    WandbLogger(tmp_path / "run-a", resume_step=1).close()  # resumed: the same W&B run continues
    assert calls[0] == (
        "init",
        {"dir": str(tmp_path / "run-a"), "id": "wandb-run-1", "resume": "allow", "name": "run-a"},
    )


def test_mlflow_and_wandb_named_in_the_config_get_every_record_of_a_run(tmp_path, monkeypatch):
    mlflow_calls, wandb_calls = [], []
    monkeypatch.setitem(sys.modules, "mlflow", fake_mlflow(mlflow_calls))
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(wandb_calls))
    records = run(tmp_path, loggers=["jsonl", "mlflow", "wandb"])
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert mlflow_calls[0] == ("start_run", None, "run") and mlflow_calls[-1] == ("end_run", "FINISHED")
    assert mlflow_calls[1][0] == "log_params" and mlflow_calls[1][1]["train.max_steps"] == 4
    assert mlflow_calls[2:-1] == [("log_metrics", scalars(r), r["step"]) for r in records]
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert wandb_calls[1:] == [
        ("config.update", {**config, "resolved": results["resolved"]}),
        *[("log", scalars(r), r["step"]) for r in records],
        ("finish", 0),
    ]
    assert (tmp_path / "run" / "mlflow_run_id").read_text().strip() == "mlflow-run-1"


def test_resuming_a_finished_run_starts_no_logger(tmp_path, monkeypatch):
    """The finished run's results stand: an MLflow run was started and given the config for nothing."""
    mlflow_calls = []
    monkeypatch.setitem(sys.modules, "mlflow", fake_mlflow(mlflow_calls))
    records = run(tmp_path, loggers=["jsonl", "mlflow"])
    calls = len(mlflow_calls)
    assert run(tmp_path, resume=True, loggers=["jsonl", "mlflow"]) == records
    assert len(mlflow_calls) == calls


# ---- not installed, or not a logger: one line, before any work ------------------------------------------


@pytest.mark.parametrize(
    ("override", "absent", "message"),
    [
        ("train.loggers=[mlflow]", "mlflow", "train.loggers: mlflow needs the mlflow package: "
         "pip install 'neutreno[mlflow]'"),
        ("train.loggers=[jsonl, wandb]", "wandb", "train.loggers: wandb needs the wandb package: "
         "pip install 'neutreno[wandb]'"),
        ("train.tensorboard=true", "tensorboard", "train.tensorboard: tensorboard needs the tensorboard "
         "package: pip install 'neutreno[tensorboard]'"),
        ("train.loggers=[neptune]", None, "train.loggers: 'neptune' is not one of jsonl, tensorboard, "
         "mlflow, wandb"),
        ("train.loggers=mlflow", None, "train.loggers: expected a list, got 'mlflow'"),
    ],
)  # fmt: skip
def test_a_logger_that_cannot_run_is_one_config_error_before_any_work(
    tmp_path, monkeypatch, capsys, override, absent, message
):
    if absent:
        monkeypatch.setitem(sys.modules, absent, None)  # as if not installed
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(digits_config()))
    assert main(["train", str(config), "--set", override, "--set", f"train.out_dir={tmp_path / 'run'}"]) == 2
    assert capsys.readouterr().err.strip() == f"neutreno train: error: {message}"
    assert not (tmp_path / "run").exists()


def test_a_logger_built_by_hand_without_its_package_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'neutreno\[mlflow\]'") as error:
        MLflowLogger(tmp_path)
    assert error.value.name == "mlflow"


def test_a_finished_run_is_the_same_run_whatever_its_loggers(tmp_path):
    """Where records go does not change what was trained: a finished run written before
    ``train.loggers`` existed, or with other loggers, is reused; another model is refused."""
    import json

    from neutreno.config import to_dict
    from neutreno.training.tasks import finished_results, load_train_config

    cfg = load_train_config("cifar10_vit_softmax", [f"train.out_dir={tmp_path}"])
    saved = to_dict(cfg)
    del saved["train"]["loggers"]  # a run from before the key existed
    saved["train"]["tensorboard"] = True
    (tmp_path / "results.json").write_text(json.dumps({"config": saved, "test": {"top1": 50.0}}))
    assert finished_results(cfg)["test"]["top1"] == 50.0
    # nor where it ran or how its data was loaded, as for train --resume (a sweep re-run with more
    # loader workers stopped: "a finished run of another config")
    moved = load_train_config("cifar10_vit_softmax", [f"train.out_dir={tmp_path}", "data.num_workers=3"])
    assert finished_results(moved)["test"]["top1"] == 50.0
    overrides = [f"train.out_dir={tmp_path}", "model.attention=neutreno"]
    other = load_train_config("cifar10_vit_softmax", overrides)
    with pytest.raises(ValueError, match="finished run of another config"):
        finished_results(other)


def test_a_failed_run_is_marked_so_and_loggers_given_to_train_are_closed_whatever_fails(
    tmp_path, monkeypatch
):
    """Found in review: a run that crashed was ended as FINISHED in MLflow and as successful in W&B (their
    defaults); loggers given to train() were left open when it failed before the trainer was built (a
    TensorBoard writer's thread ran on, its events unsaved)."""
    from neutreno.training.engine import ResumeError

    mlflow_calls, wandb_calls = [], []
    monkeypatch.setitem(sys.modules, "mlflow", fake_mlflow(mlflow_calls))
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(wandb_calls))
    real_loss = ClassificationTask.training_loss

    def fails_at_step_3(self, model, batch):
        if len([c for c in mlflow_calls if c[0] == "log_metrics"]) == 2:
            raise RuntimeError("boom")
        return real_loss(self, model, batch)

    monkeypatch.setattr(ClassificationTask, "training_loss", fails_at_step_3)
    recorder = Recorder()
    with pytest.raises(RuntimeError, match="boom"):
        run(tmp_path, extra=[recorder], loggers=["jsonl", "mlflow", "wandb"])
    assert mlflow_calls[-1] == ("end_run", "FAILED") and wandb_calls[-1] == ("finish", 1)
    assert recorder.closed == 1
    cfg = from_dict(ClassificationConfig, digits_config(train={"out_dir": str(tmp_path / "new")}))
    for make_task, resume in ((lambda: 1 / 0, False), (lambda: None, True)):  # no data; nothing to resume
        given = Recorder()
        with pytest.raises((ZeroDivisionError, ResumeError)):
            train(make_task, cfg.train, cfg.optim, {}, resume=resume, loggers=[given])
        assert given.closed == 1, resume
    given = Recorder()
    with pytest.raises(TypeError, match="is not a logger"):
        train(lambda: None, cfg.train, cfg.optim, {}, loggers=[given, object()])
    assert given.closed == 1


def failed_run(tmp_path, monkeypatch, **train_section) -> None:
    """A run into tmp_path/run that fails at its third step, before its first checkpoint."""
    real_loss, steps = ClassificationTask.training_loss, []

    def fails_at_step_3(self, model, batch):
        steps.append(1)
        if len(steps) == 3:
            raise RuntimeError("boom")
        return real_loss(self, model, batch)

    with monkeypatch.context() as patched:
        patched.setattr(ClassificationTask, "training_loss", fails_at_step_3)
        with pytest.raises(RuntimeError):
            run(tmp_path, checkpoint_every=100, **train_section)


def test_tensorboard_of_a_new_run_holds_none_of_a_failed_runs_events(tmp_path, monkeypatch):
    """Found in review: a run that failed before its first checkpoint left its events, and a new run into
    the folder showed them beside its own (steps 1-3 twice, 4-5 of the other config); metrics.jsonl
    starts afresh, and TensorBoard now too."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    failed_run(tmp_path, monkeypatch, tensorboard=True)
    records = run(tmp_path, tensorboard=True, max_steps=2)
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert losses == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in records if "split" not in r]


def test_a_new_run_forgets_a_failed_runs_dashboards_whatever_its_own_loggers(tmp_path, monkeypatch, capsys):
    """From a review: a run killed before its first checkpoint left its MLflow run id and TensorBoard
    events; a new run into the folder without those loggers kept them, a finished run showed the other
    run's curves in TensorBoard, and a resume of the new run with MLflow continued the failed run's
    MLflow run (its settings, its steps). A logger first turned on at a resume starts there, said."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    calls = []
    monkeypatch.setitem(sys.modules, "mlflow", fake_mlflow(calls))
    failed_run(tmp_path, monkeypatch, loggers=["jsonl", "mlflow"], tensorboard=True)
    folder = tmp_path / "run"
    assert (folder / "mlflow_run_id").is_file() and any((folder / "tensorboard").iterdir())
    run(tmp_path, max_steps=2, checkpoint_every=1)  # the new run: metrics.jsonl alone
    assert not (folder / "mlflow_run_id").exists() and not any((folder / "tensorboard").iterdir())
    capsys.readouterr()
    calls.clear()
    run(tmp_path, resume=True, max_steps=3, loggers=["jsonl", "mlflow"])
    assert calls[0] == ("start_run", None, "run")  # a run of its own, not the failed one's
    assert "note: mlflow starts at step 3, where this resume does; steps 1-2 are in metrics.jsonl only" in (
        capsys.readouterr().err
    )


def test_lambda_lists_reach_the_dashboards_and_results_say_what_ran(tmp_path):
    """scalars() kept ints and floats only: λ per layer (a list, per head a list of lists) never
    reached TensorBoard, MLflow or W&B; and nothing recorded the learning rate scaled to the batch."""
    from neutreno.training.loggers import scalars as to_scalars

    assert to_scalars({"step": 3, "loss": 1.0, "lam": [0.6, [0.5, 0.7]], "ok": True}) == {
        "train/loss": 1.0, "train/lam/0": 0.6, "train/lam/1/0": 0.5, "train/lam/1/1": 0.7,
    }  # fmt: skip
    run(tmp_path)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    optim, batch = results["config"]["optim"], results["config"]["train"]["batch_size"]
    resolved = results["resolved"]
    assert resolved["global_batch"] == batch and resolved["world_size"] == 1 and resolved["last_step"] == 4
    scale = batch / optim["lr_base_batch"] if optim["lr_base_batch"] else 1.0
    assert resolved["lr"] == pytest.approx(optim["lr"] * scale) and resolved["device"] == "cpu"


def test_curves_say_what_they_draw(tmp_path, monkeypatch):
    """Under 100 steps the loss's "running mean" was the loss itself; a perplexity falling from 9255 to
    111 was drawn on a linear axis, every point after the second flat on zero."""
    from neutreno.training import engine

    records = [{"step": s, "loss": 9.0 - s / 10} for s in range(1, 11)]
    records += [{"step": s, "split": "val", "ppl": p} for s, p in ((2, 9255.0), (6, 400.0), (10, 111.0))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    figures = []
    monkeypatch.setattr(engine, "save_figure", lambda fig, path, dpi: figures.append(fig))
    engine.plot_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png", "ppl")
    loss, val = figures[0].axes
    assert loss.get_title() == "training loss" and len(loss.get_lines()) == 1
    assert val.get_yscale() == "log"


def test_a_metrics_line_the_disk_cannot_take_names_the_file(tmp_path):
    """A full disk under metrics.jsonl said "[Errno 28] No space left on device", not which file."""
    import errno
    import re

    from neutreno.training.loggers import JsonlLogger

    logger = JsonlLogger(tmp_path)

    class FullDisk:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            self.flush()

    logger.file.close()
    logger.file = FullDisk()
    where = re.escape(str(tmp_path / "metrics.jsonl"))
    with pytest.raises(
        OSError, match=rf"^cannot write {where} \(.* MiB free on its disk\): No space"
    ) as error:
        logger.log({"step": 1, "loss": 2.0}, 1)
    assert error.value.errno == errno.ENOSPC
    logger.close()  # its last flush failed and was said: no second error


def test_a_warm_up_in_steps_replacing_one_in_epochs_is_said(tmp_path, capsys):
    """optim.warmup_steps overrides optim.warmup_epochs: a config's 0.5 epochs was dropped without a word."""
    cfg = from_dict(
        ClassificationConfig,
        digits_config(train={"out_dir": str(tmp_path / "run"), "max_steps": 2}, optim={"warmup_steps": 1}),
    )
    assert cfg.optim.warmup_epochs == 0.5
    train(lambda: ClassificationTask(cfg), cfg.train, cfg.optim, to_dict(cfg))
    assert "note: optim.warmup_steps 1 replaces optim.warmup_epochs 0.5" in capsys.readouterr().err
