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
    # Speculative decoding, as vLLM counts it: sequences that verified drafts in a step, the drafts, those
    # that stood, and per draft position how often it stood.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list = dataclasses.field(default_factory=list)

    def count_drafts(self, drafted: int, accepted: int) -> None:
        """One sequence verified `drafted` drafts in a step and `accepted` of them stood."""
        self.spec_drafts += 1
        self.spec_draft_tokens += drafted
        self.spec_accepted_tokens += accepted
        if len(self.spec_accepted_per_pos) < drafted:
            self.spec_accepted_per_pos.extend([0] * (drafted - len(self.spec_accepted_per_pos)))
        for position in range(accepted):
            self.spec_accepted_per_pos[position] += 1

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Tokens each verification made, the drawn one included (vLLM's mean acceptance length)."""
        return 1 + self.spec_accepted_tokens / self.spec_drafts if self.spec_drafts else None

    def count_step(self, step: StepPlan) -> None:
        self.steps += 1
        self.step_sequences += len(step.seqs)
        self.step_tokens += step.num_tokens
        self.prompt_tokens += sum(seq.num_tokens for seq in step.seqs if seq.is_prefill)
