"""The program cache (jaxserve/program_cache.py): compiled programs stored and loaded by what they are
made of, never a stale one, and never an error that stops a start. A restarted engine loading every
program, and never storing one that JAX loaded from its own cache: tests/test_compilation_cache.py, in
fresh processes whose JAX cache the test controls (this suite's processes share one, see conftest.py)."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.execution import program_cache
from jaxserve.execution.program_cache import describe, ProgramCache, source_hash


def _donating_program():
    def step(cache, x):
        return cache + x, (cache * x).sum()

    return jax.jit(step, donate_argnums=0).lower(jnp.zeros(8), jnp.ones(8)).compile()


def test_a_stored_program_loads_and_computes_what_it_compiled_to(tmp_path):
    cache = ProgramCache(tmp_path)
    key = ProgramCache.key("step", (8,), "float32")
    assert cache.load(key, jax.devices()) is None
    cache.store(key, _donating_program())
    loaded = ProgramCache(tmp_path).load(key, jax.devices())  # as a restarted process finds it
    state = jnp.arange(8.0)
    new_state, total = loaded(state, jnp.full(8, 2.0))
    np.testing.assert_array_equal(new_state, np.arange(8.0) + 2)
    assert float(total) == 2 * sum(range(8))
    assert state.is_deleted()  # the donation survived the round trip: the state is updated in place
    assert ProgramCache(tmp_path).load(ProgramCache.key("step", (16,), "float32"), jax.devices()) is None


def test_keys_are_the_same_in_every_process_and_differ_with_the_program():
    mesh_fn = jax.numpy.zeros  # a function: its repr carries an address, which must not reach the key
    assert "0x" not in describe(mesh_fn) and describe(mesh_fn) == describe(jax.numpy.zeros)
    a = ProgramCache.key(jax.ShapeDtypeStruct((4, 8), jnp.float32), mesh_fn, 16)
    assert a == ProgramCache.key(jax.ShapeDtypeStruct((4, 8), jnp.float32), mesh_fn, 16)
    assert a != ProgramCache.key(jax.ShapeDtypeStruct((4, 8), jnp.bfloat16), mesh_fn, 16)
    assert a != ProgramCache.key(jax.ShapeDtypeStruct((4, 8), jnp.float32), mesh_fn, 32)


def test_any_edit_to_the_source_changes_the_code_hash(tmp_path):
    root = Path(__file__).resolve().parents[1]
    for package in ("jaxserve", "pallas_kernels", "sharding"):
        shutil.copytree(root / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    before = source_hash(tmp_path)
    assert before == source_hash(root)
    kernel = tmp_path / "pallas_kernels" / "blocked.py"
    kernel.write_text(kernel.read_text() + "\n# a comment is an edit too\n")
    assert source_hash(tmp_path) != before


def test_a_torn_entry_is_compiled_again_not_an_error(tmp_path, caplog):
    cache = ProgramCache(tmp_path)
    key = ProgramCache.key("torn")
    cache.store(key, _donating_program())
    path = next(cache.directory.glob("*.program"))
    path.write_bytes(path.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="jaxserve.execution.program_cache"):
        assert cache.load(key, jax.devices()) is None
    assert "unusable" in caplog.text
    assert ProgramCache(None).load(key, jax.devices()) is None  # off: nothing stored, nothing found
    ProgramCache(None).store(key, _donating_program())


def test_only_the_latest_code_versions_are_kept(tmp_path):
    for age, name in enumerate(["v1", "v2", "v3", "v4", "v5"]):
        (tmp_path / name).mkdir()
        os.utime(tmp_path / name, (1_000_000 + age, 1_000_000 + age))
    cache = ProgramCache(tmp_path)
    cache.store(ProgramCache.key("now"), _donating_program())
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert len(kept) == program_cache.CODE_VERSIONS_KEPT and cache.directory.name in kept
    assert kept == sorted([cache.directory.name, "v5", "v4", "v3"])
