"""Offline inference in vLLM's shape: `LLM(model=...).generate(prompts, SamplingParams(...))`.

It runs on the same engine and scheduler as the server: all prompts are queued at once and batched
continuously, and the results come back in prompt order.

Images (vision-language checkpoints): `chat` takes OpenAI's image parts (`{"type": "image_url", "image_url":
{"url": ...}}`, or `{"type": "image", "image": <PIL image>}`) and `generate` vLLM's `{"prompt": text,
"multi_modal_data": {"image": <PIL image or a list>}}` (the text holding the model's image placeholder once
per image). They are loaded, checked and turned into the prompt's image tokens (jaxserve/multimodal/), and the
engine runs the model's vision encoder on them (Gemma 3; a model whose images it does not run refuses them by
name).

Multi-host (`distributed_coordinator=...`): run the same script on every host. Process 0's calls do the
work and return the outputs; on the other processes each call runs process 0's device steps for that
call and returns an empty list.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from tqdm.auto import tqdm

from jaxserve.engine.engine import Engine
from jaxserve.engine_args import EngineArgs, sampling_defaults
from jaxserve.lora.request import LoRARequest
from jaxserve.outputs import RequestOutput
from jaxserve.pooling.params import EmbeddingRequestOutput, PoolingParams
from jaxserve.sampling.params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, warmup: bool = True, **engine_kwargs):
        """`model`: a Hugging Face model directory or an Orbax checkpoint from `jaxserve convert` (None:
        the built-in stories260K; "demo-random": a small model with random weights). Other keyword
        arguments are `EngineArgs` fields: dtype, max_num_seqs, max_model_len, page_size, num_pages,
        kv_cache_memory, gpu_memory_utilization,
        enable_prefix_caching (on by default), kv_cache_dtype ("auto" | "int8" | "fp8"), quantization ("int8" |
        "fp8": linear layers quantized at load; None follows the checkpoint), quantization_strategy, quantize_lm_head,
        quantize_embedding, quantized_matmul ("auto" | "xla" | "pallas": what runs weight-only products),
        max_num_batched_tokens, token_buckets, attention_backend, layer_loop, cpu_matmul_library,
        tensor_parallel_size,
        pipeline_parallel_size, enable_expert_parallel, distributed_coordinator, num_processes, process_id,
        scheduling_policy, target_itl_ms, long_prefill_token_threshold, max_num_partial_prefills,
        waiting_served_ratio, runner
        ("auto", "generate" or "pooling": embeddings with `embed`), pooler_config, enable_lora, max_loras,
        max_lora_rank, max_cpu_loras, lora_modules, speculative_config (vLLM's dict, docs/speculative.md).
        `warmup`: compile every step program now, as a server does before it is ready (the default); False
        compiles each when a step first needs it. A workbench that only steps the model by hand (`Workbench`:
        `step`, `score`) runs programs of its own, with every row's logits, and none of the engine's."""
        self.engine = Engine(EngineArgs(model=model, **engine_kwargs))
        if warmup:
            self.engine.warmup()
        self._defaults = sampling_defaults(self.engine.args.model_dir)
        self._image_inputs = None  # read when a request first carries images (PIL is imported then)

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses without sampling_params: the model's generation_config.json (temperature,
        top_p, top_k, min_p, repetition_penalty, max_new_tokens), else the engine's defaults."""
        return SamplingParams(**self._defaults)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix page (returns how many pages were evicted)."""
        return self.engine.reset_prefix_cache()

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for each prompt (text, or a list of token ids). Returns one output per prompt, in order.
        `priority`: one per prompt, lower first (needs `scheduling_policy="priority"`). `lora_request`: the
        LoRA adapter of every prompt, or one per prompt (None: the base model); needs `enable_lora=True`."""
        return self.engine.call(lambda: self._generate(prompts, sampling_params, use_tqdm, priority, lora_request),
                                on_follower=[])

    def _generate(self, prompts, sampling_params, use_tqdm: bool, priority=None,
                  lora_request=None) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        encoded, sampling_params = self._encoded(prompts, sampling_params, SamplingParams, "sampling_params")
        priority = self._per_prompt(priority, 0, len(encoded), "priority")
        lora_request = self._per_prompt(lora_request, None, len(encoded), "lora_request")
        # Validate everything before queueing anything, so a bad prompt leaves nothing half-submitted.
        for (_, ids, images), params, rank in zip(encoded, sampling_params, priority):
            self.engine.check_request(ids, params, rank, images=images)
        for lora in set(lora_request) - {None}:
            self.engine.resolve_lora(lora)
        return self._run([self.engine.submit(self.engine.check_request(ids, params, rank, lora, images), prompt=text)
                          for (text, ids, images), params, rank, lora in zip(encoded, sampling_params, priority,
                                                                             lora_request)],
                         [params.n for params in sampling_params], use_tqdm)

    @staticmethod
    def _per_prompt(value, default, count: int, name: str) -> list:
        """`value` as one entry per prompt: None -> `default` for each, a single LoRARequest for each, else
        a sequence of exactly `count` entries."""
        if value is None or isinstance(value, LoRARequest):
            return [default if value is None else value] * count
        value = list(value)
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
        return value

    def embed(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = False) -> list[EmbeddingRequestOutput]:
        """Embed each prompt (text, or a list of token ids) with the pooling runner (`runner="pooling"`, or
        a model that `auto` makes one); one `EmbeddingRequestOutput` per prompt, in order. The prompts are
        batched as generation's are: several per step, long ones in chunks."""
        return self.engine.call(lambda: self._embed(prompts, pooling_params, use_tqdm), on_follower=[])

    def _embed(self, prompts, pooling_params, use_tqdm: bool) -> list[EmbeddingRequestOutput]:
        encoded, pooling_params = self._encoded(prompts, PoolingParams() if pooling_params is None else pooling_params,
                                                PoolingParams, "pooling_params")
        for index, ((_, ids, images), params) in enumerate(zip(encoded, pooling_params)):  # all checked first
            if images:
                raise ValueError(f"prompts[{index}].multi_modal_data: the pooling runner takes no images")
            self.engine.pooling.validate(ids, params)
        ids = [self.engine.pooling.add(ids, params, prompt=text)
               for (text, ids, _), params in zip(encoded, pooling_params)]
        done: dict[str, EmbeddingRequestOutput] = {}
        with tqdm(total=len(ids), desc="Embedding", disable=not use_tqdm) as bar:
            while len(done) < len(ids):
                for output in self.engine.step():
                    done[output.request_id] = output
                    bar.update()
        return [done[i] for i in ids]

    def _encoded(self, prompts, params, params_type: type, name: str) -> tuple[list[tuple[str | None, list[int],
                                                                                      tuple]], list]:
        """The prompts as a list of (text or None, token ids, images), and `params` as one entry per prompt. A
        prompt is text, token ids, a list of token ids with its images (`chat`), or vLLM's dict forms:
        `{"prompt": text}`, `{"prompt_token_ids": ids}`, `{"prompt": text, "multi_modal_data": ...}`."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise ValueError("prompts is empty: pass at least one prompt")
        if isinstance(params, params_type):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{name} has {len(params)} entries for {len(prompts)} prompts")
        tokenizer = self.engine.tokenizer
        encoded = []
        for i, p in enumerate(prompts):
            if isinstance(p, dict) and "multi_modal_data" in p:
                prompt = self._image_prompt(p, i)
                encoded.append((prompt.text, list(prompt.token_ids), prompt.images))
            elif isinstance(p, _WithImages):
                encoded.append((None, list(p.token_ids), p.images))
            else:
                p = _prompt_of(p, i)
                encoded.append((p, tokenizer.encode(p), ()) if isinstance(p, str) else (None, list(p), ()))
        return encoded, params

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             use_tqdm: bool = False, lora_request: LoRARequest | None = None) -> list[RequestOutput]:
        """Apply the chat template to one conversation (or a list of them) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer

        def render(conversation: list[dict]) -> str:
            return tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                 chat_template=chat_template)

        def chat() -> list[RequestOutput]:
            prompts = []
            for conversation in conversations:
                prompt = None
                if any(isinstance(m.get("content"), list) for m in conversation):
                    prompt = self._chat_images(conversation, render)
                prompts.append(tokenizer.encode(render(conversation), add_special_tokens=False) if prompt is None
                               else _WithImages(prompt.token_ids, prompt.images))
            return self._generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

        return self.engine.call(chat, on_follower=[])

    # -- images: loaded, checked and prepared for the engine, which refuses them for a model it runs none of ----

    def _images(self):
        if self._image_inputs is None:
            from jaxserve.multimodal.prompt import ImageInputs
            self._image_inputs = ImageInputs.from_args(self.engine.args, self.engine.model_name)
        return self._image_inputs

    def _chat_images(self, conversation: list[dict], render):
        """A conversation's image parts through the request side: its `MultiModalPrompt`, or None without
        images (ValueError naming the part)."""
        from jaxserve.multimodal.chat_parts import split_images
        messages, sources = split_images(conversation)
        if not sources:
            return None
        inputs = self._images()
        inputs.check(sources)
        return inputs.prompt(render(messages), inputs.load(sources), sources,
                             lambda text: self.engine.tokenizer.encode(text, add_special_tokens=False))

    def _image_prompt(self, prompt: dict, index: int):
        """vLLM's `{"prompt": text, "multi_modal_data": {"image": ...}}` through the request side: its
        `MultiModalPrompt`."""
        from jaxserve.multimodal.chat_parts import ImageSource
        data, field = prompt["multi_modal_data"], f"prompts[{index}].multi_modal_data"
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError(f"{field} must be {{'image': <PIL image or a list of them>}} (images only)")
        if not isinstance(prompt.get("prompt"), str):
            raise ValueError(f"{field} needs the prompt as text ('prompt'), with the model's image placeholder "
                             f"once per image")
        images = data["image"] if isinstance(data["image"], (list, tuple)) else [data["image"]]
        sources = [ImageSource(image, f"{field}.image[{k}]") for k, image in enumerate(images)]
        inputs = self._images()
        inputs.check(sources)
        return inputs.prompt(prompt["prompt"], inputs.load(sources), sources, self.engine.tokenizer.encode,
                             field=f"prompts[{index}].prompt")

    def _run(self, request_ids: list[str], choices: list[int], use_tqdm: bool) -> list[RequestOutput]:
        """Step until every choice of every request is finished; one RequestOutput per request, its
        `outputs` holding every choice in index order (vLLM's shape)."""
        done: dict[str, list[RequestOutput]] = {i: [] for i in request_ids}
        prompt_logprobs: dict[str, list] = {}
        with tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm) as bar:
            remaining = len(request_ids)
            while remaining:
                for output in self.engine.step():
                    if output.prompt_logprobs is not None:
                        prompt_logprobs[output.request_id] = output.prompt_logprobs
                    if output.finished:
                        finals = done[output.request_id]
                        finals.append(output)
                        if len(finals) == choices[request_ids.index(output.request_id)]:
                            remaining -= 1
                            bar.update()
        results = []
        for request_id in request_ids:
            finals = sorted(done[request_id], key=lambda o: o.index)
            result = dataclasses.replace(finals[0], outputs=[o.outputs[0] for o in finals], index=0,
                                         prompt_logprobs=prompt_logprobs.get(request_id))
            results.append(result)
        return results


@dataclasses.dataclass(frozen=True)
class _WithImages:
    """A chat prompt prepared with its images (`chat`)."""
    token_ids: list[int]
    images: tuple


def _prompt_of(prompt, index: int):
    """A prompt's text or token ids, from any form `generate` and `embed` take; a dict of vLLM's shapes
    (`TextPrompt`, `TokensPrompt`) gives its text or ids, and anything it does not serve is refused by name."""
    if not isinstance(prompt, dict):
        return prompt
    unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
    if unknown:
        raise ValueError(f"prompts[{index}] has unsupported keys {sorted(unknown)}: "
                         "pass {'prompt': text} or {'prompt_token_ids': [ids]}")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError(f"prompts[{index}] needs exactly one of 'prompt' and 'prompt_token_ids'")
    if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise ValueError(f"prompts[{index}]['prompt'] must be a string")
        return prompt["prompt"]
    ids = prompt["prompt_token_ids"]
    if isinstance(ids, (str, bytes)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"prompts[{index}]['prompt_token_ids'] must be a list of integers")
    return list(ids)
