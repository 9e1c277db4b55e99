"""Give the memory of ended executions back to the system.

A session's token ids are Python lists: growing one to 200k ids reallocates it again and again,
and glibc, whose mmap threshold rises as large blocks are freed, ends up serving those blocks from
its heap. Freed, they stay in the heap, counted in the proxy's RSS until ``malloc_trim`` hands the
free pages back. ``TrimAfterSeals`` calls it at most once per ``every_s``, after executions were
sealed (their sessions dropped). Without glibc (another libc) it does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)


def _malloc_trim():  # -> a callable, or None
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


_TRIM = _malloc_trim()


class TrimAfterSeals:
    def __init__(self, every_s: float = 1.0):
        self.every_s = every_s
        self.num_trims = 0
        self._pending = False

    def sealed(self) -> None:
        """An execution's sessions were dropped: trim soon (once for a burst of seals)."""
        if _TRIM is None or self._pending:
            return
        self._pending = True
        asyncio.get_running_loop().call_later(self.every_s, self._trim)

    def _trim(self) -> None:
        self._pending = False
        assert _TRIM is not None
        _TRIM(0)
        self.num_trims += 1
