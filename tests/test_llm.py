"""The offline API and CLI on the real stories260K checkpoint."""

import os
from pathlib import Path
import subprocess
import sys

import pytest

from jaxserve import SamplingParams


def test_readme_story_from_bare_bos(stories_llm, story_text):
    tok = stories_llm.get_tokenizer()
    expected = tok.encode(story_text, add_special_tokens=False)
    out = stories_llm.generate([""], SamplingParams(temperature=0, max_tokens=len(expected)))[0].outputs[0]
    assert out.token_ids == expected
    assert out.text == story_text
    assert out.finish_reason == "length"


def test_readme_story_from_once_upon_a_time(stories_llm, story_text):
    tok = stories_llm.get_tokenizer()
    prompt = "Once upon a time"
    assert tok.encode(prompt) == [1, 403, 407, 261, 378]
    full = tok.encode(story_text)
    expected = full[5:]
    out = stories_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=len(expected)))[0]
    assert out.prompt_token_ids == full[:5]
    assert out.outputs[0].token_ids == expected
    assert out.outputs[0].text == story_text[len(prompt):]


def test_story_ends_on_eos_id_1(stories_llm):
    # The model ends a story by emitting BOS (id 1), which generation_config lists as an EOS id.
    out = stories_llm.generate(["The cat"], SamplingParams(temperature=0, max_tokens=500))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == 1 and out.token_ids[-1] == 1
    assert len(out.token_ids) < 500


def test_cli_generate_matches_readme(stories_dir, story_text, stories_llm):
    max_tokens = len(stories_llm.get_tokenizer().encode(story_text)) - 5
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-m", "jaxserve", "generate", "--model", str(stories_dir),
                             "--prompt", "Once upon a time", "--max-tokens", str(max_tokens), "--max-num-batched-tokens", "16",
                             "--max-num-seqs", "2", "--stop", "park", "--stop", "ball"],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    story = story_text[len("Once upon a time"):]
    assert result.stdout.rstrip("\n") == story[:story.index("park")]  # the first stop string cuts it
    assert "finish_reason=stop" in result.stderr
    assert "attention kernels: blocked (jnp)" in result.stderr  # the log says which kernels and precision
    assert "float32" in result.stderr
    assert "Loading weights" in result.stderr and "Compiling" in result.stderr  # progress is shown


def test_cli_serve_takes_the_model_as_vllm_does_and_generate_takes_stops():
    from jaxserve.entrypoints.args import engine_args_from
    from jaxserve.entrypoints.cli import build_parser
    here = str(Path(__file__).parent)
    ns = build_parser().parse_args(["serve", here, "--max-num-seqs", "2"])
    assert engine_args_from(ns).model == here
    ns = build_parser().parse_args(["serve", here, "--model", "/elsewhere"])
    with pytest.raises(ValueError, match="given twice"):
        engine_args_from(ns)
    ns = build_parser().parse_args(["generate", "--prompt", "x", "--stop-token-ids", "5,6", "--ignore-eos"])
    assert ns.stop_token_ids == "5,6" and ns.ignore_eos


def test_many_prompts_batch_continuously_and_keep_order(stories_llm):
    prompts = ["Once upon a time", "The cat", "Tom had a dog", "", "A bird", "Lily"]
    alone = [stories_llm.generate([p], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0].token_ids
             for p in prompts]
    together = stories_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    assert [o.outputs[0].token_ids for o in together] == alone


def test_vllm_prompt_dicts_give_what_text_and_ids_give(stories_llm):
    """vLLM's `TextPrompt` and `TokensPrompt` dicts, alone or in a list with plain prompts, as their text or
    ids give; a dict the engine cannot serve is refused by name before anything is queued."""
    greedy = SamplingParams(temperature=0, max_tokens=8)
    ids = stories_llm.get_tokenizer().encode("The cat")
    plain = [o.outputs[0].token_ids for o in stories_llm.generate(["Lily", ids], greedy)]
    as_dicts = stories_llm.generate([{"prompt": "Lily"}, {"prompt_token_ids": ids}], greedy)
    assert [o.outputs[0].token_ids for o in as_dicts] == plain
    assert as_dicts[1].prompt_token_ids == ids and as_dicts[0].prompt == "Lily"
    assert stories_llm.generate({"prompt_token_ids": ids}, greedy)[0].outputs[0].token_ids == plain[1]
    for bad, match in (({"prompt": "a", "prompt_token_ids": [1]}, "exactly one"), ({}, "exactly one"),
                       ({"prompt_token_ids": "1 2"}, "list of integers"), ({"prompt": 5}, "must be a string"),
                       ({"prompt": "a", "multi_modal_data": {"image": None}}, "takes no images"),
                       ({"prompt": "a", "multi_modal_data": {"audio": None}}, "images only"),
                       ({"prompt": "a", "mm_processor_kwargs": {}}, "unsupported keys")):
        with pytest.raises(ValueError, match=match):
            stories_llm.generate(["Lily", bad], greedy)
    assert not stories_llm.engine.has_unfinished()


def test_seeded_sampling_is_reproducible_whatever_the_batch(stories_llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=1234, max_tokens=30)
    alone = stories_llm.generate(["Once upon a time"], params)[0].outputs[0].token_ids
    crowd = stories_llm.generate(["The cat", "Once upon a time", "A bird"],
                                 [SamplingParams(temperature=0.7, max_tokens=30), params,
                                  SamplingParams(temperature=0, max_tokens=30)])
    assert crowd[1].outputs[0].token_ids == alone
    other_seed = stories_llm.generate(["Once upon a time"], SamplingParams(temperature=1.0, top_p=0.9, top_k=40,
                                                                            seed=99, max_tokens=30))
    assert other_seed[0].outputs[0].token_ids != alone


def test_chat_applies_template(stories_llm):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    chat = stories_llm.chat([{"role": "user", "content": "Once upon a time"}],
                            SamplingParams(temperature=0, max_tokens=8), chat_template=template)
    plain = stories_llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=8))
    assert chat[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


@pytest.mark.parametrize("make_params, name", [
    (lambda: SamplingParams(max_tokens=0), "max_tokens"),
    (lambda: SamplingParams(max_tokens=-3), "max_tokens"),
    (lambda: SamplingParams(top_p=0.0), "top_p"),
    (lambda: SamplingParams(top_p=1.5), "top_p"),
    (lambda: SamplingParams(temperature=-0.1), "temperature"),
    (lambda: SamplingParams(min_p=2.0), "min_p"),
    (lambda: SamplingParams(top_k=-5), "top_k"),
])
def test_bad_sampling_params_name_the_parameter(make_params, name):
    with pytest.raises(ValueError, match=name):
        make_params()


def test_bad_prompts_raise_and_allocate_nothing(stories_llm):
    engine = stories_llm.engine
    free_before = engine.scheduler.allocator.num_free
    with pytest.raises(ValueError, match="prompts"):
        stories_llm.generate([])
    too_long = [1] + [403] * 600
    with pytest.raises(ValueError, match="context length"):
        # The first prompt is fine: the bad second one must stop both before anything is queued.
        stories_llm.generate([[1, 403], too_long], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="vocabulary"):
        stories_llm.generate([[1, 100000]])
    assert not engine.has_unfinished()
    assert engine.scheduler.allocator.num_free == free_before
    assert engine.scheduler.num_free_slots == engine.scheduler_config.max_num_seqs
    # And the engine still works afterwards.
    assert stories_llm.generate(["Lily"], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].token_ids
