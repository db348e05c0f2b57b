"""Multi-host start and the per-step hand-off from the leader process to the others.

1. `initialize` calls `jax.distributed.initialize` once, before anything touches a device, from
   `--distributed-coordinator HOST:PORT --num-processes N --process-id I` or the environment variables
   JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID. `auto` lets JAX detect the cluster
   (Cloud TPU pod slices, SLURM, Open MPI). After it, `jax.devices()` lists every host's devices.
2. Process 0 (the leader) runs the scheduler and, where there is one, the HTTP server. Every jitted
   step is one SPMD program over all hosts, so every process must call it with the same inputs in the
   same order. The leader therefore broadcasts each step before running it: a fixed-size header
   (step or end, token bucket, logits flag) and then the two packed host batch buffers, both with
   `multihost_utils.broadcast_one_to_all`. Followers sit in `StepChannel.receive` and run what arrives.
3. Why broadcast rather than run the same scheduler everywhere: requests arrive over HTTP at the leader
   only, with timing that differs between hosts (arrivals, aborts, client disconnects), so a replicated
   scheduler would need the same inputs broadcast anyway, and would have to stay bit-for-bit in step.
   The packed batch is a few KB per step; one broadcast is cheaper than keeping two schedulers honest.
"""

from __future__ import annotations

import logging
import os

import jax
import numpy as np

logger = logging.getLogger(__name__)

END, STEP = 0, 1  # header kinds
_initialized = False


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """Join the distributed runtime when asked to (flags or env); returns whether this is a multi-process run."""
    global _initialized
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and os.environ.get("JAX_NUM_PROCESSES"):
        num_processes = int(os.environ["JAX_NUM_PROCESSES"])
    if process_id is None and os.environ.get("JAX_PROCESS_ID"):
        process_id = int(os.environ["JAX_PROCESS_ID"])
    if coordinator is None:
        if num_processes not in (None, 1) or process_id not in (None, 0):
            raise ValueError("--num-processes / --process-id need --distributed-coordinator HOST:PORT (or auto)")
        return False
    if _initialized:
        return jax.process_count() > 1
    if coordinator == "auto":  # JAX detects Cloud TPU, SLURM, Open MPI, ... and fills in everything
        coordinator = None
    elif num_processes is None or process_id is None:
        raise ValueError("--distributed-coordinator HOST:PORT needs --num-processes and --process-id")
    elif not 0 <= process_id < num_processes:
        raise ValueError(f"process_id {process_id} must be in [0, {num_processes})")
    # CPU collectives across processes need an implementation; gloo ships with jaxlib. (Only the CPU
    # backend reads this option, so it is harmless on GPU and TPU.)
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception:  # noqa: BLE001 - a jax without the option uses its default
        pass
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)
    _initialized = True
    logger.info("joined the distributed runtime: process %d of %d, %d local / %d global devices",
                jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count())
    return jax.process_count() > 1


def shutdown() -> None:
    """Leave the distributed runtime (a barrier with the other processes), if this process joined it.

    Process 0 hosts the coordination service: if it vanished first, the followers still connected to it
    would abort. Leaving together lets everyone exit cleanly; call it where a process may be killed
    right after (the server re-raises SIGTERM once it has shut down).
    """
    global _initialized
    if _initialized:
        _initialized = False
        jax.distributed.shutdown()


def is_leader() -> bool:
    return jax.process_index() == 0


class StepChannel:
    """Leader -> followers, once per jitted step: (kind, bucket, flag) then the batch pytree."""

    def __init__(self):
        self.active = jax.process_count() > 1

    def send(self, kind: int, size: int = 0, flag: int = 0, batch=None) -> None:
        if not self.active:
            return
        if kind == END:
            logger.info("releasing the follower processes")
        _broadcast(np.array([kind, size, flag], np.int32))
        if batch is not None:
            self.send_batch(batch)

    def send_batch(self, batch) -> None:
        """One more pytree of the step the header announced (its flag says so to the followers)."""
        if self.active:
            _broadcast(batch)

    def receive_header(self) -> tuple[int, int, int]:
        kind, size, flag = (int(v) for v in _broadcast(np.zeros(3, np.int32)))
        return kind, size, flag

    def receive_batch(self, template):
        """The leader's batch; `template` has the same structure and shapes (its values are ignored)."""
        return _broadcast(template)


def _broadcast(tree):
    from jax.experimental import multihost_utils
    return multihost_utils.broadcast_one_to_all(tree)
