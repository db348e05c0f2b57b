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

from jaxserve.scheduling.pages import NULL_PAGE
from jaxserve.sampling.logits import ADD_BIAS, ALLOWED, LogitsParams
from jaxserve.sampling.sampler import SamplingArrays
from jaxserve.scheduling.scheduler import ScheduledChunk


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepBatch:
    tokens: jax.Array  # [T] int32 new token ids (0 for padding, and where from_prev says otherwise)
    from_prev: jax.Array  # [T] int32 row of the previous step's samples that is this token; -1: use tokens
    positions: jax.Array  # [T] int32 position of each token in its sequence (0 for padding)
    write_index: jax.Array  # [T] int32 flat KV slot (page * page_size + offset); padding -> the null page
    token_kind: jax.Array  # [T] int32 0 padding, 1 prompt token, 2 output token (for the sampler state)
    prompt_target: jax.Array  # [T] int32 the prompt token after this one, for prompt logprobs; -1: none
    cu_q_lens: jax.Array  # [S + 1] int32 first token row of each sequence; padding sequences are empty
    kv_lens: jax.Array  # [S] int32 tokens in the cache per sequence after this step; 0 for padding
    page_tables: jax.Array  # [S, max_pages] int32 page ids per sequence (null page beyond its length)
    sample_index: jax.Array  # [S] int32 row of each sequence's last token, whose logits are sampled
    logprobs: jax.Array  # [S] int32 top logprobs wanted for the sampled token; -1: none at all
    constrained: jax.Array  # [] int32 1 when some row's draw is limited by a grammar mask (runner.py)
    sampling: SamplingArrays  # [S] rows
    processing: LogitsParams  # [S] rows


# (name, length in units of T, S, S + 1, S * max_pages, S * bias entries or 1): the int32 buffer, then
# the float32 one.
_INT_FIELDS = (("tokens", "T"), ("from_prev", "T"), ("positions", "T"), ("write_index", "T"),
               ("token_kind", "T"), ("prompt_target", "T"), ("cu_q_lens", "S+1"), ("kv_lens", "S"),
               ("sample_index", "S"), ("page_tables", "SP"), ("logprobs", "S"), ("top_k", "S"),
               ("seed", "2S"), ("step", "S"), ("slots", "S"), ("fresh", "S"), ("bias_ids", "SB"),
               ("bias_kinds", "SB"), ("restrict", "S"), ("active", "1"), ("constrained", "1"))
_FLOAT_FIELDS = (("temperature", "S"), ("top_p", "S"), ("min_p", "S"), ("presence", "S"), ("frequency", "S"),
                 ("repetition", "S"), ("bias_values", "SB"))


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    tokens: int  # T: the token bucket
    seqs: int  # S: sequence rows
    max_pages: int
    bias_entries: int  # B: logit-bias / allowed-token entries per row

    def _size(self, unit: str) -> int:
        return {"T": self.tokens, "S": self.seqs, "S+1": self.seqs + 1, "SP": self.seqs * self.max_pages,
                "SB": self.seqs * self.bias_entries, "2S": 2 * self.seqs, "1": 1}[unit]

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

    def _shaped(self, fields: dict) -> dict:
        for name in ("page_tables", "bias_ids", "bias_kinds", "bias_values"):
            if name in fields:
                fields[name] = fields[name].reshape(self.seqs, -1)
        fields["seed"] = fields["seed"].reshape(self.seqs, 2)
        return fields

    def views(self, ints: np.ndarray, floats: np.ndarray) -> dict[str, np.ndarray]:
        """Named views into the two buffers (host side: writing a view fills the buffer)."""
        out = {n: ints[a:b] for n, (a, b) in self._offsets(_INT_FIELDS).items()}
        out.update({n: floats[a:b] for n, (a, b) in self._offsets(_FLOAT_FIELDS).items()})
        return self._shaped(out)

    def empty(self, scratch_slot: int) -> tuple[np.ndarray, np.ndarray]:
        """A batch with no sequences: every token is padding writing to the null page (warm-up, followers).
        `scratch_slot` is the sampler-state row padding rows use."""
        ints, floats = np.zeros(self.int_size, np.int32), np.zeros(self.float_size, np.float32)
        v = self.views(ints, floats)
        v["from_prev"][:] = -1
        v["prompt_target"][:] = -1
        v["logprobs"][:] = -1
        v["slots"][:] = scratch_slot
        v["top_p"][:] = 1.0
        v["repetition"][:] = 1.0
        return ints, floats

    def unpack(self, ints: jax.Array, floats: jax.Array) -> StepBatch:
        """Inside the jitted step: the buffers as a StepBatch."""
        f = {n: ints[a:b] for n, (a, b) in self._offsets(_INT_FIELDS).items()}
        f.update({n: floats[a:b] for n, (a, b) in self._offsets(_FLOAT_FIELDS).items()})
        f = self._shaped(f)
        sampling = SamplingArrays(temperature=f["temperature"], top_k=f["top_k"], top_p=f["top_p"],
                                  min_p=f["min_p"], seed=jax.lax.bitcast_convert_type(f["seed"], jnp.uint32),
                                  step=f["step"])
        processing = LogitsParams(slots=f["slots"], fresh=f["fresh"], presence=f["presence"],
                                  frequency=f["frequency"], repetition=f["repetition"], bias_ids=f["bias_ids"],
                                  bias_values=f["bias_values"], bias_kinds=f["bias_kinds"],
                                  restrict=f["restrict"], active=f["active"][0])
        return StepBatch(tokens=f["tokens"], from_prev=f["from_prev"], positions=f["positions"],
                         write_index=f["write_index"], token_kind=f["token_kind"],
                         prompt_target=f["prompt_target"], cu_q_lens=f["cu_q_lens"], kv_lens=f["kv_lens"],
                         page_tables=f["page_tables"], sample_index=f["sample_index"], logprobs=f["logprobs"],
                         constrained=f["constrained"][0], sampling=sampling, processing=processing)


class BatchBuilder:
    """Host side of the step batch; owned by the runner, called from the engine thread only."""

    def __init__(self, max_num_seqs: int, max_pages: int, page_size: int):
        self.max_pages = max_pages
        self.page_size = page_size
        self.scratch_slot = max_num_seqs  # the sampler-state row of padding rows
        self.tables = np.full((max_num_seqs, max_pages), NULL_PAGE, np.int32)  # each slot's pages
        # (arrival, epoch) of each row's occupant: unique per admission. Not id(request): a finished request's
        # id can be reused by a new one, which would then inherit its stale page mirror.
        self._owner: list[tuple[int, int] | None] = [None] * max_num_seqs
        self._synced = [0] * max_num_seqs  # pages of the owner already copied into its row

    def _sync_pages(self, chunk: ScheduledChunk) -> None:
        request, slot = chunk.request, chunk.request.slot
        owner = (request.arrival, request.epoch)
        if self._owner[slot] != owner:  # a new occupant (or the same request re-admitted after preemption)
            self._owner[slot], self._synced[slot] = owner, 0
            self.tables[slot] = NULL_PAGE
        pages, done = request.pages, self._synced[slot]
        if len(pages) > done:
            self.tables[slot, done:len(pages)] = pages[done:]
            self._synced[slot] = len(pages)

    def build(self, chunks: list[ScheduledChunk], layout: BatchLayout,
              constrained: bool = False) -> tuple[np.ndarray, np.ndarray]:
        n = len(chunks)
        ints, floats = layout.empty(self.scratch_slot)
        v = layout.views(ints, floats)
        v["constrained"][0] = constrained
        for chunk in chunks:
            self._sync_pages(chunk)
        requests = [c.request for c in chunks]
        lens = np.fromiter((c.num_tokens for c in chunks), np.int32, n)
        starts = np.fromiter((c.start for c in chunks), np.int32, n)
        slots = np.fromiter((r.slot for r in requests), np.int32, n)
        cu = v["cu_q_lens"]
        np.cumsum(lens, out=cu[1:n + 1])
        total = int(cu[n])
        cu[n + 1:] = total
        seq = np.repeat(np.arange(n), lens)  # the sequence of each real token
        positions = starts[seq] + (np.arange(total, dtype=np.int32) - cu[seq])
        v["positions"][:total] = positions
        pages = self.tables[slots[seq], positions // self.page_size]
        v["write_index"][:total] = pages * self.page_size + positions % self.page_size
        prompt_lens = np.fromiter((r.num_prompt_tokens for r in requests), np.int32, n)
        v["token_kind"][:total] = np.where(positions < prompt_lens[seq], 1, 2)
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
        v["slots"][:n] = slots
        v["fresh"][:n] = [c.first for c in chunks]
        params = [r.params for r in requests]
        v["temperature"][:n] = [p.temperature for p in params]
        v["top_p"][:n] = [p.top_p for p in params]
        v["min_p"][:n] = [p.min_p for p in params]
        v["top_k"][:n] = [p.top_k for p in params]
        v["seed"][:n] = np.array([r.seed_words for r in requests], np.uint32).view(np.int32).reshape(n, 2)
        v["step"][:n] = [max(c.sample_step, 0) for c in chunks]
        v["logprobs"][:n] = [p.logprobs if p.logprobs is not None and c.samples else -1
                             for p, c in zip(params, chunks)]
        if any(p.processes_logits for p in params):
            self._processing(chunks, v)
        for i, chunk in enumerate(chunks):
            if chunk.request.params.prompt_logprobs is not None and chunk.is_prefill:
                self._prompt_targets(chunk, int(cu[i]), v)
        return ints, floats

    @staticmethod
    def _processing(chunks: list[ScheduledChunk], v: dict) -> None:
        v["active"][0] = 1
        for i, chunk in enumerate(chunks):
            p = chunk.request.params
            v["presence"][i], v["frequency"][i], v["repetition"][i] = (p.presence_penalty, p.frequency_penalty,
                                                                       p.repetition_penalty)
            ids, values, kinds = _bias_entries(chunk.request, chunk.sample_step)
            v["bias_ids"][i, :len(ids)] = ids
            v["bias_values"][i, :len(ids)] = values
            v["bias_kinds"][i, :len(ids)] = kinds
            v["restrict"][i] = p.allowed_token_ids is not None

    @staticmethod
    def _prompt_targets(chunk: ScheduledChunk, first_row: int, v: dict) -> None:
        """Each prompt row's next prompt token: the one whose logprob that row's logits give."""
        request = chunk.request
        end = min(chunk.start + chunk.num_tokens + 1, request.num_prompt_tokens)
        targets = request.token_ids[chunk.start + 1:end]
        v["prompt_target"][first_row:first_row + len(targets)] = targets


def _bias_entries(request, sample_step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A request's (ids, values, kinds) list: its logit_bias and allowed_token_ids (built once), plus -inf
    on its EOS and stop tokens while the token being drawn is one of its first `min_tokens`."""
    if request.bias_table is None:
        p = request.params
        entries: dict[int, list] = {t: [v, ADD_BIAS] for t, v in (p.logit_bias or {}).items()}
        for t in p.allowed_token_ids or ():
            entries.setdefault(t, [0.0, 0])[1] |= ALLOWED
        request.bias_table = (np.fromiter(entries, np.int32, len(entries)),
                              np.array([e[0] for e in entries.values()], np.float32),
                              np.array([e[1] for e in entries.values()], np.int32))
    ids, values, kinds = request.bias_table
    if 0 <= sample_step < request.params.min_tokens and request.suppress_ids:
        masked = np.asarray(request.suppress_ids, np.int32)
        ids = np.concatenate([ids, masked])
        values = np.concatenate([values, np.full(len(masked), -np.inf, np.float32)])
        kinds = np.concatenate([kinds, np.full(len(masked), ADD_BIAS, np.int32)])
    return ids, values, kinds
