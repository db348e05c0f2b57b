"""LoRA admission in the scheduler alone (no model): adapters compete for device slots through the real
`LoRAManager` with a recording slot writer, so what a step would run under is checked without a device."""

from pathlib import Path

from jaxserve.config import CacheConfig, ModelConfig, SchedulerConfig
from jaxserve.lora.manager import LoRAConfig, LoRAManager
from jaxserve.lora.request import LoRARequest
from jaxserve.scheduling.scheduler import Scheduler
from tests.page_checks import assert_pages_released
from tests.test_scheduler import AsyncLoop, request

LORA = Path(__file__).parent / "fixtures" / "lora"


def make(max_loras: int = 1, prefix_caching: bool = False):
    writes = []
    manager = LoRAManager(LoRAConfig(max_loras=max_loras, max_lora_rank=8),
                          ModelConfig.from_pretrained(LORA / "base"),
                          lambda slot, adapter: writes.append((slot, adapter.config.path.name)))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_model_len=256, max_num_batched_tokens=64),
                          CacheConfig(page_size=4, num_pages=200, enable_prefix_caching=prefix_caching), manager)
    return scheduler, manager, writes


def drain(loop: AsyncLoop) -> None:
    while any(not r.finished for r in loop.requests.values()):
        loop.step()


def under(manager: LoRAManager, name: str, r, index: int = 1):
    r.lora = manager.resolve(LoRARequest(name, index, str(LORA / name)))
    return r


def test_a_request_waits_for_a_slot_while_base_requests_go_ahead():
    """One slot. b waits for it; c (no adapter) goes ahead; d, whose adapter is in the slot, still waits
    behind b, so requests for a resident adapter cannot hold the slot from b forever."""
    scheduler, manager, writes = make(max_loras=1)
    a = under(manager, "r4_qv", request("a", 8, 4), 1)
    b = under(manager, "r8_all", request("b", 8, 4), 2)
    c = request("c", 8, 4)
    d = under(manager, "r4_qv", request("d", 8, 4), 1)
    loop = AsyncLoop(scheduler)
    loop.add(a, b, c, d)
    first = loop.step()
    assert {loop.request(s).request_id: s.lora_slot for s in first.seqs} == {"a": 1, "c": 0}
    assert list(scheduler.waiting) == [b, d] and writes == [(1, "r4_qv")]
    drain(loop)
    # b got the slot once a was done with it, then d; every request ran under its own adapter.
    assert writes == [(1, "r4_qv"), (1, "r8_all"), (1, "r4_qv")]
    seen = {(loop.request(s).request_id, s.lora_slot) for plan in loop.plans for s in plan.seqs}
    assert seen == {("a", 1), ("b", 1), ("c", 0), ("d", 1)}
    assert manager.slots_in_use == 0
    assert_pages_released(scheduler)


def test_prefix_pages_are_shared_under_one_adapter_only():
    scheduler, manager, _ = make(max_loras=2, prefix_caching=True)
    loop = AsyncLoop(scheduler)
    loop.add(under(manager, "r4_qv", request("p", 17, 2), 1))
    drain(loop)
    # The same prompt (same name: same tokens) under another adapter, under none, and under the same one.
    other = under(manager, "r8_all", request("p", 17, 2), 2)
    base = request("p", 17, 2)
    same = under(manager, "r4_qv", request("p", 17, 2), 1)
    loop.add(other, base, same)
    loop.step()
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0 and same.num_cached_tokens == 16
    drain(loop)
    assert_pages_released(scheduler)
