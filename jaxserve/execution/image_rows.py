"""The encoder rows a step places at its image tokens: one more step input, of fixed shape per token bucket.

1. `EncoderRows` is that input: up to R rows of encoder output (R = the bucket's tokens, at most the step's
   encoder budget), which row replaces each token's embedding (-1: its own), and for each image token the
   position of its image's last token, up to where it attends (a model whose image tokens see each other
   bidirectionally, Gemma 3; -1 elsewhere: causal).
2. `EncoderRowsBuilder.gather(step, tokens)` first runs the vision encoder's program (`vision.py`) for the
   step's images the encoder cache lacks (one call for all of them), then gathers, on the host, the rows of
   the plan's image chunks (`ScheduledSeq.images`) from the cache into that buffer, in span order. The runner
   then `place`s the three arrays on the mesh, replicated; a step without image tokens sends nothing: it
   reads a blank kept on the device. (Multi-host: the leader gathers and relays the host arrays, and every
   process places them the same way, `relay.py`; only the leader loads the encoder.)
3. Inside the step, `place_rows` swaps the rows in right after the token embedding (`step_program.py`), so
   every layer, the KV cache and the output heads see an image token as the encoder's row, as transformers'
   `masked_scatter` of the image features does.
"""

from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.scheduling.step import StepPlan


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EncoderRows:
    """(T = the token bucket, R = its encoder rows, H = the text model's hidden size)"""
    rows: jax.Array  # [R, H] the rows placed in this step, in the language model's dtype
    row_of_token: jax.Array  # [T] int32 the row that replaces each token's embedding; -1: the token's own
    span_ends: jax.Array  # [T] int32 position of the last token of the image a token is in; -1: none


def place_rows(embedded: jax.Array, rows: jax.Array, row_of_token: jax.Array) -> jax.Array:
    """embedded [N, H] with the image tokens' rows replaced by their encoder rows."""
    placed = rows[jnp.maximum(row_of_token, 0)].astype(embedded.dtype)
    return jnp.where((row_of_token >= 0)[:, None], placed, embedded)


class EncoderRowsBuilder:
    """Host side of `EncoderRows`; owned by the runner, called from the engine thread only."""

    def __init__(self, rows_per_step: int, hidden: int, dtype, sharding, cache, encoder, spans: bool):
        """`cache`: the encoder cache (`scheduling/encoder_cache.py`); `encoder`: the vision encoder's program
        (`vision.py`), run for the images of a step whose rows the cache lacks (both None where rows are only
        placed: a multi-host follower, `jaxserve plan`); `spans`: an image's tokens attend to each other
        (Gemma 3), through the attention's span ends."""
        self.spans = spans
        self.rows_per_step = rows_per_step
        self.hidden = hidden
        self.dtype = np.dtype(dtype)
        self.sharding = sharding
        self.cache = cache
        self.encoder = encoder
        self._blank: dict[int, EncoderRows] = {}

    def rows_for(self, tokens: int) -> int:
        return min(tokens, self.rows_per_step)

    def abstract(self, tokens: int) -> EncoderRows:
        shape = lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=self.sharding)
        return EncoderRows(shape((self.rows_for(tokens), self.hidden), self.dtype), shape((tokens,), jnp.int32),
                           shape((tokens,), jnp.int32))

    def warmup(self, tokens: int) -> EncoderRows:
        """Host rows for a warm-up batch (`BatchBuilder.warmup`): the first tokens an image whose tokens see
        each other, so the first request with an image does not pay the first run of that code (a kernel's
        span branch; XLA:CPU's one-off cost of a branch, Pallas' interpret mode compiling it)."""
        rows = self.empty(tokens)
        n = len(rows.rows)
        rows.row_of_token[:n], rows.span_ends[:n] = np.arange(n), n - 1
        return rows

    def empty(self, tokens: int) -> EncoderRows:
        """Host arrays of a program of `tokens` tokens with no image token in them (zero rows, -1 indices)."""
        return EncoderRows(np.zeros((self.rows_for(tokens), self.hidden), self.dtype), np.full(tokens, -1, np.int32),
                           np.full(tokens, -1, np.int32))

    def place(self, images: EncoderRows | None, tokens: int) -> EncoderRows:
        """The step input of a program of `tokens` tokens: `images` (host arrays) on the mesh, replicated;
        for None, the blank kept on the device."""
        if images is None:
            if tokens not in self._blank:
                self._blank[tokens] = self.place(self.empty(tokens), tokens)
            return self._blank[tokens]
        return jax.device_put(images, self.sharding)

    def encode_missing(self, step: StepPlan) -> None:
        """Run the encoder, in one call, for the step's images whose rows the cache lacks."""
        missing = self.cache.missing(chunk.content_hash for seq in step.seqs for chunk in seq.images)
        if missing:
            for content_hash, rows in zip(missing, self.encoder.encode([self.cache.pixels(h) for h in missing])):
                self.cache.store(content_hash, rows)

    def gather(self, step: StepPlan, tokens: int) -> EncoderRows | None:
        """The step's rows on the host for a program of `tokens` tokens (the scheduler kept them within the
        budget); None: the step has no image token."""
        if not any(seq.images for seq in step.seqs):
            return None
        self.encode_missing(step)
        out = self.empty(tokens)
        first_token = filled = 0
        for seq in step.seqs:
            for chunk in seq.images:
                at, n = first_token + chunk.token, chunk.count
                out.rows[filled:filled + n] = self.cache.rows(chunk.content_hash)[chunk.first_row:chunk.first_row + n]
                out.row_of_token[at:at + n] = np.arange(filled, filled + n, dtype=np.int32)
                out.span_ends[at:at + n] = chunk.last_position
                filled += n
            first_token += seq.num_tokens
        return out
