"""The ragged step batch: its fields, how the host packs them, and how the jitted step unpacks them.

1. A step holds `tokens` new tokens (padded to a bucket) of at most `seqs` sequences, contiguous per
   sequence (`cu_q_lens`). `BatchLayout` fixes every field's shape for one (tokens, seqs) bucket pair.
2. `BatchBuilder.build` fills the fields from the scheduler's chunks with numpy, vectorised over the
   chunks, and packs them into two flat host buffers (int32 and float32): one transfer each per step,
   and one broadcast each to the follower processes of a multi-host run. It keeps a per-slot mirror of
   the page tables and copies only the pages a sequence gained since the last step, so host work per
   step follows what changed, not context length.
3. Inside the jitted step, `BatchLayout.unpack` slices the buffers back into a `StepBatch` (static
   offsets: free).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kv_cache import NULL_PAGE
from jaxserve.sampling import SamplingArrays
from jaxserve.scheduler import ScheduledChunk


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepBatch:
    tokens: jax.Array  # [T] int32 new token ids (0 for padding, and where from_prev says otherwise)
    from_prev: jax.Array  # [T] int32 row of the previous step's samples that is this token; -1: use tokens
    positions: jax.Array  # [T] int32 position of each token in its sequence (0 for padding)
    write_index: jax.Array  # [T] int32 flat KV slot (page * page_size + offset); padding -> the null page
    cu_q_lens: jax.Array  # [S + 1] int32 first token row of each sequence; padding sequences are empty
    kv_lens: jax.Array  # [S] int32 tokens in the cache per sequence after this step; 0 for padding
    page_tables: jax.Array  # [S, max_pages] int32 page ids per sequence (null page beyond its length)
    sample_index: jax.Array  # [S] int32 row of each sequence's last token, whose logits are sampled
    sampling: SamplingArrays  # [S] rows


# (name, length in units of T, S, S + 1 or S * max_pages): the int32 buffer, then the float32 one.
_INT_FIELDS = (("tokens", "T"), ("from_prev", "T"), ("positions", "T"), ("write_index", "T"),
               ("cu_q_lens", "S+1"), ("kv_lens", "S"), ("sample_index", "S"), ("page_tables", "SP"),
               ("top_k", "S"), ("seed", "2S"), ("step", "S"))
_FLOAT_FIELDS = (("temperature", "S"), ("top_p", "S"), ("min_p", "S"))


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    tokens: int  # T: the token bucket
    seqs: int  # S: sequence rows
    max_pages: int

    def _size(self, unit: str) -> int:
        return {"T": self.tokens, "S": self.seqs, "S+1": self.seqs + 1, "SP": self.seqs * self.max_pages,
                "2S": 2 * self.seqs}[unit]

    def _offsets(self, fields) -> dict[str, tuple[int, int]]:
        out, at = {}, 0
        for name, unit in fields:
            out[name] = (at, at + self._size(unit))
            at += self._size(unit)
        return out

    @property
    def int_size(self) -> int:
        return sum(self._size(u) for _, u in _INT_FIELDS)

    @property
    def float_size(self) -> int:
        return sum(self._size(u) for _, u in _FLOAT_FIELDS)

    def views(self, ints: np.ndarray, floats: np.ndarray) -> dict[str, np.ndarray]:
        """Named views into the two buffers (host side: writing a view fills the buffer)."""
        out = {n: ints[a:b] for n, (a, b) in self._offsets(_INT_FIELDS).items()}
        out.update({n: floats[a:b] for n, (a, b) in self._offsets(_FLOAT_FIELDS).items()})
        out["page_tables"] = out["page_tables"].reshape(self.seqs, self.max_pages)
        out["seed"] = out["seed"].reshape(self.seqs, 2)
        return out

    def empty(self) -> tuple[np.ndarray, np.ndarray]:
        """A batch with no sequences: every token is padding writing to the null page (warm-up, followers)."""
        ints, floats = np.zeros(self.int_size, np.int32), np.zeros(self.float_size, np.float32)
        v = self.views(ints, floats)
        v["from_prev"][:] = -1
        v["top_p"][:] = 1.0
        return ints, floats

    def unpack(self, ints: jax.Array, floats: jax.Array) -> StepBatch:
        """Inside the jitted step: the buffers as a StepBatch."""
        i = {n: ints[a:b] for n, (a, b) in self._offsets(_INT_FIELDS).items()}
        f = {n: floats[a:b] for n, (a, b) in self._offsets(_FLOAT_FIELDS).items()}
        sampling = SamplingArrays(temperature=f["temperature"], top_k=i["top_k"], top_p=f["top_p"],
                                  min_p=f["min_p"], seed=jax.lax.bitcast_convert_type(i["seed"], jnp.uint32)
                                  .reshape(self.seqs, 2), step=i["step"])
        return StepBatch(tokens=i["tokens"], from_prev=i["from_prev"], positions=i["positions"],
                         write_index=i["write_index"], cu_q_lens=i["cu_q_lens"], kv_lens=i["kv_lens"],
                         page_tables=i["page_tables"].reshape(self.seqs, self.max_pages),
                         sample_index=i["sample_index"], sampling=sampling)


class BatchBuilder:
    """Host side of the step batch; owned by the runner, called from the engine thread only."""

    def __init__(self, max_num_seqs: int, max_pages: int, page_size: int):
        self.max_pages = max_pages
        self.page_size = page_size
        self.tables = np.full((max_num_seqs, max_pages), NULL_PAGE, np.int32)  # each slot's pages
        self._owner: list[tuple[int, int] | None] = [None] * max_num_seqs  # (id(request), epoch) per row
        self._synced = [0] * max_num_seqs  # pages of the owner already copied into its row

    def _sync_pages(self, chunk: ScheduledChunk) -> None:
        request, slot = chunk.request, chunk.request.slot
        owner = (id(request), request.epoch)
        if self._owner[slot] != owner:  # a new occupant (or the same request re-admitted after preemption)
            self._owner[slot], self._synced[slot] = owner, 0
            self.tables[slot] = NULL_PAGE
        pages, done = request.pages, self._synced[slot]
        if len(pages) > done:
            self.tables[slot, done:len(pages)] = pages[done:]
            self._synced[slot] = len(pages)

    def build(self, chunks: list[ScheduledChunk], layout: BatchLayout) -> tuple[np.ndarray, np.ndarray]:
        n = len(chunks)
        ints, floats = layout.empty()
        v = layout.views(ints, floats)
        for chunk in chunks:
            self._sync_pages(chunk)
        lens = np.fromiter((c.num_tokens for c in chunks), np.int32, n)
        starts = np.fromiter((c.start for c in chunks), np.int32, n)
        slots = np.fromiter((c.request.slot for c in chunks), np.int32, n)
        cu = v["cu_q_lens"]
        np.cumsum(lens, out=cu[1:n + 1])
        total = int(cu[n])
        cu[n + 1:] = total
        seq = np.repeat(np.arange(n), lens)  # the sequence of each real token
        positions = starts[seq] + (np.arange(total, dtype=np.int32) - cu[seq])
        v["positions"][:total] = positions
        pages = self.tables[slots[seq], positions // self.page_size]
        v["write_index"][:total] = pages * self.page_size + positions % self.page_size
        tokens: list[int] = []
        for chunk in chunks:
            if chunk.token_ids is None:  # the token is still on the device: the step reads it there
                v["from_prev"][len(tokens)] = chunk.prev_row
                tokens.append(0)
            else:
                tokens.extend(chunk.token_ids)
        v["tokens"][:total] = tokens
        v["kv_lens"][:n] = starts + lens
        v["sample_index"][:n] = cu[1:n + 1] - 1
        v["page_tables"][:n] = self.tables[slots]
        params = [c.request.params for c in chunks]
        v["temperature"][:n] = [p.temperature for p in params]
        v["top_p"][:n] = [p.top_p for p in params]
        v["min_p"][:n] = [p.min_p for p in params]
        v["top_k"][:n] = [p.top_k for p in params]
        v["seed"][:n] = np.array([c.request.seed_words for c in chunks], np.uint32).view(np.int32).reshape(n, 2)
        v["step"][:n] = [max(c.sample_step, 0) for c in chunks]
        return ints, floats
