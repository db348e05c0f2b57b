#!/usr/bin/env python3
"""Generate golden fixtures for the vision-language families (issue 53): tiny random Gemma 3 and Qwen2.5-VL.

Run with the golden venv (torch never goes into the project venv; recipe in golden_common.py, plus
`pip install pillow`). The image processors are transformers' PIL ones (the ones jaxserve reproduces, asked
for by name); Qwen2.5-VL's processor is used without its video half, whose video processor needs torchvision
(the index has no torchvision wheel that runs on this CPU torch):

    .venv-golden/bin/python tools/make_vlm_fixtures.py [gemma3 | qwen2_5_vl ...]

Steps, into ``tests/fixtures/vlm/``:

1. ``images/``: three small PNGs drawn from a seed (an RGB landscape, an RGBA image with varying
   transparency, a portrait in grey levels), shared by both families.
2. Per family, ``<family>/``: a float32 random model (fixed seed, vision tower included) saved with
   ``save_pretrained``; a character-level tokenizer built here with the family's special tokens, a small
   chat template of the family's shape, and the processor's files, all saved by transformers' own
   processor (so they load as a hub checkpoint's do).
3. ``<family>/golden.npz``: for every image alone, the processor's pixel values and the vision encoder's
   outputs; for four conversations (text only, one image, two images in one message, an image in a
   second turn) the rendered prompt, the processor's input ids, 8 greedy tokens (``generate``) and the
   logits of one full forward over prompt + greedy tokens; Qwen2.5-VL adds the M-RoPE positions and the
   rotary cos / sin. Keys and shapes are listed in tests/fixtures/vlm/README.md.
4. Feature checks: switching off Gemma 3's bidirectional image attention, Qwen's M-RoPE or its window
   attention moves the outputs, so each fixture really tests it.
Deterministic: fixed seeds, one CPU thread, fixed zip timestamps.
"""

from __future__ import annotations

import copy
import json
import sys

import numpy as np
import torch
from PIL import Image
from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import (AutoModelForImageTextToText, AutoProcessor, AutoTokenizer, GenerationConfig,
                          PreTrainedTokenizerFast, Qwen2_5_VLProcessor)
from transformers.processing_utils import ProcessorMixin

from golden_common import (FIXTURES_ROOT, fresh_dir, list_dir, random_model, save_model, save_npz_deterministic,
                           setup_determinism, top_gap)

OUT_ROOT = FIXTURES_ROOT / "vlm"
NEW_TOKENS = 8
SLIDING, FULL = "sliding_attention", "full_attention"
CHARS = [chr(i) for i in range(32, 127)] + ["\n"]

GEMMA3_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                   "<end_of_image>", "<image_soft_token>"]
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>", "<unk>"]
G = {t: i for i, t in enumerate(GEMMA3_SPECIALS)}  # token ids by string
Q = {t: i for i, t in enumerate(QWEN_SPECIALS)}

GEMMA3 = dict(
    text_config=dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, intermediate_size=64, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
                     layer_types=[SLIDING, FULL], hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                     rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                                      FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}},
                     max_position_embeddings=512, bos_token_id=G["<bos>"], eos_token_id=G["<eos>"],
                     pad_token_id=G["<pad>"], tie_word_embeddings=True),
    vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, image_size=64, patch_size=8, layer_norm_eps=1e-6,
                       hidden_act="gelu_pytorch_tanh", vision_use_head=False),
    mm_tokens_per_image=16, boi_token_index=G["<start_of_image>"], eoi_token_index=G["<end_of_image>"],
    image_token_index=G["<image_soft_token>"], bos_token_id=G["<bos>"], eos_token_id=G["<eos>"],
    pad_token_id=G["<pad>"], tie_word_embeddings=True, dtype="float32")

QWEN = dict(
    text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, use_sliding_window=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
                     bos_token_id=Q["<|endoftext|>"], eos_token_id=Q["<|im_end|>"],
                     pad_token_id=Q["<|endoftext|>"], tie_word_embeddings=False),
    vision_config=dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                       spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1, 3],
                       tokens_per_second=2, hidden_act="silu"),
    image_token_id=Q["<|image_pad|>"], video_token_id=Q["<|video_pad|>"],
    vision_start_token_id=Q["<|vision_start|>"], vision_end_token_id=Q["<|vision_end|>"],
    tie_word_embeddings=False, dtype="float32")
QWEN_MIN_PIXELS, QWEN_MAX_PIXELS = 56 * 56, 28 * 28 * 40  # small images: the landscape is scaled down

# Chat templates of each family's shape (written here, not copied): images render as the placeholder the
# processor expands; Gemma 3 knows only {"type": "image"} parts, as its hub template.
CONTENT = ("{% if message['content'] is string %}{{ message['content'] }}{% else %}"
           "{% for part in message['content'] %}{% if part['type'] == 'image' %}IMAGE"
           "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}")
GEMMA3_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<start_of_turn>"
                   "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
                   + CONTENT.replace("IMAGE", "<start_of_image>") + "<end_of_turn>\n{% endfor %}"
                   "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
QWEN_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                 + CONTENT.replace("IMAGE", "<|vision_start|><|image_pad|><|vision_end|>") + "<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

IMAGE_NAMES = ("landscape", "rgba", "portrait")
CASES = {  # conversation, images (by index into IMAGE_NAMES) in order
    "text_only": ([{"role": "user", "content": "Say something short."}], []),
    "one_image": ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}], [0]),
    "two_images": ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " and "},
                                                 {"type": "image"}, {"type": "text", "text": ": compare."}]}], [0, 1]),
    "second_turn": ([{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi! Show me."},
                     {"role": "user", "content": [{"type": "text", "text": "Here: "}, {"type": "image"}]}], [2]),
}


# --------------------------------------------------------------------------- inputs
def make_images() -> list[Image.Image]:
    """Smooth gradients with seeded noise (PNG keeps them small), in three modes and aspect ratios."""
    rng = np.random.default_rng(5300)
    out_dir = OUT_ROOT / "images"
    out_dir.mkdir(parents=True, exist_ok=True)
    images = []
    for name, (w, h), mode in zip(IMAGE_NAMES, [(300, 200), (30, 20), (60, 150)], ["RGB", "RGBA", "L"]):
        yy, xx = np.mgrid[0:h, 0:w]
        channels = [(xx * 255 // w), (yy * 255 // h), ((xx + yy) * 127 // (w + h) + 64)]
        rgb = np.stack(channels, -1) + rng.integers(-20, 21, size=(h, w, 3))
        rgb = np.clip(rgb, 0, 255).astype(np.uint8)
        if mode == "RGBA":
            alpha = (xx * 255 // max(w - 1, 1)).astype(np.uint8)[..., None]  # transparent left, opaque right
            image = Image.fromarray(np.concatenate([rgb, alpha], -1), "RGBA")
        elif mode == "L":
            image = Image.fromarray(rgb, "RGB").convert("L")
        else:
            image = Image.fromarray(rgb, "RGB")
        image.save(out_dir / f"{name}.png", optimize=True)
        images.append(Image.open(out_dir / f"{name}.png"))
        images[-1].load()
    return images


def char_tokenizer(specials: list[str], **named) -> PreTrainedTokenizerFast:
    """Special tokens first (ids 0..), then one token per printable ASCII character and newline."""
    vocab = {t: i for i, t in enumerate(specials + CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", **named)


# --------------------------------------------------------------------------- running
def greedy(model, inputs: dict) -> np.ndarray:
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        cfg = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
        with torch.no_grad():
            out = model.generate(**inputs, generation_config=cfg)
    finally:
        model.generation_config.eos_token_id = saved
    prompt_len = inputs["input_ids"].shape[1]
    assert out.shape == (1, prompt_len + NEW_TOKENS), out.shape
    return out[0, prompt_len:].numpy().astype(np.int32)


def extended(inputs: dict, tokens: np.ndarray) -> dict:
    """The processor's inputs with `tokens` appended as text (token types 0)."""
    more = torch.tensor(tokens[None], dtype=torch.long)
    out = dict(inputs)
    out["input_ids"] = torch.cat([inputs["input_ids"], more], 1)
    out["attention_mask"] = torch.ones_like(out["input_ids"])
    for key in ("token_type_ids", "mm_token_type_ids"):
        if key in inputs:
            out[key] = torch.cat([inputs[key], torch.zeros_like(more, dtype=inputs[key].dtype)], 1)
    return out


def logits_of(model, inputs: dict) -> np.ndarray:
    with torch.no_grad():
        return model(**inputs).logits[0].float().numpy().astype(np.float32)


def process(processor, prompt: str, images: list, family: str) -> dict:
    # Gemma 3's processor takes a list of images per prompt; Qwen's a flat list for the batch.
    kwargs = {"images": [images] if family == "gemma3" else images} if images else {}
    return dict(processor(text=[prompt], return_tensors="pt", add_special_tokens=False, **kwargs))


def run_case(model, processor, name: str, images: list, family: str) -> tuple[dict, dict, float]:
    messages, indices = CASES[name]
    prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = process(processor, prompt, [images[i] for i in indices], family)
    tokens = greedy(model, inputs)
    full = extended(inputs, tokens)
    logits = logits_of(model, full)
    prompt_len = inputs["input_ids"].shape[1]
    steps = logits[prompt_len - 1: prompt_len - 1 + NEW_TOKENS]
    assert np.array_equal(steps.argmax(-1), tokens), (name, steps.argmax(-1), tokens)
    gap = min(top_gap(row) for row in steps)
    arrays = {"prompt": np.array(prompt), "input_ids": inputs["input_ids"][0].numpy().astype(np.int32),
              "images": np.array(indices, dtype=np.int32), "greedy": tokens, "logits": logits}
    type_key = "token_type_ids" if family == "gemma3" else "mm_token_type_ids"
    arrays["token_type_ids"] = inputs[type_key][0].numpy().astype(np.int32)
    print(f"  {name}: {prompt_len} prompt tokens, images {indices}, greedy {tokens.tolist()}, min gap {gap:.4f}")
    return {f"{name}.{k}": v for k, v in arrays.items()}, full, gap


def save_processor(processor, out_dir):
    """Save the processor with transformers and load it back as a user would, with the PIL image backend."""
    processor.save_pretrained(out_dir)
    try:
        reloaded = AutoProcessor.from_pretrained(out_dir, backend="pil")
    except (ImportError, ValueError, OSError) as e:  # Qwen's video half wants torchvision
        print(f"  AutoProcessor could not load the saved processor ({type(e).__name__}: {e}); using the one built")
        return processor
    assert type(reloaded.image_processor).__name__.endswith("Pil"), type(reloaded.image_processor)
    return reloaded


class QwenImageTextProcessor(Qwen2_5_VLProcessor):
    """Qwen2.5-VL's processor without its video half, whose video processor needs torchvision (the wheel for
    this CPU torch is not on the index): the same text and image processing, the same saved files."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token, self.video_token = tokenizer.image_token, tokenizer.video_token
        self.image_token_id = tokenizer.image_token_id
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


def image_only_processor(image_processor, tokenizer) -> QwenImageTextProcessor:
    return QwenImageTextProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=QWEN_TEMPLATE)


def check_cases_share_pixels(arrays: dict, family: str, cases: dict) -> None:
    """A case's pixel values are its images' pixel values, each processed alone, concatenated."""
    for name, full in cases.items():
        indices = arrays[f"{name}.images"].tolist()
        if not indices:
            assert "pixel_values" not in full, name
            continue
        mine = [arrays[f"image{i}.pixel_values"] for i in indices]
        expected = np.stack(mine) if family == "gemma3" else np.concatenate(mine)
        assert np.array_equal(full["pixel_values"].numpy(), expected), name


# --------------------------------------------------------------------------- families
def make_gemma3(images: list) -> None:
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor
    out = fresh_dir(OUT_ROOT / "gemma3")
    model = random_model("gemma3", GEMMA3, 5301, auto_class=AutoModelForImageTextToText, unit_offset_norm=True,
                         embed_std=0.05)
    with torch.no_grad():  # as the parity fixtures: a larger final-norm gain against copying the input token
        w = model.model.language_model.norm.weight
        w.copy_((1 + w) * 3.0 - 1)
    save_model(model, out)
    tokenizer = char_tokenizer(GEMMA3_SPECIALS, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                               boi_token="<start_of_image>", eoi_token="<end_of_image>",
                               image_token="<image_soft_token>")
    vision = GEMMA3["vision_config"]
    processor = save_processor(Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": vision["image_size"], "width": vision["image_size"]}),
        tokenizer=tokenizer, chat_template=GEMMA3_TEMPLATE, image_seq_length=GEMMA3["mm_tokens_per_image"]), out)

    arrays = {}
    for i, image in enumerate(images):
        pixels = processor.image_processor(images=[image], return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            feats = model.model.get_image_features(pixels)
        arrays[f"image{i}.pixel_values"] = pixels[0].numpy()
        arrays[f"image{i}.tower"] = feats.last_hidden_state[0].numpy()
        arrays[f"image{i}.embeddings"] = feats.pooler_output[0].numpy()
    cases = {}
    for name in CASES:
        case, cases[name], _ = run_case(model, processor, name, images, "gemma3")
        arrays.update(case)
    check_cases_share_pixels(arrays, "gemma3", cases)

    reloaded = AutoModelForImageTextToText.from_pretrained(out, attn_implementation="eager", dtype=torch.float32)
    assert np.array_equal(logits_of(reloaded.eval(), cases["one_image"]), arrays["one_image.logits"])
    causal = dict(cases["one_image"])
    causal.pop("token_type_ids")  # without it transformers attends causally inside the image too
    diff = np.abs(logits_of(model, causal) - arrays["one_image.logits"]).max()
    assert diff > 1e-2, diff
    print(f"  bidirectional attention within an image active: max|logit diff| {diff:.3f} when causal")
    save_npz_deterministic(out / "golden.npz", arrays)
    list_dir(out)


def make_qwen2_5_vl(images: list) -> None:
    from transformers import Qwen2VLImageProcessorPil
    out = fresh_dir(OUT_ROOT / "qwen2_5_vl")
    model = random_model("qwen2_5_vl", QWEN, 5302, auto_class=AutoModelForImageTextToText)
    save_model(model, out)
    tokenizer = char_tokenizer(QWEN_SPECIALS, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                               image_token="<|image_pad|>", video_token="<|video_pad|>",
                               vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>")
    image_processor = Qwen2VLImageProcessorPil(min_pixels=QWEN_MIN_PIXELS, max_pixels=QWEN_MAX_PIXELS)
    image_only_processor(image_processor, tokenizer).save_pretrained(out)
    for name in ("processor_config.json", "tokenizer_config.json"):  # name the class a hub checkpoint names
        cfg = json.loads((out / name).read_text())
        cfg["processor_class"] = "Qwen2_5_VLProcessor"
        (out / name).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    # Loaded back from the saved files, as a user's AutoProcessor would (less the video half).
    processor = image_only_processor(Qwen2VLImageProcessorPil.from_pretrained(out), AutoTokenizer.from_pretrained(out))
    visual = model.model.visual

    arrays, grids, pixels = {}, [], []
    for i, image in enumerate(images):
        proc = processor.image_processor(images=[image], return_tensors="pt")
        with torch.no_grad():
            merged = visual(proc["pixel_values"], grid_thw=proc["image_grid_thw"]).pooler_output
        arrays[f"image{i}.pixel_values"] = proc["pixel_values"].numpy()
        arrays[f"image{i}.grid_thw"] = proc["image_grid_thw"][0].numpy().astype(np.int32)
        arrays[f"image{i}.embeddings"] = merged.numpy()
        grids.append(proc["image_grid_thw"])
        pixels.append(proc["pixel_values"])
    with torch.no_grad():  # all three images in one call: the layout of several images
        arrays["all_images.embeddings"] = visual(torch.cat(pixels), grid_thw=torch.cat(grids)).pooler_output.numpy()
    assert np.array_equal(arrays["all_images.embeddings"],
                          np.concatenate([arrays[f"image{i}.embeddings"] for i in range(len(images))]))

    cases = {}
    for name in CASES:
        case, full, _ = run_case(model, processor, name, images, "qwen2_5_vl")
        cases[name] = full
        with torch.no_grad():
            positions, delta = model.model.get_rope_index(full["input_ids"], mm_token_type_ids=full["mm_token_type_ids"],
                                                          image_grid_thw=full.get("image_grid_thw"))
            cos, sin = model.model.language_model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
        half = cos.shape[-1] // 2
        case.update({f"{name}.positions": positions[:, 0].numpy().astype(np.int32),
                     f"{name}.rope_delta": np.array(int(delta.reshape(-1)[0]), dtype=np.int32),
                     f"{name}.cos": cos[0, :, :half].numpy(), f"{name}.sin": sin[0, :, :half].numpy()})
        arrays.update(case)
    check_cases_share_pixels(arrays, "qwen2_5_vl", cases)

    reloaded = AutoModelForImageTextToText.from_pretrained(out, attn_implementation="eager", dtype=torch.float32)
    assert np.array_equal(logits_of(reloaded.eval(), cases["one_image"]), arrays["one_image.logits"])
    flat = dict(cases["one_image"])
    n = flat["input_ids"].shape[1]
    flat["position_ids"] = torch.arange(n)[None, None].expand(3, 1, n)
    diff = np.abs(logits_of(model, flat) - arrays["one_image.logits"]).max()
    assert diff > 1e-2, diff
    print(f"  M-RoPE active: max|logit diff| {diff:.3f} with 1-D positions")
    everywhere = copy.deepcopy(visual)
    everywhere.fullatt_block_indexes = list(range(len(everywhere.blocks)))
    with torch.no_grad():
        full_attention = everywhere(pixels[0], grid_thw=grids[0]).pooler_output.numpy()
    diff = np.abs(full_attention - arrays["image0.embeddings"]).max()
    assert diff > 1e-2, diff
    print(f"  window attention active: max|diff| {diff:.3f} of the landscape's embeddings with full attention")
    save_npz_deterministic(out / "golden.npz", arrays)
    list_dir(out)


FAMILIES = {"gemma3": make_gemma3, "qwen2_5_vl": make_qwen2_5_vl}


def main(argv: list[str]) -> int:
    setup_determinism()
    images = make_images()
    for name in argv[1:] or list(FAMILIES):
        print(f"{name}:")
        FAMILIES[name](images)
    list_dir(OUT_ROOT / "images")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
