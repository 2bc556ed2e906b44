"""Where the trainer's records go: ``metrics.jsonl`` always, TensorBoard, MLflow or Weights & Biases when
``train.loggers`` names them, and any :class:`Logger` you pass to :func:`~neutreno.training.train`.

A record is a flat dict: one per optimizer step (``step``, ``epoch``, ``lr``, ``loss``, ``samples_per_s``,
``grad_norm``, the task's counters) and one per evaluation (``step``, ``epoch``, ``split: "val"`` and the
metrics). Only rank 0 logs. ``metrics.jsonl`` cannot be switched off: resuming and ``curves.png`` read
it. MLflow and W&B are imported only when used; they take their server, project and credentials from
their own environment variables (``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``, ``WANDB_PROJECT``,
``WANDB_MODE``, …). A resumed run continues the same MLflow or W&B run (its id is kept in the run
folder); the steps a killed run logged after its checkpoint are dropped from ``metrics.jsonl`` and
hidden in TensorBoard, but stay in MLflow beside the new ones (W&B ignores the repeated steps). A new
run in a folder drops a failed run's TensorBoard events and run ids; a logger first turned on at a
resume starts at its step (said on stderr). Their config is the run's plus ``resolved``: the scaled
learning rate, the schedule's steps, processes, device, whether it compiled.

A step's ``lam`` (NeuTRENO λ per layer, a list per head for ``learn_lam: head``) is the model's λ after
that step's update (times the warm-up factor): what a checkpoint saved there evaluates with.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
from pathlib import Path

from neutreno.io import atomic_path, json_safe, write_failure


class Logger:
    """A destination for the trainer's records. Subclass it and override :meth:`log` (the other two do
    nothing by default). The trainer calls them on rank 0 only, and closes the logger at the end."""

    def log_config(self, config: dict) -> None:
        """The run's config (nested dicts, as config.json holds it) and under ``"resolved"`` what the run
        made of it (the learning rate scaled to the global batch, the schedule's steps, processes,
        device, whether it compiled), once before the first record."""

    def log(self, record: dict, step: int) -> None:
        """One record (see the module docstring); ``step`` is ``record["step"]``, the optimizer step."""
        raise NotImplementedError

    def failed(self, error: BaseException) -> None:
        """Training failed with ``error`` (an exception, or KeyboardInterrupt); called just before
        :meth:`close`, so that a dashboard can mark the run failed rather than finished."""

    def close(self) -> None:
        """Flush and release; called once when training ends, also after an error."""


def scalars(record: dict) -> dict[str, float]:
    """A record's numbers as ``{"train/loss": …}`` or ``{"val/top1": …}``, without the step: what
    TensorBoard, MLflow and W&B plot against the step. A list of numbers (λ per NeuTRENO layer, and per
    head within it) is one scalar per entry, ``train/lam/0``, ``train/lam/3/1`` (it was left out)."""
    prefix = record.get("split", "train")
    flat: dict[str, float] = {}

    def add(name: str, value: object) -> None:
        if isinstance(value, bool):
            return
        if isinstance(value, (int, float)):
            flat[name] = value
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                add(f"{name}/{i}", item)

    for key, value in record.items():
        if key not in ("step", "split"):
            add(f"{prefix}/{key}", value)
    return flat


def read_metrics(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl``; a torn line (a process killed mid-write) is skipped."""
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def truncate_log(path: Path, step: int) -> None:
    """Drop the records a killed run wrote after the checkpoint it resumes from (and torn lines)."""
    if not path.is_file():
        return
    kept = [json.dumps(r) for r in read_metrics(path) if r["step"] <= step]
    with atomic_path(path) as tmp:
        tmp.write_text("".join(line + "\n" for line in kept))


class JsonlLogger(Logger):
    """``<out_dir>/metrics.jsonl``: one JSON line per record, flushed at once. ``resume_step``: the
    checkpoint's step when resuming (the lines after it are dropped), None for a new run, which starts
    the file afresh (a run that failed before its first checkpoint leaves its lines behind)."""

    def __init__(self, out_dir: str | Path, resume_step: int | None = None) -> None:
        self.path = _folder(out_dir) / "metrics.jsonl"
        if resume_step is not None:
            truncate_log(self.path, resume_step)
        self.file = self.path.open("w" if resume_step is None else "a")

    def log(self, record: dict, step: int) -> None:
        try:
            self.file.write(json.dumps(json_safe(record), allow_nan=False) + "\n")  # inf perplexity: null
            self.file.flush()
        except OSError as error:  # a full disk said "[Errno 28] No space left on device", not where
            raise write_failure(self.path, error) from error

    def close(self) -> None:
        with contextlib.suppress(OSError):  # its last flush failed, and was said
            self.file.close()


class TensorBoardLogger(Logger):
    """Scalars in ``<out_dir>/tensorboard`` (needs the tensorboard package); a resumed run hides the
    events a killed run wrote after its checkpoint."""

    def __init__(self, out_dir: str | Path, resume_step: int | None = None) -> None:
        _require("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        folder = Path(out_dir) / "tensorboard"
        if resume_step is None:  # a new run: a failed one's events (no checkpoint) mixed with its own
            for stale in folder.glob("events.out.tfevents.*"):
                stale.unlink()
        purge = None if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(folder, purge_step=purge)

    def log(self, record: dict, step: int) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class MLflowLogger(Logger):
    """An MLflow run named after the run folder: the flattened config as params (a new run only: MLflow
    params cannot change), the scalars as metrics. ``experiment``: else ``MLFLOW_EXPERIMENT_NAME``."""

    def __init__(
        self, out_dir: str | Path, resume_step: int | None = None, experiment: str | None = None
    ) -> None:
        self.mlflow = _require("mlflow")
        if experiment is not None:
            self.mlflow.set_experiment(experiment)
        id_file = _folder(out_dir) / "mlflow_run_id"
        run_id = _saved_id(id_file, resume_step)
        self.resumed = run_id is not None
        run = self.mlflow.start_run(run_id=run_id, run_name=None if run_id else Path(out_dir).resolve().name)
        id_file.write_text(run.info.run_id + "\n")
        self.status = "FINISHED"

    def log_config(self, config: dict) -> None:
        if not self.resumed:
            self.mlflow.log_params(_flatten(config))

    def log(self, record: dict, step: int) -> None:
        self.mlflow.log_metrics(scalars(record), step=step)

    def failed(self, error: BaseException) -> None:
        self.status = "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED"

    def close(self) -> None:
        self.mlflow.end_run(status=self.status)  # (its default, FINISHED, for a run that crashed too)


class WandbLogger(Logger):
    """A Weights & Biases run (files under ``<out_dir>/wandb``) with the config and the scalars.
    ``init_kwargs`` go to ``wandb.init`` (``project``, ``entity``, ``mode``, …)."""

    def __init__(self, out_dir: str | Path, resume_step: int | None = None, **init_kwargs) -> None:
        wandb = _require("wandb")
        id_file = _folder(out_dir) / "wandb_run_id"
        run_id = _saved_id(id_file, resume_step)
        if run_id is not None:
            init_kwargs |= {"id": run_id, "resume": "allow"}
        init_kwargs.setdefault("name", Path(out_dir).resolve().name)
        self.run = wandb.init(dir=str(out_dir), **init_kwargs)
        id_file.write_text(self.run.id + "\n")
        self.exit_code = 0

    def log_config(self, config: dict) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log(self, record: dict, step: int) -> None:
        self.run.log(scalars(record), step=step)

    def failed(self, error: BaseException) -> None:
        self.exit_code = 1

    def close(self) -> None:
        self.run.finish(exit_code=self.exit_code)  # (without one, a run that crashed shows as finished)


# train.loggers names → classes, each built as cls(out_dir, resume_step=…)
LOGGERS: dict[str, type[Logger]] = {
    "jsonl": JsonlLogger,
    "tensorboard": TensorBoardLogger,
    "mlflow": MLflowLogger,
    "wandb": WandbLogger,
}
_PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}  # logger → module & extra


def missing_package(name: str) -> str | None:
    """Why logger ``name`` cannot run here, in one line naming the extra to install; None when it can."""
    module = _PACKAGES.get(name)
    if module is None:
        return None
    try:
        found = importlib.util.find_spec(module) is not None
    except ValueError:  # in sys.modules without a spec (a stand-in)
        found = True
    return None if found else f"{name} needs the {module} package: pip install 'neutreno[{module}]'"


def _require(module: str):
    """``module`` imported, or ModuleNotFoundError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name != module:
            raise
        raise ModuleNotFoundError(missing_package(module), name=module) from None


def _folder(out_dir: str | Path) -> Path:
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    return Path(out_dir)


ID_FILES = ("mlflow_run_id", "wandb_run_id")  # a run folder's MLflow and W&B run ids


def forget_failed_run(out_dir: str | Path) -> None:
    """Before a new run in a folder a failed run (no checkpoint) left: its TensorBoard events and its
    MLflow and W&B run ids go, whichever loggers the new run has (a resume of the new run continued the
    failed run's MLflow run, under its settings; a finished run without TensorBoard kept its events)."""
    folder = Path(out_dir)
    for stale in (folder / "tensorboard").glob("events.out.tfevents.*"):
        stale.unlink()
    for name in ID_FILES:
        (folder / name).unlink(missing_ok=True)


def has_logged(name: str, out_dir: str | Path) -> bool:
    """Whether logger ``name`` has records of this run folder already (its events or its run id):
    one turned on at a resume has none of the steps before it."""
    folder = Path(out_dir)
    if name == "tensorboard":
        return any((folder / "tensorboard").glob("events.out.tfevents.*"))
    if name in ("mlflow", "wandb"):
        return (folder / f"{name}_run_id").is_file()
    return True


def _saved_id(path: Path, resume_step: int | None) -> str | None:
    """The MLflow/W&B run id kept in the run folder, when resuming."""
    if resume_step is None or not path.is_file():
        return None
    return path.read_text().strip() or None


def _flatten(config: dict, prefix: str = "") -> dict[str, object]:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat
