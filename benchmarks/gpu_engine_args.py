"""The `--e2e-*` command-line options of the GPU script's end-to-end section (`gpu_engine_step.py`), and the
tiny sizes `--e2e-tiny` gives them for a CPU dry run."""

from __future__ import annotations

import argparse

E2E_TINY = dict(e2e_layers=2, e2e_hidden=64, e2e_heads=4, e2e_kv_heads=2, e2e_head_dim=16, e2e_intermediate=128,
                e2e_vocab=512, e2e_context=24, e2e_decode_batches=[1, 2], e2e_prefill=32, e2e_steps=3,
                e2e_repeats=1, e2e_warmup_steps=1, e2e_check_layers=2, e2e_check_prompts=[13, 5, 21],
                e2e_check_steps=3, e2e_copy_mib=8)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `--e2e-*` options (and --e2e-tiny, whose defaults are E2E_TINY) of the script's command line."""
    from jaxserve.config import LAYER_LOOPS, QUANTIZED_MATMULS
    e2e = parser.add_argument_group("end to end (a random Llama-3-8B-shaped model through the engine)")
    e2e.add_argument("--e2e-tiny", action="store_true",
                     help="tiny defaults for every --e2e-* size (a CPU dry run; explicit flags still win)")
    e2e.add_argument("--e2e-layers", type=int, default=32, help="layers of the timed model (the check's: below)")
    e2e.add_argument("--e2e-hidden", type=int, default=4096)
    e2e.add_argument("--e2e-heads", type=int, default=32)
    e2e.add_argument("--e2e-kv-heads", type=int, default=8)
    e2e.add_argument("--e2e-head-dim", type=int, default=128)
    e2e.add_argument("--e2e-intermediate", type=int, default=14336)
    e2e.add_argument("--e2e-vocab", type=int, default=128256)
    e2e.add_argument("--e2e-experts", type=int, default=0,
                     help="a Qwen3-MoE-shaped model with this many experts per layer (0: dense Llama); its decode "
                          "rows count the weights of the experts the step's tokens are expected to reach")
    e2e.add_argument("--e2e-experts-per-token", type=int, default=8)
    e2e.add_argument("--e2e-ngram", type=int, default=0, metavar="K",
                     help="n-gram speculation with up to K drafts a step (0: off); tok/s counts kept drafts")
    e2e.add_argument("--e2e-moe-intermediate", type=int, default=768)
    e2e.add_argument("--e2e-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    e2e.add_argument("--e2e-page-size", type=int, default=16)
    e2e.add_argument("--e2e-quantization", choices=["int8", "fp8"], default=None,
                     help="quantize the timed model's linear layers at load (issue 27; default: --e2e-dtype)")
    e2e.add_argument("--e2e-quantization-strategy", choices=["weight_only", "dynamic_int8", "dynamic_fp8"],
                     default=None, help="how the quantized layers multiply (default: the backend's pick, "
                                        "jaxserve.quantization.linear.default_strategy)")
    e2e.add_argument("--e2e-quantized-matmul", choices=list(QUANTIZED_MATMULS), default="auto",
                     help="weight-only quantized products: XLA's, the Pallas kernels (up to 64 rows), or auto "
                          "(the engine times both per shape at start; issue 52): the int8 parts force each")
    e2e.add_argument("--e2e-kv-cache-dtype", choices=["auto", "int8", "fp8"], default="auto",
                     help="KV pages of the timed model: int8 / fp8 codes with a scale per token and head")
    e2e.add_argument("--e2e-layer-loop", choices=list(LAYER_LOOPS), default="auto",
                     help="layers unrolled or under lax.scan (issue 28; auto unrolls on GPU): compare the "
                          "build+compile row and the decode rows of one run with each")
    e2e.add_argument("--e2e-kv-splits", type=int, default=None,
                     help="num_kv_splits of the Triton kernel in the timed model's step programs (split-K; "
                          "default: the kernel's, up to 16 in decode buckets; 1: unsplit)")
    e2e.add_argument("--e2e-exact-buckets", action="store_true",
                     help="a token bucket for each decode row as given (default: raised to the engine's "
                          "smallest default bucket, 16 for bf16 on a GPU, as a server would run them)")
    e2e.add_argument("--e2e-context", type=int, default=1024, help="tokens each decoding sequence has cached")
    e2e.add_argument("--e2e-profile-batches", type=int, nargs="*", default=[1, 16],
                     help="decode rows whose steps are also profiled after timing (jax.profiler; the device's "
                          "busy time against the wall time and the busiest kernels per step, printed and in "
                          "the JSON)")
    e2e.add_argument("--e2e-profile-steps", type=int, default=8, help="steps under the profiler")
    e2e.add_argument("--e2e-decode-batches", type=int, nargs="+", default=[1, 16, 64],
                     help="running sequences of each decode row")
    e2e.add_argument("--e2e-steps", type=int, default=64, help="back-to-back decode steps per timed window")
    e2e.add_argument("--e2e-repeats", type=int, default=3, help="timed windows (decode) or prompts (prefill)")
    e2e.add_argument("--e2e-warmup-steps", type=int, default=8)
    e2e.add_argument("--e2e-prefill", type=int, default=2048, help="prompt tokens of the prefill row (one step)")
    e2e.add_argument("--e2e-copy-mib", type=int, default=1024,
                     help="copy yardstick size when the decode section has not measured one")
    e2e.add_argument("--e2e-check-layers", type=int, default=2)
    e2e.add_argument("--e2e-check-vocab", type=int, default=32000, help="at most this vocabulary in the check")
    e2e.add_argument("--e2e-check-prompts", type=int, nargs="+", default=[150, 37, 300],
                     help="prompt lengths of the check's sequences (the last one is prefilled over two steps)")
    e2e.add_argument("--e2e-check-steps", type=int, default=6)
    e2e.add_argument("--e2e-check-dtypes", nargs="*", choices=["float32", "bfloat16"],
                     default=["float32", "bfloat16"], help="dtypes of the greedy check (none: no check)")
