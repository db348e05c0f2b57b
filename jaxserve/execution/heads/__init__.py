"""Output heads: what a step produces, chosen once at start from the serving mode (`step_io.OutputHead`).

- `draw.py`: sampling, logprobs and draft verification (`--runner generate`);
- `pool.py`: embeddings (`--runner pooling`).
"""

from __future__ import annotations

from jaxserve.execution.heads.draw import DrawHead
from jaxserve.execution.heads.pool import PoolHead
from jaxserve.execution.step_io import OutputHead


def head_for(runner: str, top_logprobs: int) -> OutputHead:
    """The head of a serving mode (`pooling/config.py: resolve_runner`); `top_logprobs`: the most top
    logprobs a draw may return (`SamplerConfig.max_logprobs`)."""
    return PoolHead() if runner == "pooling" else DrawHead(top_logprobs)
