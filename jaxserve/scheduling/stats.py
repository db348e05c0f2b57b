"""Engine counters for the log and /metrics: tokens in and out, finishes by reason, and the batching a load
got (steps, and the sequences and tokens they held)."""

from __future__ import annotations

import dataclasses
import time

from jaxserve.scheduling.step import StepPlan


@dataclasses.dataclass
class EngineStats:
    prompt_tokens: int = 0  # prefilled tokens: cache hits excluded, recomputation after preemption included
    generation_tokens: int = 0
    finished: dict = dataclasses.field(default_factory=dict)
    started: float = dataclasses.field(default_factory=time.time)
    # Device steps launched, and the sequences and tokens they held (padding excluded). Their ratios are the
    # batching a load got: sequences per step is what continuous batching raises with concurrency.
    steps: int = 0
    step_sequences: int = 0
    step_tokens: int = 0

    def count_step(self, step: StepPlan) -> None:
        self.steps += 1
        self.step_sequences += len(step.seqs)
        self.step_tokens += step.num_tokens
        self.prompt_tokens += sum(seq.num_tokens for seq in step.seqs if seq.is_prefill)
