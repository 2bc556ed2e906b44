"""The training engine and commands under faults (issue 19): real ``neutreno`` processes that are
killed, interrupted, started twice, or given damaged, crafted or wrong files. Every case here once
ended in a traceback, a silent wrong result or a NaN checkpoint."""

import argparse
import json
import math
import os
import pickle
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import digits_config
from neutreno.io import write_json
from neutreno.training.checkpoint import latest_checkpoint

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def neutreno(*args, env=None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "neutreno", *map(str, args)],
        capture_output=True,
        text=True,
        env=env or ENV,
        timeout=600,
        **kw,
    )


def config(path: Path, out_dir: Path, **sections) -> Path:
    data = digits_config(**sections)
    data["train"] = {**data["train"], "out_dir": str(out_dir), **sections.get("train", {})}
    path.write_text(yaml.safe_dump(data))
    return path


def one_line_error(result: subprocess.CompletedProcess, code: int = 2) -> str:
    """The command failed with ``code`` and one line on stderr, no traceback."""
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, result.stderr
    return errors[0]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished 2-epoch digits run with checkpoints at steps 10, 20, …, 88 (the newest two kept)."""
    root = tmp_path_factory.mktemp("run")
    cfg = config(root / "c.yaml", root / "run", train={"checkpoint_every": 10, "keep_checkpoints": 3})
    result = neutreno("train", cfg)
    assert result.returncode == 0, result.stderr
    return root


def copy_run(finished_run: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the finished run whose ``results.json`` is removed, so ``--resume`` trains again from its
    latest checkpoint (a run interrupted after that checkpoint); returns (config, run folder)."""
    run = tmp_path / "run"
    shutil.copytree(finished_run / "run", run)
    (run / "results.json").unlink()
    cfg = config(tmp_path / "c.yaml", run, train={"checkpoint_every": 10, "keep_checkpoints": 3})
    return cfg, run


def all_finite(folder: Path) -> bool:
    return all(t.isfinite().all() for t in load_file(folder / "model.safetensors").values())


# ---- divergence never reaches the weights or a checkpoint ----------------------------------------------


def test_huge_learning_rate_stops_with_only_finite_checkpoints(tmp_path):
    cfg = config(tmp_path / "c.yaml", tmp_path / "run", optim={"lr": 1e4}, train={"checkpoint_every": 1})
    error = one_line_error(neutreno("train", cfg), code=1)
    assert "non-finite" in error or "is inf" in error or "is nan" in error
    saved = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))
    assert saved, "checkpoints were written before the divergence"
    assert all(all_finite(folder) for folder in saved)
    named = latest_checkpoint(tmp_path / "run")
    assert named is None or str(named) in error  # the checkpoint it calls good is the one on disk


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.lr=.inf", "optim.lr: must be a finite number"),
        ("optim.lr=nan", "optim.lr: expected float, got 'nan'"),  # YAML: .nan is the float
        ("optim.weight_decay=-.inf", "optim.weight_decay: must be a finite number"),
        ("model.args.depth=0", "depth must be an integer >= 1"),
        ("model.args.mlp_ratio=0", "mlp_ratio must be a number > 0, got 0"),
        # a model field or a value from the data given again in model.args reached the constructor twice
        ("model.args.num_classes=5", "model.args: num_classes comes from the data"),
        ("model.args.lam=0.1", "model.args: lam is set by model.lam"),
        ("model.args.drop_path_rate=0.1", "model.args: drop_path_rate is set by model.drop_path_rate"),
    ],
)
def test_bad_numbers_are_config_errors_before_any_work(tmp_path, override, message):
    cfg = config(tmp_path / "c.yaml", tmp_path / "run")
    assert message in one_line_error(neutreno("train", cfg, "--set", override))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_damaged_or_foreign_results_json_is_a_one_line_error_naming_it(tmp_path):
    """What sweeps and reproduce read to skip a finished run: a results.json that is not a run's record
    is named, not an AttributeError (a list) or a JSON error that does not say which file."""
    from neutreno.training.tasks import finished_results, load_train_config

    cfg = load_train_config(config(tmp_path / "c.yaml", tmp_path / "run"), [])
    (tmp_path / "run").mkdir()
    for text, message in (("[]", "holds no run's results"), ('{"config": ', "is damaged")):
        (tmp_path / "run" / "results.json").write_text(text)
        with pytest.raises(ValueError, match=message) as refused:
            finished_results(cfg)
        assert str(tmp_path / "run") in str(refused.value)


def test_a_run_resumed_under_changed_settings_is_not_reused_as_one_configs(tmp_path):
    """Sweeps and reproduce reused a finished run whose results.json lists config_changes (part of it
    trained under other settings) as a run of its final config."""
    from neutreno.training.tasks import OtherConfigRun, finished_results, load_train_config, to_dict

    cfg = load_train_config(config(tmp_path / "c.yaml", tmp_path / "run"), [])
    (tmp_path / "run").mkdir()
    record = {"config": json.loads(json.dumps(to_dict(cfg))), "val": {}}
    (tmp_path / "run" / "results.json").write_text(json.dumps(record))
    assert finished_results(cfg) == record
    record["config_changes"] = [{"step": 20, "changed": ["optim.lr"]}]
    (tmp_path / "run" / "results.json").write_text(json.dumps(record))
    with pytest.raises(OtherConfigRun, match=r"config was changed when resumed \(at step 20\)"):
        finished_results(cfg)


def test_a_change_is_recorded_though_a_resume_under_it_was_killed_before_its_first_checkpoint(
    finished_run, tmp_path
):
    """A resume rewrites config.json at its start: killed before its first checkpoint, the next resume
    compared against the new config, saw no change, and results.json named one config for both."""
    cfg, run = copy_run(finished_run, tmp_path)
    saved = json.loads((run / "config.json").read_text())
    saved["optim"]["lr"] = 0.0031  # what the killed resume left
    (run / "config.json").write_text(json.dumps(saved))
    result = neutreno("train", cfg, "--resume", "--set", "optim.lr=0.0031")
    assert result.returncode == 0, result.stderr
    assert "changed config keys: optim.lr" in result.stderr
    changes = json.loads((run / "results.json").read_text())["config_changes"]
    assert [c["changed"] for c in changes] == [["optim.lr"]]


def test_a_damaged_or_foreign_config_json_stops_a_resume_in_one_line_naming_it(finished_run, tmp_path):
    """The run's config.json was read bare on --resume: a JSON error naming no file, or a traceback
    (AttributeError) for a list."""
    cfg, run = copy_run(finished_run, tmp_path)
    for text in ('{"model": ', "[]"):
        (run / "config.json").write_text(text)
        error = one_line_error(neutreno("train", cfg, "--resume"))
        assert str(run / "config.json") in error and "remove it" in error


def test_empty_yaml_and_broken_base_chains_are_refused(tmp_path):
    (tmp_path / "empty.yaml").write_text("")
    assert "is empty" in one_line_error(neutreno("train", tmp_path / "empty.yaml"))
    (tmp_path / "b.yaml").write_text("base: 42\n")
    assert "base: expects the file name" in one_line_error(neutreno("train", tmp_path / "b.yaml"))
    (tmp_path / "one.yaml").write_text("base: two.yaml\n")
    (tmp_path / "two.yaml").write_text("base: one.yaml\ntrain: {epochs: 1}\n")
    assert "makes a cycle" in one_line_error(neutreno("train", tmp_path / "one.yaml"))
    # plain YAML keeps a repeated key's last value: a second train: section would drop the first's
    (tmp_path / "twice.yaml").write_text(
        "train: {epochs: 1, batch_size: 8}\nmodel: {lam: 0.6}\ntrain: {epochs: 2}\n"
    )
    assert "key 'train' is given twice (line 3)" in one_line_error(neutreno("train", tmp_path / "twice.yaml"))
    (tmp_path / "lr.yaml").write_text("optim:\n  lr: 0.001\n  lr: 0.5\n")
    assert "key 'lr' is given twice (line 3)" in one_line_error(neutreno("train", tmp_path / "lr.yaml"))
    (tmp_path / "merge.yaml").write_text(
        "x: &o {lr: 0.001}\noptim:\n  <<: *o\n  lr: 0.5\n"
    )  # a merge is not a repeat
    assert "twice" not in neutreno("train", tmp_path / "merge.yaml").stderr


# ---- one writer per run folder; children die with their parent ----------------------------------------


def _default_sigint() -> None:
    # A shell runs background jobs (CI under nohup, `make test &`) with SIGINT ignored, and Python then
    # never turns it into KeyboardInterrupt: give the child the default, as a terminal would.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(cfg: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "neutreno", "train", str(cfg), *extra],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
    )


def wait_for(condition, process: subprocess.Popen | None = None, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert process is None or process.poll() is None, process.stderr.read()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_second_writer_is_refused_and_a_dead_ones_lock_is_not_stale(tmp_path):
    run = tmp_path / "run"
    cfg = config(tmp_path / "c.yaml", run, train={"epochs": 40, "checkpoint_every": 5})
    first = start(cfg)
    try:
        wait_for(lambda: latest_checkpoint(run) is not None, first)
        second = neutreno("train", cfg, "--resume")
        assert "being written by another process" in one_line_error(second)
        assert str(first.pid) in second.stderr
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    logged = train_steps(run)
    assert logged == list(range(1, len(logged) + 1))  # one writer: never interleaved
    # The killed process's lock went with it: --resume starts at once.
    resumed = start(cfg, "--resume", "--set", "train.max_steps=" + str(latest_step(run) + 3))
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()


def train_steps(run: Path) -> list[int]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if "split" not in r]


def latest_step(run: Path) -> int:
    return int(latest_checkpoint(run).name.removeprefix("step-"))


def test_training_children_die_with_a_killed_parent(tmp_path):
    run = tmp_path / "run"
    cfg = config(tmp_path / "c.yaml", run, train={"epochs": 200})
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from neutreno.training.tasks import TrainJob, run_jobs; "
            f"run_jobs([TrainJob('a', {str(cfg)!r}, [], {str(run)!r})], 1)",
        ],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for(lambda: (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").stat().st_size > 0, parent)
    child_pid = int((run / ".lock").read_text())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 30
    while Path(f"/proc/{child_pid}").exists() and time.monotonic() < deadline:
        if "Z" in Path(f"/proc/{child_pid}/stat").read_text().split()[2]:
            break  # a zombie: dead, waiting for init to reap it
        time.sleep(0.1)
    alive = Path(f"/proc/{child_pid}").exists() and "Z" not in Path(f"/proc/{child_pid}/stat").read_text()
    assert not alive, "the training outlived its killed parent"


def test_ctrl_c_exits_130_with_how_to_resume(tmp_path):
    run = tmp_path / "run"
    cfg = config(tmp_path / "c.yaml", run, train={"epochs": 40, "checkpoint_every": 5})
    process = start(cfg)
    wait_for(lambda: latest_checkpoint(run) is not None, process)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr and "--resume" in stderr


def test_sigterm_mid_write_removes_the_temp_file_and_exits_143(tmp_path):
    """SIGTERM (kill, a scheduler, torchrun stopping its workers, a reproduce run stopping its jobs) killed
    the process on the spot: a file being written atomically left its hidden temp file behind."""
    report = tmp_path / "report.json"
    script = f"""
import os, signal, sys, time
import neutreno.cli.main as cli
from neutreno.io import atomic_path

def writing(args):
    with atomic_path({str(report)!r}) as tmp:
        tmp.write_text("half")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)
    return 0

cli._main = writing
sys.argv = ["neutreno", "presets"]
sys.exit(cli.run())
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=ENV, timeout=120
    )
    assert result.returncode == 143, result.stderr
    assert "neutreno presets: terminated" in result.stderr and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []  # neither the report nor its .report.json.XXXXXXXX.json temp


def test_a_write_killed_outright_leaves_no_temp_after_the_next_write(tmp_path):
    """SIGKILL (the OOM killer, a node going away) skips every clean-up: each killed write of a corpus
    cache left its temp file (hundreds of MB for WikiText-103) for good, and safetensors' own temp file
    (it writes one and renames it onto the path it is given) too. The next atomic write of the same file
    removes what a killed writer left; a live writer's (safetensors' rename included) stays, and its
    write lands after."""
    from safetensors.torch import load_file

    from neutreno.io import atomic_path

    cache = tmp_path / "corpus.safetensors"
    script = f"""
import os, signal, sys, torch
from safetensors.torch import save_file
from neutreno.io import atomic_path

with atomic_path({str(cache)!r}) as tmp:
    if sys.argv[1] == "kill":
        (tmp.parent / ".tmpAbCdEf").write_bytes(b"safetensors' own temp file, half written")
        os.kill(os.getpid(), signal.SIGKILL)
    save_file({{"ids": torch.arange(5)}}, str(tmp))  # written elsewhere, renamed onto tmp
    print("written", flush=True)
    sys.stdin.readline()  # renamed onto the cache once told to
"""
    killed = subprocess.run([sys.executable, "-c", script, "kill"], capture_output=True, env=ENV, timeout=120)
    assert killed.returncode == -signal.SIGKILL
    (abandoned,) = tmp_path.iterdir()
    assert abandoned.name.startswith(".corpus.safetensors.") and any(abandoned.iterdir())
    alive = subprocess.Popen(
        [sys.executable, "-c", script, "wait"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        assert alive.stdout.readline() == "written\n"
        (live,) = set(tmp_path.iterdir()) - {abandoned}
        with atomic_path(cache) as tmp:
            tmp.write_bytes(b"a whole cache")
        assert cache.read_bytes() == b"a whole cache"
        assert set(tmp_path.iterdir()) == {cache, live}  # the dead writer's folder is gone, all of it
        alive.stdin.write("\n")
        alive.stdin.flush()
        assert alive.wait(timeout=120) == 0
    finally:
        alive.kill()
    assert load_file(str(cache))["ids"].tolist() == list(range(5)) and list(tmp_path.iterdir()) == [cache]


def test_what_older_and_interrupted_writers_left_is_removed_too(tmp_path, monkeypatch):
    """A writer killed before the folders (an earlier release: a plain temp file beside the target),
    and one killed between its folder and the folder's lock (an empty folder, never removed), left
    them for good; an empty folder is taken only once it is a minute old (a live writer's is not)."""
    import os
    import time

    from neutreno.io import atomic_path

    cache = tmp_path / "corpus.safetensors"
    older = tmp_path / ".corpus.safetensors.k2j4_x9a.safetensors"
    older.write_bytes(b"\0" * 1000)
    lockless, fresh = (
        tmp_path / f".corpus.safetensors.{name}.safetensors" for name in ("abcd1234", "efgh5678")
    )
    lockless.mkdir()
    fresh.mkdir()
    an_hour_ago = time.time() - 3600
    os.utime(lockless, (an_hour_ago, an_hour_ago))
    with atomic_path(cache) as tmp:
        tmp.write_bytes(b"a whole cache")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([cache.name, fresh.name])


def test_reading_the_umask_does_not_change_it(monkeypatch):
    """Every atomic write read the umask by setting it to 0 and back: for that moment another thread's
    new files were made world-writable (0666), or that thread read 0 itself."""
    import os

    from neutreno import io

    if not os.path.exists("/proc/self/status"):
        pytest.skip("no /proc/self/status on this system: the umask is read under a lock there")
    kept = os.umask(0o027)
    try:
        monkeypatch.setattr(os, "umask", lambda mask: pytest.fail(f"the umask was set to {mask:o}"))
        assert io._umask() == 0o027
    finally:
        monkeypatch.undo()
        os.umask(kept)


def test_atomic_writes_work_where_the_file_system_has_no_locks(tmp_path, monkeypatch):
    """Some network and FUSE mounts refuse flock (ENOLCK, EOPNOTSUPP): the write goes on without the
    lock, and a temp folder there is never taken for a killed writer's (nothing tells it is dead)."""
    import errno
    import fcntl

    from neutreno.io import atomic_path

    def refuse(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refuse)
    other = tmp_path / ".report.json.abcd1234.json"  # maybe a live writer's
    other.mkdir()
    (other / ".lock").write_text("")
    (other / "report.json").write_text("{")
    with atomic_path(tmp_path / "report.json") as tmp:
        tmp.write_text("{}")
    assert (tmp_path / "report.json").read_text() == "{}" and (other / "report.json").is_file()


# ---- damaged files ----------------------------------------------------------------------------------


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_truncated_weights_give_one_line_naming_the_file(finished_run, tmp_path):
    _, run = copy_run(finished_run, tmp_path)
    weights = latest_checkpoint(run) / "model.safetensors"
    truncate(weights)
    error = one_line_error(neutreno("eval", weights, "--data", "digits"))
    assert str(weights) in error and "damaged" in error
    cfg = config(tmp_path / "ft.yaml", tmp_path / "ft", train={"finetune": str(weights)})
    assert str(weights) in one_line_error(neutreno("train", cfg))


def test_an_unreadable_weights_file_is_the_systems_error_not_damaged(finished_run, monkeypatch, capsys):
    """safetensors reports a file it may not open as 'No such file or directory', which was called a
    damaged file: a permission to fix looked like a checkpoint to throw away."""
    import builtins

    from neutreno.cli.main import main
    from neutreno.training.checkpoint import checkpoint_problem

    weights = latest_checkpoint(finished_run / "run") / "model.safetensors"
    real_open = builtins.open

    def no_permission(file, *args, **kwargs):
        if Path(file) == weights:
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_permission)
    assert main(["eval", str(weights), "--data", "digits"]) == 1
    error = capsys.readouterr().err.strip()
    assert "Permission denied" in error and "damaged" not in error and "\n" not in error
    assert "Permission denied" in checkpoint_problem(weights.parent)  # resume skips it, naming why


def test_resume_skips_a_damaged_latest_checkpoint_and_says_so(finished_run, tmp_path):
    cfg, run = copy_run(finished_run, tmp_path)
    damaged = latest_checkpoint(run)
    previous = sorted((run / "checkpoints").glob("step-*"))[-2]
    truncate(damaged / "model.safetensors")
    result = neutreno("train", cfg, "--resume")
    assert result.returncode == 0, result.stderr
    assert f"skipping a damaged checkpoint: {damaged / 'model.safetensors'}" in result.stderr
    assert f"resuming from {previous}" in result.stderr
    assert all_finite(latest_checkpoint(run))


def test_a_state_lacking_what_a_resume_reads_is_damaged_and_skipped(finished_run, tmp_path):
    """A state.pt that loaded but lacked its RNG states, step, optimizer or process count passed the
    damage check: resume stopped in a KeyError traceback instead of going on from the checkpoint before,
    and one whose AdamW state was empty was resumed with Adam's moments restarted from zero."""
    from neutreno.training.checkpoint import checkpoint_problem

    cfg, run = copy_run(finished_run, tmp_path)
    newest = latest_checkpoint(run)
    previous = sorted((run / "checkpoints").glob("step-*"))[-2]
    state = torch.load(newest / "state.pt", weights_only=True)
    assert checkpoint_problem(newest, trainer_state=True) is None
    cases = {
        "rng": "no random-number state for each of its 1 process(es)",
        "step": "step None, not a count",
        "world_size": "world_size None, not a process count",
        "optimizer": "no optimizer state and parameter groups",
    }
    for key, message in cases.items():
        torch.save({k: v for k, v in state.items() if k != key}, newest / "state.pt")
        assert (
            checkpoint_problem(newest, trainer_state=True) == f"{newest / 'state.pt'} is damaged ({message})"
        )
        assert checkpoint_problem(newest) is None  # a state of one's own (save_checkpoint) may lack them
    torch.save({**state, "optimizer": {**state["optimizer"], "state": {}}}, newest / "state.pt")
    assert "an Adam optimizer at step" in checkpoint_problem(newest, trainer_state=True)
    torch.save({k: v for k, v in state.items() if k != "rng"}, newest / "state.pt")
    result = neutreno("train", cfg, "--resume")
    assert result.returncode == 0, result.stderr
    assert f"skipping a damaged checkpoint: {newest / 'state.pt'} is damaged" in result.stderr
    assert f"resuming from {previous}" in result.stderr


def poison(weights: Path, name: str = "head.weight", value: float = float("nan")) -> None:
    """Put one non-finite value into a tensor of a weights file (a run that diverged unnoticed, a file
    changed since)."""
    from safetensors.torch import safe_open, save_file

    with safe_open(weights, "pt") as f:
        metadata = f.metadata()
    tensors = load_file(weights)
    tensors[name].view(-1)[0] = value
    save_file(tensors, weights, metadata=metadata)


def test_non_finite_weights_are_refused_by_eval_finetune_and_resume(finished_run, tmp_path):
    """A checkpoint holding a NaN or an infinity is never evaluated, fine-tuned from or resumed from as
    if it were good: eval and fine-tuning refuse it in one line naming the file and the tensor; resume
    skips it, saying so, and goes on from the checkpoint before."""
    cfg, run = copy_run(finished_run, tmp_path)
    poisoned = latest_checkpoint(run)
    previous = sorted((run / "checkpoints").glob("step-*"))[-2]
    poison(poisoned / "model.safetensors")
    error = one_line_error(neutreno("eval", poisoned / "model.safetensors", "--data", "digits"))
    assert str(poisoned / "model.safetensors") in error and "non-finite" in error and "head.weight" in error
    inf = tmp_path / "inf.safetensors"
    shutil.copy(previous / "model.safetensors", inf)
    poison(inf, "blocks.0.attn.qkv.weight", float("inf"))
    ft = config(tmp_path / "ft.yaml", tmp_path / "ft", train={"finetune": str(inf)})
    error = one_line_error(neutreno("train", ft))
    assert str(inf) in error and "blocks.0.attn.qkv.weight" in error
    result = neutreno("train", cfg, "--resume")
    assert result.returncode == 0, result.stderr
    skipped = f"skipping a damaged checkpoint: {poisoned / 'model.safetensors'} holds non-finite"
    assert skipped in result.stderr
    assert f"resuming from {previous}" in result.stderr
    assert all_finite(latest_checkpoint(run))


def test_non_finite_optimizer_state_is_not_resumed_from_nor_saved(finished_run, tmp_path):
    """Only the weights were checked. A state.pt whose AdamW first moment held a NaN was resumed from,
    and the run diverged, calling it the last good checkpoint; with an infinite second moment it trained
    on with those weights frozen (Adam's step 0: they only decayed) and saved the inf again, looking
    healthy. Resume now skips it, naming the tensor, and goes on from the checkpoint before; saving
    refuses such a state (a test of its own, below)."""
    from neutreno.training.checkpoint import nonfinite_optimizer_state

    cfg, run = copy_run(finished_run, tmp_path)
    poisoned = latest_checkpoint(run)
    previous = sorted((run / "checkpoints").glob("step-*"))[-2]
    state = torch.load(poisoned / "state.pt", weights_only=True)
    first = min(state["optimizer"]["state"])
    state["optimizer"]["state"][first]["exp_avg"].view(-1)[0] = float("nan")
    state["optimizer"]["state"][first]["exp_avg_sq"].fill_(float("inf"))
    torch.save(state, poisoned / "state.pt")
    result = neutreno("train", cfg, "--resume")
    assert result.returncode == 0, result.stderr
    skipped = (
        f"skipping a damaged checkpoint: {poisoned / 'state.pt'} holds non-finite optimizer state "
        f"(param {first} exp_avg, param {first} exp_avg_sq)"
    )
    assert skipped in result.stderr, result.stderr
    assert f"resuming from {previous}" in result.stderr
    saved = latest_checkpoint(run)
    assert all_finite(saved)
    assert nonfinite_optimizer_state(torch.load(saved / "state.pt", weights_only=True)["optimizer"]) == []


def test_the_optimizer_state_check_against_each_tensor_by_hand():
    """nonfinite_optimizer_state names exactly the non-finite tensors of a real AdamW/SGD state_dict, and
    optimizer_state_finite (one reduction over all of them, before a save) agrees with a loop."""
    from neutreno.training.checkpoint import nonfinite_optimizer_state
    from neutreno.training.engine import optimizer_state_finite

    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    for optimizer in (torch.optim.AdamW(params, lr=0.1), torch.optim.SGD(params, lr=0.1, momentum=0.9)):
        sum(p.square().sum() for p in params).backward()
        optimizer.step()
        assert nonfinite_optimizer_state(optimizer.state_dict()) == [] and optimizer_state_finite(optimizer)
        names = sorted(optimizer.state[params[1]])
        for name in names:
            if optimizer.state[params[1]][name].dim() == 0:
                continue  # Adam's step count
            for bad in (float("nan"), float("inf"), -float("inf")):
                saved = optimizer.state[params[1]][name].clone()
                optimizer.state[params[1]][name].view(-1)[2] = bad
                expected = [
                    f"param {i} {k}"
                    for i, p in enumerate(params)
                    for k, t in sorted(optimizer.state[p].items())
                    if not all(math.isfinite(x) for x in t.reshape(-1).tolist())
                ]
                assert expected == [f"param 1 {name}"]
                assert nonfinite_optimizer_state(optimizer.state_dict()) == expected
                assert not optimizer_state_finite(optimizer)
                optimizer.state[params[1]][name].copy_(saved)
        assert optimizer_state_finite(optimizer)
    assert nonfinite_optimizer_state(None) == [] and nonfinite_optimizer_state({"state": []}) == []


def test_saving_refuses_non_finite_optimizer_state(tmp_path):
    """A save checks the optimizer's state as it checks the weights: a NaN in Adam's moments stops the
    run with nothing written, as non-finite weights do."""
    from neutreno.config import from_dict
    from neutreno.training.classification import ClassificationConfig, ClassificationTask
    from neutreno.training.distributed import setup_distributed
    from neutreno.training.engine import Trainer, TrainingDiverged

    sections = digits_config(
        model={"args": {"depth": 1}},
        train={"epochs": 1, "batch_size": 32, "max_steps": 3, "out_dir": str(tmp_path / "run")},
    )
    cfg = from_dict(ClassificationConfig, sections)
    trainer = Trainer(ClassificationTask(cfg), cfg.train, cfg.optim, setup_distributed("cpu"), sections)
    try:
        trainer.fit()
        trainer.save()  # finite: saves
        files = sorted(p for p in (tmp_path / "run").rglob("*") if p.is_file())
        written = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in files}
        first = next(iter(trainer.optimizer.state.values()))
        first["exp_avg_sq"].view(-1)[0] = float("inf")
        with pytest.raises(TrainingDiverged, match="non-finite optimizer state at step 3"):
            trainer.save()
    finally:
        trainer.close()
    files = sorted(p for p in (tmp_path / "run").rglob("*") if p.is_file() and p.name != "metrics.jsonl")
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in files} == {
        p: v for p, v in written.items() if p.name != "metrics.jsonl"
    }  # nothing written, moved or left half-written


def test_weights_stored_as_integers_are_refused_by_eval_and_finetune(finished_run, tmp_path):
    """A file whose float weights were stored as int32 (truncated: nearly all zeros) was cast back by
    load_state_dict without a word: eval scored it at chance, exit 0, and fine-tuning trained from it.
    Another float precision still loads."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    source = latest_checkpoint(copy_run(finished_run, tmp_path)[1]) / "model.safetensors"
    with safe_open(source, "pt") as f:
        meta = f.metadata()
    ints, halves = tmp_path / "int32.safetensors", tmp_path / "fp16.safetensors"
    save_file({k: v.to(torch.int32) for k, v in load_file(source).items()}, ints, metadata=meta)
    save_file({k: v.half() for k, v in load_file(source).items()}, halves, metadata=meta)
    error = one_line_error(neutreno("eval", ints, "--data", "digits"))
    assert str(ints) in error and "another kind" in error and "cls_token (torch.int32" in error
    error = one_line_error(
        neutreno("train", config(tmp_path / "ft.yaml", tmp_path / "ft", train={"finetune": str(ints)}))
    )
    assert str(ints) in error and "another kind" in error
    assert neutreno("eval", halves, "--data", "digits").returncode == 0


def test_resuming_a_run_stopped_before_its_results_logs_its_final_evaluation_once(finished_run, tmp_path):
    """Stopped after the final checkpoint, before results.json: --resume evaluated the last step again
    for results.json and logged that evaluation a second time."""
    from neutreno.training.loggers import read_metrics

    cfg, run = copy_run(finished_run, tmp_path)
    before = read_metrics(run / "metrics.jsonl")
    result = neutreno("train", cfg, "--resume")
    assert result.returncode == 0, result.stderr
    assert read_metrics(run / "metrics.jsonl") == before
    final = [r for r in before if r.get("split") == "val"][-1]
    assert json.loads((run / "results.json").read_text())["val"]["model"]["top1"] == final["top1"]


def test_an_emptied_latest_pointer_resumes_from_the_newest_step_folder(finished_run, tmp_path):
    cfg, run = copy_run(finished_run, tmp_path)
    newest = sorted((run / "checkpoints").glob("step-*"))[-1]
    (run / "checkpoints" / "latest").write_text("")
    result = neutreno("train", cfg, "--resume")
    assert result.returncode == 0, result.stderr
    assert f"resuming from {newest}" in result.stderr
    fresh = neutreno("train", cfg)  # and without --resume it is still a run that exists
    assert "already holds a run" in one_line_error(fresh)


def test_resume_removes_temp_files_and_cuts_a_torn_metrics_log(finished_run, tmp_path):
    cfg, run = copy_run(finished_run, tmp_path)
    step = latest_step(run)
    torn = run / "checkpoints" / f".step-{step + 10:06d}.abcd_123"  # mkdtemp's name: a save killed mid-write
    torn.mkdir()
    (torn / "state.pt").write_bytes(b"half")
    (run / ".results.json.x1y2z3w4.json").write_text('{"half": ')  # mkstemp's
    # the folder's owner's own hidden files are not temps, even where their names have two dots
    (run / ".env.local").write_text("KEY=1")
    (run / ".venv.old").mkdir()
    (run / ".notes.abcdefgh.txt").write_text("mine")
    with (run / "metrics.jsonl").open("a") as log:
        log.write('{"step": 999, "loss": 0.5}\n{"step": 1000, "lo')  # written after the checkpoint, torn
    result = neutreno("train", cfg, "--resume")
    assert result.returncode == 0, result.stderr
    assert not list(run.glob(".results.json.*")) and not list((run / "checkpoints").glob(".step-*"))
    assert (run / ".env.local").read_text() == "KEY=1" and (run / ".venv.old").is_dir()
    assert (run / ".notes.abcdefgh.txt").exists()
    steps = train_steps(run)
    assert steps == list(range(1, len(steps) + 1)) and steps[-1] == latest_step(run)


def test_resume_trains_with_the_configs_optimizer_settings_and_refuses_another_optimizer(
    finished_run, tmp_path
):
    """The optimizer's state comes back from the checkpoint, its settings from the config: a changed
    weight decay or betas is used from the resumed step on (load_state_dict had restored the saved
    ones, while config.json recorded the new); another optimizer is refused in one line."""
    from neutreno.training.checkpoint import load_state

    cfg, run = copy_run(finished_run, tmp_path)
    data = yaml.safe_load(cfg.read_text())
    data["optim"] = {**data.get("optim", {}), "weight_decay": 0.5, "betas": [0.5, 0.6]}
    cfg.write_text(yaml.safe_dump(data))
    before = load_state(latest_checkpoint(run))["optimizer"]["param_groups"]
    assert all(tuple(g["betas"]) == (0.9, 0.999) for g in before)  # the run's own, AdamW's defaults
    result = neutreno("train", cfg, "--resume", "--set", f"train.epochs={data['train']['epochs'] + 1}")
    assert result.returncode == 0, result.stderr
    groups = load_state(latest_checkpoint(run))["optimizer"]["param_groups"]
    assert all(tuple(g["betas"]) == (0.5, 0.6) for g in groups)
    assert sorted(g["weight_decay"] for g in groups) == [0.0, 0.5]  # norms and biases are not decayed
    # results.json named only the last config, as if the whole run had trained with it
    results = json.loads((run / "results.json").read_text())
    resumed_at = load_state(latest_checkpoint(finished_run / "run"))["step"]
    assert results["config_changes"] == [
        {"step": resumed_at, "changed": ["optim.betas", "optim.weight_decay", "train.epochs"]}
    ]
    assert load_state(latest_checkpoint(run))["config_changes"] == results["config_changes"]  # kept on
    # (the file's betas, which SGD has no use for, are refused first: set back to the default)
    sgd = ["--set", "optim.name=sgd", "--set", "optim.betas=[0.9, 0.999]"]
    error = one_line_error(neutreno("train", cfg, "--resume", *sgd))
    assert "AdamW" in error and "optim.name" in error
    assert "optim.betas: is for optim.name adamw" in one_line_error(
        neutreno("train", cfg, "--resume", "--set", "optim.name=sgd")
    )


def test_resuming_with_another_model_is_refused(finished_run, tmp_path):
    cfg, run = copy_run(finished_run, tmp_path)
    error = one_line_error(neutreno("train", cfg, "--resume", "--set", "model.attention=neutreno"))
    assert "model.attention" in error
    assert not (run / "results.json").exists()


def test_fine_tuning_from_a_checkpoint_of_another_head_count_is_refused(finished_run, tmp_path):
    """qkv weights of 4 heads have the shape of 2 heads' (the same width): a neutreno checkpoint records
    its head count, and fine-tuning a model of another is refused in one line, not loaded re-split."""
    weights = latest_checkpoint(finished_run / "run") / "model.safetensors"
    cfg = config(tmp_path / "ft.yaml", tmp_path / "ft", train={"finetune": str(weights)})
    error = one_line_error(neutreno("train", cfg, "--set", "model.args.num_heads=2"))
    assert str(weights) in error and "trained with 4 attention heads, this model has 2" in error


def test_a_pickle_that_runs_code_is_refused_naming_the_global_not_advising_to_run_it(tmp_path):
    class Runs:
        def __reduce__(self):
            return (os.system, ("true",))

    path = tmp_path / "evil.pth"
    torch.save({"head.weight": torch.zeros(1), "x": Runs()}, path)
    from neutreno.models.checkpoint import read_state_dict

    with pytest.raises(ValueError) as refused:
        read_state_dict(path)
    message = str(refused.value)
    assert "GLOBAL posix.system" in message and "refused" in message and "weights_only" not in message


def test_resuming_with_another_model_is_refused_without_config_json(finished_run, tmp_path):
    """A run folder that lost its config.json is checked against the checkpoint's own record of its
    model: another attention (same weights) was resumed silently and saved under the new name."""
    cfg, run = copy_run(finished_run, tmp_path)
    (run / "config.json").unlink()
    for checkpoint in (run / "checkpoints").glob("step-*"):  # as saved before state.pt kept the config
        state = torch.load(checkpoint / "state.pt", weights_only=True)
        del state["config"]
        torch.save(state, checkpoint / "state.pt")
    for override, differs in (("model.attention=neutreno", "attention"), ("model.args.mlp_ratio=2", "args")):
        error = one_line_error(neutreno("train", cfg, "--resume", "--set", override))
        assert "holds another model" in error and differs in error, override
    assert not (run / "results.json").exists()
    result = neutreno("train", cfg, "--resume")  # the same model resumes
    assert result.returncode == 0, result.stderr


def test_atomic_files_respect_the_umask_and_survive(tmp_path):
    old = os.umask(0o022)
    try:
        write_json(tmp_path / "a.json", {"x": 1})
        mode = stat.S_IMODE((tmp_path / "a.json").stat().st_mode)
        plain = tmp_path / "plain"
        plain.write_text("x")
        assert mode == stat.S_IMODE(plain.stat().st_mode) == 0o644
    finally:
        os.umask(old)
    assert json.loads((tmp_path / "a.json").read_text()) == {"x": 1}


def strict_json(text: str) -> object:
    """JSON as jq or JavaScript's JSON.parse reads it: NaN, Infinity and -Infinity are errors."""

    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_reports_are_strict_json_with_null_for_what_is_not_a_number(tmp_path):
    """write_json wrote Python's NaN literal (a segmenter's IoU of a class absent from a split, the padding
    of reproduce's pretrained-regimes plot), which strict parsers refuse; now null, at any depth."""
    data = {"iou": {"a": 50.0, "b": math.nan}, "series": [1.0, math.inf, (-math.inf, 2)], "n": 3, "s": "NaN"}
    write_json(tmp_path / "r.json", data)
    assert strict_json((tmp_path / "r.json").read_text()) == {
        "iou": {"a": 50.0, "b": None}, "series": [1.0, None, [None, 2]], "n": 3, "s": "NaN"
    }  # fmt: skip


def test_checkpoint_files_respect_the_umask(finished_run):
    checkpoint = latest_checkpoint(finished_run / "run")
    umask = os.umask(0)
    os.umask(umask)
    for path in (checkpoint, *checkpoint.iterdir(), finished_run / "run" / "results.json"):
        expected = (0o777 if path.is_dir() else 0o666) & ~umask
        assert stat.S_IMODE(path.stat().st_mode) == expected, path


# ---- crafted and wrong inputs -------------------------------------------------------------------------


class Payload:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


MARKER = Path("/tmp/neutreno-pwned-marker")


def test_a_crafted_cifar_archive_cannot_run_code(finished_run, tmp_path):
    MARKER.unlink(missing_ok=True)
    batches = tmp_path / "cifar-10-batches-py"
    batches.mkdir()
    (batches / "batches.meta").write_bytes(pickle.dumps({b"label_names": [Payload()]}, protocol=2))
    for name in ("test_batch", *(f"data_batch_{i}" for i in range(1, 6))):
        (batches / name).write_bytes(pickle.dumps({b"data": Payload(), b"labels": [0]}, protocol=2))
    archive = tmp_path / "evil.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(batches, arcname="cifar-10-batches-py")
    error = one_line_error(neutreno("eval", finished_run / "run", "--data", archive))
    assert "refusing to load posix.system" in error
    assert not MARKER.exists(), "the pickle ran a command"


class ForgedObjectDtype:
    """Pickles as numpy.dtype('O8') with its flags byte cleared: numpy's own __setstate__ took it."""

    def __reduce__(self):
        return (np.dtype, ("O8", False, True), (3, "|", None, None, None, -1, -1, 0))


class ForgedObjectArray:
    """Pickles as numpy's _reconstruct of an object array whose 'pointers' are the file's bytes."""

    def __reduce__(self):
        from numpy._core.multiarray import _reconstruct

        return (_reconstruct, (np.ndarray, (0,), b"b"), (1, (2,), ForgedObjectDtype(), False, b"A" * 16))


def test_a_crafted_cifar_pickle_of_allowed_globals_cannot_corrupt_memory(finished_run, tmp_path):
    """Found in review: a pickle of only the globals the unpickler allowed (numpy.dtype, ndarray,
    _reconstruct) forged an object dtype through numpy's own __setstate__: an array of fake pointers,
    and a segfault (exit 139) when a class name was decoded. Stand-ins now build plain arrays only."""
    batches = tmp_path / "cifar-10-batches-py"
    batches.mkdir()
    (batches / "batches.meta").write_bytes(pickle.dumps({b"label_names": ForgedObjectArray()}, protocol=2))
    good = {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1]}
    for name in ("test_batch", *(f"data_batch_{i}" for i in range(1, 6))):
        (batches / name).write_bytes(pickle.dumps(good, protocol=2))
    error = one_line_error(neutreno("eval", finished_run / "run", "--data", tmp_path))
    assert "batches.meta is not a CIFAR pickle (refusing dtype 'O8': CIFAR files hold plain numbers)" in error


def test_wrong_inputs_get_one_line(finished_run, tmp_path):
    run = finished_run / "run"
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    noise = tmp_path / "noise.tar.gz"
    noise.write_bytes(os.urandom(4096))
    pth = tmp_path / "w.pth"
    torch.save({"weight": torch.zeros(2)}, pth)
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    cfg = config(tmp_path / "c.yaml", a_file)
    cases = [
        (("eval", run, "--data", "digits", "--device", "foo"), "'foo' is not a device"),
        (("eval", run, "--data", "digits", "--workers", "100000"), "--workers: must be 0 to 256, got 100000"),
        (("generate", run, "--prompt", "hi", "--temperature", "nan"), "--temperature"),
        (
            ("generate", run, "--prompt", "hi", "--seed", str(2**64)),
            "--seed: expected a seed in [0, 2**32)",
        ),
        (("analyze", "--model", "hf:no-such-model-here", "--data", text), "cannot load the Hugging Face"),
        (("eval", run, "--data", text), f"{text} is not an image folder"),
        (("eval", run, "--data", noise), f"{noise} is not an image folder"),
        (("eval", pth, "--data", "digits"), f"{pth} is not a neutreno checkpoint"),
        (("train", cfg), "is not a folder"),
    ]
    offline = {**ENV, "HF_HUB_OFFLINE": "1"}
    for args, message in cases:
        result = neutreno(*args, env=offline)
        line = one_line_error(result)
        assert message in line, (args, line)


def test_an_output_path_below_a_file_or_onto_a_folder_is_refused_before_any_work(
    finished_run, tmp_path, capsys
):
    """afile/sub as an output folder failed with NotADirectoryError, and eval --out onto a folder with
    IsADirectoryError, once the training, evaluation or measurement was done."""
    from neutreno.cli.main import main

    run, a_file = finished_run / "run", tmp_path / "a_file"
    a_file.write_text("")
    below = str(a_file / "sub")
    cfg = config(tmp_path / "c.yaml", a_file / "sub")
    cases = [
        (["train", str(cfg)], f"train.out_dir {below}: {a_file} exists and is not a folder"),
        (["sweep", str(cfg), "--grid", "model.lam=0.2,0.4", "--out", below], "--out"),
        (["demo", "--out", below, "--epochs", "1"], "--out"),
        (
            ["bench", "efficiency", "--model", "vit_digits", "--rounds", "2", "--batch", "1", "--out", below],
            "--out",
        ),
        (
            ["study", "rank-collapse", "--depths", "2", "--seeds", "0", "--samples", "1", "--out", below],
            "--out",
        ),
        (["eval", str(run), "--data", "digits", "--out", str(a_file / "x.json")], "--out"),
        (["eval", str(run), "--data", "digits", "--out", str(tmp_path)], "is a folder, not a file name"),
        (["robustness", str(run), "--data", "digits", "--out", below], "--out"),
        (["analyze", "--model", "vit_digits", "--out", below], "--out"),
    ]
    for args, message in cases:
        assert main(args) == 2, args
        error = capsys.readouterr().err.strip()
        assert message in error and ("not a folder" in error or "not a file" in error), (args, error)
        assert len(error.splitlines()) == 1, (args, error)
    assert a_file.read_text() == "" and not (tmp_path / "x.json").exists()


def test_eval_refuses_to_write_over_weights_and_options_its_model_ignores(finished_run, tmp_path, capsys):
    """eval --out onto the checkpoint evaluated wrote the metrics over its weights (exit 0), and a
    segmenter's --overlay or an LM's --stride given for a classifier was ignored: no file, no word."""
    from neutreno.cli.main import main

    run = finished_run / "run"
    weights = next((run / "checkpoints").glob("step-*")) / "model.safetensors"
    before, results = weights.read_bytes(), (run / "results.json").read_text()
    cases = [
        (["--out", str(weights)], "is named like a model file"),
        (["--out", str(weights.with_name("state.pt"))], "is named like a model file"),
        (["--out", str(run / "results.json")], "is its run folder's own results.json"),
        (["--overlay", str(run / "o.png")], "--overlay does not apply to"),
        (["--stride", "7", "--scales", "1"], "--scales and --stride do not apply to"),
    ]
    for args, message in cases:
        assert main(["eval", str(run), "--data", "digits", *args]) == 2, args
        error = capsys.readouterr().err.strip()
        assert message in error and len(error.splitlines()) == 1, (args, error)
    assert weights.read_bytes() == before and not (run / "o.png").exists()
    assert (run / "results.json").read_text() == results
    project = tmp_path / "project"  # a folder holding checkpoints/ but no run: its results.json is free
    (project / "checkpoints").mkdir(parents=True)
    assert main(["eval", str(run), "--data", "digits", "--out", str(project / "results.json")]) == 0
    assert json.loads((project / "results.json").read_text())["count"] > 0


def test_a_torch_load_failure_names_the_file_and_keeps_the_cause(tmp_path):
    from neutreno.models import create_model
    from neutreno.models.checkpoint import load_pretrained

    bad = tmp_path / "random.pth"
    bad.write_bytes(b"PK\x03\x04" + os.urandom(2048))  # a damaged zip, as torch.save writes them
    model = create_model("vit_digits", depth=2)
    with pytest.raises(ValueError, match=r"cannot read .*random\.pth as PyTorch weights") as caught:
        load_pretrained(model, bad)
    assert caught.value.__cause__ is not None  # the original error stays attached
    assert "\n" not in str(caught.value)
    config = tmp_path / "run.yaml"  # --finetune given a config: torch.load said "pop from empty list"
    config.write_text("task: classification\n")
    with pytest.raises(ValueError, match=r"run\.yaml is not a weights file \(\.safetensors, or PyTorch's"):
        load_pretrained(model, config)


def test_a_wrong_architecture_is_summarised_not_dumped(finished_run, tmp_path):
    from neutreno.models import create_model, save_model
    from neutreno.models.checkpoint import load_model

    other = create_model("vit_digits", depth=8)
    path = tmp_path / "deep.safetensors"
    save_model(path, other)
    meta = load_file(path)  # sanity: 8 blocks in the file
    assert any(k.startswith("blocks.7.") for k in meta)
    from neutreno.models.checkpoint import load_safetensors, load_state_dict_checked

    shallow = create_model("vit_digits", depth=4)
    with pytest.raises(ValueError) as caught:
        load_state_dict_checked(shallow, load_safetensors(path), path)
    message = str(caught.value)
    assert str(path) in message and "unexpected" in message and "in all)" in message
    assert len(message) < 400
    load_model(path)  # the file itself is whole and loads into its own architecture


def test_a_one_class_dataset_is_refused(tmp_path):
    from PIL import Image

    root = tmp_path / "one"
    for split in ("train", "val"):
        (root / split / "cat").mkdir(parents=True)
        for i in range(4):
            Image.new("RGB", (8, 8), (i * 40, 0, 0)).save(root / split / "cat" / f"{i}.png")
    cfg = config(tmp_path / "c.yaml", tmp_path / "run")
    data = yaml.safe_load(cfg.read_text())
    data["data"] |= {"train": str(root), "val": str(root), "val_split": "val", "channels": 3}
    data["data"] |= {"mean": [0.5] * 3, "std": [0.5] * 3}
    data["train"]["batch_size"] = 2
    cfg.write_text(yaml.safe_dump(data))
    assert "needs at least 2" in one_line_error(neutreno("train", cfg))


def test_progress_in_a_log_is_lines_and_tqdm_disable_is_honoured(tmp_path):
    cfg = config(tmp_path / "c.yaml", tmp_path / "run", train={"epochs": 1})
    env = {k: v for k, v in ENV.items() if k != "TQDM_DISABLE"}
    result = neutreno("train", cfg, env=env)  # stderr is a pipe: not a terminal
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stderr
    assert "train: 44/44 (100%) step" in result.stderr
    quiet = neutreno(
        "train", cfg, "--set", f"train.out_dir={tmp_path / 'quiet'}", env={**env, "TQDM_DISABLE": "1"}
    )
    assert quiet.returncode == 0 and "train: " not in quiet.stderr


def test_an_empty_environment_variable_is_not_a_path(shared_data, tmp_path, monkeypatch):
    """NEUTRENO_DATA= (set, empty) made ${NEUTRENO_DATA}/imagenet the root's /imagenet; NEUTRENO_CACHE=
    put the corpus cache under the working directory. Empty is now unset: an error naming the variable,
    and the default cache."""
    from neutreno.config import ConfigError, expand_env
    from neutreno.data.corpus import load_wikitext

    monkeypatch.setenv("NEUTRENO_DATA", "")
    with pytest.raises(
        ConfigError, match=r"data.root: .* needs the environment variable NEUTRENO_DATA: it is empty"
    ):
        expand_env("${NEUTRENO_DATA}/imagenet", "data.root")
    monkeypatch.setenv("NEUTRENO_CACHE", "")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    load_wikitext(shared_data / "wikitext103-mini")
    assert not (tmp_path / "corpora").exists()
    assert list((tmp_path / "home" / ".cache" / "neutreno" / "corpora").glob("*.safetensors"))


def test_no_default_assumes_the_checkout_the_data_root_is_asked_for(tmp_path):
    """The presets name their data as ${NEUTRENO_DATA}/…: without it (and without --data-root for
    reproduce) the command says which to set, before any work, instead of looking in ../shared."""
    env = {k: v for k, v in ENV.items() if k != "NEUTRENO_DATA"}
    train = neutreno("train", "cifar10_vit_softmax", env=env, cwd=tmp_path)
    assert "needs the environment variable NEUTRENO_DATA" in one_line_error(train)
    reproduce = neutreno(
        "reproduce", "vit-accuracy", "--quick", "--out", tmp_path / "r", env=env, cwd=tmp_path
    )
    assert "--data-root DIR or set NEUTRENO_DATA" in one_line_error(reproduce)
    assert not (tmp_path / "r").exists()
    nowhere = {**env, "NEUTRENO_DATA": "/nowhere"}
    given = neutreno("train", "cifar10_vit_softmax", env=nowhere, cwd=tmp_path)
    assert "/nowhere/cifar10-train.tar.gz" in one_line_error(given)  # the variable is used as given
    # a data root that is not there would mark every claim skipped, over the verdicts of earlier runs
    for args, named in (
        ((), "NEUTRENO_DATA=/nowhere"),
        (("--data-root", "/nowhere"), "--data-root /nowhere"),
    ):
        reproduce = neutreno(
            "reproduce", "vit-accuracy", "--quick", "--out", tmp_path / "r", *args, env=nowhere
        )
        assert f"{named}: no such folder" in one_line_error(reproduce)
        assert not (tmp_path / "r").exists()


def test_a_read_only_output_folder_is_refused_before_any_work(tmp_path, monkeypatch):
    """On a read-only mount, train crashed with an OSError traceback once the data and model were built
    (only PermissionError was caught), and ``eval --out`` after the whole evaluation. (Run as root, a
    chmod does not make a folder read-only, so the mount's answer is stood in for.)"""
    import os

    from neutreno import io

    real_access = os.access

    def access(path, mode):
        return False if Path(path) == tmp_path else real_access(path, mode)

    monkeypatch.setattr(io.os, "access", access)
    with pytest.raises(ValueError, match=rf"--out {tmp_path / 'sub'} \({tmp_path}\) is not writable"):
        io.check_output_folder(tmp_path / "sub", "--out")
    with pytest.raises(ValueError, match="is not writable"):
        io.check_output_file(tmp_path / "results.json", "--out")
    io.check_output_folder(tmp_path.parent / "elsewhere", "--out")  # a writable folder is fine


ANALYZE = ["analyze", "--model", "vit_digits", "--samples", "8", "--metrics", "cosine"]
BENCH = ["bench", "efficiency", "--model", "vit_digits", "--attentions", "softmax", "--batch", "2",
         "--rounds", "2"]  # fmt: skip
RANK_COLLAPSE = ["study", "rank-collapse", "--depths", "1", "--norms", "pre", "--residual-scales", "1",
                 "--attentions", "softmax", "--samples", "2", "--length", "4"]  # fmt: skip


SWEEP = ["sweep", "cifar10_vit_neutreno", "--grid", "model.lam=0,0.3", "--set", "data.train=digits",
         "--set", "data.val=digits", "--set", "train.max_steps=1"]  # fmt: skip
REPRODUCE = ["reproduce", "random-init", "--quick"]


@pytest.mark.parametrize(
    "command",
    [ANALYZE, BENCH, RANK_COLLAPSE, SWEEP, REPRODUCE],
    ids=["analyze", "bench", "rank-collapse", "sweep", "reproduce"],
)
def test_a_command_into_a_folder_another_process_writes_is_refused(tmp_path, capsys, command, shared_data):
    """Two analyses into one --out ran at once and mixed their outputs: report.json of one model beside
    layers.csv of the other, both exit 0; so did two benches (efficiency.json and .md) and two studies
    (runs.jsonl and the report), two sweeps (sweep.json of one beside sweep.md of the other) and two
    reproductions (report.md of seed 5 beside result.json of seed 0). The folder is now locked as a run
    folder is."""
    from neutreno.cli.main import main

    if command is RANK_COLLAPSE:
        command = [*command, "--data", str(shared_data / "wikitext103-mini")]
    if command is REPRODUCE:
        command = [*command, "--data-root", str(shared_data)]
    out = tmp_path / "an"
    holder = subprocess.Popen(
        [sys.executable, "-c", f"from neutreno.io import FolderLock; l = FolderLock({str(out)!r}); "
         "print('held', flush=True); import time; time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, env=ENV,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        code = main([*command, "--out", str(out)])
    finally:
        holder.kill()
        holder.wait()
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "being written by another process" in err
    assert sorted(p.name for p in out.iterdir()) == [".lock"]


def test_a_system_error_is_one_line_not_a_traceback(tmp_path, monkeypatch, capsys):
    """A full disk (ENOSPC) in analyze, eval, robustness or a study gave a Python traceback."""
    import errno

    from neutreno.cli import analyze
    from neutreno.cli.main import main

    def full(args):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "report.json"))

    monkeypatch.setattr(analyze, "run", full)
    assert main(["analyze", "--model", "vit_digits", "--out", str(tmp_path / "an")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("neutreno analyze: error: ") and "No space left" in err and "\n" not in err


def test_a_truncated_hugging_face_weights_file_is_one_error(tmp_path):
    transformers = pytest.importorskip("transformers")
    from neutreno.integrations.hf import load_hf

    config = transformers.BertConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    transformers.BertModel(config).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match="cannot load the Hugging Face model"):
        load_hf(transformers.AutoModel, str(tmp_path))


def test_seeds_that_torch_reads_alike_are_refused():
    """The CLI took seeds in [-2**63, 2**63) and a config in [0, 2**63), but PyTorch's CPU generator reads a
    seed's low 32 bits: ``generate --seed 4294967296`` sampled what ``--seed 0`` did, and ``-1`` what
    ``4294967295`` did. A seed is in [0, 2**32), where no two are read alike."""
    import argparse

    from neutreno.cli.types import seed
    from neutreno.training.engine import TrainConfig

    def draws(value: int) -> torch.Tensor:
        return torch.rand(4, generator=torch.Generator().manual_seed(value))

    # the reason, from torch itself: these pairs draw alike, and the limits' neighbours do not
    assert torch.equal(draws(2**32), draws(0)) and torch.equal(draws(-1), draws(2**32 - 1))
    assert not torch.equal(draws(2**32 - 1), draws(0))
    assert seed("0") == 0 and seed(str(2**32 - 1)) == 2**32 - 1
    for text in ("-1", str(2**32), str(2**63 - 1)):
        with pytest.raises(argparse.ArgumentTypeError, match=r"expected a seed in \[0, 2\*\*32\)"):
            seed(text)
    TrainConfig(seed=2**32 - 1)
    with pytest.raises(Exception, match=r"seed: must be in \[0, 2\*\*32\)"):
        TrainConfig(seed=2**32)


def test_digits_splits_take_any_seed():
    """numpy's generator takes [0, 2**32): ``demo --seed -1`` was a traceback (when the CLI took 64-bit
    seeds); a library caller may still pass any integer."""
    import numpy as np

    from neutreno.data.digits import stratified_split

    labels = np.repeat(np.arange(3), 10)
    for seed in (-1, 2**32, 2**63 - 1):
        train, test = stratified_split(labels, 0.3, seed)
        same = stratified_split(labels, 0.3, seed % 2**32)
        assert np.array_equal(train, same[0]) and np.array_equal(test, same[1])
        assert sorted([*train, *test]) == list(range(30))


def test_a_full_disk_during_a_checkpoint_is_one_line_naming_the_file(tmp_path):
    """A write that fails for space (here a file-size limit, EFBIG; ENOSPC reads the same) inside
    safetensors or torch.save ended in a traceback: SafetensorError, or RuntimeError "unexpected pos"
    that did not mention the disk. Nothing half-written is left either way."""
    cfg = config(tmp_path / "c.yaml", tmp_path / "run", train={"max_steps": 2})
    limited = (
        "import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000)); "
        "from neutreno.cli.main import run; sys.argv = ['neutreno', 'train', sys.argv[1]]; sys.exit(run())"
    )
    result = subprocess.run([sys.executable, "-c", limited, str(cfg)], capture_output=True, text=True,
                            env=ENV, timeout=600)  # fmt: skip
    line = one_line_error(result, code=1)
    # the file where it was going, not the temp folder's (.step-000002.x8y2/, gone by then)
    written = tmp_path / "run" / "checkpoints" / "step-000002" / "model.safetensors"
    assert line.startswith(f"neutreno train: error: cannot write {written} "), line
    assert "MiB free on its disk" in line
    assert not any((tmp_path / "run" / "checkpoints").iterdir())


def test_a_state_that_cannot_be_saved_is_not_called_a_full_disk(tmp_path):
    """Every error inside a checkpoint's write was reported as the disk's ("cannot write …/.step-…/
    state.pt (… MiB free on its disk)"), a state that cannot be pickled included. Only a failed write
    is; nothing is left behind either way."""
    import pickle

    from neutreno.models import create_model
    from neutreno.training.checkpoint import save_checkpoint

    model = create_model("vit_digits", depth=1)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)) as error:
        save_checkpoint(tmp_path, 1, model, {"step": 1, "callback": lambda: None})
    assert "MiB free" not in str(error.value)
    assert not any((tmp_path / "checkpoints").iterdir())


def test_a_checkpoint_of_an_ema_run_without_its_ema_file_is_damaged(tmp_path):
    """An EMA run's checkpoint that had lost ema.safetensors was resumed with the average restarted from
    the resumed weights, which results.json then reported as the EMA (at DeiT's decay, nearly the raw
    weights) without a word there; it is now a damaged checkpoint, skipped for the one before."""
    from neutreno.models import create_model
    from neutreno.training.checkpoint import checkpoint_problem, save_checkpoint

    model = create_model("vit_digits", depth=1)
    state = {"step": 1, "config": {"train": {"ema_decay": 0.99}}}
    with_ema = save_checkpoint(tmp_path, 1, model, state, ema=model)
    assert checkpoint_problem(with_ema) is None
    (with_ema / "ema.safetensors").unlink()
    assert checkpoint_problem(with_ema) == (
        f"{with_ema / 'ema.safetensors'} is missing (the checkpoint was saved with an EMA)"
    )
    plain = save_checkpoint(tmp_path, 2, model, {"step": 2, "config": {"train": {"ema_decay": None}}})
    assert checkpoint_problem(plain) is None
    # the library's save_checkpoint with a state of its own (no run config): state.pt says an EMA
    # belongs there (the config was the only sign, so this one passed as whole)
    own = save_checkpoint(tmp_path / "own", 3, model, {"step": 3}, ema=model)
    (own / "ema.safetensors").unlink()
    assert "ema.safetensors is missing" in checkpoint_problem(own)
    # a checkpoint from before state.pt said so: the run's config still tells
    state = torch.load(with_ema / "state.pt", weights_only=True)
    del state["ema"]
    torch.save(state, with_ema / "state.pt")
    assert checkpoint_problem(with_ema) == (
        f"{with_ema / 'ema.safetensors'} is missing (the run keeps an EMA, train.ema_decay 0.99)"
    )


def test_an_error_under_torchrun_names_the_process_that_printed_it(tmp_path, monkeypatch, capsys):
    """Under torchrun every process prints its own error line, and one process's may differ from the
    other's (the one that failed, the one left waiting): they carried no rank to tell them apart."""
    from neutreno.cli.main import main

    missing = tmp_path / "missing.yaml"
    assert main(["train", str(missing)]) == 2
    assert capsys.readouterr().err.startswith("neutreno train: error: ")  # one process: as before
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert main(["train", str(missing)]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("neutreno train: [rank 1/2] error: ") and str(missing) in line


def test_commands_other_than_train_refuse_several_processes(tmp_path, monkeypatch, capsys):
    """`torchrun --nproc_per_node=2 -m neutreno eval …` scored the whole split in every process, each
    printing it and writing the same --out; a one-process torchrun is one process."""
    from neutreno.cli.main import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    for command in (["eval", str(tmp_path / "run"), "--out", str(tmp_path / "o.json")], ["presets"]):
        assert main(command) == 2
        assert capsys.readouterr().err == (
            f"neutreno {command[0]}: [rank 0/2] error: runs in one process; start it without torchrun "
            "(each of the 2 processes would do the whole work and write the same files)\n"
        )
    assert not (tmp_path / "o.json").exists()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["presets"]) == 0


def test_ctrl_c_under_torchrun_is_reported_once(tmp_path, monkeypatch, capsys):
    """Found in review: every process printed "interrupted; the last checkpoint is intact: …"."""
    from neutreno.cli import main as cli_main
    from neutreno.training import engine

    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(digits_config(train={"out_dir": str(tmp_path / "run")})))

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine, "train", stop)
    for rank, said in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        assert cli_main.main(["train", str(config)]) == 130
        assert ("interrupted" in capsys.readouterr().err) is said, rank


def test_an_interrupted_study_says_how_to_resume(monkeypatch, capsys):
    """sweep and reproduce said "run the same command again"; a study, which resumes as they do (from
    runs.jsonl), said only "interrupted"."""
    from neutreno.cli import main as cli_main
    from neutreno.cli import study

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(study, "run", stop)
    assert cli_main.main(["study", "rank-collapse", "--depths", "2", "--seeds", "1"]) == 130
    assert "interrupted; run the same command again" in capsys.readouterr().err


def _stopped(*args, **kwargs):
    raise KeyboardInterrupt  # Ctrl-C, arriving while a report's last file is written


def test_a_report_stopped_before_its_last_file_leaves_none_of_the_earlier_reports_files(
    tmp_path, monkeypatch
):
    """Each report file was replaced atomically, but not the set: a sweep, study or reproduction stopped
    before its plot left the earlier run's plot beside the new JSON and table (a reproduce report.md of
    seed 5 beside a result.json of seed 0 the same way). The earlier set is removed first now."""
    import types

    from neutreno.reproduce import report as claim_report
    from neutreno.studies import rank_collapse, spectrum
    from neutreno.training import sweep

    def written_then_stopped(folder, write, module, name, old_files):
        write()  # a whole report, then one stopped at its last file
        assert {p.name for p in folder.iterdir()} >= set(old_files)
        with monkeypatch.context() as patch:
            patch.setattr(module, name, _stopped)
            with pytest.raises(KeyboardInterrupt):
                write()
        return {p.name for p in folder.iterdir()}

    # sweep: json, csv and md written, the plot not
    config = types.SimpleNamespace(task="language_model")
    runs = [sweep.SweepRun({"model.lam": lam}, tmp_path / lam, config) for lam in ("0", "0.4")]
    rows = sweep.summarize(runs, [{"val": {"model": {"ppl": p, "loss": 3.0}}} for p in (30.0, 31.0)])
    out = tmp_path / "sweep"
    out.mkdir()
    left = written_then_stopped(
        out, lambda: sweep.write_report(out, runs, rows), sweep, "save_figure", ["sweep.png"]
    )
    assert left == {"sweep.json", "sweep.csv", "sweep.md"}

    # rank-collapse study
    fields = [
        "norm",
        "residual_scale",
        "attention",
        "depth",
        "seeds",
        "diverged",
        *rank_collapse.SUMMARY_VALUES,
    ]
    summary = [dict.fromkeys(fields, 1)]
    monkeypatch.setattr(rank_collapse, "markdown_table", lambda rows: "| table |")
    monkeypatch.setattr(rank_collapse, "plot", lambda rows, path, init: path.write_bytes(b"png"))
    out = tmp_path / "study"
    out.mkdir()
    left = written_then_stopped(
        out, lambda: rank_collapse.write_report(out, [], summary, {"init": "x"}), rank_collapse, "plot",
        ["rank_collapse.png"],
    )  # fmt: skip
    assert left == {"results.json", "rank_collapse.csv", "table.md"}

    # spectrum study
    variant = {
        "high_frequency": [1.0, 0.5],
        "cosine": [0.1, 0.2],
        "regime": ["smooth"],
        "smooth_fraction": [0.5],
    }
    report = {"variants": {"softmax": variant}}
    monkeypatch.setattr(spectrum, "markdown_table", lambda report: "| table |")
    monkeypatch.setattr(spectrum, "plot", lambda report, path: path.write_bytes(b"png"))
    out = tmp_path / "spectrum"
    out.mkdir()
    left = written_then_stopped(
        out, lambda: spectrum.write_report(out, report), spectrum, "plot", ["spectrum_study.png"]
    )
    assert left == {"results.json", "layers.csv", "table.md"}

    # a reproduced claim: stopped at its result.json, after its plot and report.md
    base = {"claim": "vit-accuracy", "title": "t", "source": "s", "paper": "p", "seeds": 3, "seconds": 1.0,
            "scale": "quick", "note": "", "reason": "r", "verdict": "agrees", "label": "agrees"}  # fmt: skip
    plotted = {"kind": "lines", "x": [1, 2], "series": {"y": [3, 4]}, "xlabel": "x", "ylabel": "y"}
    record = {**base, "measured": {"setting": "a setting", "table": [["a"], ["1"]], "plot": plotted}}
    out = tmp_path / "quick" / "vit-accuracy"
    left = written_then_stopped(
        out, lambda: claim_report.write_claim_report(out, record), claim_report, "write_json", ["result.json"]
    )
    assert left == {"plot.png", "report.md"}
    # the index: stopped at index.json, after index.md
    left = written_then_stopped(
        tmp_path, lambda: claim_report.write_index(tmp_path, ["vit-accuracy"]), claim_report, "write_json",
        ["index.json"],
    )  # fmt: skip
    assert "index.md" in left and "index.json" not in left


@pytest.mark.parametrize(
    "args",
    [
        ["train", "cifar10_vit_softmax", "--finetune", ""],
        ["eval", "run", "--data", ""],
        ["eval", "run", "--split", " "],
        ["demo", "--out", ""],
        ["analyze", "--model", "vit_digits", "--attention", ""],
        ["robustness", "run", "--data", "digits", "--baseline", ""],
    ],
    ids=["finetune", "data", "split", "out", "attention", "baseline"],
)
def test_a_blank_value_is_refused_not_taken_for_the_default(args, capsys, tmp_path, monkeypatch):
    """An unset shell variable gives an empty value: `train --finetune ""` trained from scratch,
    `eval --data ""` scored the run's own corpus, `--split " "` the default split, `demo --out ""` wrote
    into the current folder, `analyze --attention ""` ran softmax, `robustness --baseline ""` gave no
    mCE; each exit 0."""
    from neutreno.cli.main import build_parser, main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 2
    assert "expected a value, got" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before any work

    def arguments(parser):  # every argument of every subcommand
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for command in action.choices.values():
                    yield from arguments(command)
            else:
                yield action

    from neutreno.cli.generate import prompt_text

    # (generate's --prompt: a line break alone is a prompt; one with no token is refused with the tokenizer)
    taking_text = [
        a
        for a in arguments(build_parser())
        if a.nargs != 0 and a.choices is None and a.type is not prompt_text
    ]
    assert len(taking_text) > 50
    # --out=~/x reaches neutreno as it is (no shell expands ~ after "="): a folder named "~" was made
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert build_parser().parse_args(["demo", "--out=~/d"]).out == tmp_path / "home" / "d"
    for action in taking_text:  # each refuses "" (a number, a seed, a list by its own rule)
        with pytest.raises((argparse.ArgumentTypeError, ValueError)):
            action.type("")


@pytest.mark.parametrize(
    "command",
    [["demo"], RANK_COLLAPSE, ["study", "spectrum", "--config", "cifar10_vit_softmax", "--samples", "2"]],
    ids=["demo", "rank-collapse", "spectrum"],
)
def test_a_command_writing_results_json_refuses_a_training_runs_folder(
    tmp_path, capsys, command, shared_data
):
    """`demo --out RUN` and `study … --out RUN` replaced the training run's results.json with their own,
    beside its checkpoints, exit 0 (eval refused its --out there already)."""
    from neutreno.cli.main import main

    if command is RANK_COLLAPSE:
        command = [*command, "--data", str(shared_data / "wikitext103-mini")]
    run = tmp_path / "run"
    run.mkdir()
    files = {"config.json": "{}", "metrics.jsonl": "", "results.json": '{"step": 9}'}
    for name, text in files.items():
        (run / name).write_text(text)
    assert main([*command, "--out", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"--out {run} is a training run's folder" in err
    assert {p.name: p.read_text() for p in run.iterdir()} == files  # nothing written, nothing replaced


def test_a_bench_stopped_before_its_table_leaves_no_earlier_table(tmp_path, monkeypatch, capsys):
    """efficiency.json of a second bench beside efficiency.md of the first, when stopped between them."""
    from neutreno import io
    from neutreno.cli.main import main

    out = tmp_path / "bench"
    assert main([*BENCH, "--out", str(out)]) == 0
    assert (out / "efficiency.md").is_file()
    written = io.atomic_path

    def stopped_at_the_table(path, *args, **kwargs):
        return _stopped() if str(path).endswith(".md") else written(path, *args, **kwargs)

    monkeypatch.setattr(io, "atomic_path", stopped_at_the_table)
    assert main([*BENCH, "--out", str(out)]) == 130  # Ctrl-C's status
    assert {p.name for p in out.iterdir()} == {".lock", "efficiency.json"}


def test_crafted_metadata_text_and_yaml_get_short_one_line_errors(tmp_path):
    """Found in review: 100,000 nested "[" in a checkpoint's args metadata or in a labelled-text line
    gave a RecursionError traceback (a 5,000-digit label a ValueError naming no file); an hf: checkpoint
    with no classes a KeyError; a YAML file of nested aliases (449 bytes) expanded to 722 MB in its
    error message."""
    from safetensors.torch import save_file

    from neutreno.config import ConfigError, load_config
    from neutreno.data.text import load_labelled_texts
    from neutreno.models import load_model
    from neutreno.training.classification import ClassificationConfig

    weights = {"w": torch.zeros(1)}
    for name, meta, message in (
        ("deep", {"model": "vit_digits", "args": "[" * 100_000}, "its 'args' metadata is not a mapping"),
        ("hf", {"model": f"hf:{tmp_path}", "args": "{}"}, "its args record no list of classes"),
    ):
        path = tmp_path / f"{name}.safetensors"
        save_file(weights, str(path), metadata=meta)
        with pytest.raises(ValueError, match=message) as error:
            load_model(path)
        assert len(str(error.value)) < 500
    for name, line in (
        ("deep", '{"text": ' + "[" * 100_000 + "}"),
        ("big", '{"text": "a", "label": ' + "9" * 5000 + "}"),
    ):
        path = tmp_path / f"{name}.jsonl"
        path.write_text('{"text": "a", "label": "x"}\n' + line + "\n")
        with pytest.raises(ValueError, match=rf"{name}\.jsonl:2: not JSON"):
            load_labelled_texts(path)
    nested = '&l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]'
    for level in range(1, 7):
        nested = f"&l{level} [" + ", ".join([nested] + [f"*l{level - 1}"] * 9) + "]"
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("train:\n  epochs: " + nested + "\n")
    with pytest.raises(ConfigError, match=r"train\.epochs") as error:
        load_config(ClassificationConfig, bomb)
    assert len(str(error.value)) < 10_000  # it was 7.2 MB at this depth


@pytest.mark.parametrize(
    ("preprocess", "message"),
    [
        # one mean and std for three channels broadcast silently over them
        ({"mean": [0.5], "std": [0.25]}, "mean: needs 3 values, got [0.5]"),
        ({"std": [0.2, 0.0, 0.2]}, "std: needs 3 positive values, got [0.2, 0.0, 0.2]"),  # inf
        ({"mean": [123.675, 116.28, 103.53]}, "mean: values are fractions of 255 in [0, 1]"),  # levels
        ({"image_size": None}, "image_size must be an integer >= 1, got None"),  # a TypeError traceback
        ({"channels": "3"}, "channels must be 1 or 3, got '3'"),
        ({"crop_pct": 0}, "crop_pct must be in (0, 1]"),
        ({"image_size": ...}, "lacks image_size"),  # a KeyError traceback
    ],
)
def test_a_checkpoints_recorded_preprocessing_is_checked_as_the_config_is(tmp_path, preprocess, message):
    from neutreno import create_model
    from neutreno.models import save_model

    recorded = {"image_size": 8, "crop_pct": 1.0, "channels": 3, "mean": [0.5] * 3, "std": [0.25] * 3}
    recorded = {k: v for k, v in {**recorded, **preprocess}.items() if v is not ...}
    model = create_model("vit_digits", num_classes=2, in_chans=3)
    save_model(tmp_path / "model.safetensors", model, extra={"preprocess": recorded, "classes": ["a", "b"]})
    error = one_line_error(neutreno("eval", tmp_path / "model.safetensors", "--data", "digits"))
    assert f"model.safetensors: its preprocess metadata {message}" in error


def test_a_checkpoint_naming_a_model_of_other_sizes_is_refused_before_it_is_built(tmp_path, monkeypatch):
    """Metadata is the file's word for its architecture: a hand-made file naming a huge model (a vocabulary
    of 10⁸ at width 10⁴ is 4 TB) was built, its memory allocated, before the weights' shapes were compared.
    The shapes are now compared on the meta device first (here a harmless size, and the builds watched)."""
    from safetensors.torch import save_file

    from neutreno import create_model
    from neutreno.models import checkpoint, load_model, save_model

    path = tmp_path / "model.safetensors"
    save_model(path, create_model("lm_wt103_mini", vocab_size=100, cutoffs=[50], embed_dim=16, depth=1))
    meta, state = checkpoint.safetensors_metadata(path), load_file(path)
    args = {**json.loads(meta["args"]), "vocab_size": 10_000}
    save_file(state, str(path), metadata={**meta, "args": json.dumps(args)})
    built_on = []
    build = checkpoint.create_model
    monkeypatch.setattr(
        checkpoint,
        "create_model",
        lambda *a, **k: built_on.append(torch.empty(0).device.type) or build(*a, **k),
    )
    with pytest.raises(
        ValueError, match=r"model\.safetensors does not fit a TransformerLM of this architecture"
    ):
        load_model(path)
    assert built_on == ["meta"]
    save_file(state, str(path), metadata=meta)  # the file as written loads, built twice
    load_model(path)
    assert built_on == ["meta", "meta", "cpu"]


def test_finetune_given_both_as_a_setting_and_as_the_option_is_refused(capsys, tmp_path, monkeypatch):
    """`--set train.finetune=A --finetune B` trained from B, A dropped without a word."""
    from neutreno.cli.main import main

    monkeypatch.chdir(tmp_path)
    args = [
        "train",
        "cifar10_vit_softmax",
        "--set",
        "train.finetune=a.safetensors",
        "--finetune",
        "b.safetensors",
    ]
    assert main(args) == 2
    assert (
        "--set train.finetune: --finetune sets it, so the value given would be ignored"
        in capsys.readouterr().err
    )
    assert not any(tmp_path.iterdir())


def test_a_key_twice_in_a_merged_anchor_and_a_merge_of_a_list_are_refused(tmp_path):
    """A mapping anchored below the top and merged elsewhere was flattened before it was read, and its
    key given twice passed (the last value kept); `<<: [*a, *b]` kept b's values where YAML's merge keeps
    a's. Both are refused in one line; a plain merge still overrides."""
    from neutreno.config import ConfigError, read_yaml

    (tmp_path / "nested.yaml").write_text("x:\n  y: &d {seed: 1, seed: 2}\ntrain:\n  <<: *d\n")
    with pytest.raises(ConfigError, match=r"key 'seed' is given twice \(line 2\)"):
        read_yaml(tmp_path / "nested.yaml")
    (tmp_path / "list.yaml").write_text("a: &a {seed: 1}\nb: &b {seed: 2}\ntrain:\n  <<: [*a, *b]\n")
    with pytest.raises(ConfigError, match=r"'<<:' merges one mapping here, not a list of them \(line 4\)"):
        read_yaml(tmp_path / "list.yaml")
    (tmp_path / "merge.yaml").write_text("x: &o {seed: 1, epochs: 3}\ntrain:\n  <<: *o\n  seed: 2\n")
    assert read_yaml(tmp_path / "merge.yaml")["train"] == {"seed": 2, "epochs": 3}


def test_every_atomic_write_that_fails_for_space_names_its_file(tmp_path, shared_data):
    """Only checkpoints said which file a full disk stopped: config.json, results.json and reports
    gave "[Errno 27] File too large" alone, and safetensors' or torch.save's own error (a demo's model,
    robustness' progress file) was a 30-40 line traceback. Each is one OSError naming the file, and
    nothing half-written is left. A corpus cache that cannot be written is said and skipped: the run
    goes on with the streams in memory."""
    script = f"""
import resource, sys, torch
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
from neutreno.io import atomic_path, write_json
from neutreno.models import create_model, save_model
out = __import__("pathlib").Path({str(tmp_path)!r})
def progress():  # as robustness keeps its progress
    with atomic_path(out / "progress.pt") as tmp:
        torch.save(torch.zeros(5000), tmp)
for name, write in [
    ("report.json", lambda: write_json(out / "report.json", {{"x": list(range(5000))}})),
    ("model.safetensors", lambda: save_model(out / "model.safetensors", create_model("vit_digits"))),
    ("progress.pt", progress),
]:
    try:
        write()
    except OSError as error:
        print(name, "|", error)
from neutreno.data.corpus import load_corpus
tokenizer, streams = load_corpus({str(shared_data / "wikitext103-mini")!r}, cache_dir=out / "cache")
print("corpus", len(tokenizer), sorted(streams))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=ENV, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" | ", 1) for line in done.stdout.splitlines() if " | " in line)
    for name in ("report.json", "model.safetensors", "progress.pt"):
        assert lines[name].startswith(f"cannot write {tmp_path / name} ("), lines
        assert "MiB free on its disk): " in lines[name] and not (tmp_path / name).exists()
    assert "warning: the corpus is not cached (cannot write" in done.stderr
    assert "['test', 'train', 'valid']" in done.stdout.splitlines()[-1]
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".") and p.is_file()]


def test_a_runs_checkpoints_folder_and_latest_pointer_name_its_latest_weights(finished_run):
    """`eval run/checkpoints` said "no checkpoint at run/checkpoints", where the checkpoints are, and
    `eval run/checkpoints/latest` (a pointer file) was read as weights: "not a neutreno checkpoint"."""
    from neutreno.training.checkpoint import resolve_weights

    run = finished_run / "run"
    expected = latest_checkpoint(run) / "model.safetensors"
    for given in (run, run / "checkpoints", run / "checkpoints" / "latest"):
        assert resolve_weights(given) == expected, given
