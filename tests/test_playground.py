"""The web playground: its files and headers over plain HTTP, then the page itself in headless Chromium
against a server of the built-in default model (stories260K, with its own chat template) that needs an API key.

The browser tests type into the page as a person would: the empty page's suggested first prompt gets the
model's story, an answer streams in (its text grows while it is
being written), Stop ends one mid-way (and the server frees its request), a greedy seeded answer is the
same twice, a JSON Schema constrains the answer, text is shown as text, the page works behind a path
prefix and on a phone-sized screen. Every request the page makes is recorded: all must go to the test
server. They need the `playwright` package and Debian's Chromium (tools/ensure_chromium.sh installs it as
root); without them they skip, saying which is missing, unless JAXSERVE_REQUIRE_BROWSER=1 (CI) makes
that a failure. The screenshots' paths are printed and recorded as the tests' `screenshot` property;
JAXSERVE_UPDATE_SCREENSHOT=1 also writes the README's docs/images/playground.png.
"""

from __future__ import annotations

import asyncio
import base64
import fnmatch
import json
import os
import re
import shutil
import time
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import jsonschema
import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from jaxserve.engine_args import EngineArgs
from server import playground
from server.http.guards import RequestGuard
from server.options import ServerOptions
from tests.page_checks import assert_pages_released
from tests.server_harness import running_server

ROOT = Path(__file__).resolve().parents[1]
KEY = "playground-test-key"
CHROMIUM = os.environ.get("JAXSERVE_CHROMIUM", "/usr/bin/chromium")
# Debian's Chromium as root, kept off the network: without these it calls Google's services at start.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


# ---- the files and headers (no browser, no model) ----------------------------------------------------------

@pytest.fixture(scope="module")
def files():
    return TestClient(Starlette(routes=playground.routes()))


def test_page_and_files_carry_types_cache_headers_and_a_csp(files):
    for path in playground.PAGE_PATHS:
        page = files.get(path)
        assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
        assert page.headers["cache-control"] == "no-cache" and page.headers["etag"]
        csp = page.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp and "connect-src 'self'" in csp
        assert '<meta name="viewport"' in page.text
    assert files.get("/", headers={"If-None-Match": page.headers["etag"]}).status_code == 304
    linked = re.findall(r'(?:href|src)="(playground/[^"]+)"', page.text)
    assert {urlsplit(u).path for u in linked} == {"playground/playground.css", "playground/app.js"}
    for url in linked:  # the page links a file by its content hash, which may be kept for a year
        r = files.get("/" + url)
        assert r.status_code == 200 and r.headers["cache-control"] == "public, max-age=31536000, immutable"
        assert urlsplit(url).query == "v=" + r.headers["etag"].strip('"')
    for name, kind in [("app.js", "text/javascript"), ("api.js", "text/javascript"), ("playground.css", "text/css")]:
        r = files.get(f"/playground/{name}")  # unversioned (a module import): revalidated every time
        assert r.headers["content-type"] == f"{kind}; charset=utf-8" and r.headers["cache-control"] == "no-cache"
        assert r.headers["x-content-type-options"] == "nosniff"
        assert files.get(f"/playground/{name}", headers={"If-None-Match": r.headers["etag"]}).status_code == 304
    assert files.get("/playground/index.html?").status_code == 404  # only the CSS and JS are files here
    assert files.get("/playground/missing.js").json()["error"]["code"] == "not_found"
    assert files.head("/playground").headers["content-length"] == str(len(page.content))


def test_the_page_uses_relative_urls_only():
    """So a reverse proxy may mount the server under any prefix: no URL may start at the root."""
    folder = Path(playground.__file__).parent
    for path in folder.glob("*.*"):
        if path.suffix in (".html", ".js", ".css"):
            text = path.read_text()
            assert not re.search(r"""(?:href|src|action)=["']/|fetch\(\s*["'`]/|url\(\s*["']?/|import .* from ["']/""",
                                 text), path.name
            assert "http://" not in text and "https://" not in text, path.name  # no CDN, nothing remote
            assert "innerHTML" not in text and "insertAdjacentHTML" not in text, path.name


def test_the_package_ships_every_playground_file():
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = globs["server.playground"]
    for path in Path(playground.__file__).parent.iterdir():
        if path.is_file() and path.suffix != ".py":
            assert any(fnmatch.fnmatch(path.name, g) for g in shipped), f"{path.name} is not package data"


def test_the_page_needs_no_key_but_the_api_does_also_under_a_root_path():
    for root in ("", "/proxy"):  # uvicorn's --root-path puts the mount point in front of the scope's path
        for path in ("/", "/playground", "/playground/app.js", "/health"):
            assert _status_without_key(root, root + path) == 200, (root, path)
        for path in ("/v1/models", "/v1/chat/completions", "/metrics", "/playgroundx", "/playground/../v1/models"):
            assert _status_without_key(root, root + path) == 401, (root, path)
    assert _status_without_key("/proxy", "/proxy") == 401  # the bare mount point is no page


def _status_without_key(root: str, path: str) -> int:
    """The status RequestGuard answers a GET of `path` without a key, on a server mounted at `root`."""
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def receive():
        return {"type": "http.disconnect"}

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "root_path": root, "headers": [], "query_string": b""}
    asyncio.run(RequestGuard(app, api_key=KEY, max_body_bytes=1 << 20)(scope, receive, send))
    return sent[0]["status"]


# ---- the page in headless Chromium ---------------------------------------------------------------------------

def _browser_missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the browser tests need the `playwright` package: pip install -e '.[test]'"
    if not os.access(CHROMIUM, os.X_OK):
        return f"the browser tests need Chromium at {CHROMIUM}: run tools/ensure_chromium.sh as root"
    return None


@pytest.fixture(scope="module")
def browser():
    missing = _browser_missing()
    if missing:
        if os.environ.get("JAXSERVE_REQUIRE_BROWSER") == "1":
            pytest.fail(missing)
        pytest.skip(missing)
    from playwright.sync_api import sync_playwright
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def server(browser):  # after the browser: a machine without one starts no server
    args = EngineArgs(max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(4, 32))  # the built-in model
    with running_server(args, options=ServerOptions(api_key=KEY)) as running:
        yield running


class Session:
    """One browser context on the playground, with every request it made."""

    def __init__(self, browser, base: str, **context_options):
        self.base, self.requests = base, []
        self.context = browser.new_context(**context_options)
        self.context.on("request", lambda r: self.requests.append(r))
        self.page = self.context.new_page()
        self.page.set_default_timeout(60_000)

    def open(self, path: str = "/"):
        """Load the page, give it the key it asks for, wait for the model list."""
        self.page.goto(self.base + path)
        self.page.locator("#key-dialog").wait_for(state="visible")
        self.page.fill("#api-key", KEY)
        self.page.press("#api-key", "Enter")
        self.page.locator("#model option", has_text="stories260K").wait_for(state="attached")
        return self

    def settings(self, **values):
        for name, value in values.items():
            self.page.fill(f"#{name}", str(value))

    def send(self, text: str):
        self.page.fill("#prompt", text)
        self.page.press("#prompt", "Enter")

    def last_answer(self):
        return self.page.locator("#transcript article:not([data-role=user])").last

    def wait_answered(self, states: str = "done") -> str:
        answer = self.last_answer()
        self.page.wait_for_function("a => !['streaming', undefined].includes(a.dataset.state)",
                                    arg=answer.element_handle())
        assert answer.get_attribute("data-state") in states.split(","), answer.inner_text()
        return answer.locator(".content").inner_text()

    def posted(self, path: str) -> list[dict]:
        return [r.post_data_json for r in self.requests if r.method == "POST" and urlsplit(r.url).path == path]

    def close(self):
        self.context.close()
        origin = urlsplit(self.base)[:2]
        stray = [r.url for r in self.requests if urlsplit(r.url)[:2] != origin and not r.url.startswith("data:")]
        assert not stray, f"the page made requests off the test server: {stray}"


@pytest.fixture
def session(browser, server):
    s = Session(browser, server[0], viewport={"width": 1280, "height": 800})
    yield s
    s.close()


def _screenshot(page, request, tmp_path_factory, name: str) -> Path:
    path = tmp_path_factory.mktemp("screenshots") / name
    page.screenshot(path=str(path))
    request.node.user_properties.append(("screenshot", str(path)))
    print(f"playground screenshot: {path}")
    if os.environ.get("JAXSERVE_UPDATE_SCREENSHOT") == "1" and name == "playground.png":
        shutil.copyfile(path, ROOT / "docs" / "images" / "playground.png")
    return path


def test_the_first_screen_suggests_a_prompt_that_tells_the_story(session, story_text):
    """On an empty page each mode suggests a first prompt; a click sends it. Greedy, the built-in model
    answers the chat suggestion with its known story, and continues the completion one into the same story."""
    session.open()
    hint = session.page.locator("#empty-hint")
    assert hint.is_visible() and session.page.is_hidden("#empty-hint .completion-only")
    # The story's tokens after BOS: 61 in chat (the template leaves the whole story to the model), 57 after
    # the completion prompt's "Once upon a time".
    session.settings(temperature=0, max_tokens=61)
    hint.get_by_role("button", name="Tell me a story").click()
    assert session.wait_answered() == story_text
    assert session.posted("/v1/chat/completions")[-1]["messages"] == [{"role": "user", "content": "Tell me a story"}]
    assert hint.is_hidden()
    session.page.check("input[name=mode][value=completion]")  # its own conversation: empty, with its suggestion
    assert session.page.is_hidden("#empty-hint .chat-only")
    session.settings(max_tokens=57)
    hint.get_by_role("button", name="Once upon a time").click()
    assert session.wait_answered() == story_text
    assert session.posted("/v1/completions")[-1]["prompt"] == "Once upon a time"


def test_chat_streams_tokens_as_they_come(session, request, tmp_path_factory):
    session.open()
    session.settings(system="A short story for children.", max_tokens=96, extra='{"ignore_eos": true}')
    # Record the answer's length at every change while it is being written.
    session.page.evaluate("""() => {
        window.growth = [];
        const transcript = document.getElementById('transcript');
        new MutationObserver(() => {
            const answer = [...transcript.querySelectorAll('article[data-role=assistant]')].pop();
            if (answer && answer.dataset.state === 'streaming')
                window.growth.push(answer.querySelector('.content').textContent.length);
        }).observe(transcript, {subtree: true, childList: true, characterData: true, attributes: true});
    }""")
    session.send("Once upon a time")
    text = session.wait_answered()
    growth = [n for n in session.page.evaluate("window.growth") if n]
    assert len(set(growth)) >= 5 and growth == sorted(growth) and growth[-1] <= len(text), growth
    stats = session.last_answer().locator(".stats")
    assert re.fullmatch(r"TTFT \d+ ms · [\d.]+ tok/s · 96 tokens · length \(max tokens\)", stats.inner_text())
    body = session.posted("/v1/chat/completions")[-1]
    assert body["stream"] is True and body["max_tokens"] == 96 and body["ignore_eos"] is True
    assert body["messages"] == [{"role": "system", "content": "A short story for children."},
                                {"role": "user", "content": "Once upon a time"}]
    assert session.page.locator("#transcript article[data-role=user] .content").inner_text() == "Once upon a time"
    _screenshot(session.page, request, tmp_path_factory, "playground.png")


def test_stop_ends_an_answer_mid_way_and_the_server_frees_it(session, server):
    base, async_engine = server
    engine = async_engine.engine
    aborted = engine.stats.finished.get("abort", 0)
    session.open()
    session.settings(max_tokens=450, extra='{"ignore_eos": true}', temperature=1)
    session.send("Once upon a time")
    answer = session.last_answer()
    session.page.wait_for_function("a => a.querySelector('.content').textContent.length > 0",
                                   arg=answer.element_handle())
    session.page.click("#stop")
    session.wait_answered("stopped")
    assert int(answer.locator(".stats").get_attribute("data-tokens")) < 450
    assert answer.locator(".stats").inner_text().endswith("stopped")
    deadline = time.monotonic() + 30
    while engine.has_unfinished() or engine.stats.finished.get("abort", 0) == aborted:
        assert time.monotonic() < deadline, "the server did not end the stopped request"
        time.sleep(0.05)
    assert_pages_released(engine.scheduler)  # the engine is idle: evicting from this thread is safe
    assert httpx.get(f"{base}/health").status_code == 200
    assert session.page.is_enabled("#send") and session.page.is_enabled("#regenerate")
    session.settings(max_tokens=8)
    session.page.click("#regenerate")  # the page and the server go on: the stopped answer is replaced
    session.wait_answered()
    assert session.page.locator("#transcript article").count() == 2


def test_greedy_seeded_completions_are_the_same_twice(session, server):
    session.open()
    session.page.check("input[name=mode][value=completion]")
    session.settings(temperature=0, seed=1234, max_tokens=24, top_k=-1)
    session.send("Once upon a time")
    first = session.wait_answered()
    session.page.click("#regenerate")
    again = session.wait_answered()
    bodies = session.posted("/v1/completions")
    assert len(bodies) == 2 and all(b["temperature"] == 0 and b["seed"] == 1234 and b["top_k"] == -1 and
                                    b["max_tokens"] == 24 and b["prompt"] == "Once upon a time" for b in bodies)
    direct = httpx.post(f"{server[0]}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                        json={"prompt": "Once upon a time", "temperature": 0, "max_tokens": 24}).json()
    generated = direct["choices"][0]["text"]
    assert first == again == "Once upon a time" + generated and generated


def test_json_schema_box_constrains_the_answer(session):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}},
              "required": ["name"], "additionalProperties": False}
    session.open()
    session.page.fill("#json_schema", "{not json")
    assert "Not valid JSON" in session.page.inner_text("#json_schema-error")
    session.settings(json_schema=json.dumps(schema), max_tokens=48, temperature=0)
    assert session.page.is_hidden("#json_schema-error")
    session.send("Tom")
    jsonschema.validate(json.loads(session.wait_answered()), schema)
    body = session.posted("/v1/chat/completions")[-1]
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "playground", "schema": schema, "strict": True}}


def test_text_is_shown_as_text_and_the_conversation_survives_a_reload(session):
    hostile = '<img src=x onerror="document.title=\'owned\'"><b>bold</b> & more'
    session.open()
    session.settings(max_tokens=4, temperature=0.5)
    session.send(hostile)
    session.wait_answered()
    assert session.page.locator("#transcript article[data-role=user] .content").inner_text() == hostile
    assert session.page.locator("#transcript img, #transcript b").count() == 0
    assert session.page.is_hidden("#image-controls")  # stories260K reads text only: no image control
    session.settings(max_tokens=200)
    session.send("second line\nthird line")  # Shift+Enter would have made the newline; fill types it
    session.wait_answered()
    session.page.reload()  # the key stays in the tab: no dialog; the conversation and settings stay too
    session.page.locator("#model option", has_text="stories260K").wait_for(state="attached")
    assert session.page.is_hidden("#key-dialog")
    users = session.page.locator("#transcript article[data-role=user] .content")
    assert users.all_inner_texts() == [hostile, "second line\nthird line"]
    assert session.page.input_value("#temperature") == "0.5" and session.page.title() != "owned"
    session.page.fill("#prompt", "a")
    session.page.press("#prompt", "Shift+Enter")  # a new line, not a send
    assert session.page.input_value("#prompt") == "a\n" and users.count() == 2


@pytest.fixture(scope="module")
def vision_server(browser):
    """The tiny Gemma 3 vision checkpoint (tests/fixtures/vlm), no API key: its /v1/models entry lists images."""
    args = EngineArgs(model=str(ROOT / "tests" / "fixtures" / "vlm" / "gemma3"), max_model_len=128, max_num_seqs=2,
                      max_num_batched_tokens=16, token_buckets=(16,))
    with running_server(args) as running:
        yield running


def test_a_vision_model_takes_images_picked_pasted_or_dropped(browser, vision_server):
    """The image control shows for a vision model; a picked, a pasted and a dropped image go out with the
    message as OpenAI image_url parts (data: URLs), are shown in the transcript, and the model's answer to them
    streams in (the tiny checkpoint's random weights: some text, no error)."""
    session = Session(browser, vision_server[0], viewport={"width": 1280, "height": 800})
    try:
        page = session.page
        page.goto(vision_server[0] + "/")
        page.locator("#model option", has_text="gemma3").wait_for(state="attached")
        page.locator("#image-controls").wait_for(state="visible")
        images = ROOT / "tests" / "fixtures" / "vlm" / "images"
        page.set_input_files("#image-file", str(images / "rgba.png"))
        png = base64.b64encode((images / "portrait.png").read_bytes()).decode()
        for event, target in (("paste", "#prompt"), ("drop", "#composer")):
            page.evaluate("""([event, target, data]) => {
                const bytes = Uint8Array.from(atob(data), (c) => c.charCodeAt(0));
                const transfer = new DataTransfer();
                transfer.items.add(new File([bytes], "portrait.png", {type: "image/png"}));
                const init = {bubbles: true, cancelable: true};
                document.querySelector(target).dispatchEvent(event === "paste"
                    ? new ClipboardEvent("paste", {...init, clipboardData: transfer})
                    : new DragEvent("drop", {...init, dataTransfer: transfer}));
            }""", [event, target, png])
        page.wait_for_function("document.querySelectorAll('#attachments img').length === 3")
        # 97 prompt tokens with the three images, of a 128-token context. The checkpoint's 256 ids outnumber
        # its tokenizer's 105, so a random-weight answer spells nothing about 1 time in 40 (CI at f78d5c5):
        # the answer is held to the lowercase letters (ids 74-99), whatever it samples.
        session.settings(max_tokens=8, extra=json.dumps({"allowed_token_ids": list(range(74, 100))}))
        session.send("What are these?")
        assert re.fullmatch("[a-z]{8}", session.wait_answered())  # state "done", eight letters
        assert session.last_answer().locator(".error").is_hidden()
        content = session.posted("/v1/chat/completions")[-1]["messages"][-1]["content"]
        assert [part["type"] for part in content] == ["image_url"] * 3 + ["text"]
        sent = [part["image_url"]["url"] for part in content[:3]]
        assert sent[0] == "data:image/png;base64," + base64.b64encode((images / "rgba.png").read_bytes()).decode()
        assert sent[1] == sent[2] == f"data:image/png;base64,{png}" and content[3]["text"] == "What are these?"
        assert page.locator("#transcript article[data-role=user] .thumbs img").count() == 3
        assert page.locator("#attachments img").count() == 0  # sent: the next message starts without
        page.check("input[name=mode][value=completion]")
        assert page.is_hidden("#image-controls")
    finally:
        session.close()


def test_the_page_works_behind_a_path_prefix(browser, server):
    """A reverse proxy that mounts the server at /proxy/: the page's requests must all stay under it."""
    base = server[0]
    s = Session(browser, base)
    try:
        def proxy(route):
            path = urlsplit(route.request.url).path
            if not path.startswith("/proxy/"):
                return route.abort()  # the proxy serves nothing else
            route.fulfill(response=route.fetch(url=route.request.url.replace("/proxy/", "/", 1)))

        s.context.route(f"{base}/**", proxy)
        s.open("/proxy/playground")
        s.page.check("input[name=mode][value=completion]")
        s.settings(max_tokens=6)
        s.send("Once upon a time")
        assert s.wait_answered().startswith("Once upon a time")
        paths = [urlsplit(r.url).path for r in s.requests if not r.url.startswith("data:")]
        assert {"/proxy/playground", "/proxy/v1/models", "/proxy/v1/completions"} <= set(paths)
        assert all(p.startswith("/proxy/") for p in paths), paths
    finally:
        s.close()


def test_a_phone_sized_screen(browser, server, request, tmp_path_factory):
    s = Session(browser, server[0], viewport={"width": 390, "height": 844}, device_scale_factor=2,
                is_mobile=True, has_touch=True)
    try:
        s.open()
        assert s.page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        assert s.page.is_hidden("#settings")  # folded away until asked for
        s.page.click("#settings-toggle")
        assert s.page.is_visible("#temperature") and s.page.get_attribute("#settings-toggle", "aria-expanded") == "true"
        s.settings(max_tokens=24)
        s.page.click("#settings-toggle")
        s.send("Once upon a time")
        s.wait_answered()
        assert s.page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        _screenshot(s.page, request, tmp_path_factory, "playground-phone.png")
    finally:
        s.close()
