"""Images through every door of a served Qwen2.5-VL (a tiny random checkpoint): OpenAI chat image_url parts at the
gateway (a data: URL, a file:// URL under --allowed-local-media-path; refused: a file elsewhere, a remote URL from a
host not allowed), Triton's `image` input (vllm_backend's, base64) with the prompt carrying the placeholders, each
answering what the engine answers in-process; bad images and too many are a 400 naming the part, the server stays up;
a text-only model refuses an image part."""
from __future__ import annotations

import base64
import io
import urllib.error

import httpx
import pytest

from backend import LLM, SamplingParams
from backend.models.registry import DEFAULT_MODEL
from tests.conftest import (
    GATEWAY_API_KEY, free_port, generate_through_triton, make_tiny_qwen_vl, random_image, served_by_triton,
    start_gateway,
)

MAX_TOKENS = 8
QUESTION = "What is in the picture?"


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory, default_model_dir):
    return make_tiny_qwen_vl(tmp_path_factory.mktemp("qwen2_5_vl"), default_model_dir)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    (folder / "picture.png").write_bytes(_png(random_image(84, 56, 1)))
    return folder


@pytest.fixture(scope="module")
def vl_triton(vl_dir, tmp_path_factory):
    engine_args = {"model": str(vl_dir), "dtype": "float32", "block_size": 16, "limit_mm_per_prompt": {"image": 2}}
    with served_by_triton(engine_args, tmp_path_factory.mktemp("vl-triton") / "triton.log") as server:
        yield server


@pytest.fixture(scope="module")
def vl_gateway(vl_triton, vl_dir, media_dir, tmp_path_factory):
    port = free_port()
    process = start_gateway(vl_triton.grpc_url, port, tmp_path_factory.mktemp("vl-gateway") / "gateway.log",
                            extra_args=("--tokenizer", str(vl_dir), "--served-model-name", "vl",
                                        "--allowed-local-media-path", str(media_dir), "--max-body-bytes", "2000000",
                                        "--allowed-media-domains", "images.example"))
    yield f"http://127.0.0.1:{port}"
    process.terminate()
    process.wait(15)


@pytest.fixture(scope="module")
def expected(vl_dir):
    """The in-process engine's greedy answer to the question about picture.png, and its prompt's text."""
    with LLM(model=str(vl_dir), dtype="float32", block_size=16) as llm:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
        prompt = llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        [output] = llm.generate({"prompt": prompt, "multi_modal_data": {"image": random_image(84, 56, 1)}},
                                SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return output.outputs[0].text, prompt, len(output.prompt_token_ids)


def _chat(gateway: str, *urls: str, model: str = "vl") -> httpx.Response:
    content = [{"type": "image_url", "image_url": {"url": url}} for url in urls] + [{"type": "text", "text": QUESTION}]
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {GATEWAY_API_KEY}"})


def test_a_data_url_and_an_allowed_file_answer_as_the_engine(vl_gateway, media_dir, expected):
    text, _, prompt_tokens = expected
    for url in (_data_url((media_dir / "picture.png").read_bytes()), (media_dir / "picture.png").as_uri()):
        response = _chat(vl_gateway, url)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["choices"][0]["message"]["content"] == text
        assert answer["usage"]["prompt_tokens"] == prompt_tokens  # (the image's tokens counted)


def test_images_the_gateway_refuses_name_their_part(vl_gateway, media_dir, tmp_path, expected):
    """Each a 400 naming messages[0].content[k] and why; the server stays up and answers the next request."""
    outside = tmp_path / "elsewhere.png"
    outside.write_bytes((media_dir / "picture.png").read_bytes())
    png = (media_dir / "picture.png").read_bytes()
    huge, bomb = io.BytesIO(), io.BytesIO()
    random_image(8, 8, 2).convert("1").resize((9000, 9000)).save(huge, format="PNG")  # (81 M pixels, a few KB)
    random_image(8, 8, 2).convert("1").resize((20000, 20000)).save(bomb, format="PNG")  # (PIL's bomb limit)
    refusals = {
        outside.as_uri(): "not under --allowed-local-media-path",
        "https://elsewhere.example/cat.png": "allowed-media-domains",
        "ftp://images.example/cat.png": "data:, file:// or http(s)://",
        _data_url(b"plain text, no image"): "not an image",
        _data_url(png[: len(png) // 2]): "cannot be decoded",
        _data_url(huge.getvalue()): "at most",
        _data_url(bomb.getvalue()): "cannot be read",
        "data:image/png;base64,@@@": "not valid base64",
    }
    for url, why in refusals.items():
        response = _chat(vl_gateway, url)
        assert response.status_code == 400, (url[:40], response.text)
        error = response.json()["error"]
        assert why in error["message"] and error["param"] == "messages[0].content[0]", error
    # three images where the engine takes two: the engine's refusal, a 400 too
    response = _chat(vl_gateway, *[_data_url(png)] * 3)
    assert response.status_code == 400 and "At most 2 image(s)" in response.json()["error"]["message"]
    # images each allowed, too many pixels together: refused from their headers, naming the one past the budget
    large = io.BytesIO()
    random_image(8, 8, 2).convert("1").resize((7000, 7000)).save(large, format="PNG")  # (49 M pixels)
    response = _chat(vl_gateway, *[_data_url(large.getvalue())] * 3)
    error = response.json()["error"]
    assert response.status_code == 400 and "pixels together" in error["message"], error
    assert error["param"] == "messages[0].content[2]"
    assert _chat(vl_gateway, _data_url(png)).json()["choices"][0]["message"]["content"] == expected[0]


def test_tritons_image_input_answers_as_the_engine(vl_triton, media_dir, expected):
    """vllm_backend's contract: base64 images in `image`, the prompt carrying the model's placeholders."""
    text, prompt, _ = expected
    image = base64.b64encode((media_dir / "picture.png").read_bytes()).decode()
    body = {"text_input": prompt, "image": [image], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "exclude_input_in_output": True}
    assert generate_through_triton(vl_triton, body)["text_output"] == text
    with pytest.raises(urllib.error.HTTPError) as refused:
        generate_through_triton(vl_triton, {**body, "image": ["@@@ not base64"]})
    assert refused.value.code == 400 and "image[0]: not valid base64" in refused.value.read().decode()


def test_a_text_only_model_refuses_an_image_part(gateway):
    response = _chat(gateway, _data_url(_png(random_image(28, 28, 3))), model=DEFAULT_MODEL)
    assert response.status_code == 400 and "takes text only" in response.json()["error"]["message"]


def test_the_ui_sends_an_attached_picture_and_keeps_it_across_a_reload(vl_gateway, vl_triton, media_dir,
                                                                        tmp_path_factory, expected):
    """In Chromium: a picture attached to a question, a reply to the prompt with the picture's tokens, and after a
    reload the picture still in the conversation (its image loads)."""
    from tests.ui_browser import ARTIFACTS, chromium_page, open_ui, reply_done, running_ui, set_field

    with running_ui(vl_gateway, vl_triton.metrics_url, tmp_path_factory.mktemp("vl-ui")) as url, \
            chromium_page() as page:
        open_ui(page, url)
        set_field(page, "#max-tokens input[type=number]", "24")  # (a short reply: the picture stays in view)
        page.locator("#message input[type=file]").set_input_files(str(media_dir / "picture.png"))
        page.wait_for_function("document.querySelectorAll('#message img').length > 0", timeout=30000)
        page.locator("#message textarea").fill(QUESTION)
        page.locator("#message textarea").press("Enter")
        page.wait_for_function("document.querySelector('#message textarea').value === ''", timeout=30000)
        assert reply_done(page).strip()
        # the prompt as the engine counted it: the picture's tokens in it (the UI samples, so the reply differs)
        assert f"prompt {expected[2]} tokens" in page.locator("#reply-stats").inner_text()
        shown = "document.querySelectorAll('#chatbot .message.user img').length"
        assert page.evaluate(shown) == 1
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "ui-vision.png"))
        open_ui(page, url)  # a reload: the conversation comes back from the browser's storage
        page.locator("#conversations label").first.click()
        page.wait_for_function(f"{shown} === 1 && [...document.querySelectorAll('#chatbot .message.user img')]"
                               ".every(i => i.complete && i.naturalWidth > 0)", timeout=30000)


def test_the_ui_refuses_a_picture_for_a_text_only_model(gateway, triton_server, media_dir, tmp_path_factory):
    """Before sending: a warning, the chat left empty, the box still holding the question."""
    from tests.ui_browser import chromium_page, open_ui, running_ui

    with running_ui(gateway, triton_server.metrics_url, tmp_path_factory.mktemp("text-ui")) as url, \
            chromium_page() as page:
        open_ui(page, url)
        page.locator("#message input[type=file]").set_input_files(str(media_dir / "picture.png"))
        page.wait_for_function("document.querySelectorAll('#message img').length > 0", timeout=30000)
        page.locator("#message textarea").fill(QUESTION)
        page.locator("#message textarea").press("Enter")
        page.wait_for_function("document.body.innerText.includes('takes text only')", timeout=30000)
        assert page.locator("#chatbot .message").count() == 0
        assert page.locator("#message textarea").input_value() == QUESTION
