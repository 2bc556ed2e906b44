"""The training engine every task shares: one loop, read top to bottom in :meth:`Trainer.fit`.

A *task* (image classification, language modelling, segmentation) supplies the model, the datasets
and two functions — the training loss of a batch and the metric sums of an evaluation batch. The
engine does the rest: AdamW (or SGD) with a per-step warm-up + cosine (or polynomial) schedule,
gradient accumulation and
clipping, bf16 autocast, optional EMA and ``torch.compile``, DistributedDataParallel under
``torchrun``, a progress bar, per-step JSONL metrics, NaN/inf detection, atomic checkpoints and
exact resume (data order, RNG states and optimizer state all come back).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import platform
import reprlib
import sys
import time
from collections.abc import Callable, Iterable, MutableMapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from neutreno.config import check
from neutreno.constants import SEED_LIMIT
from neutreno.data.sampler import ResumableSampler, mixed_seed
from neutreno.evaluation.metric import MetricSums, NonFiniteOutputs, sum_over_processes  # noqa: F401  (sum_over_processes lived here)
from neutreno.io import (
    FolderLock,
    check_output_folder,
    first_missing,
    remove_if_only_lock,
    remove_report,
    remove_stale_temps,
    write_json,
)
from neutreno.layers import has_learned_lam, lam_by_layer, set_lam_scale
from neutreno.layers.functional import cpu_profile
from neutreno.models import canonical_args
from neutreno.progress import progress, write
from neutreno.reporting import metric_name, pyplot, save_figure
from neutreno.training.checkpoint import (
    latest_checkpoint,
    load_state,
    resolve_weights,
    resume_checkpoint,
    save_checkpoint,
)
from neutreno.training.distributed import (
    DistributedContext,
    all_gather_objects,
    all_reduce_sum,
    barrier,
    setup_distributed,
)
from neutreno.training.ema import ModelEma
from neutreno.training.loggers import (
    LOGGERS,
    Logger,
    forget_failed_run,
    has_logged,
    missing_package,
    read_metrics,
)
from neutreno.training.schedule import scheduled_lr

# 2: seeds mixed per use (order, process, workers, crop) instead of seed + epoch / seed + rank, and DeiT's
# RandomResizedCrop from the whole image in the workers instead of within a centre square on the device
PIPELINE_VERSION = 2


@dataclasses.dataclass
class OptimConfig:
    """The optimizer and its schedule (DeiT's AdamW + cosine by default; Segmenter: SGD + poly)."""

    name: Literal["adamw", "sgd"] = "adamw"
    schedule: Literal["cosine", "poly"] = "cosine"  # after the warm-up
    momentum: float = 0.9  # SGD only
    nesterov: bool = False  # SGD only (timm's "sgd", which Segmenter trains with, is Nesterov's)
    poly_power: float = 0.9  # poly only: lr = min_lr + (lr - min_lr)(1 − t)^power
    lr: float = 5e-4  # for a global batch of ``lr_base_batch``
    lr_base_batch: int | None = 512  # lr scales with global batch / this (DeiT); None: use lr as given
    weight_decay: float = 0.05
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_epochs: float = 5.0
    warmup_steps: int | None = None  # in optimizer steps instead (LM recipe); overrides warmup_epochs
    warmup_lr: float = 1e-6
    min_lr: float = 1e-5
    clip_grad: float | None = None  # max global gradient norm

    def __post_init__(self) -> None:
        check(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        check(0 <= self.momentum < 1, "momentum", f"must be in [0, 1), got {self.momentum}")
        check(not self.nesterov or (self.name == "sgd" and self.momentum > 0), "nesterov",
              f"true needs name sgd and momentum > 0, got {self.name} and {self.momentum:g}")  # fmt: skip
        check(self.poly_power > 0, "poly_power", f"must be > 0, got {self.poly_power}")
        check(self.lr_base_batch is None or self.lr_base_batch > 0, "lr_base_batch", "must be > 0 or null")
        check(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        check(all(0 <= b < 1 for b in self.betas), "betas", f"must be in [0, 1), got {self.betas}")
        check(self.warmup_epochs >= 0, "warmup_epochs", f"must be >= 0, got {self.warmup_epochs}")
        check(self.warmup_steps is None or self.warmup_steps >= 0, "warmup_steps", "must be >= 0 or null")
        for key in ("warmup_lr", "min_lr"):  # each under its own name
            check(getattr(self, key) >= 0, key, f"must be >= 0, got {getattr(self, key)}")
        check(self.clip_grad is None or self.clip_grad > 0, "clip_grad", "must be > 0 or null")


@dataclasses.dataclass
class TrainConfig:
    """How long, on what, with which numerics, and where results go."""

    out_dir: str = "runs/train"
    epochs: int = 300
    total_steps: int | None = None  # schedule length in optimizer steps (LM recipe); overrides epochs
    batch_size: int = 128  # per process; the global batch is batch_size × accum_steps × processes
    accum_steps: int = 1
    seed: int = 0
    device: str = "auto"  # auto: this process's GPU if there is one, else the CPU
    precision: Literal["fp32", "bf16"] = "fp32"  # bf16: autocast on CPU or CUDA
    # torch.compile the training model; auto: where it pays (train_compiles), so not for short runs
    compile: bool | Literal["auto"] = "auto"
    ema_decay: float | None = None  # e.g. 0.99996; evaluated beside the model
    eval_every: int = 1  # epochs
    checkpoint_every: int = 0  # optimizer steps; 0: at the end of every epoch
    keep_checkpoints: int = 2
    max_steps: int | None = None  # stop early (smoke tests); the schedule still spans epochs/total_steps
    deterministic: bool = False  # deterministic kernels (exact resume on GPU too)
    # where records go besides metrics.jsonl (always written): names of neutreno.training.loggers.LOGGERS
    loggers: list[str] = dataclasses.field(default_factory=lambda: ["jsonl"])
    tensorboard: bool = False  # also log to <out_dir>/tensorboard (same as listing it in loggers)
    finetune: str | None = None  # start from these weights (.safetensors/.pth, checkpoint or run folder)
    lam_warmup_steps: int = 0  # NeuTRENO's λ rises linearly from 0 to its value over these optimizer steps
    # what this neutreno trains with beyond the config (data order, random streams, crops): recorded so that
    # a run of an older one (1, read from configs without the key) counts as another config's
    pipeline_version: int = PIPELINE_VERSION

    def __post_init__(self) -> None:
        check(bool(self.out_dir.strip()), "out_dir", "must name a folder, got an empty string")
        # an empty one (an unset shell variable in --set train.finetune=$CKPT) trained from scratch
        check(
            self.finetune is None or bool(self.finetune.strip()), "finetune",
            "must name weights, got an empty string (null: train from scratch)",
        )  # fmt: skip
        check(
            self.pipeline_version == PIPELINE_VERSION,
            "pipeline_version",
            f"this neutreno trains with version {PIPELINE_VERSION} only (seeds mixed per use, DeiT's crop "
            f"from the whole image), got {self.pipeline_version}",
        )
        for key in ("epochs", "batch_size", "accum_steps", "eval_every", "keep_checkpoints"):
            check(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        check(
            0 <= self.seed < SEED_LIMIT,
            "seed",
            f"must be in [0, 2**32) (PyTorch's CPU generator reads a seed's low 32 bits), got {self.seed}",
        )
        check(self.checkpoint_every >= 0, "checkpoint_every", "must be >= 0")
        check(self.lam_warmup_steps >= 0, "lam_warmup_steps", f"must be >= 0, got {self.lam_warmup_steps}")
        check(self.max_steps is None or self.max_steps >= 1, "max_steps", "must be >= 1 or null")
        check(self.total_steps is None or self.total_steps >= 1, "total_steps", "must be >= 1 or null")
        check(self.ema_decay is None or 0 < self.ema_decay < 1, "ema_decay", "must be in (0, 1) or null")
        try:
            device = torch.device(self.device) if self.device != "auto" else None
        except RuntimeError:
            device = None
            check(False, "device", f"{self.device!r} is not a device (auto, cpu, cuda, cuda:1, …)")
        check(device is None or device.type in ("cpu", "cuda"), "device", "must be auto, cpu or cuda[:N]")
        if self.tensorboard:
            missing = missing_package("tensorboard")
            check(missing is None, "tensorboard", str(missing))
        for name in self.loggers:
            check(name in LOGGERS, "loggers", f"{name!r} is not one of {', '.join(LOGGERS)}")
            missing = missing_package(name)
            check(missing is None, "loggers", str(missing))


class Task(Protocol):
    """What a task gives the engine. Batches are whatever ``collate`` returns; the engine moves the
    tensors in them (in tuples, lists and mappings, nested) to the training device (:func:`to_device`).

    ``training_loss`` gives a micro-batch's ``(loss sum, item count)`` (items: images, labelled pixels,
    tokens): the optimizer step takes the sums' total over the micro-batches of ``train.accum_steps``
    and the processes, divided by the counts' total, so every item weighs the same however the global
    batch is split (a micro-batch with fewer labelled pixels, or skipped images, weighs less, as in
    one large batch). A plain scalar is read as a mean that weighs one, as each micro-batch did before.

    ``eval_sums`` gives one validation batch's sums (e.g. hits and the count), with the same keys and
    shapes for every batch; ``summarize`` turns their totals over the validation set and the processes
    into the metrics (see :class:`~neutreno.evaluation.metric.MetricSums`)."""

    model: nn.Module  # built on the CPU; the engine moves it
    train_set: Dataset
    val_set: Dataset | None
    num_workers: int
    main_metric: str  # the evaluation metric to show in the progress bar and plots
    counters: dict[str, int]  # task counters (e.g. skipped images), checkpointed and logged
    # optional: sample_repeats (int), DeiT's repeated augmentation in the training sampler;
    # may_leave_parameters_unused (bool), some batches give some parameters no gradient (DDP looks for them);
    # sample_seeds (bool), the sampler yields (index, seed) for the training set's own random crop;
    # unrecorded_model_keys (tuple of "model.…" keys), settings of the model section that the weights'
    # record of the built model does not hold (a tokenizer's max_length): a resume that changes one says so

    def collate(self, batch: list) -> Any: ...
    def training_loss(self, model: nn.Module, batch: Any) -> tuple[Tensor, Tensor | int] | Tensor: ...
    def eval_sums(self, model: nn.Module, batch: Any) -> dict[str, Tensor]: ...
    def summarize(self, sums: dict[str, float]) -> dict[str, float]: ...
    def weights_metadata(self) -> dict: ...
    def load_pretrained(self, path: str) -> None: ...


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with its tensors on ``device``, looking into tuples, lists and mutable mappings (other
    objects are left as they are: a task moves those itself), so that a task written on a CPU trains on
    a GPU. A tensor that must stay on the CPU is the task's to bring back (``.cpu()``)."""
    if isinstance(batch, Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        moved = [to_device(item, device) for item in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)  # a namedtuple
    if isinstance(batch, MutableMapping):  # a dict, or a tokenizer's BatchEncoding (a UserDict)
        moved = copy.copy(batch)  # its own class (an OrderedDict, a defaultdict's factory)
        for key, value in batch.items():
            moved[key] = to_device(value, device)
        return moved
    return batch


class TrainingDiverged(RuntimeError):
    """The loss, a gradient or a weight became NaN or infinite (no checkpoint ever holds one)."""


# train.compile: auto compiles runs of at least this many optimizer steps, in bf16 or on CUDA. Measured
# by bench/train_step.py on a DeiT-tiny step, batch 16, 2 Intel AMX cores: compiling takes 21–29 s;
# bf16 steps get 1.04–1.14× (softmax) and 1.14–1.18× (NeuTRENO) faster (five runs), so it pays after
# ~800–2,700 steps (this threshold sits inside that range, not tuned to noisy runs); fp32 ones
# 0.98–1.02× and 1.00–1.05×: not worth it on a CPU.
COMPILE_PAYS_STEPS = 2000


def train_compiles(cfg: TrainConfig, device: torch.device, total_steps: int) -> bool:
    """Whether the trainer ``torch.compile``s the model: ``train.compile`` if true or false; for
    ``auto``, runs of at least :data:`COMPILE_PAYS_STEPS` steps (``total_steps``: those it will take,
    ``max_steps`` included) in bf16 or on CUDA, without a λ warm-up (its factor changes every step, and
    each change would recompile)."""
    if cfg.compile != "auto":
        return cfg.compile
    fast = cfg.precision == "bf16" or device.type == "cuda"
    return fast and total_steps >= COMPILE_PAYS_STEPS and not cfg.lam_warmup_steps and can_compile(device)


def slow_precision_warning(precision: str, device: torch.device) -> str | None:
    """A warning where ``precision`` is far slower than fp32 on ``device``: bf16 on a CPU without bf16
    matrix units (AVX512-BF16 or AMX), whose matrix products run in a scalar fallback (on an AVX2-only
    AMD EPYC: a DeiT-tiny training step 16× as long as in fp32 at batch 2, a CIFAR ViT's 8× at batch
    32). The run goes on as configured: the precision is the user's choice."""
    if precision != "bf16" or device.type != "cpu" or platform.machine().lower() not in ("x86_64", "amd64"):
        return None  # (other architectures name their bf16 support otherwise: no claim about them)
    if cpu_profile() != "other":
        return None
    return (
        "warning: train.precision bf16 on a CPU without bf16 matrix units (AVX512-BF16 or AMX): its "
        "matrix products run in a slow fallback, 8-16x a training step's fp32 time measured (--set "
        "train.precision=fp32)"
    )


def can_compile(device: torch.device) -> bool:
    """Whether inductor has what it builds kernels with here: Python's headers and a C++ compiler (CPU),
    Triton and a C compiler (CUDA); not on other devices."""
    import importlib.util
    import shutil
    import sysconfig

    def found(*names: str | None) -> bool:
        return any(name and shutil.which(name) for name in names)

    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        return False
    if device.type == "cuda":
        triton = importlib.util.find_spec("triton") is not None
        return triton and found(os.environ.get("CC"), "gcc", "clang", "cc")
    return device.type == "cpu" and found(os.environ.get("CXX"), "g++", "c++", "clang++")


class ResumeError(RuntimeError):
    """A run folder that cannot be resumed, or would be overwritten."""


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups as in DeiT: no weight decay on biases, norms, gains, tokens and position embeddings,
    nor on what the model's ``no_weight_decay()`` names (timm's interface: Segmenter's class embeddings)."""
    listed = getattr(model, "no_weight_decay", None)
    listed = set(listed()) if callable(listed) else set()
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            exempt = param.ndim < 2 or name.endswith(("_token", "pos_embed")) or name in listed
            (no_decay if exempt else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def fusable(params: Iterable[Tensor]) -> bool:
    """Whether PyTorch's fused AdamW/SGD kernel can update ``params``: floating point, all on one CPU or
    CUDA device. It does one pass per tensor instead of ~10 elementwise ops (DeiT-tiny's AdamW step on
    2 CPU cores: 2.9 instead of 9.4 ms) and agrees with the loop to rounding."""
    devices = set()
    for param in params:
        if not param.is_floating_point():
            return False
        devices.add(param.device)
    return len(devices) == 1 and next(iter(devices)).type in ("cpu", "cuda")


def rng_state(device: torch.device) -> dict[str, Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def train(
    make_task: Callable[[], Task],
    train_cfg: TrainConfig,
    optim_cfg: OptimConfig,
    config: dict,
    *,
    resume: bool = False,
    loggers: Sequence[Logger] = (),
) -> dict:
    """Build the task (same initial weights on every process) and train it; returns the final results.
    ``loggers`` receive the records besides those ``train_cfg.loggers`` names (see :class:`Trainer`),
    and are closed at the end, also when it fails (before the trainer is built too), after their
    ``failed(error)``."""
    try:
        try:  # before the data and model are built
            check_output_folder(train_cfg.out_dir, "train.out_dir")
        except ValueError as error:
            raise ResumeError(str(error)) from None
        if resume and not (Path(train_cfg.out_dir) / "checkpoints").is_dir():  # and no folder is left behind
            raise ResumeError(
                f"nothing to resume: no checkpoint in {Path(train_cfg.out_dir) / 'checkpoints'}"
            )
        if train_cfg.finetune and not resume:
            resolve_weights(train_cfg.finetune)  # a missing file: FileNotFoundError, before any work
        context = setup_distributed(train_cfg.device)
        if train_cfg.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
            torch.backends.cudnn.benchmark = False
        torch.manual_seed(train_cfg.seed)
        task = make_task()
    except BaseException as error:  # (a TensorBoard writer's thread was left running, its events unsaved)
        close_loggers(loggers, error)
        raise
    trainer = Trainer(task, train_cfg, optim_cfg, context, config, resume=resume, loggers=loggers)
    try:
        return trainer.fit()
    except BaseException as error:
        trainer.error = error  # MLflow and W&B mark the run failed, not finished
        raise
    finally:
        trainer.close()


def close_loggers(loggers: Sequence[Logger], error: BaseException | None = None) -> None:
    """Close every logger (each, also when one fails), after telling it of ``error`` (``failed``)."""
    with contextlib.ExitStack() as stack:
        for logger in loggers:
            if callable(getattr(logger, "close", None)):
                stack.callback(logger.close)
            if error is not None and callable(getattr(logger, "failed", None)):
                stack.callback(logger.failed, error)  # (callbacks run last first: before its close)


class Trainer:
    """Trains ``task.model``; see the module docstring. Only rank 0 writes files.

    ``loggers`` (:class:`~neutreno.training.loggers.Logger`) get every record besides the loggers that
    ``cfg.loggers`` names; on rank 0 only (other processes never call them), and the trainer closes them.
    """

    def __init__(
        self,
        task: Task,
        cfg: TrainConfig,
        optim: OptimConfig,
        context: DistributedContext,
        config: dict,
        *,
        resume: bool = False,
        loggers: Sequence[Logger] = (),
    ) -> None:
        for logger in loggers:
            if not all(callable(getattr(logger, m, None)) for m in ("log_config", "log", "close")):
                error = TypeError(f"{logger!r} is not a logger: subclass neutreno.training.Logger")
                close_loggers(loggers, error)  # the others, which were
                raise error
        self.task, self.cfg, self.optim_cfg, self.context, self.config = task, cfg, optim, context, config
        self.out_dir = Path(cfg.out_dir)
        self.device = context.device
        self.lock, self.error = None, None  # error: what training failed with (the loggers are told)
        self.loggers: list[Logger] = list(loggers) if context.is_main else []
        self.unused_loggers = [] if context.is_main else list(loggers)  # closed, never called, off rank 0
        created = False
        try:
            if context.is_main:
                try:
                    check_output_folder(self.out_dir, "train.out_dir")
                except ValueError as error:
                    raise ResumeError(str(error)) from None
                created = first_missing(self.out_dir)
                try:
                    self.lock = FolderLock(self.out_dir)  # one writer per run folder
                except OSError as error:  # PermissionError, or EROFS on a read-only mount
                    why = error.strerror or type(error).__name__
                    raise ResumeError(f"train.out_dir {self.out_dir} is not writable ({why})") from None
                for folder in (self.out_dir, self.out_dir / "checkpoints"):
                    remove_stale_temps(folder)  # left by a process killed mid-write
            self._setup(resume)
        except BaseException as error:
            self.error = error
            self.close()
            if created:  # refused before any work: no folder holding only its .lock, nor its new parents
                remove_if_only_lock(self.out_dir, created)
            raise

    def _setup(self, resume: bool) -> None:
        task, cfg, optim, context = self.task, self.cfg, self.optim_cfg, self.context
        # [{"step", "changed"}] of every resume under a changed config: results.json must say the run is
        # not the one config it names (a lower optim.lr after a divergence, say)
        self.config_changes: list[dict] = []
        # seconds of training steps up to the checkpoint resumed from (None: one saved before it was kept)
        self.seconds_before: float | None = 0.0
        self.session_start = time.perf_counter()
        # this session's evaluations and checkpoint writes: not training, so a run resumed after one
        # (its final evaluation included) counts the same seconds as one that ran straight through
        self.untimed_seconds = 0.0
        self.changed_on_resume: list[str] = []  # config keys that differ from the checkpoint's run
        checkpoint, state = self._check_out_dir(resume)
        if cfg.finetune and checkpoint is None:
            task.load_pretrained(cfg.finetune)

        self.model = task.model.to(self.device)  # unwrapped: what checkpoints and evaluation use
        if cfg.lam_warmup_steps and not lam_by_layer(self.model):  # (it changed nothing but the records)
            raise ValueError("train.lam_warmup_steps: this model has no NeuTRENO λ to warm up")
        # λ ≠ 0 somewhere (read before any warm-up factor): a λ = 0 run's scores cannot depend on the factor
        self.adds_neutreno_term = any(map(_nonzero_lam, lam_by_layer(self.model)))
        self.ema = ModelEma(self.model, cfg.ema_decay) if cfg.ema_decay else None
        self.train_model: nn.Module = self.model
        self._reached: set[int] | None = None  # under DDP without find_unused_parameters: see train_step
        if context.distributed:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            # Where a batch may leave parameters without a gradient (an untied adaptive softmax's tail
            # cluster when no target falls in it), DDP must look for them each step (one graph walk), or
            # it never all-reduces their bucket: train_step refuses a step that left one out
            finds_unused = bool(getattr(task, "may_leave_parameters_unused", False))
            self.train_model = nn.parallel.DistributedDataParallel(
                self.model, device_ids=device_ids, find_unused_parameters=finds_unused
            )
            if not finds_unused:  # which parameters the synced backward reached (train_step checks)
                self._reached = set()
                for param in self.model.parameters():
                    if param.requires_grad:
                        param.register_post_accumulate_grad_hook(lambda p: self._reached.add(id(p)))
        self._build_loaders()
        self.total_steps = cfg.total_steps or cfg.epochs * self.steps_per_epoch
        self.last_step = min(self.total_steps, cfg.max_steps or self.total_steps)  # where this run stops
        if cfg.max_steps and cfg.max_steps > self.total_steps and context.is_main:  # (a sweep's two points)
            print(
                f"warning: train.max_steps {cfg.max_steps} is past the schedule's {self.total_steps} steps: "
                f"the run ends at step {self.total_steps}",
                file=sys.stderr,
            )
        self.compiled = train_compiles(cfg, self.device, self.last_step)
        if self.compiled:
            if cfg.compile == "auto":
                # auto must never cost a run: a kernel that fails to build runs eagerly, with a warning
                # (a setting of the whole process, which a training owns)
                torch._dynamo.config.suppress_errors = True
                if context.is_main:
                    steps = self.last_step
                    print(f"compiling the model (train.compile: auto, {steps} steps; false turns it off)")
            self.train_model = torch.compile(self.train_model)
        # its weights would be trained to the end (and saved) at a scaled-down λ: the factor of the last
        # step, total_steps − 1, is below 1 unless the warm-up ends before it
        if cfg.lam_warmup_steps >= self.total_steps:
            raise ValueError(
                f"train.lam_warmup_steps ({cfg.lam_warmup_steps}) is as long as or longer than training "
                f"({self.total_steps} steps): λ would never reach its value"
            )
        self.logs_lam = bool(cfg.lam_warmup_steps) or has_learned_lam(self.model)
        warmup = optim.warmup_steps
        default_epochs = OptimConfig.__dataclass_fields__["warmup_epochs"].default
        # a config's warm-up in epochs was dropped without a word: said as training starts (fit)
        self.replaced_warmup = warmup is not None and optim.warmup_epochs != default_epochs
        # in epochs: 1e308 of them made round(inf) an OverflowError traceback (_check_schedule refuses inf)
        if warmup is None:
            warmup = optim.warmup_epochs * self.steps_per_epoch
            warmup = round(warmup) if math.isfinite(warmup) else warmup
        self.warmup_steps = warmup
        self.global_batch = cfg.batch_size * cfg.accum_steps * context.world_size
        self.base_lr = optim.lr * (self.global_batch / optim.lr_base_batch if optim.lr_base_batch else 1.0)
        groups = param_groups(self.model, optim.weight_decay)
        fused = fusable(p for group in groups for p in group["params"])  # a resumed run keeps its own
        if optim.name == "sgd":
            self.optimizer = torch.optim.SGD(
                groups, lr=self.base_lr, momentum=optim.momentum, nesterov=optim.nesterov, fused=fused
            )
        else:
            self.optimizer = torch.optim.AdamW(groups, lr=self.base_lr, betas=optim.betas, fused=fused)
        self.autocast = torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16"
        )
        self.step, self.last_checkpoint, self.history = 0, None, []
        # augmentation and dropout differ between processes, and between seeds at every rank (not seed + rank)
        torch.manual_seed(mixed_seed("process", cfg.seed, context.rank))
        if checkpoint is not None:
            self._resume_from(checkpoint, state)
        # a finished run resumed: its results stand, and no logger (W&B, MLflow) is opened for nothing
        self.finished = self._finished_results() if self.step >= self.last_step else None
        if self.finished is None and self.step > self.last_step:  # it wrote "step 40" under max_steps 20
            raise ResumeError(
                f"{checkpoint} is at step {self.step}, past this config's last step {self.last_step}: raise "
                "train.max_steps or train.epochs to train on, or train into another folder"
            )
        if self.finished is None:  # a finished run is returned as it is, whatever its schedule was
            self._check_schedule()
        if self.finished is None and checkpoint is not None and context.is_main:
            # a finished run trained on (a higher train.max_steps): no longer finished, and its results
            # (of weights a later checkpoint replaced) must not say so, were it stopped before the end
            remove_report(self.out_dir, ["results.json", "curves.png"])
        if self.changed_on_resume and self.finished is None and context.is_main:
            # where it runs (folder, device, workers) or stops changes no weights and is not recorded
            kept = [k for k in self.changed_on_resume if k not in UNRECORDED_KEYS]
            place = [k for k in self.changed_on_resume if k in UNRECORDED_KEYS]
            if kept:
                print(
                    f"warning: resuming with changed config keys: {', '.join(kept)} (results.json lists "
                    "them under config_changes: the run is no longer one config's)",
                    file=sys.stderr,
                )
            if place:
                what = "where it runs or stops, not what it trains"
                print(f"resuming with {', '.join(place)} changed ({what})", file=sys.stderr)
        if context.is_main and self.finished is None:
            self._start_loggers(resumed=checkpoint is not None)

    def _check_schedule(self) -> None:
        """A warm-up longer than training, or a decay that rises: each a one-line error, before any step."""
        optim, warmup = self.optim_cfg, self.warmup_steps
        given = "optim.warmup_steps" if optim.warmup_steps is not None else "optim.warmup_epochs"
        if warmup >= self.total_steps:  # step `warmup` is the first at optim.lr (scheduled_lr)
            raise ValueError(
                f"{given} ({warmup} steps) is as long as or longer than training ({self.total_steps} steps): "
                "the learning rate would never reach optim.lr"
            )
        scaled = "" if not optim.lr_base_batch else (
            f" (optim.lr {optim.lr:g} × global batch {self.global_batch} / optim.lr_base_batch "
            f"{optim.lr_base_batch})"
        )  # fmt: skip
        bounds = (("min_lr", optim.min_lr, "decay"), ("warmup_lr", optim.warmup_lr, "warm-up"))
        for key, value, phase in bounds:
            if value > self.base_lr * (1 + 1e-9) and (key == "min_lr" or warmup):  # equal, once rounded: flat
                raise ValueError(
                    f"optim.{key} {value:g} is above the learning rate {self.base_lr:.3g}{scaled}: the "
                    f"{phase} would raise it; lower optim.{key} or raise optim.lr"
                )

    def _build_loaders(self) -> None:
        """The resumable training sampler and loader, the validation loader, and the steps per epoch."""
        task, cfg, context = self.task, self.cfg, self.context
        self.sampler = ResumableSampler(
            len(task.train_set),
            shuffle=True,
            seed=cfg.seed,
            rank=context.rank,
            world_size=context.world_size,
            repeats=getattr(task, "sample_repeats", 1),  # DeiT's repeated augmentation, where a task asks
            item_seeds=getattr(task, "sample_seeds", False),  # seeds of its dataset's own random crops
        )
        self.train_loader = self._loader(task.train_set, self.sampler, drop_last=True)
        self.val_loader = None
        if task.val_set is not None:
            if len(task.val_set) < context.world_size:  # a process without a batch would stall the all-reduce
                raise ValueError(
                    f"the validation set has {len(task.val_set)} item(s), fewer than the "
                    f"{context.world_size} process(es): each process needs one"
                )
            val_sampler = ResumableSampler(
                len(task.val_set),
                shuffle=False,
                rank=context.rank,
                world_size=context.world_size,
                drop_tail=False,
            )
            self.val_loader = self._loader(task.val_set, val_sampler, drop_last=False)
        self.steps_per_epoch = len(self.train_loader) // cfg.accum_steps
        if self.steps_per_epoch < 1:
            raise ValueError(
                f"the training set ({len(task.train_set)} samples) is smaller than one global batch of "
                f"{cfg.batch_size * cfg.accum_steps * context.world_size} (train.batch_size "
                f"{cfg.batch_size} × train.accum_steps {cfg.accum_steps} × {context.world_size} processes)"
            )

    def _start_loggers(self, resumed: bool) -> None:
        """On rank 0: the run's config.json, and the configured loggers before the ones passed in."""
        cfg = self.cfg
        write_json(self.out_dir / "config.json", self.config)
        names = dict.fromkeys(["jsonl", *cfg.loggers, *(["tensorboard"] if cfg.tensorboard else [])])
        resume_step = self.step if resumed else None  # cut back to the checkpoint
        if not resumed:  # a failed run's (no checkpoint) dashboards: this run's loggers or not, not its own
            forget_failed_run(self.out_dir)
        elif self.step:
            started = [n for n in names if n != "jsonl" and not has_logged(n, self.out_dir)]
            if started:  # turned on at this resume: it has none of the steps before
                print(
                    f"note: {', '.join(started)} starts at step {self.step + 1}, where this resume does; "
                    f"steps 1-{self.step} are in metrics.jsonl only",
                    file=sys.stderr,
                )
        for i, name in enumerate(names):  # metrics.jsonl first: it always gets the record
            self.loggers.insert(i, LOGGERS[name](self.out_dir, resume_step=resume_step))
        for logger in self.loggers:
            logger.log_config({**self.config, "resolved": self.resolved_settings()})

    def resolved_settings(self) -> dict:
        """What the config leaves to the run and what it ran with: the learning rate scaled to the global
        batch, the schedule's steps, the processes and the device (config.json holds the settings as given:
        ``optim.lr`` 2e-3 for a run trained at 1e-3 with ``lr_base_batch``)."""
        return {
            "lr": self.base_lr,
            "global_batch": self.global_batch,
            "total_steps": self.total_steps,
            "warmup_steps": self.warmup_steps,
            "last_step": self.last_step,
            "world_size": self.context.world_size,
            "device": str(self.device),
            "compiled": self.compiled,
        }

    # ---- the loop -------------------------------------------------------------------------------------

    def fit(self) -> dict:
        """Train to ``epochs`` (or ``max_steps``), evaluating and checkpointing; returns the results."""
        cfg, spe = self.cfg, self.steps_per_epoch
        if self.replaced_warmup and self.finished is None and self.context.is_main:
            print(
                f"note: optim.warmup_steps {self.optim_cfg.warmup_steps} replaces optim.warmup_epochs "
                f"{self.optim_cfg.warmup_epochs:g}",
                file=sys.stderr,
            )
        last_step = self.last_step
        if self.finished is not None:  # evaluating again would log a second final record at this step
            if self.context.is_main:
                curves = self.out_dir / "curves.png"
                if not curves.exists():  # stopped between the two by an older neutreno, which wrote it last
                    plot_curves(self.out_dir / "metrics.jsonl", curves, self.task.main_metric)
                print(
                    f"{self.out_dir} is finished at step {self.step} (results.json); raise train.epochs or "
                    "train.max_steps to train on",
                    file=sys.stderr,
                )
            self.close()
            return self.finished
        if self.context.is_main:
            print(
                f"training {self.step}→{last_step} of {self.total_steps} steps ({spe}/epoch), global batch "
                f"{self.global_batch}, lr {self.base_lr:.3g}, {self.context.world_size} process(es) on "
                f"{self.device.type}, {cfg.precision}; writing {self.out_dir}",
                file=sys.stderr,
            )
            slow = slow_precision_warning(cfg.precision, self.device)
            if slow:
                print(slow, file=sys.stderr)
        self.session_start, start_step, self.untimed_seconds = time.perf_counter(), self.step, 0.0
        # Workers' own draws differ between seeds and processes, and a resume does not repeat the start's
        # (they are not replayed exactly; the built-in tasks' worker-side crops take the sampler's
        # per-sample seeds instead, which are)
        self.train_loader.generator.manual_seed(mixed_seed("workers", cfg.seed, self.context.rank, self.step))
        with progress(
            total=last_step, initial=self.step, desc="train", unit="step", enabled=self.context.is_main
        ) as bar:  # closed before any error is printed
            while self.step < last_step:
                epoch, offset = divmod(self.step, spe)
                self.sampler.set_epoch(epoch, start=offset * cfg.accum_steps * cfg.batch_size)
                batches = iter(self.train_loader)
                for _ in range(offset, spe):
                    step_start = time.perf_counter()
                    loss, grad_norm = self.train_step(batches)
                    self.step += 1
                    record = {
                        "step": self.step,
                        "epoch": round(self.step / spe, 4),
                        "lr": self._lr(self.step - 1),
                        "loss": loss,
                        "samples_per_s": self.global_batch / (time.perf_counter() - step_start),
                    }
                    if grad_norm is not None:
                        record["grad_norm"] = grad_norm
                    if self.logs_lam:
                        record["lam"] = lam_by_layer(self.model)  # per NeuTRENO layer (or per head)
                    self.log(record | {k: v for k, v in self._global_counters().items() if v})
                    # this step's loss on this step's line (it showed the step before's)
                    bar.set_postfix(epoch=epoch + 1, loss=f"{loss:.4f}", lr=f"{record['lr']:.2e}")
                    bar.update()
                    # at an epoch's end, after its evaluation (below); the last step's after the final one
                    every = cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0
                    if every and self.step % spe and self.step < last_step:
                        self.save()
                    if self.step >= last_step:
                        break
                epoch_done = self.step % spe == 0
                if epoch_done and (self.step // spe) % cfg.eval_every == 0 and self.step < last_step:
                    self.evaluate_and_log()  # before the checkpoint: a resumed run never misses an evaluation
                every = not cfg.checkpoint_every or self.step % cfg.checkpoint_every == 0
                if epoch_done and every and self.step < last_step:
                    self.save()
        seconds = self.trained_seconds()
        # evaluated before the last checkpoint: weights that are finite but overflow on real data (NaN
        # logits) stop the run here and are never saved as a finished run's
        # resumed from the final checkpoint (stopped before results.json): its evaluation, made before
        # that checkpoint, is in the log already, and is made again for results.json but not logged twice
        logged = self.step == start_step and self.context.is_main and self._val_logged(self.step)
        final = self.evaluate_and_log(log=not logged)
        if self.last_checkpoint is None or self.last_checkpoint.name != f"step-{self.step:06d}":
            self.save()
        results = {
            "step": self.step,
            "epochs": round(self.step / spe, 4),
            "val": final,
            # over every step of the run, the sessions before a resume included (to their checkpoints)
            "train_samples_per_s": None
            if seconds is None
            else self.step * self.global_batch / max(seconds, 1e-9),
            "train_seconds": None if seconds is None else round(seconds, 1),
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "processes": self.context.world_size,
            "process_group": self.context.backend,  # nccl/gloo under torchrun, else null
            "counters": self._global_counters(),
            "checkpoint": str(self.last_checkpoint),
            "config": self.config,
            "resolved": self.resolved_settings(),
        }
        if self.config_changes:  # trained under other settings before these steps: "config" is the last
            results["config_changes"] = self.config_changes
        scale = min((getattr(m, "lam_scale", 1.0) for m in self.model.modules()), default=1.0)
        # stopped inside the λ warm-up (train.max_steps), with a λ to scale: at λ = 0 (a sweep's baseline
        # point) the scores cannot depend on it, and its row said they did
        if scale < 1 and self.adds_neutreno_term:
            # the scores are at the warm-up's λ; the checkpoint holds weights only, so it loads at full λ
            results["lam_scale"] = scale
            if self.context.is_main:
                print(
                    f"warning: stopped at step {self.step}, inside the λ warm-up ({cfg.lam_warmup_steps} "
                    f"steps): these scores are at λ × {results['lam_scale']:.3g}; the checkpoint loads at "
                    "full λ",
                    file=sys.stderr,
                )
        if self.context.is_main:  # results.json last: it says the run is finished, its plot included
            plot_curves(self.out_dir / "metrics.jsonl", self.out_dir / "curves.png", self.task.main_metric)
            write_json(self.out_dir / "results.json", results)
        self.close()
        return results

    def _finished_results(self) -> dict | None:
        """This run's ``results.json`` when it was written at this step, else None (then the run is
        evaluated and the file written again).

        Raises:
            ResumeError: the finished run was trained under another config (lr, seed, …): evaluating
                its weights again would write them up under this one.
        """
        results = self._results_at(self.step)
        current = results is not None
        saved = results.get("config") if current else None
        if not isinstance(saved, dict):
            saved = read_run_config(self.out_dir)
        changed = config_changes(saved, self.config) if isinstance(saved, dict) else []
        changed = [k for k in changed if k not in UNRECORDED_KEYS]  # moved, another device, …
        if changed:
            raise ResumeError(
                f"{self.out_dir} is finished (step {self.step}) under another config ({', '.join(changed)} "
                "differ): its weights were not trained with this one; train into another folder, or score "
                "them with neutreno eval --data …"
            )
        return results if current else None

    def _results_at(self, step: int) -> dict | None:
        """This run folder's results.json when it was written at ``step`` (the run finished there)."""
        try:
            results = json.loads((self.out_dir / "results.json").read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return None
        return results if isinstance(results, dict) and results.get("step") == step else None

    def close(self) -> None:
        """Close the loggers and release the run folder (also after an error)."""
        loggers, self.loggers = self.loggers + self.unused_loggers, []
        self.unused_loggers = []
        with contextlib.ExitStack() as stack:  # every one is closed even when one fails
            if self.lock is not None:
                stack.callback(self.lock.release)
            stack.callback(close_loggers, loggers, self.error)

    def train_step(self, batches) -> tuple[float, float]:
        """One optimizer step over ``accum_steps`` micro-batches; returns (global mean loss, grad norm).

        A non-finite loss or gradient stops training before the update. A weight that a finite update
        overflows (a huge lr) is caught by the next step's loss, and :meth:`save` checks the weights,
        so no checkpoint holds one; checking every weight after every step would cost ~1.5% of a step."""
        cfg = self.cfg
        lr = self._lr(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._warm_up_lam(self.step)
        self.model.train()
        # (loss sum, item count) of this process; float64 counts pixels exactly past float32's 2**24
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        for micro in range(cfg.accum_steps):
            batch = next(batches)
            # DDP all-reduces gradients on every backward; only the last micro-batch needs it.
            sync = micro == cfg.accum_steps - 1 or not self.context.distributed
            if sync and self._reached is not None:
                self._reached.clear()
            with contextlib.nullcontext() if sync else self.train_model.no_sync():
                with self.autocast:
                    loss = self.task.training_loss(self.train_model, to_device(batch, self.device))
                loss_sum, count = loss if isinstance(loss, tuple) else (loss, 1)
                loss_sum.backward()  # divided by the step's total count below, once it is known
            totals[0] += loss_sum.detach()
            totals[1] += count
        loss_total, count_total = all_reduce_sum(totals, self.context).unbind()
        count_total = count_total.clamp_min(1)  # no labelled item anywhere: the gradients are all zero
        mean_loss = loss_total / count_total
        if self._reached is not None:
            self._check_every_parameter_has_a_gradient()
        params = [p for p in self.model.parameters() if p.grad is not None]
        # DDP averaged the processes' gradients: × world size gives their sum
        torch._foreach_mul_([p.grad for p in params], (self.context.world_size / count_total).float())
        if self.optim_cfg.clip_grad:
            grad_norm_t = nn.utils.clip_grad_norm_(params, self.optim_cfg.clip_grad)
        else:  # measured on every step: finite losses can come with infinite gradients
            grad_norm_t = torch.linalg.vector_norm(torch.stack(torch._foreach_norm([p.grad for p in params])))
        loss_value, grad_norm = torch.stack([mean_loss.float(), grad_norm_t.float()]).tolist()
        if not math.isfinite(loss_value) or not math.isfinite(grad_norm):
            what = f"gradient norm is {grad_norm}" if math.isfinite(loss_value) else f"loss is {loss_value}"
            raise self._diverged(f"{what} at step {self.step + 1}", "stopped before updating the weights")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update(self.model)
        return loss_value, grad_norm

    def _check_every_parameter_has_a_gradient(self) -> None:
        """Under DDP without ``find_unused_parameters``, a parameter the synced (last) micro-batch's
        backward did not reach keeps its bucket from being all-reduced, even with a gradient from an
        earlier micro-batch: the bucket's gradients stay this process's own, a wrong update (DDP itself
        fails only at the next step, too late for the last one)."""
        missing = [
            name
            for name, p in self.model.named_parameters()
            if p.requires_grad and id(p) not in self._reached
        ]
        if missing:
            raise RuntimeError(
                f"parameter {missing[0]} (and {len(missing) - 1} more) got no gradient from the last "
                f"backward of step {self.step + 1} in process {self.context.rank}: under torchrun the task "
                "must set may_leave_parameters_unused = True"
            )

    def _warm_up_lam(self, step: int) -> None:
        """λ's warm-up factor for the optimizer step after ``step`` steps, from the step alone (so a
        resumed run gets the same factors), on the model and its EMA copy (evaluated beside it)."""
        warmup = self.cfg.lam_warmup_steps
        if warmup and step <= warmup:  # after it, every factor stays 1
            for model in (self.model, self.ema.module if self.ema is not None else None):
                if model is not None:
                    set_lam_scale(model, min(1.0, step / warmup))

    def _global_counters(self) -> dict[str, int]:
        """The task's counters summed over the processes (each counts its own share of the data); a
        collective, so every process calls it at the same points."""
        names = sorted(self.task.counters)
        if not names or not self.context.distributed:
            return dict(self.task.counters)
        totals = torch.tensor([self.task.counters[k] for k in names], dtype=torch.int64, device=self.device)
        return dict(zip(names, all_reduce_sum(totals, self.context).tolist(), strict=True))

    def _diverged(self, what: str, done: str) -> TrainingDiverged:
        from neutreno.training.checkpoint import checkpoints_by_step

        last = self.last_checkpoint
        if last is None and self.step == 0:  # no update yet: the learning rate is not in it
            kept = "no update had been made: the weights it started from give it (fine-tuned or backbone "
            kept += "weights that overflow on this data?)"
        elif last is None:
            kept = "no checkpoint yet: train again, perhaps with a lower optim.lr"
        elif int(last.name.removeprefix("step-")) >= self.step:
            # the weights that failed are the ones after self.step steps, which it holds: a resume
            # recomputes this very failure (the same batch and random state; the learning rate is not in it)
            then = (
                "then --resume continues from the one before, perhaps with a lower optim.lr"
                if any(c != last for c in checkpoints_by_step(last.parent))
                else "then train again without --resume, perhaps with a lower optim.lr (it is the only one)"
            )
            kept = (  # the weights, the batch or the loss: this step alone cannot tell which
                f"the last checkpoint, {last}, holds finite weights from which this step gave it (weights "
                "about to overflow, a batch of bad values, or a loss whose gradient is not finite there), "
                f"and --resume from it would compute it again: to go past it, delete it, {then}"
            )
        else:
            kept = f"last good checkpoint: {last} (--resume continues from it, perhaps with a lower optim.lr)"
        epoch = self.step // self.steps_per_epoch + 1
        return TrainingDiverged(
            f"{what} (epoch {epoch}); training {done}, nothing non-finite was saved; {kept}"
        )

    @torch.no_grad()
    def evaluate(self, model: nn.Module | None = None) -> dict[str, float]:
        """The task's metrics on the whole validation set: its ``eval_sums`` of every batch, summed over
        the batches and the processes (:class:`~neutreno.evaluation.metric.MetricSums`), summarized."""
        if self.val_loader is None:
            return {}
        model = model or self.model
        was_training = model.training
        model.eval()
        metric = MetricSums(self.task.summarize, context=self.context)
        try:
            for batch in self.val_loader:
                with self.autocast:
                    metric.update(self.task.eval_sums(model, to_device(batch, self.device)))
            scores = metric.compute()
        except NonFiniteOutputs as error:
            raise self._diverged(f"validation at step {self.step}: {error}", "stopped") from None
        model.train(was_training)
        return scores

    def _val_logged(self, step: int) -> bool:
        """Whether metrics.jsonl holds a validation record at ``step``."""
        path = self.out_dir / "metrics.jsonl"
        return path.is_file() and any(
            r["step"] == step and r.get("split") == "val" for r in read_metrics(path)
        )

    def evaluate_and_log(self, log: bool = True) -> dict[str, dict[str, float]]:
        with self._untimed():
            return self._evaluate_and_log(log)

    @contextlib.contextmanager
    def _untimed(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.untimed_seconds += time.perf_counter() - start

    def _evaluate_and_log(self, log: bool) -> dict[str, dict[str, float]]:
        metrics = {"model": self.evaluate()}
        if self.ema is not None:
            metrics["ema"] = self.evaluate(self.ema.module)
        record = {"step": self.step, "epoch": round(self.step / self.steps_per_epoch, 4), "split": "val"}
        for name, values in metrics.items():
            record |= {(k if name == "model" else f"ema_{k}"): v for k, v in values.items()}
        if log:
            self.log(record)
        if self.context.is_main and metrics["model"]:
            shown = ", ".join(
                f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                for k, v in record.items()
                if k not in ("step", "epoch", "split")
            )
            write(f"step {self.step} (epoch {record['epoch']:g}): val {shown}")
        return metrics

    # ---- bookkeeping -----------------------------------------------------------------------------------

    def _lr(self, step: int) -> float:
        return scheduled_lr(
            step,
            base_lr=self.base_lr,
            total_steps=self.total_steps,
            warmup_steps=self.warmup_steps,
            warmup_lr=self.optim_cfg.warmup_lr,
            min_lr=self.optim_cfg.min_lr,
            schedule=self.optim_cfg.schedule,
            power=self.optim_cfg.poly_power,
        )

    def _loader(self, dataset: Dataset, sampler: ResumableSampler, drop_last: bool) -> DataLoader:
        workers = self.task.num_workers
        return DataLoader(
            dataset,
            batch_size=self.cfg.batch_size,
            sampler=sampler,
            num_workers=workers,
            collate_fn=self.task.collate,
            drop_last=drop_last,
            pin_memory=self.device.type == "cuda",
            persistent_workers=workers > 0,
            # Its own generator: creating an iterator must not draw from the global RNG (exact resume).
            # It seeds the workers' RNG (a task's own random transforms); fit() seeds it per rank.
            generator=torch.Generator(),
        )

    def log(self, record: dict) -> None:
        """Hand ``record`` to every logger (none outside rank 0)."""
        for logger in self.loggers:
            logger.log(record, record["step"])

    def trained_seconds(self) -> float | None:
        """Seconds spent training this run's steps so far, evaluations and checkpoint writes left out: the
        sessions before a resume (to the checkpoint resumed from) and this one's; None when a checkpoint
        from before this was recorded was resumed."""
        if self.seconds_before is None:
            return None
        return self.seconds_before + time.perf_counter() - self.session_start - self.untimed_seconds

    def save(self) -> None:
        """Checkpoint now: weights, EMA, optimizer, step, counters and every process's RNG state.
        Refuses (TrainingDiverged) to save weights or optimizer state that are not all finite."""
        if not weights_finite(self.model) or (self.ema is not None and not weights_finite(self.ema.module)):
            raise self._diverged(f"non-finite weights at step {self.step}", "stopped")
        if not optimizer_state_finite(self.optimizer):
            raise self._diverged(f"non-finite optimizer state at step {self.step}", "stopped")
        seconds = self.trained_seconds()
        with self._untimed():
            self._save(seconds)

    def _save(self, seconds: float | None) -> None:
        states = all_gather_objects(rng_state(self.device), self.context)
        counters = self._global_counters()
        if self.context.is_main:
            state = {
                "step": self.step,
                "optimizer": self.optimizer.state_dict(),
                "rng": states,
                "counters": counters,
                "train_seconds": seconds,
                "train_samples": len(self.task.train_set),  # the data a step count places a resume in
                "world_size": self.context.world_size,
                "config_changes": self.config_changes,
                "config": self.config,
            }
            self.last_checkpoint = save_checkpoint(
                self.out_dir,
                self.step,
                self.model,
                state,
                ema=self.ema.module if self.ema else None,
                extra=self.task.weights_metadata(),
                keep=self.cfg.keep_checkpoints,
            )
        else:
            self.last_checkpoint = self.out_dir / "checkpoints" / f"step-{self.step:06d}"
        barrier(self.context)

    def _check_out_dir(self, resume: bool) -> tuple[Path | None, dict]:
        """The checkpoint to resume from and its state (None and {} for a fresh run), checked against
        the config; ``config_changes`` gets this resume's changed keys."""
        if not resume:
            checkpoint = latest_checkpoint(self.out_dir)
            if checkpoint is not None:
                raise ResumeError(
                    f"{self.out_dir} already holds a run (checkpoint {checkpoint.name}); pass --resume to "
                    "continue it, or choose another train.out_dir"
                )
            if (self.out_dir / "results.json").exists():  # a demo's or study's report, or a run's without
                raise ResumeError(  # its checkpoints: replaced by this run's, beside the other's files
                    f"{self.out_dir} holds a results.json but no checkpoint (another command's report, or a "
                    "run whose checkpoints were removed); choose another train.out_dir"
                )
            return None, {}
        try:
            checkpoint = resume_checkpoint(self.out_dir)
        except ValueError as error:
            raise ResumeError(str(error)) from None
        if checkpoint is None:
            raise ResumeError(f"nothing to resume: no checkpoint in {self.out_dir / 'checkpoints'}")
        state = load_state(checkpoint)
        self.config_changes = list(state.get("config_changes", []))
        saved = trained_config(self.out_dir, state)
        if saved is not None:
            changed = config_changes(saved, self.config)
            # The weights fit every attention variant (NeuTRENO adds no parameters), so a changed model
            # would load silently and be reported under the old run's name.
            fixed = [k for k in changed if k == "task" or k.startswith("model.")]
            if fixed and "task" not in fixed and self._model_differs(checkpoint / "model.safetensors") == "":
                # spelled otherwise, the same model: model.lam 0.6 for the null that resolved to 0.6, a
                # preset's own depth written out (the weights' record of the built model says so)
                unrecorded = set(getattr(self.task, "unrecorded_model_keys", ()))
                fixed, changed = [], [k for k in changed if not k.startswith("model.") or k in unrecorded]
            if fixed:
                theirs, ours = ({k: _shown_value(_lookup(c, k)) for k in fixed} for c in (saved, self.config))
                shown = "; ".join(f"{k} {theirs[k]} there, {ours[k]} here" for k in fixed)
                raise ResumeError(
                    f"{checkpoint} was trained with other {', '.join(fixed)} ({shown}); resuming would mix "
                    "two models in one run (train into another folder, with train.finetune to start from it)"
                )
            kept = [k for k in changed if k not in UNRECORDED_KEYS]
            if kept:
                self.config_changes.append({"step": int(state["step"]), "changed": kept})
            self.changed_on_resume = changed  # said once the run is known to have steps left
        return checkpoint, state

    def _check_same_meaning(self, weights: Path) -> None:
        """The ids the weights were trained on mean what they meant: the same tokenizer (a language
        model's vocabulary, rebuilt from a changed corpus, can map id k to another word with the same
        size) and the same class names (in the same order). Another would load and train on silently."""
        from neutreno.models.checkpoint import metadata_differs

        differ = metadata_differs(weights, self.task.weights_metadata(), ("tokenizer", "classes"))
        if differ:
            raise ResumeError(
                f"{weights} was trained with another {differ[0]} than this run's data gives (ids would "
                "change meaning); restore the data, or train into another train.out_dir"
            )

    def _check_same_model(self, weights: Path) -> None:
        """The checkpoint's own record of its model (registry name, attention, λ, constructor arguments)
        must be the configured one: every attention variant has the same weights, so another would load
        and go on under the new name. config.json says the same, but a run folder may have lost it."""

        shown = self._model_differs(weights)
        if shown:
            raise ResumeError(
                f"{weights} holds another model ({shown}); resuming would mix two models in one run "
                "(train into another folder, with train.finetune to start from it)"
            )

    def _model_differs(self, weights: Path) -> str | None:
        """How the weights' record of their model differs from this run's built model ("" where it is the
        same in every key), or None where that cannot be told (a model not built by ``create_model``, no
        readable record, or a record lacking a key and differing in none it has)."""
        from neutreno.models.checkpoint import read_metadata, running_spec

        model = self.task.model
        if getattr(model, "model_spec", None) is None:  # not built by create_model: its checkpoints
            return None  # carry no record either
        try:
            saved = read_metadata(weights)
        except (OSError, ValueError):  # (a damaged file: refused where it is loaded)
            return None
        spec = running_spec(model, full_lam=True)
        ours = {key: spec[key] for key in ("model", "attention", "lam", "args")}
        if isinstance(saved.get("args"), dict) and "config" not in saved["args"]:
            # an hf: file from before the architecture was recorded (neutreno.hf.sequence_classifier)
            ours["args"] = {k: v for k, v in ours["args"].items() if k != "config"}
        # (a record from before a key was kept: the keys it has are compared, and it is never "the same")
        differ = [k for k, v in ours.items() if k in saved and json.loads(json.dumps(v)) != saved[k]]
        if differ:
            return "; ".join(_difference(k, saved[k], json.loads(json.dumps(ours[k]))) for k in differ)
        return "" if all(k in saved for k in ours) else None

    def _check_same_place_in_data(self, checkpoint: Path, state: dict) -> None:
        """A run with steps left resumes at the global batch it was trained at, on as many training
        samples: the step count is its place in the data and the schedule only then (another batch or
        data set re-reads samples or skips them, reshapes the epochs and the schedule, and another batch
        rescales the learning rate), as timm and DeiT keep it in the recipe."""
        saved = (trained_config(self.out_dir, state) or {}).get("train")
        step = int(state["step"])
        if step >= self.last_step and self._results_at(step) is not None:
            return  # finished, and nothing to train (the new batch's last step alone would not say)
        samples = state.get("train_samples")  # (checkpoints from before it was recorded: not checked)
        if samples is not None and samples != len(self.task.train_set):
            raise ResumeError(
                f"{checkpoint} was trained on {samples} training samples, the data now has "
                f"{len(self.task.train_set)}: its step {step} would continue another data order and "
                "schedule; restore the data, or train into another train.out_dir (train.finetune to start "
                "from this checkpoint)"
            )
        if not isinstance(saved, dict):
            return
        processes = int(state["world_size"])
        batch, accum = saved.get("batch_size"), saved.get("accum_steps", 1)
        if not isinstance(batch, int) or not isinstance(accum, int):
            return
        trained = batch * accum * processes
        if trained != self.global_batch:
            raise ResumeError(
                f"{checkpoint} was trained at global batch {trained} ({processes} process(es) × "
                f"train.batch_size {batch} × train.accum_steps {accum}), this resume's is "
                f"{self.global_batch}: its steps would re-read samples and reshape the schedule; set "
                f"train.batch_size and train.accum_steps to make {trained} with {self.context.world_size} "
                "process(es)"
            )

    def _resume_from(self, checkpoint: Path, state: dict) -> None:
        from neutreno.models.checkpoint import load_safetensors, load_state_dict_checked

        self._check_same_place_in_data(checkpoint, state)
        weights = checkpoint / "model.safetensors"
        self._check_same_model(weights)
        self._check_same_meaning(weights)
        load_state_dict_checked(self.model, load_safetensors(weights, str(self.device)), weights)
        if self.ema is not None and (checkpoint / "ema.safetensors").is_file():
            weights = checkpoint / "ema.safetensors"
            load_state_dict_checked(self.ema.module, load_safetensors(weights, str(self.device)), weights)
        elif self.ema is not None:  # train.ema_decay set on resume: the average starts here, not at init
            self.ema = ModelEma(self.model, self.cfg.ema_decay)
            if self.context.is_main:
                print(f"{checkpoint} holds no EMA: it starts from the resumed weights", file=sys.stderr)
        configured = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        saved_groups = state["optimizer"]["param_groups"]
        if [("betas" in g, "momentum" in g) for g in saved_groups] != [
            ("betas" in g, "momentum" in g) for g in configured
        ]:  # AdamW's groups have betas, SGD's momentum: the state of one means nothing to the other
            saved = "AdamW" if "betas" in saved_groups[0] else "SGD"
            raise ResumeError(f"{checkpoint} was saved by {saved}; resume with the run's optim.name")
        self.optimizer.load_state_dict(state["optimizer"])
        # load_state_dict brings back the saved weight decay, betas, momentum: the config says what the
        # run trains with from here (its changed keys were listed above); lr is set every step
        for group, settings in zip(self.optimizer.param_groups, configured, strict=True):
            group.update(settings)
        self.step = int(state["step"])
        self.seconds_before = state.get("train_seconds") if self.step else 0.0
        # the checkpoint holds the counts of every process: the main one carries them on
        saved = state.get("counters", {})
        self.task.counters.update({k: v if self.context.is_main else 0 for k, v in saved.items()})
        if self.step:  # the factor of the step that led here: a run resumed at its end is evaluated so
            self._warm_up_lam(self.step - 1)
        self.last_checkpoint = checkpoint
        if state["world_size"] == self.context.world_size:
            set_rng_state(state["rng"][self.context.rank], self.device)
        elif self.context.is_main:
            print(
                f"warning: {checkpoint} was saved by {state['world_size']} processes, resuming with "
                f"{self.context.world_size}: the data order continues, random augmentations differ",
                file=sys.stderr,
            )
        if self.context.is_main:  # metrics.jsonl is cut back to the checkpoint by its logger
            print(f"resuming from {checkpoint} (step {self.step})", file=sys.stderr)


def read_run_config(run_dir: Path) -> dict | None:
    """A run's ``config.json`` (None without one); a ResumeError naming it when it is damaged or
    holds no config: it was read bare, a JSON error naming no file, or an AttributeError (a list)."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ResumeError(f"{path} is damaged ({error}); remove it to resume without its check") from None
    if not isinstance(saved, dict):
        raise ResumeError(f"{path} holds no run config (a {type(saved).__name__}); remove it to resume")
    return saved


def trained_config(run_dir: Path, state: dict) -> dict | None:
    """The config a checkpoint (its ``state``) was trained under: the one the state keeps, else, for
    checkpoints saved before they kept it, the run's ``config.json``; None without either. config.json
    alone will not do: a resume rewrites it as it starts, so after one killed before its first
    checkpoint it names the new config for weights trained under the old."""
    return state.get("config") or read_run_config(run_dir)


# How a run is logged or executed, not what it trains: never a reason to call two configs different runs.
LOGGING_KEYS = ("train.loggers", "train.tensorboard", "train.compile")
# Where and how a run executes, not what it trains: a finished run's results stand under any of these.
PLACE_KEYS = ("train.out_dir", "train.device", "data.num_workers")
# Where a run stops and what it keeps or scores on the way: every step's weights are the same under any
# of these (a resume that raises max_steps trains on one run, as the schedule spans total_steps).
ON_THE_WAY_KEYS = ("train.max_steps", "train.keep_checkpoints", "train.checkpoint_every", "train.eval_every")
# A resume that changes only these trains the same run: said, not recorded in config_changes.
UNRECORDED_KEYS = PLACE_KEYS + ON_THE_WAY_KEYS


_ABSENT = object()  # a key one config lacks differs from any value, None included

# Keys added after runs were saved, with the value that behaves as before they existed: a saved config
# that lacks one ran with that value, so it matches a config holding it.
ADDED_KEYS = {
    "train.pipeline_version": 1,
    "train.lam_warmup_steps": 0,
    "augment.base_size": None,
    "optim.nesterov": False,
    "augment.repeated_aug": 1,
}


def config_changes(saved: dict, config: dict) -> list[str]:
    """The dotted keys whose values differ between two config dicts, logging and execution keys left out
    (``LOGGING_KEYS``), model arguments compared in today's names (``mlp_dim: 512`` at D 128 is
    ``mlp_ratio: 4.0``) and a key added since ``saved`` was written taken at its earlier behaviour
    (``ADDED_KEYS``)."""
    changed = _diff(_canonical(saved), _canonical(config))
    return sorted(
        k
        for k in changed
        if k not in LOGGING_KEYS
        and not (k in ADDED_KEYS and _lookup(saved, k) is _ABSENT and _lookup(config, k) == ADDED_KEYS[k])
    )


def _lookup(config: dict, dotted: str) -> Any:
    for key in dotted.split("."):
        if not isinstance(config, dict) or key not in config:
            return _ABSENT
        config = config[key]
    return config


def _canonical(config: dict) -> dict:
    model = config.get("model")
    if isinstance(model, dict) and isinstance(model.get("name"), str) and isinstance(model.get("args"), dict):
        return {**config, "model": {**model, "args": canonical_args(model["name"], model["args"])}}
    return config


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        keys = set(a) | set(b)
        return [k for key in keys for k in _diff(a.get(key, _ABSENT), b.get(key, _ABSENT), f"{prefix}{key}.")]
    return [] if a == b or _same_file(a, b) else [prefix.rstrip(".")]


def _difference(key: str, theirs: Any, ours: Any) -> str:
    """How a checkpoint's record ``theirs`` of ``key`` differs from this run's ``ours``, in one short line:
    a mapping's differing entries only (a Hugging Face classifier's args hold its whole config)."""

    def shown(record: Any, dotted: str) -> str:
        value = _lookup({key: record}, dotted)
        return "(none)" if value is _ABSENT else reprlib.repr(value)

    keys = _diff(theirs, ours, f"{key}.") if isinstance(theirs, dict) and isinstance(ours, dict) else [key]
    return "; ".join(f"{k} {shown(theirs, k)} there, {shown(ours, k)} here" for k in keys)


def _nonzero_lam(lam: float | list[float]) -> bool:
    """Whether a layer's λ (a number, or one per head) is anything but 0."""
    return any(lam) if isinstance(lam, list) else bool(lam)


def _shown_value(value: Any) -> str:
    """A config value in a message: "(none)" for a key the config does not have, else a short repr."""
    return "(none)" if value is _ABSENT else reprlib.repr(value)


def _same_file(a: Any, b: Any) -> bool:
    """Two path strings naming one existing file or folder (``../shared/data/x`` and ``/work/shared/data/x``
    from the checkout): a run that read its data by another spelling of the path."""
    if not (isinstance(a, str) and isinstance(b, str) and os.path.exists(a) and os.path.exists(b)):
        return False
    return os.path.samefile(a, b)


def weights_finite(model: nn.Module) -> bool:
    """Whether every parameter and buffer of ``model`` is finite (one reduction, one sync)."""
    return _all_finite([*model.parameters(), *model.buffers()])


def optimizer_state_finite(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every floating-point tensor of the optimizer's state (Adam's moments, SGD's momentum) is
    finite: a NaN there turns its weights NaN at the next step, an infinite second moment freezes them."""
    return _all_finite(
        [t for state in optimizer.state.values() for t in state.values() if isinstance(t, Tensor)]
    )


def _all_finite(tensors: list[Tensor]) -> bool:
    """Whether the floating-point ``tensors`` hold no NaN or infinity (one reduction, one sync)."""
    tensors = [t for t in tensors if t.is_floating_point() and t.numel()]
    if not tensors:
        return True
    # The max-norm: NaN and inf propagate, and huge finite values do not overflow as a sum of squares.
    return bool(torch.isfinite(torch.stack(torch._foreach_norm(tensors, ord=math.inf))).all())


def plot_curves(metrics_path: Path, out: Path, main_metric: str) -> None:
    """Training loss and the validation ``main_metric`` against the step, from ``metrics.jsonl``."""
    plt = pyplot()

    records = read_metrics(metrics_path)
    train = [r for r in records if "split" not in r]
    val = [r for r in records if r.get("split") == "val" and main_metric in r]
    lams = [r for r in train if isinstance(r.get("lam"), list)]  # learned or scheduled λ
    fig, axes = plt.subplots(1, 3 if lams else 2, figsize=(15 if lams else 10, 4))
    ax_loss, ax_val = axes[0], axes[1]
    window = max(1, len(train) // 50)  # a running mean shows the trend through per-step noise
    if window > 1:
        ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], lw=0.6, alpha=0.5)
        smooth = torch.tensor([r["loss"] for r in train]).unfold(0, window, 1).mean(1)
        ax_loss.plot([r["step"] for r in train][window - 1 :], list(smooth), lw=1.5)
        title = f"training loss (line: running mean of {window} steps)"
    else:  # under 100 steps the "running mean" was the loss itself
        ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1.0)
        title = "training loss"
    ax_loss.set(xlabel="optimizer step", ylabel="training loss", title=title)
    ax_val.plot([r["step"] for r in val], [r[main_metric] for r in val], marker="o")
    name = metric_name(main_metric)
    ax_val.set(xlabel="optimizer step", ylabel=name, title=f"validation {name.split(' (')[0]}")
    if main_metric == "ppl" and val and all(r[main_metric] > 0 for r in val):
        ax_val.set_yscale("log")  # 9255 → 111 drew every point after the second flat on the axis
    if lams:
        ax_lam, steps = axes[2], [r["step"] for r in lams]
        per_head = any(isinstance(v, list) for v in lams[0]["lam"])
        for i in range(len(lams[0]["lam"])):  # a per-head λ is drawn as its heads' mean
            values = [v if isinstance(v := r["lam"][i], (int, float)) else sum(v) / len(v) for r in lams]
            ax_lam.plot(steps, values, label=f"layer {i + 1}")
        # (a Segmenter's decoder is a stack of its own: its first layer, after the encoder's, too)
        title = "λ by NeuTRENO layer" + (", mean over heads" if per_head else "")
        ax_lam.set(
            xlabel="optimizer step",
            ylabel="NeuTRENO λ",
            title=f"{title}\n(a stack's first layer adds no term)",
        )
        ax_lam.legend(fontsize=7, ncol=2)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, out, dpi=110)
