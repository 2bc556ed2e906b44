"""Grids of training runs: ``neutreno sweep CONFIG --grid model.lam=0,0.2,0.4 [--grid train.seed=0,1]``.

Every combination of the grid values is one run of CONFIG with those ``--set`` overrides, trained in
``OUT/<key=value,…>``. All configs are built and checked before anything trains. Runs go one after
another in this process, or ``jobs`` at a time as ``neutreno train`` subprocesses (logs in each run's
``train.log``); a finished run of the same config is skipped and an interrupted one resumed, so a sweep
restarted after a crash redoes nothing. The final validation metrics are tabulated (``sweep.csv``,
``sweep.md``, ``sweep.json``) and the task's main metric plotted against the first grid key
(``sweep.png``), one line per combination of the others: the paper's Table 13 shape.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from neutreno import reporting
from neutreno.config import ConfigError, override_leaves, refuse_overrides_of, set_text, to_dict
from neutreno.io import atomic_path, remove_report, write_json
from neutreno.reporting import pyplot, save_figure
from neutreno.training.tasks import (
    EPOCHS_OR_STEPS,
    TASKS,
    finished_results,
    load_train_config,
    task_classes,
    train_to_end,
)


class SweepFailed(RuntimeError):
    """Some runs of a sweep failed or did not finish (the others are kept)."""


@dataclass
class SweepRun:
    """One grid point: its values ({key: text}), folder and typed config."""

    values: dict[str, str]
    out_dir: Path
    config: object
    overrides: list[str] = field(default_factory=list)


def parse_grid(text: str) -> tuple[str, list[str]]:
    """``"model.lam=0,0.2"`` → ("model.lam", ["0", "0.2"]); ConfigError on a malformed grid."""
    key, sep, values = text.partition("=")
    items = [v.strip() for v in values.split(",")]
    if not sep or not key.strip() or not all(items) or len(set(items)) != len(items):
        raise ConfigError(f"--grid {text!r}: expected KEY=V1,V2,… with distinct values")
    return key.strip(), items


def run_name(values: dict[str, str]) -> str:
    """The folder name of a grid point: ``model.lam=0.2,train.seed=1`` (path separators replaced)."""
    return ",".join(f"{k}={v}" for k, v in values.items()).replace("/", "_").replace("\\", "_")


def _null_lam(cfg) -> float | None:
    """The λ a NeuTRENO model of a built-in task runs for ``model.lam`` null (0.6 for vision and text
    classification, 0.4 for the language model); None for a registered task (its own)."""
    from neutreno.layers import DEFAULT_LAM, LM_DEFAULT_LAM

    return {"language_model": LM_DEFAULT_LAM}.get(cfg.task, DEFAULT_LAM) if cfg.task in TASKS else None


def _config_key(cfg) -> str:
    """What trains: the config without its folder, λ as the model runs it (null is the task's default:
    0.6 for vision and text classification, 0.4 for the language model; a registered task's is kept as
    written) and whole numbers alike (model.args is untyped: mlp_ratio 2 and 2.0 are one model)."""
    from neutreno.layers.attention import resolve_lam

    null_lam = _null_lam(cfg)

    def canonical(value):
        if isinstance(value, dict):
            return {k: canonical(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [canonical(v) for v in value]
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value

    config = to_dict(cfg)
    config["train"] = {k: v for k, v in config["train"].items() if k != "out_dir"}
    model = config.get("model")
    if isinstance(model, dict) and isinstance(model.get("attention"), str) and "lam" in model and null_lam:
        lam = null_lam if model["lam"] is None and model["attention"].endswith("neutreno") else model["lam"]
        # an attention resolve_lam does not know keeps λ as written
        with contextlib.suppress(ValueError):
            model["lam"] = resolve_lam(model["attention"], lam, model.get("learn_lam"))
    return json.dumps(canonical(config), sort_keys=True, default=str)


def plan_sweep(
    config: str | Path, grids: list[str], out: Path, overrides: list[str] | None = None
) -> list[SweepRun]:
    """Every grid point's checked config (ConfigError naming the key and the point, before any work)."""
    parsed = [parse_grid(g) for g in grids]
    keys = [k for k, _ in parsed]
    if not parsed or len(set(keys)) != len(keys):
        raise ConfigError(f"give each --grid key once, got {keys or 'none'}")
    owned = {"train.out_dir": "each run's folder is --out/<grid point>"}
    # what each grid point sets, a mapping's keys included (train={seed: 1} sets train.seed)
    grid_leaves: set[str] = set()
    setter: dict[str, str] = {}  # leaf → the --grid key that sets it
    for key, values in parsed:
        leaves = set()
        for value in values:
            try:
                leaves.update(override_leaves(f"{key}={value}"))
            except ConfigError as error:  # "[0.3, 0.4],[0.5, 0.6]" is split at every comma
                why = str(error).split(": ", 1)[-1]
                raise ConfigError(f"--grid {key}: {why} (commas separate a grid's values)") from None
        for leaf in sorted(leaves):
            if leaf in owned:  # a grid over it was ignored (the run went to --out/<point>) or "one config"
                raise ConfigError(f"--grid {key}: sets {leaf}, which the sweep sets: {owned[leaf]}")
            if setter.setdefault(leaf, key) != key:  # the later won, the row named the earlier's value
                raise ConfigError(f"--grid {setter[leaf]} and --grid {key} both set {leaf}: give it once")
        grid_leaves |= leaves
    refuse_overrides_of(overrides or [], {**owned, **dict.fromkeys(grid_leaves, "it is a --grid key")})
    runs = []
    for combination in itertools.product(*(values for _, values in parsed)):
        values = dict(zip(keys, combination, strict=True))
        out_dir = out / run_name(values)
        point = [f"{k}={v}" for k, v in values.items()]
        run_overrides = [*(overrides or []), *point, set_text("train.out_dir", out_dir)]
        try:
            cfg = load_train_config(config, run_overrides)
        except ConfigError as error:
            raise ConfigError(f"{error} (at grid point {', '.join(point)})") from None
        for section, epochs, steps in EPOCHS_OR_STEPS:
            length = getattr(getattr(cfg, section), steps)
            if f"{section}.{epochs}" in grid_leaves and length is not None:  # steps win: points train alike
                raise ConfigError(
                    f"--grid {section}.{epochs}: {section}.{steps} ({length}) overrides it, so every point "
                    f"would train alike; set {section}.{steps}=null to count in epochs"
                )
        runs.append(SweepRun(values, out_dir, cfg, run_overrides))
    # values spelled otherwise but read the same (0.5 and 0.50) would train one config twice
    seen: dict[str, SweepRun] = {}
    folders: dict[Path, SweepRun] = {}
    for run in runs:
        other = folders.setdefault(run.out_dir, run)
        if other is not run:  # a/b and a_b: the second would find the first's run there
            raise ConfigError(
                f"--grid points {', '.join(f'{k}={v}' for k, v in other.values.items())} and "
                f"{', '.join(f'{k}={v}' for k, v in run.values.items())} would share the folder {run.out_dir}"
            )
        same = seen.setdefault(_config_key(run.config), run)
        if same is not run:
            raise ConfigError(
                f"--grid points {run_name(same.values)} and {run_name(run.values)} are one config"
            )
    return runs


def run_sweep(config: str | Path, runs: list[SweepRun], jobs: int = 1) -> list[dict]:
    """Train every unfinished run (``jobs`` > 1: that many ``neutreno train`` subprocesses at a time);
    returns each run's results in grid order."""
    todo = [run for run in runs if finished_results(run.config) is None]
    print(f"sweep: {len(runs)} runs, {len(runs) - len(todo)} already finished, {len(todo)} to train")
    if jobs == 1:
        failures = {}
        for run in todo:
            print(f"sweep: {run_name(run.values)}")
            try:
                train_to_end(run.config)
            except Exception as error:  # as with --jobs > 1: the other runs still train
                why = failures[run_name(run.values)] = " ".join(str(error).split()) or type(error).__name__
                print(f"sweep: {run_name(run.values)} failed: {why}", file=sys.stderr)
        if failures:
            raise SweepFailed(f"runs failed: {'; '.join(f'{n} ({why})' for n, why in failures.items())}")
    else:
        _run_subprocesses(config, todo, jobs)
    results = [finished_results(run.config) for run in runs]
    missing = [run_name(run.values) for run, r in zip(runs, results, strict=True) if r is None]
    if missing:
        raise SweepFailed(f"runs did not finish: {', '.join(missing)}")
    # a run trained under torchrun by other processes had another global batch, which no grid value says
    processes = {run_name(run.values): r.get("processes", 1) for run, r in zip(runs, results, strict=True)}
    if len(set(processes.values())) > 1:
        shown = ", ".join(f"{name}: {count}" for name, count in processes.items())
        raise SweepFailed(
            f"the runs were trained by different numbers of processes ({shown}), so at different global "
            "batches: not one experiment; train them alike, in another --out"
        )
    return results


def _run_subprocesses(config: str | Path, todo: list[SweepRun], jobs: int) -> None:
    """``jobs`` ``neutreno train`` processes at a time (``--resume`` where a checkpoint exists)."""
    from neutreno.training.tasks import TrainingFailed, TrainJob, run_jobs

    try:
        run_jobs([TrainJob(run_name(r.values), config, r.overrides, r.out_dir) for r in todo], jobs)
    except TrainingFailed as error:
        raise SweepFailed(str(error).replace("trainings failed", "runs failed")) from None


def summarize(runs: list[SweepRun], results: list[dict]) -> list[dict]:
    """One row per run: its grid values, then its final validation metrics (counts left out), and the
    λ warm-up's factor ``lam_scale`` where a run ended inside it (its scores are at λ × that, not at the
    λ its row names)."""
    rows = []
    for run, result in zip(runs, results, strict=True):
        metrics = {k: v for k, v in result["val"].get("model", {}).items() if k != "count"}
        # the EMA's scores too, named as metrics.jsonl names them: a sweep over train.ema_decay showed
        # the raw model's, the same at every point
        metrics |= {f"ema_{k}": v for k, v in result["val"].get("ema", {}).items() if k != "count"}
        scale = {"lam_scale": result["lam_scale"]} if "lam_scale" in result else {}
        rows.append({**run.values, **metrics, **scale})
    return rows


REPORT_NAMES = ("sweep.json", "sweep.csv", "sweep.md", "sweep.png")


def write_report(out: Path, runs: list[SweepRun], rows: list[dict]) -> list[Path]:
    """``sweep.json``, ``sweep.csv``, ``sweep.md`` and ``sweep.png``, each written atomically, the earlier
    sweep's removed first."""
    plt = pyplot()
    remove_report(out, REPORT_NAMES)

    keys = list(runs[0].values)
    columns = list(dict.fromkeys(k for row in rows for k in row))
    main_metric = task_classes(runs[0].config.task)[1].main_metric
    write_json(out / "sweep.json", {"grid": keys, "main_metric": main_metric, "runs": rows})
    reporting.write_csv(out / "sweep.csv", [columns, *([r.get(c, "") for c in columns] for r in rows)])
    cells = [[_cell(r, c) for c in columns] for r in rows]
    with atomic_path(out / "sweep.md") as tmp:
        tmp.write_text(reporting.markdown_table([columns, *cells]) + "\n")
    fig, ax = plt.subplots(figsize=(6, 4))
    x_key, others = keys[0], keys[1:]
    # x as each run's config holds it, λ null as the λ it runs (0.6 drawn after 0.9, as text, once); where
    # some x is no number, every point at its rank with its grid text, no distance claimed
    x_of = {run.values[x_key]: _x_value(run.config, x_key) for run in runs}
    numeric = all(isinstance(x, float) for x in x_of.values())
    if not numeric:
        ranks = sorted(x_of, key=_sort_key)
        x_of = {text: float(ranks.index(text)) for text in x_of}
        ax.set_xticks(range(len(ranks)), ranks)

    def others_of(row: dict) -> tuple:
        return tuple(row[k] for k in others)

    for group, members in itertools.groupby(sorted(rows, key=others_of), key=others_of):
        # joined in the order of x, not of the grid as typed (0.5,0,0.2 drew a V)
        members = sorted((m for m in members if main_metric in m), key=lambda m: x_of[m[x_key]])
        label = ", ".join(f"{k}={v}" for k, v in zip(others, group, strict=True)) or main_metric
        ax.plot([x_of[m[x_key]] for m in members], [m[main_metric] for m in members], marker="o", label=label)
    nulls = sorted({x for text, x in x_of.items() if text == "null"}) if numeric else []
    ax.set(
        xlabel=x_key + (f" (null: {nulls[0]:g})" if nulls else ""),
        ylabel=f"validation {reporting.metric_name(main_metric)}",
        title=f"sweep over {x_key}",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, out / "sweep.png", dpi=110)
    return [out / name for name in REPORT_NAMES]


def _cell(row: dict, column: str) -> str:
    """A sweep.md cell: a score to 4 digits; a score results.json holds as null (not a finite number, a
    perplexity past float range) as "not finite", not "None"; empty where the run has no such column."""
    value = row.get(column, "")
    if value is None:
        return "not finite"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _x_value(cfg, key: str) -> float | None:
    """The number a run's typed config holds at a dotted ``key`` (λ null as the λ the model runs), None
    where it is no number (a name, a list, a flag)."""
    value = cfg
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else getattr(value, part, None)
    attention = str(getattr(getattr(cfg, "model", None), "attention", ""))
    if key == "model.lam" and value is None and attention.endswith("neutreno"):
        value = _null_lam(cfg)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _sort_key(text: str) -> tuple:
    number = _number(text)
    return (0, number, "") if isinstance(number, float) else (1, 0.0, text)


def _number(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text
