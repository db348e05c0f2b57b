"""The vision encoders and M-RoPE positions against transformers (tests/fixtures/vlm, float32): Gemma 3's
SigLIP tower and projector, Qwen2.5-VL's windowed ViT and merger (alone, several images in one call, and
padded to a bucket), loaded by their checkpoint names; Qwen's 3-axis positions and rotary cos / sin."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.json_files import read_json_object
from jaxserve.loader.encoders import load_vision_encoder
from jaxserve.model.mrope import mrope_cos_sin, mrope_positions, text_positions
from jaxserve.model.qwen_vit import vision_layout
from jaxserve.vision_config import QwenVisionConfig, SiglipConfig, vision_config

VLM = Path(__file__).parent / "fixtures" / "vlm"
TOL = 1e-4
NUM_IMAGES = 3
CASES = ("text_only", "one_image", "two_images", "second_turn")


def golden(family: str) -> dict:
    return dict(np.load(VLM / family / "golden.npz"))


@pytest.fixture(scope="module")
def gemma3():
    return load_vision_encoder(VLM / "gemma3"), golden("gemma3")


@pytest.fixture(scope="module")
def qwen():
    return load_vision_encoder(VLM / "qwen2_5_vl"), golden("qwen2_5_vl")


def test_configs_are_read_with_their_derived_sizes():
    c = vision_config(read_json_object(VLM / "gemma3" / "config.json"))
    assert isinstance(c, SiglipConfig)
    assert (c.patches_per_side, c.tokens_per_side, c.pool_kernel, c.text_hidden_size) == (8, 4, 2, 64)
    q = vision_config(read_json_object(VLM / "qwen2_5_vl" / "config.json"))
    assert isinstance(q, QwenVisionConfig)
    assert (q.window_tokens, q.merge_unit, q.patch_dim, q.fullatt_block_indexes) == (4, 4, 1176, (1, 3))
    with pytest.raises(ValueError, match="must be a square"):
        SiglipConfig(32, 64, 1, 2, 64, 8, 64, mm_tokens_per_image=15)


@jax.jit
def tower_and_embeddings(graphdef, state, pixels):
    encoder = nnx.merge(graphdef, state)
    tower = encoder.vision_tower(pixels)
    return tower, encoder.multi_modal_projector(tower)


def test_gemma3_tower_and_projector_match_transformers(gemma3):
    encoder, g = gemma3
    pixels = jnp.asarray(np.stack([g[f"image{i}.pixel_values"] for i in range(NUM_IMAGES)]))
    graphdef, state = nnx.split(encoder)
    tower, embeddings = tower_and_embeddings(graphdef, state, pixels)
    for i in range(NUM_IMAGES):
        np.testing.assert_allclose(tower[i], g[f"image{i}.tower"], rtol=0, atol=TOL)
        np.testing.assert_allclose(embeddings[i], g[f"image{i}.embeddings"], rtol=0, atol=TOL)
    assert embeddings.shape == (NUM_IMAGES, 16, 64)


BUCKET = 256  # patches: every image alone and all three together fit one compiled program


@jax.jit
def encode(graphdef, state, patches, layout):
    """The encoder as the engine will run it: split once, one jitted pure function over its state."""
    return nnx.merge(graphdef, state)(patches, layout)


def run_qwen(encoder, g, indices, num_patches=BUCKET):
    config = encoder.config
    patches = np.concatenate([g[f"image{i}.pixel_values"] for i in indices])
    layout = vision_layout([tuple(g[f"image{i}.grid_thw"]) for i in indices], config, num_patches)
    if num_patches is not None:
        patches = np.concatenate([patches, np.zeros((num_patches - len(patches), patches.shape[1]), np.float32)])
    graphdef, state = nnx.split(encoder)
    out = np.asarray(encode(graphdef, state, jnp.asarray(patches), layout))
    assert np.isfinite(out).all()  # padding rows too: they attend only among themselves
    return out[: len(patches) // 4] if num_patches is None else out


def test_qwen_vit_matches_transformers_one_image_at_a_time(qwen):
    """Each image alone, padded to the bucket: its rows first, padding rows after them."""
    encoder, g = qwen
    for i in range(NUM_IMAGES):
        expected = g[f"image{i}.embeddings"]
        out = run_qwen(encoder, g, [i])
        assert out.shape == (BUCKET // 4, 64)
        np.testing.assert_allclose(out[: len(expected)], expected, rtol=0, atol=TOL)


def test_qwen_vit_several_images_in_one_call(qwen):
    """All images in one call (windows and full attention never cross images), unpadded and in the bucket."""
    encoder, g = qwen
    expected = g["all_images.embeddings"]
    np.testing.assert_allclose(run_qwen(encoder, g, range(NUM_IMAGES), None), expected, rtol=0, atol=TOL)
    np.testing.assert_allclose(run_qwen(encoder, g, range(NUM_IMAGES))[: len(expected)], expected, rtol=0, atol=TOL)


def test_vision_layout_windows(qwen):
    """The landscape (10 x 14 patches, 5 x 7 merged units) is cut into 4 x 4-unit windows, the last row and
    column partial; full attention groups by image; the window order is a permutation restore undoes."""
    encoder, g = qwen
    layout = vision_layout([(1, 10, 14)], encoder.config)
    units = layout.window_segment[::4]
    assert np.bincount(units).tolist() == [16, 12, 4, 3]
    assert sorted(layout.window_index.tolist()) == list(range(35))
    assert np.array_equal(layout.window_index[layout.restore], np.arange(35))
    assert set(layout.image_segment.tolist()) == {0}
    first_window = layout.positions[:64]  # units (0..3, 0..3) -> patch rows and columns 0..7
    assert first_window.max() == 7 and first_window.min() == 0
    with pytest.raises(ValueError, match="do not fit a bucket"):
        vision_layout([(1, 10, 14)], encoder.config, num_patches=100)


def qwen_text_config():
    text = read_json_object(VLM / "qwen2_5_vl" / "config.json")["text_config"]
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    rope = text["rope_parameters"]
    inv_freq = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    return inv_freq, rope["mrope_section"]


@pytest.mark.parametrize("case", CASES)
def test_mrope_positions_and_angles_match_transformers(case):
    g = golden("qwen2_5_vl")
    cfg = read_json_object(VLM / "qwen2_5_vl" / "config.json")
    ids = np.concatenate([g[f"{case}.input_ids"], g[f"{case}.greedy"]])
    grids = [tuple(g[f"image{i}.grid_thw"]) for i in g[f"{case}.images"]]
    positions, delta = mrope_positions(ids, cfg["image_token_id"], grids, 2)
    np.testing.assert_array_equal(positions, g[f"{case}.positions"])
    assert delta == int(g[f"{case}.rope_delta"])
    # The generated tokens after the prompt: sequence index + delta on every axis.
    prompt_len = len(g[f"{case}.input_ids"])
    np.testing.assert_array_equal(positions[:, prompt_len:], text_positions(prompt_len, len(ids) - prompt_len, delta))
    inv_freq, sections = qwen_text_config()
    cos, sin = mrope_cos_sin(jnp.asarray(positions), inv_freq, sections)
    np.testing.assert_allclose(cos, g[f"{case}.cos"], rtol=0, atol=TOL)
    np.testing.assert_allclose(sin, g[f"{case}.sin"], rtol=0, atol=TOL)


def test_mrope_refuses_runs_that_do_not_match_the_grids():
    with pytest.raises(ValueError, match="do not match"):
        mrope_positions([1, 5, 5, 5, 2], 5, [(1, 4, 4)], 2)


def test_loading_names_the_missing_tensor(tmp_path):
    import shutil
    from safetensors.numpy import load_file, save_file
    shutil.copy(VLM / "qwen2_5_vl" / "config.json", tmp_path / "config.json")
    tensors = load_file(VLM / "qwen2_5_vl" / "model.safetensors")
    dropped = next(name for name in tensors if name.endswith("merger.mlp.2.weight"))
    save_file({k: v for k, v in tensors.items() if k != dropped}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing vision tensor .*merger.mlp.2.weight"):
        load_vision_encoder(tmp_path)
