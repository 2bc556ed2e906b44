"""Keeping freed CPU memory for reuse (glibc's allocator), as PyTorch's CUDA caching allocator does on a GPU.

By default glibc serves each allocation above 128 KiB–32 MiB with a fresh ``mmap`` and returns it to
the system when freed, and trims the heap's free top: every batch's activations (hundreds of MB) then
arrive as untouched pages, and the kernel zero-fills them page by page on first touch. On this
project's 2-core CPU that is 19% of a batch-64 DeiT-tiny forward and 11% of a WikiText-103 language
model's training step (``bench/allocator.py``), and most of the round-to-round spread.
:func:`keep_freed_memory` serves every allocation from the heap and never trims it, so memory freed by
one step is reused, already touched, by the next. The process keeps its peak memory until it exits:
right for a training or analysis process, which reaches that peak again every step, not for a library
to impose on its host — so the command line calls it, and a library user opts in.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4
_TOP_PAD = 64 << 20  # grow the heap in 64 MiB steps: fewer brk calls
ENV = "NEUTRENO_MALLOC"  # "default": leave the allocator as it is; "keep" (or unset): keep freed memory


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse: no ``mmap`` for large blocks, no trimming of the heap.
    Call it early, before large tensors exist. A no-op (returns False) outside glibc (macOS, Windows,
    musl) or when the environment variable ``NEUTRENO_MALLOC=default`` is set; True once applied.

    Raises:
        ValueError: ``NEUTRENO_MALLOC`` set to another value (``off``, ``0``: an opt-out that was read as
            none, and the process-wide setting applied anyway).
    """
    setting = os.environ.get(ENV, "").strip().lower()
    if setting not in ("", "keep", "default"):
        raise ValueError(f"{ENV} must be 'default' (glibc's allocator as it is) or 'keep', got {setting!r}")
    if setting == "default" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    settings = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_TOP_PAD, _TOP_PAD))
    return all(libc.mallopt(parameter, value) == 1 for parameter, value in settings)
