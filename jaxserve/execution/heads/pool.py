"""The pool head: embeddings from the same ragged step that generates (`--runner pooling`, `jaxserve/pooling/`).

1. Its one batch field (`PoolBatch.kind`) is each sequence row's pooling (last token, mean, CLS), copied
   from the span's head setting (`ScheduledSeq.head_setting`, the request's `PooledPrompt.setting`).
2. On the device it pools each sequence row's share of the step from the hidden states after the final
   norm (`jaxserve/pooling/device.py`): one float32 row per sequence, fixed shapes; no LM head runs and
   nothing is drawn. It keeps no state, and the samples pass through untouched (a prompt to embed never
   reads a pending token).
3. On the host the engine reads the pooled rows a step later and folds each into its request
   (`PooledPrompt`): a prompt longer than one step's budget arrives in chunks. The span that ends the prompt
   (the one the scheduler marks as followed by a result, `ScheduledSeq.samples`) finishes the request
   with an `EmbeddingRequestOutput`.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxserve.execution.batch import StepBatch
from jaxserve.execution.step_io import OutputHead, to_host
from jaxserve.packing import per_seq
from jaxserve.pooling.device import pool_rows
from jaxserve.pooling.params import EmbeddingOutput, EmbeddingRequestOutput, PooledPrompt
from jaxserve.scheduling.request import Request
from jaxserve.scheduling.step import StepPlan


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PoolBatch(StepBatch):
    """The pool head's input, after StepBatch's."""
    kind: jax.Array = per_seq(source="head_setting")  # [S] int32 pooling kind (LAST, MEAN, CLS: pooling/config.py)


def pooled_request(prompt_ids: list[int], pooling: PooledPrompt, request_id: str, prompt: str | None) -> list[Request]:
    """A prompt to embed as the one request the scheduler runs: its prompt is prefilled and pooled; it draws
    nothing (no sampling settings), and its length limit leaves room for the result after the prompt."""
    return [Request(request_id, prompt_ids, None, seed=0, max_len=len(prompt_ids) + 1, prompt=prompt,
                    head_state=pooling)]


@dataclasses.dataclass(frozen=True)
class PoolHead(OutputHead):
    batch = PoolBatch

    def run(self, hidden, logits_fn, batch: PoolBatch, state, inputs, layout, rows: int, tokens, seq_of_token):
        return state.head, state.samples, pool_rows(hidden, batch.cu_q_lens, batch.kind, rows)

    def copy_to_host(self, result: jax.Array) -> None:
        result.copy_to_host_async()

    def ready(self, result: jax.Array) -> bool:
        return result.is_ready()

    def read(self, result: jax.Array, step: StepPlan) -> np.ndarray:
        """[rows, hidden] float32 each sequence row's pooled hidden states."""
        return to_host(result)[:len(step.seqs)]

    def update(self, tracker, step: StepPlan, read: np.ndarray) -> list[EmbeddingRequestOutput]:
        """Fold each chunk's pooled row into its request; the chunk that ends the prompt finishes it."""
        outputs = []
        for row, seq, request in tracker.live_rows(step):
            pooling: PooledPrompt = request.head_state
            pooling.add(read[row], seq.first_chunk, seq.start, last_chunk=seq.samples)
            if not seq.samples:
                continue
            tracker.scheduler.accept_draws(request, seq, 0)
            vector = pooling.finish(request.num_prompt_tokens)
            tracker.finish(request, "stop")
            outputs.append(EmbeddingRequestOutput(request.request_id, EmbeddingOutput(vector.tolist()),
                                                  request.prompt_ids, prompt=request.prompt,
                                                  queue_seconds=request.queue_seconds,
                                                  num_cached_tokens=request.num_cached_tokens or 0))
        return outputs
