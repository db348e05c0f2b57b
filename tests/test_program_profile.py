"""The static profile of a compiled step (`benchmarks/program_profile.py`, `jaxserve/execution/program_profile.py`).

1. A hand-written HLO module and GPU thunk sequence, small enough to count by hand, pin each rule: a gather
   of the embedding reads its rows, an in-place scatter into the KV pool writes its rows, the attention kernel
   reads sequences x context of the pool, a loop's condition runs once more than its body and both are
   launched from the host, a conditional counts its cheapest (or costliest) branch, kernels take the layer
   of the weights they read.
2. The engine's real step program for a tiny Llama, compiled for an H200 and a v6e (one small bucket each):
   the JSON contract, counts that add up, the KV cache never counted whole, and bytes at or above the
   minimum (every weight is read at least once and attention reads what the minimum counts of the KV: a
   profile below the minimum has lost a kernel's bytes).
3. XLA's autotuning results from a lease (`sharding/autotune.py`, `--autotune-results`): read, joined, and
   refused with a clear error before any compile when a file is missing, empty or not XLA's text; a file
   of the target's own key loaded into the H200 compile.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from jaxserve.execution.hlo_text import HloModule
from jaxserve.execution.program_profile import Assumptions, profile_program
from jaxserve.execution.thunks import parse_metadata, parse_sequence
from tests.compile_targets import tiny_config, write_config

ROOT = Path(__file__).resolve().parents[1]

HLO = """HloModule jit_step, is_scheduled=true

%fused_gather (param_0: bf16[64,8], param_1: s32[4]) -> bf16[4,8] {
  %param_0 = bf16[64,8]{1,0} parameter(0)
  %param_1 = s32[4]{0} parameter(1)
  %bitcast.1 = s32[4,1]{1,0} bitcast(%param_1)
  ROOT %gather.1 = bf16[4,8]{1,0} gather(%param_0, %bitcast.1), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,8}
}

%fused_dot (param_0.1: bf16[4,8], param_1.1: bf16[8,16]) -> bf16[4,16] {
  %param_0.1 = bf16[4,8]{1,0} parameter(0)
  %param_1.1 = bf16[8,16]{1,0} parameter(1)
  ROOT %dot.1 = bf16[4,16]{1,0} dot(%param_0.1, %param_1.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%add (x: bf16[], y: bf16[]) -> bf16[] {
  %x = bf16[] parameter(0)
  %y = bf16[] parameter(1)
  ROOT %sum = bf16[] add(%x, %y)
}

%fused_scatter (param_0.2: bf16[2,32,8], param_1.2: bf16[4,16], param_2.2: s32[4]) -> bf16[2,32,8] {
  %param_0.2 = bf16[2,32,8]{2,1,0} parameter(0)
  %param_1.2 = bf16[4,16]{1,0} parameter(1)
  %bitcast.2 = bf16[4,2,8]{2,1,0} bitcast(%param_1.2)
  %param_2.2 = s32[4]{0} parameter(2)
  %bitcast.3 = s32[4,1]{1,0} bitcast(%param_2.2)
  ROOT %scatter.1 = bf16[2,32,8]{2,1,0} scatter(%param_0.2, %bitcast.3, %bitcast.2), update_window_dims={0,2}, inserted_window_dims={1}, scatter_dims_to_operand_dims={1}, index_vector_dim=1, to_apply=%add
}

%fused_increment (param_0.3: s32[4]) -> s32[4] {
  %param_0.3 = s32[4]{0} parameter(0)
  %one = s32[] constant(1)
  %ones = s32[4]{0} broadcast(%one), dimensions={}
  ROOT %add.3 = s32[4]{0} add(%param_0.3, %ones)
}

%cond (arg: (s32[], s32[4])) -> pred[] {
  %arg = (s32[], s32[4]{0}) parameter(0)
  %counter = s32[] get-tuple-element(%arg), index=0
  %three = s32[] constant(3)
  ROOT %loop_compare_fusion = pred[] compare(%counter, %three), direction=LT
}

%body (arg.1: (s32[], s32[4])) -> (s32[], s32[4]) {
  %arg.1 = (s32[], s32[4]{0}) parameter(0)
  %counter.1 = s32[] get-tuple-element(%arg.1), index=0
  %values = s32[4]{0} get-tuple-element(%arg.1), index=1
  %loop_add_fusion = s32[4]{0} fusion(%values), kind=kLoop, calls=%fused_increment
  %one.1 = s32[] constant(1)
  %next = s32[] add(%counter.1, %one.1)
  ROOT %tuple.b = (s32[], s32[4]{0}) tuple(%next, %loop_add_fusion)
}

%fused_any (param_0.4: s32[4]) -> pred[] {
  %param_0.4 = s32[4]{0} parameter(0)
  %slice.4 = s32[1]{0} slice(%param_0.4), slice={[0:1]}
  %first = s32[] bitcast(%slice.4)
  %zero = s32[] constant(0)
  ROOT %compare.4 = pred[] compare(%first, %zero), direction=GT
}

%fused_exp (param_0.5: f32[4]) -> f32[4] {
  %param_0.5 = f32[4]{0} parameter(0)
  ROOT %exp.5 = f32[4]{0} exponential(%param_0.5)
}

%branch_true (p.t: f32[4]) -> f32[4] {
  %p.t = f32[4]{0} parameter(0)
  ROOT %copy.t = f32[4]{0} copy(%p.t)
}

%branch_false (p.f: f32[4]) -> f32[4] {
  %p.f = f32[4]{0} parameter(0)
  %loop_exp_fusion = f32[4]{0} fusion(%p.f), kind=kLoop, calls=%fused_exp
  ROOT %loop_exp_fusion.1 = f32[4]{0} fusion(%loop_exp_fusion), kind=kLoop, calls=%fused_exp
}

ENTRY %main (param_leaves_0_.1: bf16[64,8], param_leaves_1_.1: bf16[8,16], kv_cache_k_0_.1: bf16[2,4,8,8], ints.1: s32[4], floats.1: f32[4]) -> (bf16[2,4,8,8], bf16[4,16], f32[4]) {
  %param_leaves_0_.1 = bf16[64,8]{1,0} parameter(0), metadata={op_name="param_leaves[0]"}
  %param_leaves_1_.1 = bf16[8,16]{1,0} parameter(1), metadata={op_name="param_leaves[1]"}
  %kv_cache_k_0_.1 = bf16[2,4,8,8]{3,2,1,0} parameter(2), metadata={op_name="kv_cache.k[0]"}
  %ints.1 = s32[4]{0} parameter(3), metadata={op_name="ints"}
  %floats.1 = f32[4]{0} parameter(4), metadata={op_name="floats"}
  %loop_gather_fusion = bf16[4,8]{1,0} fusion(%param_leaves_0_.1, %ints.1), kind=kLoop, calls=%fused_gather
  %zero.e = s32[] constant(0)
  %tuple.0 = (s32[], s32[4]{0}) tuple(%zero.e, %ints.1)
  %while.1 = (s32[], s32[4]{0}) while(%tuple.0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %slots = s32[4]{0} get-tuple-element(%while.1), index=1
  %gemm_fusion_dot = bf16[4,16]{1,0} fusion(%loop_gather_fusion, %param_leaves_1_.1), kind=kCustom, calls=%fused_dot
  %bitcast.k = bf16[2,32,8]{2,1,0} bitcast(%kv_cache_k_0_.1)
  %input_scatter_fusion = bf16[2,32,8]{2,1,0} fusion(%bitcast.k, %gemm_fusion_dot, %slots), kind=kInput, calls=%fused_scatter
  %bitcast.k2 = bf16[2,4,8,8]{3,2,1,0} bitcast(%input_scatter_fusion)
  %pallas_call = bf16[4,16]{1,0} custom-call(%gemm_fusion_dot, %bitcast.k2, %ints.1), custom_call_target="__gpu$xla.gpu.triton"
  %loop_compare_fusion.2 = pred[] fusion(%ints.1), kind=kLoop, calls=%fused_any
  %conditional.1 = f32[4]{0} conditional(%loop_compare_fusion.2, %floats.1, %floats.1), true_computation=%branch_true, false_computation=%branch_false
  ROOT %tuple.r = (bf16[2,4,8,8]{3,2,1,0}, bf16[4,16]{1,0}, f32[4]{0}) tuple(%bitcast.k2, %pallas_call, %conditional.1)
}
"""

_LAUNCH = "grid: [1, 1, 1] threads: [32, 1, 1]  shared_memory: 0 bytes"
THUNKS = f"""000: kCommandBuffer [source       | next=002 (1)] 
    001: kCustomKernel [source       | sink        ] loop_gather_fusion {_LAUNCH}
002: kWhile         [prev=000 (1) | next=000 (1)]   
condition:
    003: kCustomKernel [source | sink] loop_compare_fusion {_LAUNCH}
  body:
    004: kCustomKernel [source       | sink        ] loop_add_fusion {_LAUNCH}
000: kCommandBuffer [prev=002 (1) | sink        ] 
    005: kCustomKernel [source       | next=006 (1)] gemm_fusion_dot {_LAUNCH}
    006: kCustomKernel [prev=005 (1) | next=007 (1)] input_scatter_fusion {_LAUNCH}
    007: kCustomKernel [prev=006 (1) | next=008 (1)] ragged_paged_attention_triton {_LAUNCH}
    008: kCustomKernel [prev=007 (1) | next=012 (1)] loop_compare_fusion_2 {_LAUNCH}
    012: kConditional  [prev=008 (1) | sink        ]       
      true_branch:
        009: kCopy [source | sink] kCopy
      false_branch:
        010: kCustomKernel [source       | next=011 (1)] loop_exp_fusion {_LAUNCH}
        011: kCustomKernel [prev=010 (1) | sink        ] loop_exp_fusion_1 {_LAUNCH}
"""
NAMES = {1: "loop_gather_fusion", 2: "while.1", 3: "loop_compare_fusion", 4: "loop_add_fusion", 5: "gemm_fusion_dot",
         6: "input_scatter_fusion", 7: "pallas_call", 8: "loop_compare_fusion.2", 9: "copy.t", 10: "loop_exp_fusion",
         11: "loop_exp_fusion.1", 12: "conditional.1"}
METADATA = "".join(f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{name}"\n    thunk_id: {i}\n  }}\n}}\n'
                   for i, name in NAMES.items())
PATHS = ["embed_tokens/embedding/value", "layers/0/self_attn/q_proj/kernel/value"]
# 2 sequences of 8 tokens against a pool of 2 heads x 4 pages x 8 tokens x 8 dims: half of its 32 tokens
ASSUME = Assumptions(sequences=2, context=8, query_heads=2, head_dim=8, bandwidth=1e12, peak_flops=1e15)


def by_name(profile):
    return {k.name: k for k in profile.kernels}


def test_the_thunk_sequence_nests_loops_branches_and_command_buffers():
    thunks = parse_sequence(THUNKS, parse_metadata(METADATA))
    assert [t.kind for t in thunks] == ["kCommandBuffer", "kWhile", "kCommandBuffer"]
    assert [t.name for t in thunks[1].sections["condition"]] == ["loop_compare_fusion"]
    assert [t.name for t in thunks[1].sections["body"]] == ["loop_add_fusion"]
    conditional = thunks[2].sections[""][-1]
    assert conditional.name == "conditional.1"
    assert [t.name for t in conditional.sections["false_branch"]] == ["loop_exp_fusion", "loop_exp_fusion.1"]


def test_each_rule_counts_what_a_kernel_touches_on_a_gpu():
    profile = profile_program(HLO, PATHS, ASSUME, parse_sequence(THUNKS, parse_metadata(METADATA)))
    k = by_name(profile)
    # the embedding's 4 rows (4 x 8 bf16), not its 64, and the 4 token ids
    assert (k["loop_gather_fusion"].bytes_in, k["loop_gather_fusion"].bytes_out) == (4 * 8 * 2 + 16, 64)
    # written in place: the 4 rows of 2 heads x 8 dims, not the pool; read: the projection and the slots
    scatter = k["input_scatter_fusion"]
    assert (scatter.kind, scatter.bytes_in, scatter.bytes_out) == ("kv write", 128 + 16, 4 * 2 * 8 * 2)
    # attention: 2 sequences x 8 tokens of the 32 the pool holds = half its 1024 bytes, plus q and the ints
    attention = k["pallas_call"]
    assert (attention.kind, attention.bytes_in) == ("attention", 1024 // 2 + 128 + 16)
    assert attention.flops == 2 * 2 * 8 * 2 * 8
    assert k["gemm_fusion_dot"].kind == "gemm" and k["gemm_fusion_dot"].flops == 2 * 4 * 16 * 8
    # the loop: condition 3 + 1 times, body 3 times, both launched from the host
    assert (k["loop_compare_fusion"].runs, k["loop_add_fusion"].runs) == (4, 3)
    step = profile.totals()
    assert step["host_launched_kernels"] == 7 and step["command_buffers"] == 2
    assert step["kernels"] == 1 + 7 + 4 + 1  # the cheapest branch: the one copy
    assert [s["where"] for s in profile.skipped] == ["conditional.1 false_branch"]
    # layers: the gemm reads layer 0's weight; the gather reads the embedding, outside the layers
    assert [x.layer for x in profile.kernels] == ["pre"] * 3 + ["0"] * 5
    assert profile.kernels_per_layer() == 5 and profile.layers == 1
    costliest = profile_program(HLO, PATHS, ASSUME, parse_sequence(THUNKS, parse_metadata(METADATA)), "costliest")
    assert costliest.totals()["kernels"] == step["kernels"] + 1
    assert [s["where"] for s in costliest.skipped] == ["conditional.1 true_branch"]


def test_without_thunks_the_scheduled_hlo_is_the_order_as_on_a_tpu():
    profile = profile_program(HLO, PATHS, ASSUME)
    assert [k.name for k in profile.kernels] == ["loop_gather_fusion", "loop_add_fusion", "gemm_fusion_dot",
                                                 "input_scatter_fusion", "pallas_call", "loop_compare_fusion.2",
                                                 "copy.t"]
    assert by_name(profile)["loop_add_fusion"].runs == 3  # the trip count read from the condition's bound
    assert profile.totals()["host_launched_kernels"] == 0 and all(k.command_buffer is None for k in profile.kernels)


def test_values_are_followed_through_bitcasts_tuples_and_loops_to_the_entry_parameter():
    module = HloModule.parse(HLO)
    body = module.computations["body"]
    computation, origin = module.origin(body, "values")  # the loop's carried element 1: the entry's ints
    assert computation.entry and origin.name == "ints.1"
    assert module.origin(module.entry, "bitcast.k2")[1].name == "input_scatter_fusion"
    assert module.trip_count(module.entry.by_name["while.1"]) == 3


# ---- the engine's program, compiled ------------------------------------------------------------------------

def _bench():
    spec = importlib.util.spec_from_file_location("program_profile_bench", ROOT / "benchmarks" / "program_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY = dict(pages=4 * 256 // 16 + 1, page_size=16, kv_heads=4, head_dim=128)  # every slot at full context


@pytest.fixture(scope="module", params=["h200", "v6e-1"])
def compiled(request, tmp_path_factory):
    model = write_config(tmp_path_factory.mktemp("tiny") / "llama", tiny_config("llama"))
    bench = _bench()
    argv = ["--model", str(model), "--target", request.param, "--max-num-seqs", "4", "--max-model-len", "256",
            "--context", "64", "--autotune-results", "none", "--json"]  # untuned, whatever benchmarks/autotune holds
    return request.param, bench.run(bench.parse_args(argv)), bench, argv


def test_the_json_has_the_step_the_layers_and_the_minimum(compiled):
    target, r, _, _ = compiled
    for key in ("target", "layers", "kernels", "kernels_per_layer", "host_launched_kernels", "command_buffers",
                "bytes_per_step", "min_bytes_per_step", "est_step_seconds", "by_layer", "kernel_list"):
        assert key in r, key
    assert r["target"] == target and r["layers"] == 2 and r["sequences"] == 4 and r["context"] == 64
    assert r["layer_loop"] == ("scan" if target.startswith("v") else "unroll")


def test_the_counts_add_up(compiled):
    target, r, _, _ = compiled
    kernels = r["kernel_list"]
    assert r["kernels"] == sum(k["runs"] for k in kernels)
    host = sum(k["runs"] for k in kernels if k["in_command_buffer"] is False)
    if target == "h200":
        assert r["host_launched_kernels"] == host and r["command_buffer_kernels"] + host == r["kernels"]
        # One CUDA graph, nothing launched from the host (issue 52): no `while` loop in the step (the work
        # items and each token's sequence are counted, not binary-searched), which a command buffer would not take.
        assert host == 0 and r["command_buffers"] == 1 and r["command_buffer_kernels"] == r["kernels"]
    else:  # a TPU program is one launch
        assert r["host_launched_kernels"] == 0 and host == 0
    assert r["kernels_per_layer"] * r["layers"] <= r["kernels"]
    assert sum(layer["kernels"] * (r["layers"] if name == "layers" else 1) for name, layer in r["by_layer"].items()) \
        == r["kernels"]
    assert r["est_step_seconds"] >= r["bytes_per_step"] / r["bandwidth_bytes_s"] * 0.999


def test_the_kv_cache_is_never_counted_whole(compiled):
    target, r, _, _ = compiled
    pool = TINY["pages"] * TINY["page_size"] * TINY["kv_heads"] * TINY["head_dim"] * 2  # one layer's K (or V)
    attention = [k for k in r["kernel_list"] if k["kind"] == "attention"]
    assert sum(k["runs"] for k in attention) == 2  # one a layer
    read = 2 * 4 * 64 * TINY["kv_heads"] * TINY["head_dim"] * 2  # K and V: 4 sequences x 64 tokens
    for k in attention:  # (a pool the program holds in VMEM, as the tiny TPU one does, is read from there)
        assert k["bytes_in"] < pool and (target != "h200" or k["bytes_in"] >= read)
    writes = [k for k in r["kernel_list"] if k["kind"] == "kv write"]
    # K and V a layer (a TPU may write both in one kernel; a GPU decode step does, with q: issue 52)
    assert sum(k["runs"] for k in writes) == (2 if target == "h200" else 4)
    row = TINY["kv_heads"] * TINY["head_dim"] * 2
    q = 16 * 2 * row  # the GPU's q/k/v epilogue also stores q: the bucket's 16 rows x 8 heads (2 a KV head)
    for k in writes:  # the bucket's rows (every row of the 16-token GPU bucket, padding included; 4 on a TPU)
        assert k["bytes_out"] % row == 0 and k["bytes_out"] <= 2 * 16 * row + q < pool
        assert target != "h200" or k["bytes_out"] == 2 * 16 * row + q
    # What reads or writes a whole pool is a copy (the tiny TPU program moves its 2 MB pool through VMEM), and
    # it is flagged; never the attention kernel or a write.
    assert all(k["kind"] == "copy" for k in r["kernel_list"] if k["flags"])
    assert target != "h200" or r["flagged"] == []


def test_a_plain_draw_reads_the_logits_as_the_lm_head_wrote_them(compiled):
    """No row masks, processes or asks log-probabilities of its logits (the branches counted): the sampler
    reads the LM head's bf16 logits, neither converted to float32 nor copied (issue 52)."""
    target, r, _, _ = compiled
    logits = 4 * 512 * 2  # the draw rows (--max-num-seqs 4) x the tiny vocabulary, bf16
    after = [k for k in r["kernel_list"] if k["layer"] == "post"]
    # (A TPU's copies move other arrays, such as the sampler state, between HBM and VMEM.)
    assert not [k["name"] for k in after if k["kind"] == "copy" and k["bytes_in"] in (logits, 2 * logits)]
    assert not [k["name"] for k in after if k["bytes_in"] == logits and k["bytes_out"] == 2 * logits]
    assert target != "h200" or [k["name"] for k in after if k["kind"] == "gemm" and k["bytes_out"] == logits]


def test_a_gpu_decode_step_ends_its_split_products_with_one_kernel(compiled):
    """o_proj and down_proj split along K, each followed by one Pallas epilogue that adds the residual and
    applies the next RMSNorm (jaxserve/model/split_k.py): 2 layers, so 3 epilogues (the last layer's down
    product has no norm of its own after it: XLA adds it); a TPU's layers keep XLA's products (issue 52)."""
    target, r, _, _ = compiled
    epilogues = [k for k in r["kernel_list"] if k["kind"] == "custom call" and k["layer"] not in ("pre", "post")]
    hidden, rows = 256, 16  # the tiny model's, the 16-token decode bucket's
    assert sum(k["runs"] for k in epilogues) == (3 if target == "h200" else 0)
    for k in epilogues:  # out: the new residual and its norm, bf16
        assert k["bytes_out"] == 2 * rows * hidden * 2


def test_bytes_are_at_least_the_minimum(compiled):
    _, r, _, _ = compiled
    m = r["minimum"]
    assert r["min_bytes_per_step"] == m["weights"] + m["kv_read"] + m["kv_written"]
    assert m["kv_read"] == 4 * 64 * 2 * 2 * TINY["kv_heads"] * TINY["head_dim"] * 2  # seqs x context x K,V x layers
    assert r["bytes_per_step"] >= r["min_bytes_per_step"]


def test_the_table_lists_the_step_a_layer_and_the_busiest_kernels(compiled):
    target, r, bench, argv = compiled
    a = bench.parse_args(argv[:-1])
    text = bench.render(r, a)
    assert "| step |" in text and "| minimum |" in text and "| a layer" in text
    assert "x the minimum: weights" in text and "busiest kernels" in text
    assert ("host-launched" in text) == (target == "h200")


# XLA's autotuning results as a lease writes them (`XLA_FLAGS=--xla_gpu_dump_autotune_results_to=...txt`): a
# version, then an entry per tuned fusion, whose HLO text holds braces and escaped quotes.
RESULTS = '''version: 3
results {
  device: "CUDA: 9.0, Cores: 132, GPU clock: 1.98 GHz, Memory bandwidth: 4915 GB/s, L2 cache: 60 MB"
  hlo: "(bf16[16,4096]{1,0}, bf16[4096,14336]{1,0}) -> bf16[16,14336]{1,0} { \\"dot\\" }"
  result {
    triton {
      block_m: 16
      block_n: 64
    }
  }
}
results {
  device: "CUDA: 9.0, Cores: 132, GPU clock: 1.98 GHz, Memory bandwidth: 4915 GB/s, L2 cache: 60 MB"
  hlo: "{ fused lm head }"
  result {
    gemm {
      algorithm: 7
    }
  }
}
'''


def test_autotune_results_are_read_merged_and_refused_with_a_clear_error(tmp_path):
    """sharding/autotune.py: a lease's files joined one entry per device and fusion (the session script's
    merge), and what no compile should be handed refused with a message naming the file and the fault."""
    from sharding import autotune

    first, second = tmp_path / "e2e8.txt", tmp_path / "int8x.txt"
    first.write_text(RESULTS)
    second.write_text(RESULTS.replace("{ fused lm head }", "{ int8 gate/up }") + "# a comment\n")
    merged = autotune.merge([autotune.read_results(first), autotune.read_results(second)])
    assert merged.scalars == {"version": "3"} and len(merged.entries) == 3
    (device,) = merged.devices()
    assert merged.devices()[device] == 3 and "Cores: 132" in device
    again = autotune.AutotuneResults.parse(merged.text())
    assert again.entries == merged.entries  # written back as XLA reads it
    option, held = autotune.load_option(first)
    assert option == {"xla_gpu_load_autotune_results_from": str(first.resolve())} and len(held.entries) == 2

    faults = {"missing.txt": (None, "does not exist"), "empty.txt": ("\n", "is empty"),
              "results.pb": (RESULTS, "ends in .txt or .textproto"), "bare.txt": ("# no fields\n", "holds no entries"),
              "cut.txt": (RESULTS[:-20], "never closed"), "none.txt": ("version: 3\n", "holds no entries"),
              "junk.txt": ("version: 3\n!!\n", "not a text proto")}
    for name, (text, message) in faults.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        with pytest.raises(autotune.AutotuneFileError, match=re.escape(message)):
            autotune.load_option(tmp_path / name)
    with pytest.raises(autotune.AutotuneFileError, match="different versions"):
        autotune.merge([merged, autotune.AutotuneResults({"version": "4"}, {})])
    # another layout (newer XLA releases read xla.autotuner.AutotuneCache first): entries merged by their text
    other = autotune.AutotuneResults.parse("entries { key { a: 1 } }\nentries { key { a: 2 } }\n")
    assert len(autotune.merge([other, other]).entries) == 2 and other.devices() == {"(no device field)": 2}


def test_the_static_profile_refuses_a_bad_autotune_file_before_compiling(tmp_path):
    bench = _bench()
    with pytest.raises(SystemExit, match="--autotune-results: autotune results file .* does not exist"):
        bench.run(bench.parse_args(["--target", "h200", "--autotune-results", str(tmp_path / "h200.txt")]))
    with pytest.raises(SystemExit, match="TPU target takes none"):
        bench.run(bench.parse_args(["--target", "v6e-1", "--autotune-results", str(tmp_path / "h200.txt")]))


def test_the_h200_compile_loads_a_lease_s_autotune_results(compiled, tmp_path):
    """XLA reads the file named by --autotune-results while it compiles the H200 step (an unreadable one fails
    the compile), and the report says what it held. These entries are keyed to another GPU and to no fusion
    of this program, so XLA tunes nothing from them: the program's kernels are those of the untuned compile."""
    target, untuned, bench, argv = compiled
    if target != "h200":  # XLA autotunes GPU programs only: a TPU's report says nothing of GEMM tiles
        assert untuned["autotune_results"] is None and "GEMM tiles" not in bench.render(untuned, bench.parse_args(argv))
        return
    path = tmp_path / "h200.txt"
    path.write_text(RESULTS)
    a = bench.parse_args(argv + ["--autotune-results", str(path)])
    r = bench.run(a)
    (device,) = r["autotune_results"]["devices"]
    assert r["autotune_results"] == {"file": str(path), "entries": 2, "devices": {device: 2}}
    assert [k["name"] for k in r["kernel_list"]] == [k["name"] for k in untuned["kernel_list"]]
    assert f"GEMM tiles: tuned on a device ({path}, 2 entries)" in bench.render(r, a)
    assert "GEMM tiles: XLA's untuned defaults" in bench.render(untuned, a)
    # held to the file, the compile fails on the first fusion it has no entry for
    with pytest.raises(Exception, match="No cached config found for HLO instr"):
        bench.run(bench.parse_args(argv + ["--autotune-results", str(path), "--autotune-complete"]))
