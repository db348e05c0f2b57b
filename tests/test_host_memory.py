"""Host memory freed by loading and compiling goes back to the OS when warm-up ends (host_memory.py)."""

import logging
import platform
import threading

import pytest

from jaxserve.execution import compiler as compiler_module
from jaxserve.execution.batch import BatchLayout
from jaxserve.execution.compile_events import CompileEvents
from jaxserve.execution.compiler import StepCompiler
from jaxserve.execution.host_memory import release_freed_memory, resident_anonymous_bytes

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")


@glibc
def test_freed_blocks_in_the_middle_of_an_arena_go_back():
    """What a compile leaves: many mid-sized blocks freed, a few still live among them, so the arena's top
    never frees and glibc keeps the rest. On a thread of its own, as XLA's compile threads are."""
    held = []

    def fragment():
        blocks = [bytearray(32 << 10) for _ in range(4096)]  # 128 MB in 32 KB blocks, from a thread arena
        held.extend(blocks[15::16])  # every 16th stays alive, the last one among them
        del blocks

    worker = threading.Thread(target=fragment)
    worker.start()
    worker.join()
    before = resident_anonymous_bytes()
    released = release_freed_memory()
    after = resident_anonymous_bytes()
    assert released is not None and released >= 64 << 20, released
    assert after <= before - (64 << 20)
    assert len(held) == 256 and all(len(b) == 32 << 10 for b in held)  # what is live stays


def test_warmup_returns_freed_memory_once_every_program_is_built(monkeypatch, caplog):
    """With background warm-up the release comes after the last program, not after the first."""
    calls = []
    monkeypatch.setattr(compiler_module, "release_freed_memory", lambda: calls.append(list(built)) or 5 << 20)
    layouts = {tokens: BatchLayout(tokens=tokens, seqs=4, max_pages=2, bias_entries=1, scratch_slot=4)
               for tokens in (4, 16, 64)}
    compiler = StepCompiler(step=None, layouts=layouts, program_inputs=None, key_parts=(), devices=None,
                            min_bucket=4, events=CompileEvents())
    built = []
    with caplog.at_level(logging.INFO, logger="jaxserve.execution.compiler"):
        compiler.warmup(background=True, build=lambda layout: built.append(layout.tokens))
        assert compiler.warmup_done.wait(30)
    assert calls == [[4, 64, 16]]
    assert "returned 5 MB of host memory freed while loading and compiling to the OS" in caplog.text
