"""Atomic, durable file writing: a reader never sees a half-written report or checkpoint, and a
renamed file survives a power cut (its data and the directory entry are fsync'ed)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl  # BSD locks on atomic_path's temp folders; not on Windows
except ImportError:
    fcntl = None

_UMASK_LOCK = threading.Lock()


def _umask() -> int:
    """The process umask, read without changing it where Linux says it (``/proc/self/status``): setting
    it to read it left a moment in which another thread's new files got mode 0666, or read 0 itself."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _UMASK_LOCK:  # elsewhere: at least this module's threads never race each other here
        mask = os.umask(0)
        os.umask(mask)
    return mask


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's (or a directory's entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def finish_temp(tmp: Path, mode: int = 0o666) -> None:
    """Give a temporary file written by this module the mode the umask gives a new file (``mkstemp``
    makes it 0600), and flush it to disk before it is renamed."""
    os.chmod(tmp, mode & ~_umask())
    fsync_path(tmp)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path for ``path`` (same name, in a hidden folder beside it); on success flush
    it to disk and rename it onto ``path`` (then flush the directory entry), else delete it.

    The folder (``.NAME.XXXXXXXX.SUFFIX/``) holds everything the writer makes, a library's own temp
    file too (safetensors writes one and renames it onto the path it was given), and a lock the writer
    holds until the rename: the next writer of ``path`` removes a killed writer's folder
    (:func:`remove_abandoned_temps`), never a live one's."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_temps(path)
    folder, lock = _locked_temp_folder(path)
    tmp = folder / path.name
    try:
        with failed_writes_named(path):
            yield tmp
            finish_temp(tmp)
            os.replace(tmp, path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        os.close(lock)
    fsync_path(path.parent)


# torch.save's RuntimeErrors when its file cannot be written (its own words; any other passes as it is)
DISK_ERROR = re.compile(
    r"unexpected pos|iostream error|failed writing|file write failed|No space|File too large"
)


@contextmanager
def failed_writes_named(path: str | os.PathLike) -> Iterator[None]:
    """Within the block, a write that fails for the disk is :func:`write_failure`'s OSError naming
    ``path``; an error of the writer's own (a state that cannot be saved) passes as it is."""
    try:
        yield
    except Exception as error:
        # a full disk or a file-size limit: an OSError, or safetensors' and torch.save's own error
        # (SafetensorError "I/O error: No space left on device", RuntimeError "unexpected pos")
        from safetensors import SafetensorError  # (imported on a failure only: io is imported at start)

        if isinstance(error, RuntimeError) and not DISK_ERROR.search(str(error)):
            raise
        if not isinstance(error, (OSError, RuntimeError, SafetensorError)):
            raise
        raise write_failure(path, error) from error


def write_failure(path: str | os.PathLike, error: BaseException) -> OSError:
    """The OSError to raise for a failed write of ``path``: naming the file and the space left on its disk
    (the errors said neither: "[Errno 28] No space left on device", or a library's traceback)."""
    path = Path(path)
    if isinstance(error, OSError) and str(path) in str(error):
        return error  # (already says which file: a nested atomic_path's, say)
    existing = next((p for p in path.parents if p.exists()), None)  # (a folder still being made)
    try:
        free = f" ({shutil.disk_usage(existing).free / 2**20:,.1f} MiB free on its disk)" if existing else ""
    except OSError:
        free = ""
    why = error.strerror if isinstance(error, OSError) and error.strerror else str(error).strip()
    message = f"cannot write {path}{free}: {why.splitlines()[0] if why else type(error).__name__}"
    failure = OSError(message)  # (one argument: its text without "[Errno N]", which the cause keeps)
    failure.errno = error.errno if isinstance(error, OSError) else None
    return failure


_LOCK = ".lock"  # in a temp folder of atomic_path: held by its writer


def _locked_temp_folder(path: Path) -> tuple[Path, int]:
    """A new temp folder for ``path`` and the descriptor of its lock file, locked."""
    while True:
        folder = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix))
        try:
            lock = os.open(folder / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        except FileNotFoundError:  # another writer's clean-up took the folder first
            continue
        except BaseException:  # Ctrl-C here: no folder left without its lock
            shutil.rmtree(folder, ignore_errors=True)
            raise
        try:
            _hold(lock)
            # another writer's clean-up may have taken it between the lock file's creation and the lock
            if os.path.samestat(os.fstat(lock), os.stat(folder / _LOCK)):
                return folder, lock
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(lock)
            shutil.rmtree(folder, ignore_errors=True)
            raise
        os.close(lock)


def _hold(fd: int, wait: bool = True) -> bool:
    """Take an exclusive BSD lock on an open file (held until this descriptor closes, whatever else
    opens and closes the file); False when another holds it and not ``wait``. Where there are no such
    locks (not POSIX, or not on this file system), ``wait``: writers go on, and nothing is deleted."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    except OSError:  # a file system without locks (some network and FUSE mounts): a writer goes on
        return wait  # without one, and a temp folder whose writer cannot be told dead is left alone
    return True


def remove_abandoned_temps(path: Path) -> None:
    """Delete what killed :func:`atomic_path` writers of ``path`` left beside it (a SIGKILL or a power cut
    skips the clean-up; a corpus cache's is hundreds of MB): their temp folders, whose lock no live
    writer holds; a folder killed before its lock was made, once empty for a minute; and the temp files
    of releases before the folders (which locked them, or not at all). Not on systems without ``fcntl``."""
    if fcntl is None:
        return
    pattern = re.compile(rf"\.{re.escape(path.name)}\.[a-z0-9_]{{8}}{re.escape(path.suffix)}")
    try:
        found = [Path(entry.path) for entry in os.scandir(path.parent) if pattern.fullmatch(entry.name)]
    except OSError:
        return
    for temp in found:
        # read-only: where locks need a writable file (NFS), nothing is taken for dead
        lock_file = temp / _LOCK if temp.is_dir() else temp
        try:
            lock = os.open(lock_file, os.O_RDONLY)
        except FileNotFoundError:  # gone meanwhile, or a folder whose writer has not made its lock yet
            try:
                if temp.is_dir() and time.time() - temp.stat().st_mtime > 60:
                    temp.rmdir()  # empty: killed between the folder and its lock (else this fails)
            except OSError:
                pass
            continue
        except OSError:
            continue
        try:
            if not _hold(lock, wait=False):  # a live writer's
                continue
            if temp.is_dir():
                shutil.rmtree(temp, ignore_errors=True)
            else:
                temp.unlink(missing_ok=True)
        finally:
            os.close(lock)


def json_safe(data: object) -> object:
    """``data`` with every non-finite float (NaN, ±inf) as None, in nested dicts, lists and tuples: JSON
    has no NaN, and Python's ``NaN`` literal is refused by strict parsers (jq, JavaScript's JSON.parse)."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {key: json_safe(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [json_safe(value) for value in data]
    return data


def json_text(data: object) -> str:
    """``data`` as strict, indented JSON: a number that is not finite is ``null`` (see :func:`json_safe`)."""
    return json.dumps(json_safe(data), indent=2, allow_nan=False)


def write_json(path: str | os.PathLike, data: object) -> None:
    """Write ``data`` as indented, strict JSON (:func:`json_text`), atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json_text(data) + "\n")


def remove_report(folder: str | os.PathLike, names: list[str]) -> None:
    """Remove the files ``names`` of an earlier report in ``folder`` before a new set is written: each
    file is replaced atomically, but not the set, so a run stopped between two writes (or a second
    writer) left one run's JSON beside another's table or plot. Now it leaves fewer files, never two
    runs' side by side."""
    for name in names:
        (Path(folder) / name).unlink(missing_ok=True)


def remove_stale_temps(folder: str | os.PathLike) -> list[Path]:
    """Delete what a process killed mid-write left in ``folder``: the hidden ``.name.XXXX`` temp folders
    (and older releases' files) of :func:`atomic_path` and temp checkpoint folders. Call it only while
    holding the folder (a run lock).
    Returns what was removed."""
    removed = []
    for path in Path(folder).glob(".*.*"):
        if not is_temp_name(path.name):  # a user's own hidden file (.env.local) is not ours to delete
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


# ".<name>.<8 random characters of tempfile's><name's suffix>", as mkstemp/mkdtemp name our temps
_TEMP_NAME = re.compile(r"\.(?P<name>.+)\.[a-z0-9_]{8}(?P<suffix>(\.[^.]+)?)")


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is one :func:`atomic_path` (or a checkpoint's temp folder) gives a temporary:
    ``.results.json.k2j4_x9a.json`` for ``results.json``, ``.step-000009.ab12cd34`` for a folder."""
    match = _TEMP_NAME.fullmatch(name)
    return bool(match) and Path(match["name"]).suffix == match["suffix"]


class FolderLocked(RuntimeError):
    """Another live process is writing to the folder."""


class FolderLock:
    """An exclusive lock on a folder (``folder/.lock``, a POSIX record lock): one writer process at a
    time. The operating system releases it when the holder exits or is killed, so a stale lock cannot
    block a later run, and forked children (DataLoader workers) do not inherit it.

    Raises:
        FolderLocked: another process holds it (its pid is named).
    """

    def __init__(self, folder: str | os.PathLike) -> None:
        import fcntl

        self.path = Path(folder) / ".lock"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a+")
        try:
            fcntl.lockf(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._file.seek(0)
            holder = self._file.read().strip() or "unknown"
            self._file.close()
            raise FolderLocked(
                f"{self.path.parent} is being written by another process (pid {holder}); wait for it to "
                "finish, stop it, or choose another folder"
            ) from None
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"{os.getpid()}\n")
        self._file.flush()

    def release(self) -> None:
        if not self._file.closed:
            self._file.close()  # closing releases the lock


def first_missing(folder: str | os.PathLike) -> Path | None:
    """The outermost of ``folder`` and its parents that does not exist yet (what making ``folder`` with its
    parents creates first), or None when ``folder`` exists: what :func:`remove_if_only_lock` may remove."""
    missing = None
    for path in (Path(folder), *Path(folder).parents):
        if path.exists():
            break
        missing = path
    return missing


def remove_if_only_lock(folder: str | os.PathLike, created: str | os.PathLike | None = None) -> None:
    """Remove a folder this process created for a command that was refused, if it holds nothing but its
    lock, and the parents it created with it (``created``, from :func:`first_missing` before: the
    outermost), each if now empty: no empty folder left behind."""
    folder = Path(folder)
    if [p.name for p in folder.iterdir()] != [".lock"]:
        return
    (folder / ".lock").unlink()
    folder.rmdir()
    if created is None or Path(created) == folder or Path(created) not in folder.parents:
        return
    for parent in folder.parents:
        if any(parent.iterdir()):
            return
        parent.rmdir()
        if parent == Path(created):
            return


def check_output_folder(path: str | os.PathLike, name: str, writes: str | None = None) -> None:
    """A folder a command will write into: it, or else its nearest existing parent, must be a folder.
    Checked before any work (``afile/sub`` failed with NotADirectoryError once the work was done).
    ``writes``: a file the command writes that a training run's folder holds too (``results.json``):
    such a folder is refused (a study's results.json replaced the run's, beside its checkpoints).

    Raises:
        ValueError: naming ``name`` (``--out``, ``train.out_dir``) and the file in the way.
    """
    path = Path(path)
    if writes is not None and (path / "config.json").is_file() and (path / "metrics.jsonl").is_file():
        raise ValueError(
            f"{name} {path} is a training run's folder: this command's {writes} would replace the run's; "
            "choose another folder"
        )
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        where = "" if existing == path else f": {existing}"
        raise ValueError(f"{name} {path}{where} exists and is not a folder")
    if existing is not None and not os.access(existing, os.W_OK):  # a read-only mount: after the work, once
        where = "" if existing == path else f" ({existing})"
        raise ValueError(f"{name} {path}{where} is not writable")


def check_output_file(path: str | os.PathLike, name: str) -> None:
    """A file a command will write: not a folder, and in a folder (or where one can be made).

    Raises:
        ValueError: naming ``name`` and what is in the way.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{name} {path} is a folder, not a file name")
    check_output_folder(path.parent, f"{name} {path}: its folder")
