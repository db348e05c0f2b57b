"""`jaxserve bench`: serve against a real test server (stories260K), latency and throughput offline."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxserve.entrypoints.cli import main as jaxserve_main
from jaxserve.engine_args import EngineArgs
from tests.server_harness import SHARED_ENGINE, free_port, running_server, scrape


def bench(argv: list[str]) -> int:
    """`jaxserve bench ...`, in this process."""
    return jaxserve_main(["bench", *argv])


@pytest.fixture(scope="module")
def server(stories_dir):
    with running_server(EngineArgs(model=str(stories_dir), **SHARED_ENGINE)) as running:
        yield running[0]


def test_bench_serve_reports_vllm_metrics_that_agree_with_the_server(server, stories_dir, tmp_path, capsys):
    before = scrape(server)
    result_file, plots = tmp_path / "result.json", tmp_path / "plots"
    assert bench(["serve", "--base-url", server, "--tokenizer", str(stories_dir), "--num-prompts", "6",
                  "--random-input-len", "16", "--random-output-len", "12", "--random-range-ratio", "0.5",
                  "--max-concurrency", "1,3", "--goodput", "ttft:60000", "tpot:60000", "--no-progress", "--num-warmups", "0",
                  "--save-result", str(result_file), "--plot", str(plots), "--label", "jaxserve"]) == 0
    after = scrape(server)
    out = capsys.readouterr().out
    assert "| concurrency |" in out and "goodput at concurrency 3" in out

    report = json.loads(result_file.read_text())
    assert report["model"] == "stories260K" and report["endpoint"] == "completions"
    assert [level["max_concurrency"] for level in report["levels"]] == [1, 3]
    for level in report["levels"]:
        m = level["metrics"]
        assert level["num_prompts"] == 6 and m["completed"] == 6 and m["failed"] == 0
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            stats = m[key]
            assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"], key
            assert stats["median"] == pytest.approx(stats["p50"])
        assert m["ttft_ms"]["median"] <= m["e2el_ms"]["median"]
        assert m["goodput"] == pytest.approx(m["request_throughput"])  # generous SLOs: every request is good
        assert m["output_throughput"] == pytest.approx(m["total_output_tokens"] / m["duration_s"])
        assert len(m["ttfts_ms"]) == 6 and len(m["output_lens"]) == 6
    # Output tokens are the server's own count: the sum over both levels equals its counter's increase.
    generated = after["jaxserve:generation_tokens_total"] - before["jaxserve:generation_tokens_total"]
    assert sum(level["metrics"]["total_output_tokens"] for level in report["levels"]) == generated

    # The plots are real PNGs with something drawn on them.
    import matplotlib.image
    for name in ("throughput.png", "latency.png", "cdf.png"):
        image = matplotlib.image.imread(plots / name)
        assert image.shape[0] > 200 and image.shape[1] > 200 and np.asarray(image).std() > 0.01


def test_bench_plot_draws_several_results_on_the_same_axes(server, tmp_path):
    files = []
    for label in ("one", "two"):
        path = tmp_path / f"{label}.json"
        # One count per level of the sweep.
        assert bench(["serve", "--base-url", server, "--num-prompts", "2,3", "--random-input-len", "8",
                      "--random-output-len", "4", "--max-concurrency", "1,2", "--no-progress", "--label", label,
                      "--save-result", str(path)]) == 0
        levels = json.loads(path.read_text())["levels"]
        assert [(level["num_prompts"], level["metrics"]["completed"]) for level in levels] == [(2, 2), (3, 3)]
        files.append(str(path))
    assert bench(["plot", *files, "--out", str(tmp_path / "both")]) == 0
    assert (tmp_path / "both" / "throughput.png").stat().st_size > 1000


def test_chat_and_prefix_repetition_datasets(server, stories_dir, tmp_path, capsys):
    conversations = tmp_path / "chats.jsonl"
    conversations.write_text("\n".join(json.dumps({"prompt": p, "max_tokens": 5}) for p in ("Once", "The dog")))
    assert bench(["serve", "--base-url", server, "--dataset-name", "jsonl", "--dataset-path", str(conversations),
                  "--num-prompts", "4", "--no-progress"]) == 0
    assert bench(["serve", "--base-url", server, "--dataset-name", "prefix-repetition", "--tokenizer",
                  str(stories_dir), "--prefix-len", "32", "--suffix-len", "4", "--num-prefixes", "2",
                  "--random-output-len", "4", "--num-prompts", "6", "--no-progress"]) == 0
    assert capsys.readouterr().out.count("| concurrency |") == 2


def test_a_server_that_refuses_connections_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench(["serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "cannot reach http://127.0.0.1:" in err and "Traceback" not in err


def test_a_prompt_count_per_level_must_match_the_sweep(server, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench(["serve", "--base-url", server, "--num-prompts", "2,3,4", "--max-concurrency", "1,2"])
    assert exit_info.value.code == 2
    assert "one per level of the sweep (2)" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["latency", "throughput"])
def test_offline_benchmarks_run_on_stories260k(kind, stories_dir, tmp_path, capsys):
    out_file = tmp_path / f"{kind}.json"
    extra = ["--batch-size", "2", "--num-iters", "2"] if kind == "latency" else ["--num-prompts", "8"]
    # The server tests' engine sizes (SHARED_ENGINE): its two programs come from the run's cache.
    engine = ["--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--token-buckets", "8,64"]
    assert bench([kind, "--model", str(stories_dir), "--input-len", "16", "--output-len", "8",
                  "--output-json", str(out_file), *engine, *extra]) == 0
    result = json.loads(out_file.read_text())
    assert result["compilations_while_timed"] == 0 and result["command"].startswith("jaxserve bench")
    if kind == "latency":
        assert len(result["latencies_s"]) == 2 and 0 < result["prefill_latency_s"] < result["avg_latency_s"]
        assert result["decode_tokens_per_s"] > 0
    else:
        assert result["output_tokens_per_s"] == pytest.approx(8 * 8 / result["elapsed_s"])


def test_token_id_prompts_begin_as_the_tokenizer_begins_text(stories_dir):
    """vLLM's random dataset counts the tokenizer's special tokens in the input length; a token-id prompt
    begins with them (a Llama's BOS), as a tokenized text prompt would."""
    from jaxserve.bench.datasets import load_tokenizer, prefix_repetition_requests, random_requests
    tokenizer = load_tokenizer(str(stories_dir))
    bos = tokenizer.encode("", add_special_tokens=True).ids
    assert bos == [1]
    for request in random_requests(5, 16, 4, 0.0, 0, tokenizer):
        assert len(request.prompt) == request.prompt_len == 16 and request.prompt[0] == 1
        assert 1 not in request.prompt[1:]
    for request in prefix_repetition_requests(4, 8, 3, 2, 4, 0, tokenizer):
        assert len(request.prompt) == 11 and request.prompt[0] == 1
    texts = random_requests(2, 16, 4, 0.0, 0, tokenizer, form="text")
    assert all(isinstance(r.prompt, str) for r in texts)  # the server adds the BOS to text itself


def test_the_load_generator_does_not_load_the_engine():
    """`bench serve` only talks HTTP: loading JAX would cost its client a couple of seconds of CPU and a
    heap ten times the size before it measures anything, and `--help` would take as long. A new
    interpreter, because this one has long imported JAX."""
    import subprocess
    import sys

    probe = ("import sys\n"
             "from jaxserve.entrypoints.cli import build_parser\n"
             "build_parser().parse_args(['bench', 'serve', '--base-url', 'http://127.0.0.1:1'])\n"
             "import jaxserve, jaxserve.bench.serve, jaxserve.bench.datasets, jaxserve.bench.plot\n"
             "print(sorted(m for m in ('jax', 'flax', 'jaxlib') if m in sys.modules))\n")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


def test_the_random_mm_dataset_draws_as_vllm_does():
    """Images per request within the range and the limit, sizes from the buckets, the same requests for the
    same seed; the text is `random`'s, with or without images; the chat body carries the text, then each
    image as a data: URL (JPEG); a pool of one image repeats it."""
    import base64
    import io

    from PIL import Image

    from jaxserve.bench.datasets import parse_mm_buckets, random_mm_requests, random_requests
    from jaxserve.bench.serve import request_body
    draw = dict(base_items=2, items_range_ratio=0.5, limit=3, buckets="{(24, 40, 1): 1.0, (720, 1280, 16): 0.0}")
    requests = random_mm_requests(20, 16, 4, 0.0, 7, **draw)
    assert requests == random_mm_requests(20, 16, 4, 0.0, 7, **draw)
    assert requests != random_mm_requests(20, 16, 4, 0.0, 8, **draw)
    assert {r.images for r in requests} == {1, 2, 3}  # [floor(2 * 0.5), ceil(2 * 1.5)] = [1, 3], capped at 3
    plain = random_mm_requests(20, 16, 4, 0.0, 7, base_items=0)
    for request, text, bare in zip(requests, random_requests(20, 16, 4, 0.0, 7, form="text"), plain):
        assert request.prompt == text.prompt == bare.prompt and request.output_len == 4 and bare.images == 0
    body = request_body(requests[0], "m", chat=True, temperature=0.0, ignore_eos=True)
    message, = body["messages"]
    assert message["role"] == "user" and message["content"][0] == {"type": "text", "text": requests[0].prompt}
    urls = [part["image_url"]["url"] for part in message["content"][1:]]
    assert len(urls) == requests[0].images and all(u.startswith("data:image/jpeg;base64,") for u in urls)
    image = Image.open(io.BytesIO(base64.b64decode(urls[0].partition(",")[2])))
    assert (image.format, image.size, image.mode) == ("JPEG", (40, 24), "RGB")

    def distinct(requests):
        return {part["image_url"]["url"] for r in requests for part in r.messages[0]["content"][1:]}
    small = dict(base_items=2, buckets={(8, 8, 1): 1})
    assert len(distinct(random_mm_requests(6, 8, 4, num_distinct_images=1, **small))) == 1
    assert len(distinct(random_mm_requests(6, 8, 4, **small))) == 12

    assert parse_mm_buckets("{(256, 256, 1): 1, (720, 1280, 1): 3}") == {(256, 256): 0.25, (720, 1280): 0.75}
    for bad, match in (("{(32, 32): 1}", "height, width, frames"), ("{(32, 32, 1): -1}", "probability"),
                       ("{(32, 32, 8): 1}", "video"), ("{(32, 32, 1): 0}", "no size"), ("256x256", "not a dict")):
        with pytest.raises(ValueError, match=match):
            parse_mm_buckets(bad)
    with pytest.raises(ValueError, match="over the 3 images"):
        random_mm_requests(2, 8, 4, base_items=4, limit=3)


def test_bench_serve_flags_reach_the_random_mm_dataset():
    from jaxserve.bench.cli import _requests
    from jaxserve.entrypoints.cli import build_parser
    ns = build_parser().parse_args(
        ["bench", "serve", "--base-url", "http://127.0.0.1:1", "--dataset-name", "random-mm",
         "--random-input-len", "12", "--random-mm-base-items-per-request", "4", "--random-mm-limit-mm-per-prompt",
         '{"image": 4}', "--random-mm-bucket-config", "{(16, 16, 1): 1.0}", "--random-mm-num-distinct-images", "2"])
    requests = _requests(ns, None, 0, 3)
    assert [r.images for r in requests] == [4, 4, 4]
    assert len({p["image_url"]["url"] for r in requests for p in r.messages[0]["content"][1:]}) == 2
