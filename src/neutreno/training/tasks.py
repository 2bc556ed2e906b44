"""The training tasks by name (a config's ``task:`` key), typed configs from YAML, and training a config
to its end: a finished run is reused, an interrupted one resumed (``neutreno sweep`` and ``study``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from neutreno.config import ConfigError, apply_overrides, from_dict, merge_layers, read_yaml_layers, to_dict

# A config's `task:` key → "module:ConfigClass:TaskClass", imported only when used.
_TASKS: dict[str, str | tuple[type, type]] = {
    "classification": "neutreno.training.classification:ClassificationConfig:ClassificationTask",
    "language_model": "neutreno.training.language_model:LanguageModellingConfig:LanguageModelTask",
    "segmentation": "neutreno.training.segmentation:SegmentationConfig:SegmentationTask",
    "text_classification": (
        "neutreno.training.text_classification:TextClassificationConfig:TextClassificationTask"
    ),
}
TASKS = tuple(_TASKS)  # the built-in task names


def register_task(name: str, config_cls: type, task_cls: type) -> None:
    """Make ``task: name`` in a config train ``task_cls(config)``, without editing the engine.

    ``config_cls`` is a dataclass with the sections the engine reads (``train``: TrainConfig, ``optim``:
    OptimConfig) and a ``task`` field; ``task_cls`` follows :class:`neutreno.training.engine.Task`.
    """
    import dataclasses

    if not dataclasses.is_dataclass(config_cls) or not {"task", "train", "optim"} <= {
        f.name for f in dataclasses.fields(config_cls)
    }:
        raise TypeError(f"{config_cls.__name__} must be a dataclass with task, train and optim fields")
    _TASKS[name] = (config_cls, task_cls)


def task_classes(name: str) -> tuple[type, type]:
    """The config class and task class of a task name (built-in ones are imported only when used)."""
    import importlib

    entry = _TASKS.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ConfigError(f"task: unknown task {name!r}; one of {', '.join(_TASKS)}")
    if isinstance(entry, tuple):
        return entry
    module, config_name, task_name = entry.split(":")
    loaded = importlib.import_module(module)
    return getattr(loaded, config_name), getattr(loaded, task_name)


# Lengths a config gives in epochs or in steps: (section, epochs key, steps key); given both, steps win.
EPOCHS_OR_STEPS = (("optim", "warmup_epochs", "warmup_steps"), ("train", "epochs", "total_steps"))


def load_train_config(path: str | Path, overrides: list[str]):
    """The typed config of ``path`` (a YAML file or a preset's name) with ``--set`` overrides, checked
    (ConfigError naming the key)."""
    from neutreno.presets import resolve_config

    layers = read_yaml_layers(resolve_config(path))  # the base: chain's files, then the file itself
    data = apply_overrides(merge_layers(layers), overrides)
    config_cls, _ = task_classes(data.get("task", "classification"))
    cfg = from_dict(config_cls, data)
    # A length in epochs given after a length in steps that overrides it would be ignored without a word:
    # epochs by --set over steps from a file or the task's defaults, epochs in a file over the task's
    # default steps or over steps from its base: file. Both in one place: steps win, as documented (a
    # run's config.json has both).
    layers.append(apply_overrides({}, overrides))
    for section, epochs, steps in EPOCHS_OR_STEPS:
        value = getattr(getattr(cfg, section), steps)
        # the last layer giving each key; -1: the task's defaults
        given = [_keys(layer.get(section)) for layer in layers]
        steps_at = max((i for i, keys in enumerate(given) if steps in keys), default=-1)
        epochs_at = max((i for i, keys in enumerate(given) if epochs in keys), default=-1)
        if value is not None and epochs_at > steps_at:
            raise ConfigError(
                f"{section}.{epochs} is overridden by {section}.{steps} ({value}): set "
                f"{section}.{steps}=null to count in epochs, or give {section}.{steps}"
            )
    # A setting of another optimizer or schedule than the one used changed nothing, without a word (and
    # a resume that changed it was recorded as another config): refused where a file or --set gives it
    # another value than the task's default (a run's config.json, which lists every key, still loads).
    given = set().union(*(_keys(layer.get("optim")) for layer in layers))
    optim = cfg.optim
    default = next(f for f in fields(config_cls) if f.name == "optim").default_factory()
    for key, used, owner in OTHER_OPTIM_KEYS:
        if key in given and getattr(optim, owner) != used and getattr(optim, key) != getattr(default, key):
            raise ConfigError(
                f"optim.{key}: is for optim.{owner} {used}, this config's is {getattr(optim, owner)}, "
                "which does not use it"
            )
    # the trainer finds it too, once the model is built: in a sweep or study, after the points before it
    # had trained
    attention = getattr(getattr(cfg, "model", None), "attention", None)
    if cfg.train.lam_warmup_steps and isinstance(attention, str) and not attention.endswith("neutreno"):
        raise ConfigError(
            f"train.lam_warmup_steps: model.attention {attention!r} has no NeuTRENO λ to warm up"
        )
    return cfg


# optimizer keys used by one optimizer or schedule only: (key, the value of owner that uses it, owner)
OTHER_OPTIM_KEYS = (
    ("momentum", "sgd", "name"),
    ("betas", "adamw", "name"),
    ("poly_power", "poly", "schedule"),
)


def _keys(section: object) -> set:
    return set(section) if isinstance(section, dict) else set()


class OtherConfigRun(ValueError):
    """A run folder holds a run (finished or not) of another config than the one asked for; ``older``:
    an older neutreno trained it (another ``train.pipeline_version``)."""

    def __init__(self, message: str, older: bool = False) -> None:
        super().__init__(message)
        self.older = older


def finished_results(cfg) -> dict | None:
    """The ``results.json`` of a finished run of exactly this config in ``cfg.train.out_dir``, None when
    the run has not finished; OtherConfigRun when the folder holds a run of another config, finished or
    not, and ValueError when its results.json or config.json is damaged.

    Sweeps and ``reproduce`` resume an unfinished run without being asked, so one started with another
    seed, learning rate or data must stop them: ``train --resume`` takes such changes with a warning (a
    lower ``optim.lr`` after a divergence), and the run would be reported under the new config."""
    from neutreno.training.checkpoint import load_state, resume_checkpoint
    from neutreno.training.engine import UNRECORDED_KEYS, ResumeError, config_changes, trained_config

    def other_config(saved: dict, what: str, then: str, finished: bool) -> OtherConfigRun | None:
        # as train --resume: where the run lives and what loads its data, keeps or scores on the way do not
        # change its weights; nor where it stops, while it has steps left (a finished one ends there)
        ignored = set(UNRECORDED_KEYS) - ({"train.max_steps"} if finished else set())
        changed = set(config_changes(saved, json.loads(json.dumps(to_dict(cfg))))) - ignored
        if not changed:
            return None
        older = "train.pipeline_version" in changed
        why = f"{', '.join(sorted(changed))} differ" + (
            "; it was trained by an older neutreno" if older else ""
        )
        return OtherConfigRun(f"{cfg.train.out_dir} holds {what} of another config ({why}); {then}", older)

    run_dir = Path(cfg.train.out_dir)
    path = run_dir / "results.json"
    if not path.is_file():
        checkpoint = resume_checkpoint(run_dir)  # the one a resume takes (ValueError: none loads)
        if checkpoint is None:
            return None  # nothing to resume: a start writes its own config.json
        try:
            started = trained_config(run_dir, load_state(checkpoint))  # what the resume compares with
        except ResumeError as error:
            raise ValueError(str(error)) from None
        then = "resuming would report it under this one: choose another folder, or remove it"
        error = (
            other_config(started, "an unfinished run", then, finished=False) if started is not None else None
        )
        if error:
            raise error
        return None

    try:
        results = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is damaged ({error}); remove it to train the run again") from None
    if not isinstance(results, dict) or not isinstance(results.get("config"), dict):
        raise OtherConfigRun(f"{cfg.train.out_dir} holds no run's results; choose another folder")
    error = other_config(results["config"], "a finished run", "use another folder", finished=True)
    if error:
        raise error
    if results.get("config_changes"):  # resumed under other settings: not one config's run
        steps = ", ".join(str(c.get("step")) for c in results["config_changes"] if isinstance(c, dict))
        raise OtherConfigRun(
            f"{cfg.train.out_dir} holds a run whose config was changed when resumed (at step {steps}); "
            "choose another folder"
        )
    return results


def train_to_end(cfg) -> tuple[dict, str]:
    """Train ``cfg`` to its end: reuse a finished run, resume an interrupted one, or start. Returns
    (results, what happened: ``"reused"``, ``"resumed"`` or ``"trained"``)."""
    from neutreno.training.checkpoint import latest_checkpoint
    from neutreno.training.engine import train

    results = finished_results(cfg)
    if results is not None:
        return results, "reused"
    _, task_cls = task_classes(cfg.task)
    resume = latest_checkpoint(Path(cfg.train.out_dir)) is not None
    results = train(lambda: task_cls(cfg), cfg.train, cfg.optim, to_dict(cfg), resume=resume)
    return results, "resumed" if resume else "trained"


class TrainingFailed(RuntimeError):
    """Some trainings run as subprocesses failed (the others are kept); ``failures`` maps each failed
    job's name to what happened."""

    def __init__(self, failures: dict[str, str]) -> None:
        super().__init__(f"trainings failed: {'; '.join(f'{n} ({why})' for n, why in failures.items())}")
        self.failures = failures


@dataclass
class TrainJob:
    """``neutreno train CONFIG --set …`` for one run: a name for messages, the YAML, its overrides (which
    set ``train.out_dir`` to ``out_dir``)."""

    name: str
    config: str | Path
    overrides: list[str] = field(default_factory=list)
    out_dir: Path = Path(".")


def _die_with_parent() -> None:
    """In a child, before exec: ask Linux to send it SIGTERM when the parent dies, even by SIGKILL, so
    no training outlives the command that started it (and races its restart). Elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def run_jobs(jobs: list[TrainJob], parallel: int) -> None:
    """Run ``jobs`` as ``neutreno train`` subprocesses, ``parallel`` at a time, each with an equal share
    of the cores as torch threads (``--resume`` where a checkpoint exists; logs in ``out_dir/train.log``).
    If this process stops (an error, Ctrl-C, even SIGKILL), its running children are stopped too.
    TrainingFailed names every job that failed."""
    from neutreno.training.checkpoint import latest_checkpoint

    threads = str(max(1, (os.cpu_count() or 1) // parallel))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    pending, running, failed = list(jobs), {}, {}
    try:
        while pending or running:
            while pending and len(running) < parallel:
                job = pending.pop(0)
                Path(job.out_dir).mkdir(parents=True, exist_ok=True)
                command = [sys.executable, "-m", "neutreno", "train", str(job.config)]
                command += [arg for override in job.overrides for arg in ("--set", override)]
                if latest_checkpoint(Path(job.out_dir)) is not None:
                    command.append("--resume")
                log = (Path(job.out_dir) / "train.log").open("a")
                print(f"  started {job.name} (log: {Path(job.out_dir) / 'train.log'})", flush=True)
                process = subprocess.Popen(
                    command, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent
                )
                running[job.name] = (job, process, log)
            time.sleep(0.2)
            for name, (job, process, log) in list(running.items()):
                if process.poll() is None:
                    continue
                del running[name]
                log.close()
                if process.returncode:
                    failed[name] = f"exit {process.returncode}, see {Path(job.out_dir) / 'train.log'}"
                else:
                    print(f"  finished {name}", flush=True)
    finally:
        for _, process, log in running.values():
            process.terminate()
            process.wait()
            log.close()
    if failed:
        raise TrainingFailed(failed)
