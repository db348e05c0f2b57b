"""LoRA through the whole engine (issue 31, items 1 and 2): `LLM.generate(..., lora_request=...)` as vLLM has
it, over the fixtures' tiny Llama (tests/lora_model.py) with two device slots for four adapters.

- Every adapter's greedy continuation equals the peft golden, with all of them and the base model queued at
  once: the requests whose adapter finds no free slot wait (never fail) and take a slot as others finish.
- Nothing compiles after warm-up while adapters are loaded into slots, swapped and mixed; nothing leaks.
- The prefix cache shares a prompt's pages under the same adapter only, never across adapters or with the
  base model; a preempted request is recomputed under its own adapter.
- Bad adapters are refused by name (DoRA, modules_to_save, rank above the slots'), before anything is queued.
"""

import shutil

import pytest

from jaxserve import LLM, LoRARequest, SamplingParams
from jaxserve.lora.adapter import LoRAError
from tests.lora_model import ADAPTERS, LORA, golden_tokens, servable_base
from tests.page_checks import assert_pages_released

GREEDY = SamplingParams(temperature=0, max_tokens=16)


def lora(name: str, index: int) -> LoRARequest:
    return LoRARequest(name, index + 1, str(LORA / name))


REQUESTS = {name: lora(name, i) for i, name in enumerate(ADAPTERS)}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    base = servable_base(tmp_path_factory.mktemp("lora") / "base")
    # Buckets of their own (the run shares a compilation cache); page size 8: the 48-token prompt is 6 pages.
    return LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=3, max_num_seqs=4,
               page_size=8, max_model_len=80, max_num_batched_tokens=136, token_buckets=(4, 136))


def test_mixed_adapters_match_peft_with_fewer_slots_than_adapters(llm):
    prompt, _ = golden_tokens("base")
    names = ["base", *ADAPTERS, "r4_qv", "base"]
    outputs = llm.generate([prompt] * len(names), GREEDY,
                           lora_request=[REQUESTS.get(name) for name in names])
    for name, output in zip(names, outputs):
        assert output.outputs[0].token_ids == golden_tokens(name)[1], name
    engine = llm.engine
    assert engine.compilations_since_warmup == 0
    assert engine.lora.loads >= 4 and engine.lora.slots_in_use == 0  # slots were refilled as requests finished
    assert_pages_released(engine.scheduler)


def test_prefix_cache_is_keyed_by_adapter(llm):
    prompt, _ = golden_tokens("base")
    llm.reset_prefix_cache()
    first = llm.generate(prompt, GREEDY, lora_request=REQUESTS["r8_all"])[0]
    same = llm.generate(prompt, GREEDY, lora_request=REQUESTS["r8_all"])[0]
    other = llm.generate(prompt, GREEDY, lora_request=REQUESTS["r4_qv"])[0]
    base = llm.generate(prompt, GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert same.num_cached_tokens == 40  # 5 of the prompt's 6 pages (the last token is always computed)
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    # The same prompt under another adapter was computed afresh, and so gives that adapter's answer.
    assert other.outputs[0].token_ids == golden_tokens("r4_qv")[1]
    assert base.outputs[0].token_ids == golden_tokens("base")[1]
    assert_pages_released(llm.engine.scheduler)


def test_preempted_requests_recompute_under_their_adapter(tmp_path):
    """Too few pages for everything at once: the newest requests are preempted and recomputed, each still
    under its own adapter."""
    base = servable_base(tmp_path / "base")
    # Its own pool and adapter slots are its own programs: one bucket compiles one (preemption is the
    # scheduler's; the 4-token bucket's decodes under adapters are the module engine's tests).
    small = LLM(str(base), enable_lora=True, max_loras=4, max_lora_rank=8, max_num_seqs=4, page_size=8,
                max_model_len=80, max_num_batched_tokens=136, token_buckets=(136,), num_pages=26,
                enable_prefix_caching=False)
    prompt, _ = golden_tokens("base")
    outputs = small.generate([prompt] * 4, GREEDY, lora_request=[REQUESTS[name] for name in ADAPTERS])
    for name, output in zip(ADAPTERS, outputs):
        assert output.outputs[0].token_ids == golden_tokens(name)[1], name
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.compilations_since_warmup == 0
    assert_pages_released(small.engine.scheduler)


@pytest.mark.parametrize("folder, reason", [("dora", "DoRA"), ("modules_to_save", "modules_to_save"),
                                            ("r8_all", "exceeds --max-lora-rank 4")])
def test_unservable_adapters_are_refused_by_name(folder, reason):
    from jaxserve.config import ModelConfig
    from jaxserve.lora.adapter import load_adapter

    config = ModelConfig.from_pretrained(LORA / "base")
    with pytest.raises(LoRAError, match=reason) as info:
        load_adapter(LORA / folder, config, max_rank=4)
    assert "adapter_config.json" in str(info.value)


def test_bad_adapter_fails_the_call_and_queues_nothing(llm, tmp_path):
    prompt, _ = golden_tokens("base")
    broken = tmp_path / "broken"
    shutil.copytree(LORA / "r4_qv", broken)
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(LoRAError, match="could not be read as safetensors"):
        llm.generate([prompt, prompt], GREEDY, lora_request=[REQUESTS["r4_qv"], LoRARequest("broken", 9, broken)])
    with pytest.raises(LoRAError, match="DoRA"):
        llm.generate(prompt, GREEDY, lora_request=LoRARequest("dora", 10, str(LORA / "dora")))
    assert not llm.engine.has_unfinished()
    # The engine goes on serving.
    assert llm.generate(prompt, GREEDY, lora_request=REQUESTS["r4_qv"])[0].outputs[0].token_ids == \
        golden_tokens("r4_qv")[1]


def test_lora_request_needs_lora_enabled(stories_llm):
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        stories_llm.generate("Once", GREEDY, lora_request=REQUESTS["r4_qv"])


def test_unloading_an_adapter_lets_its_running_and_queued_requests_finish(llm):
    engine = llm.engine
    adapter = engine.lora.register("temporary", str(LORA / "r8_all"))
    prompt, expected = golden_tokens("r8_all")
    first = engine.add_request(prompt, GREEDY, lora_request=adapter)
    finished = {}

    def step():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids

    step()
    step()  # the first request is running
    second = engine.add_request(prompt, GREEDY, lora_request=adapter)  # queued
    engine.lora.unregister("temporary")
    assert engine.lora.lookup("temporary") is None
    while engine.has_unfinished():
        step()
    assert finished == {first: expected, second: expected}
    assert_pages_released(engine.scheduler)
