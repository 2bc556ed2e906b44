"""What the image readers share: which files are images (torchvision's ``ImageFolder`` rules), reading
a ``.tar``/``.tar.gz`` archive to its end (so a damaged one is an error, not a smaller dataset), and
bringing 16-bit images to 8 bits."""

from __future__ import annotations

import bz2
import gzip
import lzma
import os
import tarfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

# torchvision.datasets.folder.IMG_EXTENSIONS, matched case-insensitively
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N")
_CHUNK = 1 << 20
# The most one archive member may hold: far above any image or CIFAR batch (30 MB), far below a machine's
# memory, so that a crafted archive (1 MB of gzip holding a member of tens of GB) is an error, not a
# process killed for memory.
MAX_MEMBER_BYTES = 1 << 30


def is_image_name(name: str) -> bool:
    """Whether a file name (the last part of a path) has one of torchvision's image suffixes."""
    return name.lower().endswith(IMAGE_SUFFIXES)


def is_hidden(parts: list[str] | tuple[str, ...]) -> bool:
    """Whether any part of a path is hidden (``.DS_Store``, macOS's ``._x.jpg``, ``.thumbs/``)."""
    return any(part.startswith(".") for part in parts)


def is_file_member(member: tarfile.TarInfo) -> bool:
    """A regular file, or a hard or symbolic link (to one, :func:`member_bytes` checks): a folder's
    reader follows links, so the archive of that folder must not give a smaller dataset."""
    return member.isfile() or member.islnk() or member.issym()


def _link_target(member: tarfile.TarInfo) -> str:
    """The normalised member name a link points to: a hard link's name is from the archive's root, a
    symbolic link's from its own folder."""
    if member.islnk():
        return os.path.normpath(member.linkname)
    return os.path.normpath(os.path.join(os.path.dirname(member.name), member.linkname))


def _named(members: list[tarfile.TarInfo], name: str, other: tarfile.TarInfo) -> list[tarfile.TarInfo]:
    """The members but ``other`` whose normalised name is ``name``."""
    return [m for m in members if m is not other and os.path.normpath(m.name) == name]


def member_bytes(tar: tarfile.TarFile, member: tarfile.TarInfo, seen: dict[int, bytes]) -> bytes:
    """The bytes of a file member, or of a link's target (a hard link's: the last member of that name
    stored before it, as ``tar -x`` gives it; a symbolic link's: the last one of that name anywhere in
    the archive, or a link to one). A target already read comes from ``seen`` (member offset → bytes,
    filled here: by offset, not name, so that a later copy of the name, read first when members are read
    out of order, is not taken for the one a hard link means); another is read again, which in a
    ``.tar.gz`` decompresses the archive again from its start up to it (a symbolic link's target: the
    archive's members are read ahead, which the iteration then goes on over).

    Raises:
        tarfile.ReadError: a link to no file, or a symbolic link out of the archive.
    """
    if member.islnk() or member.issym():
        kind = "hard" if member.islnk() else "symbolic"
        if member.issym() and (os.path.isabs(member.linkname) or _link_target(member).startswith("..")):
            raise tarfile.ReadError(f"{member.name} is a symbolic link out of the archive: {member.linkname}")
        link, data = member, None
        for _ in range(32):  # a chain of links
            # a hard link is the copy of its target stored before it; a symbolic link resolves when read,
            # to the target's last copy in the archive (tar -u, -r append new copies), as tar -x leaves it
            if link.issym():  # its target may also come after it, or again later: read ahead
                found = _named(tar.getmembers(), _link_target(link), link)
            else:  # not tar.extractfile(member): it looks the target up in the whole archive
                found = _named(tar.members[: tar.members.index(link)], _link_target(link), link)
            if found and found[-1].isfile():
                data = seen.get(found[-1].offset)
                if data is None:
                    data = _read(tar, found[-1])
                break
            if not found or not (found[-1].islnk() or found[-1].issym()):
                where = "no file before it" if member.islnk() else "no file in the archive"
                raise tarfile.ReadError(f"{member.name} is a {kind} link to {member.linkname}, {where}")
            link = found[-1]
        if data is None:
            raise tarfile.ReadError(f"{member.name}: a chain of links that does not end")
    else:
        data = _read(tar, member)
    seen[member.offset] = data
    return data


def _read(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    """A file member's bytes, refused before they are read when its header says it holds more than
    :data:`MAX_MEMBER_BYTES`."""
    if member.size > MAX_MEMBER_BYTES:
        raise ValueError(
            f"{tar.name}: {member.name} holds {member.size:,} bytes, more than the {MAX_MEMBER_BYTES:,} an "
            "image or data file of an archive may (a crafted or wrong archive?)"
        )
    return tar.extractfile(member).read()


def refuse_folder_link(tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
    """Raise for a symbolic link, among an image folder's entries, that may be a folder's: one to a
    folder in the archive, or one out of it (which it is, is not known). A folder's reader follows it,
    so the archive of that folder, which does not, gave a smaller dataset without a word: the linked
    class missing and every later class's label shifted.

    Raises:
        ValueError: naming the archive, the link and what to do."""
    target, where = _link_target(member), f"{tar.name}: {member.name} is a symbolic link"
    if os.path.isabs(member.linkname) or target.startswith(".."):
        raise ValueError(f"{where} out of the archive ({member.linkname}), perhaps to a folder of images")
    inside = target + "/"
    members = tar.getmembers()
    if any(
        (m.isdir() and os.path.normpath(m.name) == target) or os.path.normpath(m.name).startswith(inside)
        for m in members
    ):
        raise ValueError(
            f"{where} to a folder ({member.linkname}), which an archive's reader does not follow: pack the "
            "folder with its links followed (tar -h)"
        )


def check_archive_end(tar: tarfile.TarFile, path: str | Path) -> None:
    """Read an archive whose members were all iterated on to its end.

    tarfile stops quietly at a damaged member header (after the first) as if the archive ended there,
    and never reads a gzip stream's trailer. So: for a compressed archive, decompress the rest (gzip
    then checks its CRC and length), which must be zero bytes (the end-of-archive blocks); a plain
    ``.tar`` is re-read from the block where tarfile stopped (seeking back is cheap there; in a
    compressed stream it would decompress it all again), which must be there and zero. Call it after
    iterating the members and before extracting any out of order.

    Raises:
        ValueError: ``"<path> is damaged: …"``.
    """
    stream = tar.fileobj
    compressed = isinstance(stream, (gzip.GzipFile, bz2.BZ2File, lzma.LZMAFile))
    try:
        if not compressed or stream.tell() < tar.offset:  # forward only in a compressed stream
            stream.seek(tar.offset)
        size = 0
        while chunk := stream.read(_CHUNK):
            if chunk.count(0) != len(chunk):
                raise ValueError(
                    f"{path} is damaged: reading stopped at byte {tar.offset}, after {len(tar.members)} "
                    "member(s), at an unreadable member header (or data after the archive's end)"
                )
            size += len(chunk)
    except (OSError, EOFError, zlib.error, lzma.LZMAError) as error:  # BadGzipFile is an OSError
        raise ValueError(f"{path} is damaged: {_cause(error)}") from None
    if not compressed and size == 0:
        raise ValueError(
            f"{path} is damaged: it ends after byte {tar.offset} without the end-of-archive blocks"
        )


TAR_ERRORS = (tarfile.TarError, OSError, EOFError, zlib.error)


def _cause(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__  # tarfile's messages span lines


@contextmanager
def open_archive(path: str | Path, not_archive: str) -> Iterator[tarfile.TarFile]:
    """``tarfile.open(path)`` for a ``with`` block, its errors as one-line ValueErrors: ``"<not_archive>
    (<cause>)"`` when it does not open as an archive, ``"<path> is damaged: <cause>"`` when reading it
    fails once open (inside the block)."""
    try:
        tar = tarfile.open(path)  # noqa: SIM115 (closed by the with below)
    except TAR_ERRORS as error:
        raise ValueError(f"{not_archive} ({_cause(error)})") from None
    try:
        with tar:
            yield tar
    except TAR_ERRORS as error:
        raise ValueError(f"{path} is damaged: {_cause(error)}") from None


def image_error(error: Exception) -> str | Exception:
    """Why PIL could not read an image, in words: its "cannot identify image file <_io.BytesIO object at
    0x…>" says "not a recognised image"; other errors are their own message."""
    return "not a recognised image" if isinstance(error, UnidentifiedImageError) else error


def to_8_bits(image: Image.Image) -> Image.Image:
    """``image``, a 16-bit grayscale one scaled to 8 bits (value >> 8): PIL's ``convert("L"/"RGB")``
    clips it, so anything above 255 would come out white. Other modes are returned as they are.

    Raises:
        ValueError: a 32-bit image (mode ``I`` or ``F``), whose value range is unknown.
    """
    mode = image.mode
    if mode == "I" and image.format in ("PNG", "PPM"):  # a 16-bit PGM, or a 16-bit PNG in older Pillow
        mode = "I;16"
    if mode in SIXTEEN_BIT_MODES:
        return Image.fromarray((np.asarray(image).astype(np.uint32) >> 8).astype(np.uint8))
    if mode in ("I", "F"):
        raise ValueError(f"a 32-bit image (PIL mode {mode}) has no known value range; use 8 or 16 bits")
    return image


def raise_walk_error(error: OSError) -> None:
    """``os.walk``'s ``onerror``: an unreadable folder is the system's error (``os.walk`` skipped it, and
    its images were left out of a score without a word)."""
    raise error


def same_source(a: str | Path, b: str | Path) -> bool:
    """Whether two data arguments name one source: one file or folder however spelled (``run/x.csv``,
    ``./run/x.csv``, a link), or one name where it is no path (``digits``)."""
    a, b = Path(a), Path(b)
    if a.exists() and b.exists():
        return a.resolve() == b.resolve()
    return str(a) == str(b)
