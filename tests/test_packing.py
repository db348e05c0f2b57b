"""The step's device batch: its transfer buffers derived from the field declarations (jaxserve/packing.py),
filled by the batch builder from a plain-data step, and read back as the jitted step reads them."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.execution.batch import BatchBuilder, BatchLayout, StepBatch
from jaxserve.execution.heads.draw import DrawHead
from jaxserve.packing import Packing, packed, per_seq, per_token
from jaxserve.sampling.params import ADD_BIAS, ALLOWED, SamplingParams
from jaxserve.scheduling.step import ScheduledSeq, StepPlan


@dataclasses.dataclass
class Inner:
    scale: jax.Array = per_seq(np.float32, fill=1.0, source="params.temperature")  # [S] float32
    words: jax.Array = packed("S,2", np.uint32)  # [S, 2] uint32


@dataclasses.dataclass
class Toy:
    ids: jax.Array = per_token(fill=-1)  # [T] int32
    rows: jax.Array = packed("S+1")  # [S + 1] int32
    flag: jax.Array = packed("")  # [] int32
    spare: jax.Array = per_seq(fill="R")  # [S] int32, padding rows point at row R
    inner: Inner


def test_buffers_views_and_unpacking_follow_the_declarations():
    packing = Packing(Toy, {"T": 4, "S": 2, "R": 7})
    assert (packing.int_size, packing.float_size) == (4 + 3 + 1 + 2 + 4, 2)
    ints, floats = packing.empty()
    host = packing.views(ints, floats)
    assert list(host.ids) == [-1] * 4 and list(host.spare) == [7, 7] and list(host.inner.scale) == [1.0, 1.0]
    host.ids[:2] = [5, 6]
    host.flag[...] = 1
    host.inner.words[1] = [0xFFFFFFFF, 3]  # uint32 values beyond int32's range survive the int32 buffer
    device = packing.unpack(jnp.asarray(ints), jnp.asarray(floats))
    assert device.inner.words.dtype == jnp.uint32 and device.flag.shape == ()
    np.testing.assert_array_equal(device.ids, [5, 6, -1, -1])
    np.testing.assert_array_equal(device.inner.words, [[0, 0], [0xFFFFFFFF, 3]])
    assert int(device.flag) == 1
    assert [path for path, _ in packing.sourced("inner")] == [("inner", "scale")]
    fresh, _ = packing.empty()
    assert fresh[0] == -1 and fresh is not ints  # each step gets its own buffers


def test_a_new_per_sequence_field_is_one_declaration():
    """What adding an input to the step takes: the field, with its shape, fill and source. The offsets, the
    buffer sizes, the views and the builder's copy all follow from it."""
    @dataclasses.dataclass
    class WithTypicalP(StepBatch):
        typical_p: jax.Array = per_seq(np.float32, fill=1.0, source="params.top_p")  # [S] float32, 1 = off

    layout = BatchLayout(tokens=8, seqs=2, max_pages=4, bias_entries=2, scratch_slot=2)
    base = layout.packing
    grown = Packing(WithTypicalP, base.dims)
    assert grown.float_size == base.float_size + 2 and grown.int_size == base.int_size
    assert ("typical_p",) in [path for path, _ in grown.sourced()]
    assert list(grown.views(*grown.empty()).typical_p) == [1.0, 1.0]


def test_the_builder_fills_the_batch_from_a_plain_step():
    layout = BatchLayout(tokens=8, seqs=2, max_pages=4, bias_entries=3, scratch_slot=2, head=DrawHead(top=2))
    builder = BatchBuilder(max_num_seqs=2, max_pages=4, page_size=4)
    penalised = SamplingParams(temperature=0.5, top_k=3, seed=9, logprobs=2, presence_penalty=0.5,
                               logit_bias={7: 2.0}, allowed_token_ids=[7, 8], max_tokens=None)
    step = StepPlan.of([
        ScheduledSeq.for_sequence(1, [5, 6], 0, [10, 11, 12, 13, 14], params=penalised, seed=9),
        ScheduledSeq.for_sequence(0, [9], 2, [20]),
    ])
    ints, floats = builder.build(step, layout)
    b = layout.packing.views(ints, floats)
    np.testing.assert_array_equal(b.tokens, [10, 11, 12, 13, 14, 20, 0, 0])
    np.testing.assert_array_equal(b.positions, [0, 1, 2, 3, 4, 2, 0, 0])
    # Flat KV slots: page * 4 + offset, from each sequence's own page-table row; padding to the null page.
    np.testing.assert_array_equal(b.write_index, [20, 21, 22, 23, 24, 38, 0, 0])
    np.testing.assert_array_equal(b.cu_q_lens, [0, 5, 6])
    np.testing.assert_array_equal(b.kv_lens, [5, 3])
    np.testing.assert_array_equal(b.row_index, [4, 5])  # no drafts: one draw row per sequence, its last token
    np.testing.assert_array_equal(b.row_seq, [0, 1])
    np.testing.assert_array_equal(b.page_tables, [[5, 6, 0, 0], [9, 0, 0, 0]])
    np.testing.assert_array_equal(b.slots, [1, 0])
    np.testing.assert_array_equal(b.logprobs, [2, -1])
    np.testing.assert_allclose(b.sampling.temperature, [0.5, 0.0])
    np.testing.assert_array_equal(b.sampling.top_k, [3, 0])
    np.testing.assert_array_equal(b.sampling.seed, [[0, 9], [0, 0]])
    p = b.processing
    assert int(p.active) == 1 and list(p.restrict) == [1, 0]
    np.testing.assert_allclose(p.presence, [0.5, 0.0])
    assert (list(p.bias_ids[0, :2]), list(p.bias_kinds[0, :2])) == ([7, 8], [ADD_BIAS | ALLOWED, ALLOWED])
    np.testing.assert_allclose(p.bias_values[0, :2], [2.0, 0.0])
    # The jitted step reads the same values back from the two buffers.
    device = layout.unpack(jnp.asarray(ints), jnp.asarray(floats))
    np.testing.assert_array_equal(device.write_index, b.write_index)
    np.testing.assert_array_equal(device.sampling.seed, np.array([[0, 9], [0, 0]], np.uint32))
