"""Images through `shinkai serve` (the in-process tower behind the same `ImagePrompts` path an engine process
uses with the multimodal service): the openai client's reply equals `LLM.chat` exactly (batch-invariant
mode), gRPC chat parts too; the readiness gate lets a later text request run while an image is encoded;
every bad image is a 400 / INVALID_ARGUMENT naming the problem, with nothing leaked and the server serving;
a multimodal service that is down is a 503."""

from __future__ import annotations

import asyncio
import base64
import io
import socket
import threading
import time

import numpy as np
import openai
import pytest
import torch
from PIL import Image

from services.client import InvalidArgument, ShinkaiClient
from services.engine import SamplingParams
from services.engine.images.encoder import MultimodalClient
from services.engine.images.prompt import ImagePrompts
from services.gateway import errors
from services.gateway.api_server import ApiServer
from services.gateway.backends import LocalEngine
from services.gateway.errors import ApiError
from services.gateway.frontend import Frontend, GenerateArgs
from services.gateway.remote import RemoteEngine
from tests.services.gateway.support import pools_whole, wait_whole

pytestmark = pytest.mark.timeout(120)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


THINKING_OFF = {"chat_template_kwargs": {"thinking": False}}


def encoded(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def ask(*urls: str, text: str = "What is in the picture?") -> list[dict]:
    parts = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": parts}]


def big_png() -> bytes:
    """56 million pixels in a few kilobytes (1-bit, all black): over the pixel limit, under the byte limit."""
    out = io.BytesIO()
    Image.new("1", (8000, 7000)).save(out, "PNG")
    return out.getvalue()


def bmp() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (30, 30)).save(out, "BMP")
    return out.getvalue()


def test_openai_chat_with_a_data_url_image_equals_llm_chat(served, openai_client, reference_llm):
    messages = ask(data_url(encoded(100, 80, seed=1)))
    reply = openai_client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, temperature=0, logprobs=True, extra_body=THINKING_OFF
    )  # thinking off: the answer is all content, as LLM.chat's text
    expected = reference_llm.chat(messages, GREEDY, thinking={"type": "disabled"})[0]
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert reply.choices[0].message.content == expected.text
    assert [t.logprob for t in reply.choices[0].logprobs.content] == pytest.approx(expected.logprobs, abs=0)
    with ShinkaiClient(served.grpc_target, timeout=60) as client:  # the gRPC API's chat parts
        done = client.generate(messages=messages, max_tokens=4, temperature=0, thinking=False)
    thinking_off = reference_llm.chat(messages, GREEDY, thinking={"type": "disabled"})[0]
    assert done.prompt_tokens == len(thinking_off.prompt_token_ids) and done.text == thinking_off.text
    wait_whole(served)


def test_a_text_request_after_a_slow_image_request_gets_its_first_token_first(served, reference_llm):
    """The readiness gate: the image request waits unready (holding nothing) while its encode sleeps; a text
    request submitted after it is scheduled meanwhile."""
    api = served.server.served.images.encoder.api
    messages = ask(data_url(encoded(90, 70, seed=7)))
    first_token: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}

    def run(name: str, **request) -> None:
        with ShinkaiClient(served.grpc_target, timeout=60) as client:
            for delta in client.generate_stream(max_tokens=4, temperature=0, ignore_eos=True, **request):
                if delta.token_ids:
                    first_token.setdefault(name, time.monotonic())
                    tokens.setdefault(name, []).extend(delta.token_ids)

    api.encode_delay_s = 3.0
    try:
        image = threading.Thread(target=run, args=("image",), kwargs={"messages": messages, "thinking": False})
        image.start()
        deadline = time.monotonic() + 30
        while served.server.engine.stats().num_waiting == 0:  # queued, unready
            assert time.monotonic() < deadline and "image" not in first_token
            time.sleep(0.02)
        run("text", prompt=[0, 19923, 16])
        image.join(60)
    finally:
        api.encode_delay_s = 0.0
    assert first_token["text"] < first_token["image"]
    expected = reference_llm.chat(messages, GREEDY, thinking={"type": "disabled"})[0]
    assert tokens["image"] == expected.token_ids
    wait_whole(served)


# (row, image_url, a word of the message)
BAD_IMAGES = [
    ("bad base64", "data:image/png;base64,!!!!", "base64"),
    ("not an image", data_url(b"\x00" * 64), "supported format"),
    (
        "unsupported format (its media type; refused by deepseek-recipe)",
        data_url(bmp(), "image/bmp"),
        "unsupported image",
    ),
    ("unsupported format (its bytes)", data_url(bmp(), "image/png"), "image format BMP is not supported"),
    ("truncated (found only when encoding)", data_url(encoded(100, 80)[:3000]), "truncated"),
    ("over the pixel limit", data_url(big_png()), "pixels, over the limit of 50000000"),
    ("loopback URL (the SSRF rule)", "http://127.0.0.1:9/cat.png", "--allow-private-image-urls"),
    ("file URL (refused by deepseek-recipe)", "file:///etc/passwd", "Unsupported image_url"),
]


@pytest.mark.parametrize("row, url, word", BAD_IMAGES, ids=[r[0] for r in BAD_IMAGES])
def test_each_bad_image_is_a_400_naming_it_over_http_and_grpc(served, openai_client, row, url, word):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(model="tiny", messages=ask(url), max_tokens=1)
    assert word in caught.value.body["message"] and caught.value.body["param"] == "messages", caught.value.body
    with ShinkaiClient(served.grpc_target, timeout=60) as client:
        with pytest.raises(InvalidArgument, match=word.replace("(", r"\(")):
            client.generate(messages=ask(url), max_tokens=1)
        assert client.generate("Hi", max_tokens=1).finish_reason == "length"  # still serving
    wait_whole(served)


def test_too_many_images_is_a_400(served, openai_client):
    small = data_url(encoded(30, 30))
    with pytest.raises(openai.BadRequestError, match="9 images in one request, over the limit of 8"):
        openai_client.chat.completions.create(model="tiny", messages=ask(*[small] * 9), max_tokens=1)


def test_a_chat_whose_image_span_passes_the_context_is_a_400_naming_count_and_limit(
    served, openai_client, reference_llm
):
    """The gateway's budget counts the image as its one placeholder, so this chat passes it; the engine checks
    the expanded prompt (LLM.chat's count) and refuses it by name over HTTP and gRPC, leaving nothing queued."""
    messages = ask(data_url(encoded(32, 28, seed=1)))
    num_prompt = len(reference_llm.chat(messages, GREEDY)[0].prompt_token_ids)
    max_model_len = served.server.frontend.info.max_model_len
    max_tokens = max_model_len - num_prompt + 1  # the rendered prompt (≤ num_prompt − 1 tokens) fits; one over
    message = (
        rf"the prompt \({num_prompt} tokens\) plus max_tokens \({max_tokens}\) is {max_model_len + 1}, "
        rf"longer than the context of {max_model_len} tokens"
    )
    with pytest.raises(openai.BadRequestError, match=message) as caught:
        openai_client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens)
    assert caught.value.body["param"] == "messages"
    with ShinkaiClient(served.grpc_target, timeout=60) as client:
        with pytest.raises(InvalidArgument, match=message):
            client.generate(messages=messages, max_tokens=max_tokens, thinking=True)
    wait_whole(served)


def test_a_bare_string_image_url_is_a_short_400(served, openai_client):
    """OpenAI's image_url is an object; the recipe refuses a bare string, quoting it: the 400 cuts the value."""
    url = data_url(encoded(100, 80))
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": url}]}]
    with pytest.raises(openai.BadRequestError, match="expected struct ChatCompletionImageUrl") as caught:
        openai_client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    assert len(caught.value.body["message"]) < 1000 < len(url)


def test_a_failed_encode_leaves_nothing_queued(served, openai_client):
    """The truncated image passes the header plan, so the request is queued unready before the encode fails:
    it must leave the scheduler with its pools whole."""
    for _ in range(3):
        with pytest.raises(openai.BadRequestError, match="truncated"):
            openai_client.chat.completions.create(
                model="tiny", messages=ask(data_url(encoded(100, 80)[:3000])), max_tokens=1
            )
    assert pools_whole(served.server.engine.stats())


@pytest.mark.parametrize("hop", ["in-process", "through an engine endpoint"])
def test_a_multimodal_service_that_is_down_is_a_503(served, hop):
    """Its engine's frontend answers 503 ``multimodal_unavailable``; a gateway in front of that engine (over
    shinkai.v1, as in `shinkai up`) answers the same code and message."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening
        server = served.server
        images = server.served.images

        async def start():  # on the server's loop, where the grpc.aio channels must live
            client = MultimodalClient(f"127.0.0.1:{port}", timeout_s=30)
            down = LocalEngine(server.engine, ImagePrompts(images.vision, images.placeholder_id, client))
            frontend = Frontend(
                server.frontend.info, down, server.frontend.tokenizer, server.metrics, takes_request_ids=True
            )
            endpoint = remote = None
            if hop != "in-process":
                endpoint = ApiServer(frontend, "127.0.0.1", None, 0)
                await endpoint.start()
                remote = RemoteEngine("engine-down", f"127.0.0.1:{endpoint.grpc_port}")
                frontend = Frontend(server.frontend.info, remote, server.frontend.tokenizer, server.metrics)
            args = GenerateArgs(model=None, chat_body={"messages": ask(data_url(encoded(60, 60)))}, params=GREEDY)
            try:
                await frontend.start(args)
            finally:
                await client.close()
                if endpoint is not None:
                    await remote.close()
                    await endpoint.stop()

        with pytest.raises(ApiError) as caught:
            asyncio.run_coroutine_threadsafe(start(), served.loop).result(60)
    assert caught.value.kind == errors.UNAVAILABLE and caught.value.code == "multimodal_unavailable"
    assert caught.value.message == "the multimodal service cannot encode images now (UNAVAILABLE); try again shortly"
    wait_whole(served)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(600)
def test_on_cuda_images_run_on_the_torch_backend_and_on_the_kernel_backend():
    """The served image chat on CUDA equals ``LLM.chat`` with the same engine arguments, on the torch backend
    and on the CUDA default, the FP8 kernel backend (its router selects image tokens' experts with
    ``bias_vl``; batch-invariant mode, so the one served request and the offline one give the same bits)."""
    from services.engine import LLM
    from services.gateway.server import ServeConfig
    from tests.services.gateway.support import ServerThread

    messages = ask(data_url(encoded(100, 80, seed=1)))
    # Fixed pools: engines share the GPU in this process (unset, each would size itself to the GPU).
    torch_args = {"device": "cuda", "kernel_backend": None, "num_blocks": 512}
    kernel_args = {"device": "cuda", "num_blocks": 512, "batch_invariant": True}  # the CUDA default: kernels
    for engine_args in (torch_args, kernel_args):
        expected = LLM("tiny", **engine_args).chat(messages, GREEDY, thinking={"type": "disabled"})[0]
        thread = ServerThread(ServeConfig(model="tiny", http_port=0, grpc_port=0, engine_args=engine_args)).start()
        try:
            client = openai.OpenAI(base_url=thread.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
            reply = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=4, temperature=0, extra_body=THINKING_OFF
            )
            assert reply.usage.prompt_tokens == len(expected.prompt_token_ids), engine_args
            assert reply.choices[0].message.content == expected.text, engine_args
        finally:
            thread.stop()
        assert pools_whole(thread.server.engine.stats())
