"""Engine options on the command line: the argument groups every engine-running command shares
(`generate`, `serve`, `bench latency|throughput`) and their translation into `EngineArgs`.

No JAX here: parsers are built (and `--help` printed) without loading the engine.
"""

from __future__ import annotations

import argparse
import dataclasses

from jaxserve.config import CPU_MATMUL_LIBRARIES, KV_CACHE_DTYPES, LAYER_LOOPS, QUANTIZATION_METHODS, QUANTIZED_MATMULS
from jaxserve.engine_args import DEFAULT_IMAGES_PER_PROMPT, EngineArgs


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="Hugging Face model directory (default: the built-in stories260K, a tiny model that tells "
                        "children's stories); 'demo-random': a small model with random weights, whose text is noise")
    g.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a directory with the tokenizer (tokenizer.json, tokenizer_config.json, chat template) "
                        "to use instead of the model's")
    g.add_argument("--revision", default=None,
                   help="refused: a Hugging Face Hub revision; jaxserve serves local directories, so check out "
                        "the revision you want and pass its directory")
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--max-num-seqs", type=int, default=EngineArgs.max_num_seqs, help="sequences running at once")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--page-size", "--block-size", type=int, default=EngineArgs.page_size,
                   help="tokens per KV page (--block-size is vLLM's name for it)")
    g.add_argument("--num-pages", type=int, default=None, help="KV pages (default: every slot at full context)")
    g.add_argument("--kv-cache-memory", type=int, default=None,
                   help="bytes of KV cache on each device; the page count follows (instead of --num-pages)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="fraction of the device memory left free by the weights to give the KV cache "
                        "(devices without memory statistics, such as the CPU, keep the default)")
    g.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true", default=True,
                   help="reuse the KV pages of prompt prefixes seen before (the default)")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="recompute every prompt from its first token")
    g.add_argument("--quantization", "-q", default=None, choices=list(QUANTIZATION_METHODS),
                   help="quantize a float checkpoint's linear layers at load, per output channel (embeddings, "
                        "norms and, without --quantize-lm-head, the LM head stay float); a pre-quantized "
                        "checkpoint (compressed-tensors int8 / fp8, AWQ, GPTQ) is detected without it, and a "
                        "value that disagrees with it is an error")
    g.add_argument("--quantization-strategy", default=None,
                   choices=["weight_only", "dynamic_int8", "dynamic_fp8"],
                   help="how quantized linear layers run (default: the fastest for the backend, see "
                        "docs/quantization.md); weight_only keeps float activations")
    g.add_argument("--quantize-lm-head", action="store_true",
                   help="with --quantization: quantize the LM head as well (an untied one), as llama.cpp's Q8_0 "
                        "files do: a quarter of its memory and bandwidth, logits a little less exact")
    g.add_argument("--quantize-embedding", action="store_true",
                   help="with --quantization: store the token embedding (an untied one) as codes with one scale "
                        "per token, as llama.cpp's Q8_0 files do: a quarter of its float32 memory; each step "
                        "looks up its rows and scales them")
    g.add_argument("--quantized-matmul", default=EngineArgs.quantized_matmul, choices=list(QUANTIZED_MATMULS),
                   help="what multiplies weight-only quantized layers (int4 checkpoints, int8 on GPUs) in decode-"
                        "sized steps: 'auto' times a Pallas kernel against XLA's product for each layer shape at "
                        "start on a GPU or TPU and keeps the faster (the log says which); 'xla' or 'pallas' forces "
                        "one (on a CPU 'auto' is XLA, and 'pallas' runs the kernels interpreted: for tests)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="KV page precision: 'auto' keeps the model's dtype; 'int8' and 'fp8' (e4m3) store codes "
                        "with a float32 scale per token and KV head (3.8x the tokens of float32 pages in the "
                        "same memory at head_dim 64)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step: a token per running sequence plus prefill chunks "
                        "(default: 2048)")
    g.add_argument("--token-buckets", default=None,
                   help="comma-separated token counts a step is padded to, one compiled program each "
                        "(default: 1,2,4,... up to --max-num-batched-tokens)")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "reference", "pallas"])
    g.add_argument("--layer-loop", default=EngineArgs.layer_loop, choices=list(LAYER_LOOPS),
                   help="how a step program runs the layers: 'scan' compiles one period of layers under "
                        "lax.scan (compile time independent of depth), 'unroll' one copy per layer; 'auto' "
                        "unrolls on CPU (faster steps there) and scans on TPU and GPU")
    g.add_argument("--cpu-matmul-library", default=EngineArgs.cpu_matmul_library, choices=list(CPU_MATMUL_LIBRARIES),
                   help="what runs a step's matrix products on a CPU: 'ynnpack' (XLA's default), 'eigen', or "
                        "'ynnpack-feature-major' (weights turned [out, in] at load, few-token products as W @ x.T); "
                        "'auto' takes feature-major for float32 models of hidden size 512 and up on one device "
                        "(Eigen on a mesh), faster there at batched decode (docs/performance.md)")
    add_scheduling_args(parser)
    g.add_argument("--max-logprobs", type=int, default=EngineArgs.max_logprobs,
                   help="top logprobs a request may ask for, per sampled and per prompt token")
    g.add_argument("--max-logit-bias", type=int, default=EngineArgs.max_logit_bias,
                   help="logit_bias / allowed_token_ids entries a request may carry")
    g.add_argument("--generation-config", default="auto", choices=["auto", "vllm"],
                   help="sampling defaults: 'auto' takes the model's generation_config.json (temperature, "
                        "top_p, top_k, min_p, repetition_penalty, max_new_tokens); 'vllm' uses none")
    g.add_argument("--runner", default="auto", choices=["auto", "generate", "pooling"],
                   help="pooling: embeddings (/v1/embeddings; prefill only, no sampling); generate: text; auto "
                        "(default): pooling for a sentence-transformers directory or a bare ...Model architecture")
    g.add_argument("--pooler-config", default=None, metavar="JSON",
                   help='pooling runner: override the model\'s pooling, e.g. \'{"pooling_type": "MEAN", '
                        '"normalize": false}\' (pooling_type LAST, MEAN or CLS)')
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vLLM takes it: {"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4} or {"method": "draft_model", "model": DIR, '
                        '"num_speculative_tokens": 4}; optional "disable_by_batch_size": N, "adaptive_drafting": false')
    add_parallel_args(parser)
    add_lora_args(parser)
    add_media_args(parser)


def add_media_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("images in requests (vision-language models)")
    g.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="let requests name images as file:// URLs of files under DIR (symlinks and .. resolved "
                        "first); default: file:// URLs are refused")
    g.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="the only hosts http(s) image URLs may name; they may then resolve to private addresses "
                        "too (default: any host whose addresses are all public: loopback, private and "
                        "link-local addresses are refused)")
    g.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON",
                   help=f'images one prompt may carry, as vLLM: \'{{"image": 4}}\' (default '
                        f'{DEFAULT_IMAGES_PER_PROMPT}; 0 refuses images)')
    g.add_argument("--media-fetch-timeout", type=float, default=EngineArgs.media_fetch_timeout, metavar="SECONDS",
                   help="time one http(s) image URL may take, redirects and body included (vLLM's "
                        "VLLM_IMAGE_FETCH_TIMEOUT)")
    g.add_argument("--max-media-bytes", type=int, default=EngineArgs.max_media_bytes, metavar="BYTES",
                   help="size of one encoded image, fetched, read or sent as base64 (default 20 MiB)")
    g.add_argument("--max-num-encoder-input-tokens", type=int, default=None, metavar="N",
                   help="the vision encoder's budget of one step: image tokens whose encoder rows one step places "
                        "(vLLM's name for it; a Gemma 3 image is 256). An image is computed whole in one step, so "
                        "this is at least one image's tokens and at most --max-num-batched-tokens; the encoder "
                        "program's batch sizes follow (1, 2, 4, ... images). Default: four images' tokens, "
                        "within --max-num-batched-tokens")
    g.add_argument("--mm-encoder-cache-gb", type=float, default=EngineArgs.mm_encoder_cache_gb, metavar="GIB",
                   help="encoder output kept for images no running request needs, least recently used dropped "
                        "first: a repeated image then skips the encoder (vLLM's --mm-processor-cache-gb keeps "
                        "preprocessed inputs; this keeps the encoder's rows). 0 keeps none; images that running "
                        "requests share are encoded once either way (default 0.25)")


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("LoRA adapters (docs/lora.md)")
    g.add_argument("--enable-lora", action="store_true", help="serve PEFT LoRA adapters beside the base model")
    g.add_argument("--lora-modules", nargs="+", default=(), metavar="NAME=DIR",
                   help='adapters to load at start, each name=DIR or vLLM\'s JSON {"name": ..., "path": ...}; '
                        "requests choose one by its name as their model")
    g.add_argument("--max-loras", type=int, default=EngineArgs.max_loras,
                   help="adapters on the device at once (one step mixes them); others wait for a slot")
    g.add_argument("--max-lora-rank", type=int, default=EngineArgs.max_lora_rank,
                   help="the device slots' rank: adapters of a higher rank are refused")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept read in host memory, least recently used dropped (default: --max-loras)")


def add_scheduling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("scheduling")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="'fcfs': requests run in arrival order; 'priority': lower request `priority` first "
                        "(ties by arrival), and a higher-priority request may preempt lower-priority running ones")
    g.add_argument("--target-itl-ms", type=float, default=None, metavar="MS",
                   help="inter-token latency that a step carrying decodes should stay under: its prefill share "
                        "is cut to what the measured step times say fits (default: twice a full batch's "
                        "decode step, measured at warm-up; 0: no cap)")
    g.add_argument("--long-prefill-token-threshold", type=int, default=0, metavar="N",
                   help="prefill a prompt at most N tokens per step (0: as many as the budget allows)")
    g.add_argument("--max-num-partial-prefills", type=int, default=None, metavar="N",
                   help="at most N sequences prefill in one step (default: as many as the budget allows)")
    g.add_argument("--waiting-served-ratio", type=float, default=EngineArgs.waiting_served_ratio, metavar="R",
                   help="as TGI: a step carrying decodes prefills at full width, past --target-itl-ms, when the "
                        "sequences waiting for their prefill are at least R times those decoding (a burst of "
                        "arrivals then starts together; 0: never)")


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("device mesh and multi-host")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="devices that split each layer (attention heads, MLP columns, vocabulary)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="pipeline stages, each a contiguous block of layers")
    g.add_argument("--enable-expert-parallel", "-ep", action="store_true",
                   help="mixture-of-experts models: place whole experts on the tensor-parallel devices "
                        "(the experts must divide by the tensor-parallel size) instead of slicing every expert")
    g.add_argument("--distributed-coordinator", default=None, metavar="HOST:PORT",
                   help="process 0's address for jax.distributed ('auto': detect Cloud TPU / SLURM / MPI; "
                        "default: $JAX_COORDINATOR_ADDRESS or single-process)")
    g.add_argument("--num-processes", type=int, default=None, help="default: $JAX_NUM_PROCESSES")
    g.add_argument("--process-id", type=int, default=None, help="default: $JAX_PROCESS_ID")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    if getattr(ns, "revision", None) is not None:
        raise ValueError(f"--revision {ns.revision}: jaxserve loads local directories, not the Hugging Face Hub; "
                         f"download that revision (e.g. `hf download MODEL --revision {ns.revision} --local-dir "
                         f"DIR`) and pass --model DIR")
    if getattr(ns, "model_tag", None):  # `jaxserve serve MODEL`, as vllm serve takes it
        if ns.model not in (None, ns.model_tag):
            raise ValueError(f"the model is given twice: {ns.model_tag!r} and --model {ns.model!r}")
        ns.model = ns.model_tag
    kwargs = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs) if hasattr(ns, f.name)}
    if kwargs.get("token_buckets"):
        kwargs["token_buckets"] = parse_token_buckets(kwargs["token_buckets"])
    return EngineArgs(**kwargs)


def parse_token_buckets(text: str) -> tuple[int, ...]:
    """`--token-buckets 16,64` -> (16, 64); EngineArgs checks the sizes."""
    return tuple(int(b) for b in text.split(","))
