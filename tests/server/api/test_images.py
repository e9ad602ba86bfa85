"""Image input end to end on a real server over the tiny LLaVA: TGI's list ``inputs`` (seed 004),
TGI's markdown image in a string, OpenAI chat ``image_url`` parts through the openai SDK, images
from data: URLs, a local http.server and local files under --allowed-local-media-path, each
giving HF's greedy tokens; and every bad image a 4xx in its API's shape, the server serving on."""

from __future__ import annotations

import asyncio
import base64
import functools
import http.server
import io
import json
import os
import threading

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from llmserve.chat_template import load_chat_template
from llmserve.multimodal import ImageProcessor, expand_image_tokens
from llmserve.sampling_params import InvalidRequest
from llmserve.server.api.media import MediaConfig, load_image_bytes
from parity_utils import hf_llava_greedy
from serving_utils import ServerProcess

NEW_TOKENS = 6
MAX_PIXELS = 200 * 200
MAX_BYTES = 150_000


def png(seed: int, size: tuple[int, int] = (48, 40), fmt: str = "PNG", solid: bool = False) -> bytes:
    """Random pixels (which do not compress: ~3 bytes a pixel), or one colour (a few hundred bytes)."""
    rng = np.random.default_rng(seed)
    pixels = np.full((size[1], size[0], 3), 90, np.uint8) if solid else rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    (d / "cat.png").write_bytes(png(7))
    (d / "big.png").write_bytes(png(9, (300, 300)))
    outside = tmp_path_factory.mktemp("outside")
    (outside / "secret.png").write_bytes(png(8))
    os.symlink(outside / "secret.png", d / "link.png")
    return d, outside


@pytest.fixture(scope="module")
def http_images(media_dir):
    """A local http.server (127.0.0.1 only) serving the media directory; /loop redirects to itself,
    /elsewhere to the same file under the host name localhost (the same machine, another host)."""

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            if self.path in ("/loop", "/elsewhere"):
                self.send_response(302)
                port = self.server.server_address[1]
                self.send_header("Location", "/loop" if self.path == "/loop" else f"http://localhost:{port}/cat.png")
                self.end_headers()
                return
            super().do_GET()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(media_dir[0])))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def llava_server(tiny_llava, media_dir):
    path, _ = tiny_llava
    with ServerProcess(path, "--served-model-name", "llava", "--chat-template", "llava", "--max-images-per-request", "2",
                       "--max-image-pixels", str(MAX_PIXELS), "--max-image-bytes", str(MAX_BYTES), "--allowed-local-media-path", str(media_dir[0]),
                       "--allowed-media-domains", "127.0.0.1") as server:
        yield server


@pytest.fixture(scope="module")
def reference(tiny_llava):
    """HF's greedy tokens for a prompt text with <image> placeholders and its images' bytes."""
    from transformers import AutoTokenizer

    path, hf = tiny_llava
    tokenizer = AutoTokenizer.from_pretrained(path)
    processor = ImageProcessor(path)
    image_id = hf.config.image_token_index

    def greedy(text: str, images: list[bytes], add_special_tokens: bool = True) -> list[int]:
        ids = expand_image_tokens(tokenizer(text, add_special_tokens=add_special_tokens).input_ids, image_id, 25)
        pixels = torch.from_numpy(np.stack(processor([Image.open(io.BytesIO(b)).convert("RGB") for b in images])))
        return hf_llava_greedy(hf, ids, pixels, NEW_TOKENS)[0]

    return greedy


def generate(server, inputs, **parameters) -> httpx.Response:
    return httpx.post(server.url + "/generate", timeout=60, json={
        "inputs": inputs, "parameters": {"max_new_tokens": NEW_TOKENS, "details": True, **parameters}})


def assert_hf_tokens(response: httpx.Response, expected: list[int]) -> None:
    assert response.status_code == 200, response.text
    details = response.json()["details"]
    ids = [t["id"] for t in details["tokens"]]
    # a random model may draw its EOS early: then HF's next token is that EOS
    assert ids == expected[: len(ids)] and (len(ids) == NEW_TOKENS or details["finish_reason"] == "eos_token")


def test_tgi_list_inputs_give_hf_greedy_tokens(llava_server, reference, http_images):
    """Seed 004's request: text and image_url parts joined in order; one image from a data: URL
    (webp), one from a local http.server."""
    webp = png(1, fmt="WEBP")
    inputs = [{"type": "text", "text": "What is in "}, {"type": "image_url", "image_url": {"url": data_url(webp, "image/webp")}},
              {"type": "text", "text": " and "}, {"type": "image_url", "image_url": {"url": http_images + "/cat.png"}},
              {"type": "text", "text": "?"}]
    expected = reference("What is in <image> and <image>?", [webp, png(7)])
    assert_hf_tokens(generate(llava_server, inputs), expected)


def seed_004_request(image_url: str) -> dict:
    """Seed 004's multimodal example as written (its image_url a plain string), greedy: the seed's
    sampling fields off, so that HF's greedy tokens are the reference."""
    return {
        "inputs": [{"type": "text", "text": "My name is Olivier and I"}, {"type": "image_url", "image_url": image_url}],
        "parameters": {"decoder_input_details": False, "details": True, "do_sample": False,
                       "max_new_tokens": NEW_TOKENS, "repetition_penalty": None, "return_full_text": False,
                       "seed": None, "temperature": None, "top_k": None, "top_p": None, "truncate": None,
                       "typical_p": None, "watermark": False, "stop": None, "adapter_id": "None"},
    }


def test_seed_004_image_strings_give_hf_greedy_tokens(llava_server, reference, media_dir):
    """The seed's image_url string: a png and a jpg under the allowed directory (a path and a
    file:// URL), a data: URL, and raw base64 of a jpg and of a png (no prefix)."""
    inside, _ = media_dir
    jpg = png(11, fmt="JPEG")
    (inside / "test.jpg").write_bytes(jpg)
    for source, image in [(str(inside / "cat.png"), png(7)), (f"file://{inside}/test.jpg", jpg),
                          (data_url(jpg, "image/jpeg"), jpg), (base64.b64encode(jpg).decode(), jpg),
                          (base64.b64encode(png(7)).decode(), png(7))]:
        r = httpx.post(llava_server.url + "/generate", timeout=60, json=seed_004_request(source))
        assert_hf_tokens(r, reference("My name is Olivier and I<image>", [image]))
    # the same strings where OpenAI's clients put a URL, and in TGI's markdown image
    raw = base64.b64encode(jpg).decode()
    r = generate(llava_server, f"Describe ![]({raw}) briefly.")
    assert_hf_tokens(r, reference("Describe <image> briefly.", [jpg]))
    for part in ({"url": raw}, raw):
        oai = httpx.post(llava_server.url + "/v1/chat/completions", timeout=60, json={
            "model": "llava", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": part}, {"type": "text", "text": "hi"}]}]})
        assert oai.status_code == 200, oai.text


@pytest.mark.parametrize("source, flag", [("test.png", "--allowed-local-media-path"),
                                          ("/elsewhere/test.png", "outside the allowed"),
                                          ("http://example.com/test.png", "--allowed-media-domains"),
                                          ("aGVsbG8gd29ybGQh", "--allowed-local-media-path")])
def test_seed_004_image_strings_refused_say_which_flag_allows_them(llava_server, source, flag):
    r = httpx.post(llava_server.url + "/generate", timeout=60, json=seed_004_request(source))
    assert r.status_code == 422 and r.json()["error_type"] == "validation" and flag in r.json()["error"], r.text
    assert generate(llava_server, "text only").status_code == 200


def test_tgi_markdown_image_in_a_string(llava_server, reference):
    image = png(2, fmt="JPEG")
    r = generate(llava_server, f"Describe ![]({data_url(image, 'image/jpeg')}) briefly.")
    assert_hf_tokens(r, reference("Describe <image> briefly.", [image]))


def test_openai_chat_image_url_part(llava_server, reference, tiny_llava):
    image = png(3)
    client = llava_server.openai_client()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                             {"type": "text", "text": "What is this?"}]}]
    r = client.chat.completions.create(model="llava", messages=messages, temperature=0, max_tokens=NEW_TOKENS,
                                       extra_body={"ignore_eos": True})
    template = load_chat_template("llava")
    text = template.render([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}])
    assert "USER: <image>\nWhat is this?" in text
    expected = reference(text, [image], add_special_tokens=template.template.add_special_tokens)
    assert r.usage.completion_tokens == NEW_TOKENS
    # the same tokens, as text (the SDK gives no ids)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llava[0])
    assert r.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)


def test_local_files_only_under_the_allowed_directory(llava_server, reference, media_dir):
    inside, outside = media_dir
    assert_hf_tokens(generate(llava_server, [{"type": "image_url", "image_url": {"url": str(inside / "cat.png")}}]),
                     reference("<image>", [png(7)]))
    for url in (str(outside / "secret.png"), f"{inside}/../{outside.name}/secret.png", str(inside / "link.png"),
                f"file://{outside}/secret.png"):
        r = generate(llava_server, [{"type": "image_url", "image_url": {"url": url}}])
        assert r.status_code == 422 and "outside the allowed" in r.json()["error"], (url, r.text)


@pytest.mark.parametrize("case", ["bad base64", "not an image", "truncated png", "too many pixels", "too many bytes",
                                  "too many bytes fetched", "redirect loop", "too many images", "unreachable",
                                  "not found", "unknown scheme", "stray placeholder"])
def test_bad_images_are_4xx_and_the_server_keeps_serving(llava_server, http_images, case):
    def part(url: str) -> dict:
        return {"type": "image_url", "image_url": {"url": url}}

    inputs = {
        "bad base64": [part("data:image/png;base64,@@@not-base64@@@")],
        "not an image": [part(data_url(b"hello, world"))],
        "truncated png": [part(data_url(png(4)[:60]))],
        "too many pixels": [part(data_url(png(5, (250, 250), solid=True)))],
        "too many bytes": [part(data_url(png(6, (300, 300))))],
        "too many bytes fetched": [part(http_images + "/big.png")],
        "redirect loop": [part(http_images + "/loop")],
        "too many images": [part(data_url(png(1))), part(data_url(png(2))), part(data_url(png(3)))],
        "unreachable": [part(f"http://127.0.0.1:{_closed_port()}/x.png")],
        "not found": [part(http_images + "/missing.png")],
        "unknown scheme": [part("ftp://example.com/x.png")],
        "stray placeholder": "a literal <image> with no image",
    }[case]
    r = generate(llava_server, inputs)
    assert r.status_code == 422 and r.json()["error_type"] == "validation", r.text
    # OpenAI's shape for the same image
    if isinstance(inputs, list):
        oai = httpx.post(llava_server.url + "/v1/chat/completions", timeout=60, json={
            "model": "llava", "max_tokens": 2, "messages": [{"role": "user", "content": [*inputs, {"type": "text", "text": "hi"}]}]})
        assert oai.status_code == 400 and oai.json()["error"]["message"], oai.text
    assert generate(llava_server, "text only").status_code == 200


def _closed_port() -> int:
    from serving_utils import free_port

    return free_port()


def test_an_image_for_a_text_only_model_is_refused(tiny_server):
    r = httpx.post(tiny_server.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(png(1))}}, {"type": "text", "text": "hi"}]}]})
    assert r.status_code == 400 and "text only" in r.json()["error"]["message"], r.text
    r = httpx.post(tiny_server.url + "/generate", timeout=60, json={
        "inputs": [{"type": "image_url", "image_url": {"url": data_url(png(1))}}], "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 422 and "text only" in r.json()["error"], r.text


def test_urls_are_fetched_only_from_the_operators_hosts(http_images):
    """No flag: no URL is fetched; with one, only its hosts, on every redirect hop too."""
    with pytest.raises(InvalidRequest, match="--allowed-media-domains"):
        asyncio.run(load_image_bytes(http_images + "/cat.png", MediaConfig()))
    only_loopback = MediaConfig(allowed_media_domains=frozenset({"127.0.0.1"}))
    assert asyncio.run(load_image_bytes(http_images + "/cat.png", only_loopback)).startswith(b"\x89PNG")
    with pytest.raises(InvalidRequest, match="'localhost' is not among"):
        asyncio.run(load_image_bytes(http_images.replace("127.0.0.1", "localhost") + "/cat.png", only_loopback))
    with pytest.raises(InvalidRequest, match="'localhost' is not among"):
        asyncio.run(load_image_bytes(http_images + "/elsewhere", only_loopback))
    any_host = MediaConfig(allowed_media_domains=frozenset({"*"}))
    assert asyncio.run(load_image_bytes(http_images + "/elsewhere", any_host)).startswith(b"\x89PNG")


def test_local_paths_are_refused_without_the_flag(media_dir):
    for url in (str(media_dir[0] / "cat.png"), f"file://{media_dir[0]}/cat.png", "/xxxx/test.png"):
        with pytest.raises(InvalidRequest, match="--allowed-local-media-path"):
            asyncio.run(load_image_bytes(url, MediaConfig()))


def test_raw_base64_needs_no_flag_and_is_told_from_a_path():
    """A jpg's base64 starts "/9j/", like an absolute path: what it decodes to decides."""
    jpg = png(12, fmt="JPEG")
    raw = base64.b64encode(jpg).decode()
    assert raw.startswith("/9j/")
    assert asyncio.run(load_image_bytes(raw, MediaConfig())) == jpg
    # base64's alphabet, but not an image once decoded: a path, refused without the flag
    with pytest.raises(InvalidRequest, match="--allowed-local-media-path"):
        asyncio.run(load_image_bytes("/abc/defg", MediaConfig()))


def test_a_jinja_template_gets_image_parts_as_hf_processors_do(tiny_llava):
    """A model's own Jinja template receives the parts, each image as {"type": "image"}, in order."""
    from transformers import AutoTokenizer

    from llmserve.chat_template.jinja import JinjaTemplate
    from llmserve.server.api.openai.convert import chat_messages
    from llmserve.server.api.openai.schema import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "A: "}, {"type": "image_url", "image_url": {"url": "u1"}},
                                     {"type": "text", "text": " B: "}, {"type": "image_url", "image_url": {"url": "u2"}}]}]})
    messages, urls = chat_messages(body.messages)
    assert urls == ["u1", "u2"]
    source = ("{% for m in messages %}[{{ m['role'] }}]{% if m['content'] is string %}{{ m['content'] }}{% else %}"
              "{% for p in m['content'] %}{% if p['type'] == 'image' %}<IMG>{% else %}{{ p['text'] }}{% endif %}"
              "{% endfor %}{% endif %}{% endfor %}")
    template = JinjaTemplate(source=source, tokenizer=AutoTokenizer.from_pretrained(tiny_llava[0]))
    assert template.messages2prompt(messages) == "[system]Be brief.[user]A: <IMG> B: <IMG>"


def test_streams_with_images(llava_server, reference):
    """TGI's /generate_stream and a streamed OpenAI chat carry the images too."""
    image = png(11)
    expected = reference("Look: <image>", [image])
    with httpx.stream("POST", llava_server.url + "/generate_stream", timeout=60, json={
            "inputs": [{"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": {"url": data_url(image)}}],
            "parameters": {"max_new_tokens": NEW_TOKENS}}) as r:
        assert r.status_code == 200
        ids = [json.loads(line[5:])["token"]["id"] for line in r.iter_lines() if line.startswith("data:")]
    assert ids == expected[: len(ids)] and ids
    chunks = llava_server.openai_client().chat.completions.create(
        model="llava", stream=True, temperature=0, max_tokens=NEW_TOKENS, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}}]}])
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
