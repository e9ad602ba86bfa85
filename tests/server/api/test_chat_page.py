"""The chat page at GET / (server/api/ui.py, server/ui/), driven in a real headless Chromium
against one server on the embedded model, behind --api-key.

Chromium comes from Playwright's own download (`playwright install chromium`) where that host is
reachable, else from the system (`.ci/browser.sh` installs Debian's `chromium`); Playwright
drives either. Without both the tests are skipped, saying why.
"""

from __future__ import annotations

import io
import re
import shutil
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from serving_utils import ServerProcess

try:
    from playwright import sync_api
    from playwright.sync_api import expect
except ImportError:      # the browser fixture skips; the tests without a browser still run
    sync_api = expect = None

from llmserve.cli import main
from llmserve.server.api import ui
from llmserve.server.api.middleware import APIKeyMiddleware

KEY = "page-s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
TIMEOUT_MS = 120_000
SYSTEM_CHROMIUMS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
if expect is not None:
    expect.set_options(timeout=TIMEOUT_MS)     # answers come from a CPU shared with other tests


@pytest.fixture(scope="module")
def server(default_model_path) -> Iterator[ServerProcess]:
    with ServerProcess(None, "--api-key", KEY) as server:      # the embedded model (skipped where not installed)
        yield server


@pytest.fixture(scope="module")
def browser() -> Iterator[sync_api.Browser]:
    if sync_api is None:
        pytest.skip("the chat page's browser tests need Playwright (the [test] extra) and a Chromium "
                    "(.ci/browser.sh)")
    with sync_api.sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        yield browser
        browser.close()


def launch_chromium(playwright: sync_api.Playwright) -> sync_api.Browser:
    """Playwright's own Chromium if it was downloaded, else the first one on PATH."""
    try:
        return playwright.chromium.launch()
    except sync_api.Error as own_missing:
        for name in SYSTEM_CHROMIUMS:
            if (path := shutil.which(name)) is not None:
                # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
                return playwright.chromium.launch(executable_path=path, args=["--no-sandbox"])
        pytest.skip("no Chromium to drive: `playwright install chromium` could not download one "
                    f"({str(own_missing).splitlines()[0]}) and none of {', '.join(SYSTEM_CHROMIUMS)} is on "
                    "PATH (.ci/browser.sh installs Debian's chromium)")


class Recorder:
    """Every request a browser context makes, to check where they went and what they carried."""

    def __init__(self, context: sync_api.BrowserContext) -> None:
        self.requests: list[sync_api.Request] = []
        context.on("request", lambda request: self.requests.append(request))

    def foreign(self, server: ServerProcess) -> list[str]:
        """The URLs of requests for anything but the server (data: URLs stay in the page)."""
        return [r.url for r in self.requests
                if urlsplit(r.url).scheme != "data" and urlsplit(r.url).netloc != urlsplit(server.url).netloc]

    def to(self, path: str) -> list[sync_api.Request]:
        return [r for r in self.requests if urlsplit(r.url).path == path]


@pytest.fixture
def context(browser) -> Iterator[sync_api.BrowserContext]:
    """A fresh context: its own session storage, so the page has no key yet."""
    context = browser.new_context()
    context.set_default_timeout(TIMEOUT_MS)
    yield context
    context.close()


@pytest.fixture
def recorder(context, server) -> Iterator[Recorder]:
    recorder = Recorder(context)
    yield recorder
    assert recorder.requests, "the page made no request at all"
    assert recorder.foreign(server) == [], "the page reached another host"


def open_page(context: sync_api.BrowserContext, server: ServerProcess) -> sync_api.Page:
    """The page, given the key, once it has read /info; its settings opened."""
    page = context.new_page()
    page.goto(server.url + "/")
    enter_key(page, KEY)
    expect(page.locator("body")).to_have_attribute("data-ready", "true")
    page.click("#settings summary")
    return page


def enter_key(page: sync_api.Page, key: str) -> None:
    expect(page.locator("#key-box")).to_be_visible()
    page.fill("#key", key)
    page.press("#key", "Enter")


@pytest.fixture
def page(context, recorder, server) -> sync_api.Page:
    return open_page(context, server)


def answers(page: sync_api.Page) -> sync_api.Locator:
    return page.locator(".message.assistant")


def wait_for_answer(page: sync_api.Page, n: int) -> sync_api.Locator:
    """The n-th answer (1-based), once its stream has ended (its stats line is shown)."""
    answer = answers(page).nth(n - 1)
    expect(answer.locator(".stats")).to_be_visible()
    return answer


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)


# -- serving the page: --no-ui, the key ---------------------------------------------------------

def test_no_ui_turns_the_page_off(monkeypatch):
    import llmserve.server.serve as serve_module

    configs = []
    monkeypatch.delenv("LLMSERVE_NO_UI", raising=False)
    monkeypatch.setattr(serve_module, "run_server", lambda engine_config, config, **kw: configs.append(config) or 0)
    assert main(["serve", "--no-ui"]) == 0 and main(["serve"]) == 0
    monkeypatch.setenv("LLMSERVE_NO_UI", "true")
    assert main(["serve"]) == 0
    assert [config.ui for config in configs] == [False, True, False]


def app_with(page: bool) -> FastAPI:
    """The page's routes (or none) and the key check as create_app sets them up, beside a
    stand-in for TGI's POST /."""
    app = FastAPI()
    app.add_api_route("/", lambda: {"generated_text": ""}, methods=["POST"])
    if page:
        app.include_router(ui.build_router())
    app.add_middleware(APIKeyMiddleware, api_key=KEY, open_pages=ui.PAGE_PATHS if page else frozenset())
    return app


def test_only_a_get_of_the_pages_own_files_goes_without_the_key():
    with TestClient(app_with(page=True)) as client:
        for path in ui.PAGE_PATHS:
            assert client.get(path).status_code == 200, path
        assert client.post("/").status_code == 401
        assert client.post("/", headers=AUTH).status_code == 200
        assert client.get("/ui/other.js").status_code == 401
    with TestClient(app_with(page=False)) as client:
        assert client.get("/").status_code == 401
        assert client.get("/", headers=AUTH).status_code == 405       # as before the page: only POST /


# -- the page and the key ----------------------------------------------------------------------

def test_the_page_is_served_without_the_key_but_every_api_call_needs_it(server):
    page = httpx.get(server.url + "/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    # the browser itself refuses to load or fetch from anywhere but the server
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    for asset in re.findall(r'(?:src|href)="(/ui/[^"]+)"', page.text):
        assert httpx.get(server.url + asset, timeout=10).status_code == 200, asset
    # only the page's own files are open: TGI's POST / and the rest still need the key
    assert httpx.post(server.url + "/", json={"inputs": "Hi"}, timeout=10).status_code == 401
    for path in ("/info", "/openapi.json", "/ui/other.js", "/metrics"):
        assert httpx.get(server.url + path, timeout=10).status_code == 401, path


def test_the_page_asks_for_the_key_keeps_it_in_the_tab_and_sends_it(context, recorder, server):
    page = context.new_page()
    page.goto(server.url + "/")
    enter_key(page, "wrong")
    expect(page.locator("#key-note")).to_have_text("That key was refused.")
    enter_key(page, KEY)
    expect(page.locator("body")).to_have_attribute("data-ready", "true")
    info = httpx.get(server.url + "/info", headers=AUTH, timeout=10).json()
    expect(page.locator("#model")).to_have_text(info["model_id"])
    expect(page.locator("#context")).to_contain_text(str(info["max_total_tokens"]))
    # the model's sampling defaults (the embedded model's card: 0.2, 0.9) fill the fields
    assert info["generation_config"]["temperature"] == 0.2
    expect(page.locator("#temperature")).to_have_value("0.2")
    expect(page.locator("#top-p")).to_have_value("0.9")
    assert page.evaluate("sessionStorage.getItem('llmserve-api-key')") == KEY
    page.reload()                                  # the tab keeps the key: no second question
    expect(page.locator("body")).to_have_attribute("data-ready", "true")
    expect(page.locator("#key-box")).to_be_hidden()
    sent = [r.headers.get("authorization") for r in recorder.to("/info")]
    assert sent == [None, "Bearer wrong", f"Bearer {KEY}", f"Bearer {KEY}"]
    # a text-only model: no image button
    assert info["takes_images"] is False and info["max_images_per_request"] == 0
    expect(page.locator("#attach")).to_be_hidden()


# -- chatting ----------------------------------------------------------------------------------

def test_paris_streams_in_at_temperature_0(page, recorder):
    page.fill("#temperature", "0")
    # every text the answer shows, as it changes
    page.evaluate("""() => {
        window.shown = [];
        new MutationObserver(() => {
            const bodies = document.querySelectorAll('.message.assistant .body');
            if (bodies.length) window.shown.push(bodies[bodies.length - 1].textContent);
        }).observe(document.getElementById('log'), {childList: true, subtree: true, characterData: true});
    }""")
    page.fill("#input", "What is the capital of France?")
    with page.expect_request("**/v1/chat/completions") as request:
        page.press("#input", "Enter")
    body = request.value.post_data_json
    assert request.value.headers["authorization"] == f"Bearer {KEY}"
    assert body["stream"] is True and body["temperature"] == 0
    assert body["messages"] == [{"role": "user", "content": "What is the capital of France?"}]
    answer = wait_for_answer(page, 1)
    expect(answer.locator(".body")).to_contain_text("Paris")
    final = answer.locator(".body").text_content()
    shown = [text for text in page.evaluate("window.shown") if text]
    # it came in pieces, each a beginning of the answer (tokens come slower than frames on a CPU)
    assert len(set(shown)) >= 2, shown
    assert all(final.startswith(text) for text in shown), (shown, final)
    stats = answer.locator(".stats").text_content()
    assert re.search(r"\d+ tokens · [\d.]+ tokens/s · \d+ ms to first token$", stats), stats
    expect(page.locator("#input")).to_have_value("")


def test_regenerate_asks_again_without_the_old_answer(page):
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "6")
    page.fill("#system", "You are terse.")
    page.fill("#input", "Name a colour.")
    page.press("#input", "Enter")
    first = wait_for_answer(page, 1).locator(".body").text_content()
    with page.expect_request("**/v1/chat/completions") as request:
        page.click("#regenerate")
    body = request.value.post_data_json
    assert body["max_tokens"] == 6
    assert body["messages"] == [{"role": "system", "content": "You are terse."},
                                {"role": "user", "content": "Name a colour."}]
    again = wait_for_answer(page, 1)
    expect(answers(page)).to_have_count(1)             # replaced, not added
    assert again.locator(".body").text_content() == first    # greedy: the same answer


def test_shift_enter_is_a_new_line_and_enter_sends(page, recorder):
    page.fill("#max-tokens", "4")
    page.click("#input")
    page.keyboard.type("first line")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("second line")
    expect(page.locator("#input")).to_have_value("first line\nsecond line")
    assert recorder.to("/v1/chat/completions") == [] and page.locator(".message").count() == 0
    page.keyboard.press("Enter")
    expect(page.locator(".message.user .body")).to_have_text("first line\nsecond line")
    wait_for_answer(page, 1)
    assert [r.post_data_json["messages"][-1]["content"] for r in recorder.to("/v1/chat/completions")] == \
        ["first line\nsecond line"]


def in_flight(server: ServerProcess) -> tuple[float, float]:
    """The server's generations in flight and the engine's running batch."""
    metrics = server.metrics(AUTH)
    return metrics["llmserve_requests_in_flight"], metrics["llmserve_running_batch_size"]


def aborted(server: ServerProcess) -> float:
    return server.metrics(AUTH)['llmserve_request_finished_total{finish_reason="abort"}']


@pytest.mark.parametrize("how", ["button", "escape"])
def test_stop_ends_the_request_on_the_server(page, server, how):
    before = aborted(server)
    page.fill("#input", "Write a very long story about a dragon who learns to cook, in at least 2000 words.")
    page.press("#input", "Enter")
    expect(answers(page).last.locator(".body")).to_have_text(re.compile(r"\w"))    # it is streaming
    assert in_flight(server) == (1, 1)
    expect(page.locator("#stop")).to_be_visible()
    if how == "button":
        page.click("#stop")
    else:
        page.keyboard.press("Escape")
    stats = wait_for_answer(page, 1).locator(".stats")
    expect(stats).to_contain_text("stopped")
    wait_until(lambda: in_flight(server) == (0, 0), 10, "the server's running requests go back to 0")
    assert aborted(server) == before + 1
    expect(page.locator("#send")).to_be_visible()


def tiny_png() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_an_image_goes_as_a_data_url_part_and_a_refusal_shows_as_an_error(context, recorder, server):
    # The embedded model takes text only, so /info is made to say otherwise to show the button;
    # the server then refuses the image, and the page shows its error.
    def images_on(route: sync_api.Route) -> None:
        response = route.fetch()
        if response.ok:
            route.fulfill(json={**response.json(), "takes_images": True, "max_images_per_request": 1})
        else:
            route.fulfill(response=response)     # the 401 before the key

    context.route("**/info", images_on)
    page = open_page(context, server)
    expect(page.locator("#attach")).to_be_visible()
    png = tiny_png()
    page.set_input_files("#file", files=[{"name": "red.png", "mimeType": "image/png", "buffer": png}])
    expect(page.locator("#attachments img")).to_have_count(1)
    page.fill("#input", "What colour is this?")
    with page.expect_request("**/v1/chat/completions") as request:
        page.press("#input", "Enter")
    text, image = request.value.post_data_json["messages"][0]["content"]
    assert text == {"type": "text", "text": "What colour is this?"}
    assert image["type"] == "image_url" and image["image_url"]["url"].startswith("data:image/png;base64,")
    expect(page.locator(".message.user img")).to_have_count(1)
    expect(page.locator("#attachments img")).to_have_count(0)
    error = answers(page).last.locator(".error")
    expect(error).to_contain_text("400")
    expect(error).to_contain_text("image_url")


# -- rendering and layout ----------------------------------------------------------------------

MARKDOWN = [
    ('<img src=x onerror="alert(1)">', '<p>&lt;img src=x onerror=&quot;alert(1)&quot;&gt;</p>'),
    ("**bold**, *it* and `a<b>`", "<p><strong>bold</strong>, <em>it</em> and <code>a&lt;b&gt;</code></p>"),
    ("`**not bold**`", "<p><code>**not bold**</code></p>"),
    ('```python\nprint("<x>")\n```\nafter', '<pre><code data-lang="python">print(&quot;&lt;x&gt;&quot;)</code></pre><p>after</p>'),
    ("```\nstill streaming", "<pre><code>still streaming</code></pre>"),
    ("# Title\n- a\n- b\n\n1. c", "<h1>Title</h1><ul><li>a</li><li>b</li></ul><ol><li>c</li></ol>"),
    ("![x](http://example.com/a.png) [l](http://example.com)",
     "<p>![x](http://example.com/a.png) [l](http://example.com)</p>"),
    ("one\ntwo", "<p>one<br>two</p>"),
]


def test_markdown_is_rendered_from_escaped_text(page):
    rendered = page.evaluate("(sources) => sources.map(renderMarkdown)", [source for source, _ in MARKDOWN])
    assert rendered == [html for _, html in MARKDOWN]


def test_a_phone_width_window_shows_the_input_and_send_without_scrolling_sideways(context, recorder, server):
    page = open_page(context, server)
    page.set_viewport_size({"width": 390, "height": 844})
    long_line = "x" * 400
    page.evaluate("(text) => { addMessage('assistant').querySelector('.body').innerHTML = renderMarkdown(text); }",
                  f"```\n{long_line}\n```\n{'y' * 400}")
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 390, width
    for control in ("#input", "#send", "#regenerate"):
        box = page.locator(control).bounding_box()
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= 390 and box["y"] + box["height"] <= 844, \
            (control, box)
    page.fill("#input", "Hi")
    page.click("#send")                  # a tap on the button sends
    expect(page.locator(".message.user .body")).to_have_text("Hi")
    page.click("#stop")
    wait_for_answer(page, 2)

