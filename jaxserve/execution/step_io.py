"""The step's contract: `step(params, state, inputs) -> (state, outputs)`, and the output heads behind it.

1. `StepState` is everything a step takes donated and hands back updated: the paged KV cache, the samples
   of the step before (the pending tokens the next step reads on the device) and the output head's own
   state (the draw head's sampler state). The runner keeps one, and replaces it with each step's.
2. `StepInputs` is everything else the step reads, fresh each step: the two packed batch buffers (the
   common `StepBatch` fields and the head's own, `batch.py`), the head's extra inputs (the draw head's
   grammar masks), the LoRA adapters' slot stacks and, for a vision model, the image encoder's rows placed at
   the image tokens of the ragged batch (`image_rows.py`). A later input is one more field here.
3. `StepOutputs` is what the step returns besides the state: the head's result, the step's tokens as it
   ran them (pending ones read from the device: what a draft model follows) and, when asked, the logits.
4. An `OutputHead` is chosen once at start from the model and the serving mode (`heads/`): it names its
   batch fields, its state, its device function (hidden states after the final norm -> its result) and,
   on the host, how its result is read back and how it advances the requests. A serving mode is a head,
   not a branch in the step program, the batch builder or the scheduler.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import jax
import numpy as np

from jaxserve.lora.delta import LoRAStack
from jaxserve.model.kv_cache import KVCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepState:
    """What a step takes donated and returns updated (R = max_num_seqs sequence rows)."""
    kv_cache: KVCache  # every layer's K/V pages
    samples: jax.Array  # [R] int32 each row's last standing token of the step before: the pending tokens
    head: Any = None  # the output head's state (the draw head's `SamplerState`; None for a head without one)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepInputs:
    """What a step reads, fresh each step (S = the layout's sequence rows, W = bitmask words per row)."""
    ints: Any  # [packing.int_size] int32 the batch's int fields (`BatchLayout.unpack`)
    floats: Any  # [packing.float_size] float32 its float fields
    masks: Any = None  # [S, W] int32 allowed-token bitmask per sequence row (a head that takes masks)
    lora: LoRAStack | None = None  # the adapters' slot stacks (`jaxserve/lora/slots.py`); None without LoRA
    images: Any = None  # `image_rows.EncoderRows` ([R, H] rows, [T] row per token, [T] span ends); None: no images


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepOutputs:
    """What a step returns besides its state (T = the token bucket)."""
    head: Any  # the output head's result (`DrawResults`, pooled rows)
    tokens: jax.Array  # [T] int32 the step's tokens as it ran them, the pending ones read on the device
    logits: jax.Array | None = None  # [T, vocab] float32 every row's logits, when the step was asked for them


class OutputHead:
    """What a step produces, and everything that follows from it. Subclasses are frozen dataclasses: a head is
    part of each program's static layout (`BatchLayout.head`), compared by value."""
    batch: ClassVar[type]  # the batch class: `StepBatch`'s common fields, then the head's own
    takes_masks: ClassVar[bool] = False  # `StepInputs.masks` is an input of its programs

    # ---- at start -------------------------------------------------------------------------------------
    def abstract_state(self, rows: int, vocab_size: int, sharding) -> Any:
        """Its part of `StepState`, as shapes with `sharding` (None: it keeps none)."""
        return None

    # ---- host, building a step ------------------------------------------------------------------------
    def fill(self, b, seqs: list, layout, seq_of) -> None:
        """Write its batch fields for the plan's sequences (`b`: numpy views of the buffers, the common
        fields filled; `seq_of`: the sequence of each real token). Fields that name a per-sequence source
        are copied already."""

    def fill_warmup(self, b, n: int, draws: int, every_option: bool) -> None:
        """Its fields of a warm-up batch of `n` sequences with `draws` draw rows each (`BatchBuilder.warmup`)."""

    # ---- device ---------------------------------------------------------------------------------------
    def run(self, hidden: jax.Array, logits_fn: Callable, batch, state: StepState, inputs: StepInputs, layout,
            rows: int, tokens: jax.Array, seq_of_token: jax.Array) -> tuple[Any, jax.Array, Any]:
        """hidden [T, H] after the final norm -> (its new state, the samples the next step reads [rows],
        its result). `logits_fn(hidden rows, float32=True)`: the LM head's raw logits, in float32 or (False)
        in the head's own dtype."""
        raise NotImplementedError

    # ---- host, reading a step -------------------------------------------------------------------------
    def copy_to_host(self, result) -> None:
        """Start copying what the host reads of `result` (at dispatch: the engine reads it a step later)."""

    def ready(self, result) -> bool:
        """The step is done (nothing would block on reading it)."""
        raise NotImplementedError

    def read(self, result, step) -> Any:
        """`result` on the host, for `update` (blocks until the step is done)."""
        raise NotImplementedError

    def update(self, tracker, step, read) -> list:
        """Advance the step's requests by what `read` returned: the one place a step's result reaches
        them (`RequestTracker`, `jaxserve/scheduling/update.py`). Returns the callers' outputs."""
        raise NotImplementedError


def to_host(x: jax.Array) -> np.ndarray:
    """A replicated output to numpy; in a multi-host run only this process's copy is addressable."""
    return np.asarray(x.addressable_data(0))
