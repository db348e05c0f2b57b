"""LoRA adapters under tensor parallelism (issue 31, item 4): with A and B split like their base layers (B
with q/k/v/gate/up's output columns, A with o/down's input rows, the latter's term added before the
all-reduce), a mixed ragged batch of the base model and four adapters matches the transformers + peft
goldens within 1e-4, greedy identical, as on one device (tests/test_lora_parity.py). tp 4 also replicates
the fixture's 2 KV heads."""

import pytest

from sharding import ParallelConfig
from tests.test_lora_parity import check, load_into, make_runner, run_sequences


@pytest.mark.parametrize("tp", [2, 4])
def test_mixed_adapters_match_peft_under_tensor_parallelism(tp):
    # One program, the prefill budget, for the decodes too: it compiles for seconds on a mesh of fake devices.
    runner = make_runner(ParallelConfig(tp, 1), token_buckets=(152,))
    assert runner.plan.tp == tp
    a = runner.lora.stack.b[0]["q_proj"]  # [slots, R, out]: split over the output columns
    assert a.sharding.shard_shape(a.shape)[2] == a.shape[2] // tp
    load_into(runner, {1: "r8_all", 2: "r4_qv", 3: "r4_mlp_alpha4", 4: "r8_rslora_attn"})
    cases = [("base", 0), ("r4_qv", 2), ("r8_all", 1), ("r4_mlp_alpha4", 3), ("r8_rslora_attn", 4)]
    results = run_sequences(runner, cases)
    for i, (name, _) in enumerate(cases):
        check(results[i], name)
