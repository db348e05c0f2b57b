"""Giving the host memory that loading and compiling freed back to the operating system.

1. Loading quantizes float kernels on the host and XLA:CPU compiles each step program on its own threads;
   both free what they allocated, but glibc keeps freed memory in its per-thread arenas unless it sits at
   an arena's top. On the 124.7M model with int8 weights and ten step programs that was about 300 MB of
   the server's resident memory, held for its whole life (docs/quantization.md, "Resident memory").
2. `release_freed_memory` asks glibc (`malloc_trim(0)`, which also returns whole free pages inside every
   arena) to hand it back, once, when warm-up has finished. It takes well under a second and changes
   nothing the program can see. Elsewhere (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys


@functools.cache
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def resident_anonymous_bytes() -> int | None:
    """This process's anonymous resident memory (heap, arenas, buffers), from /proc; None where absent."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def release_freed_memory() -> int | None:
    """Return freed heap memory to the OS; the bytes of resident memory that gave back (None: unsupported)."""
    trim = _malloc_trim()
    if trim is None:
        return None
    before = resident_anonymous_bytes()
    trim(0)
    after = resident_anonymous_bytes()
    if before is None or after is None:
        return None
    return max(0, before - after)
