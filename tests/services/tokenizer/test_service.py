"""The tokenizer service over gRPC (the gateway's `RemoteTokenizer`, as in `shinkai up`): a chat's image counts
as its one placeholder against the budget, however long its data URL's text; that text sent as a prompt is
refused by its token count (the "the prompt is 2613 tokens" a stack once answered an image chat with came from
there, not from the image's span); a refusal quoting a megabyte value is still INVALID_ARGUMENT."""

import asyncio
import json
import subprocess
import sys

import pytest

from services.entrypoints.stack import ROOT
from services.gateway.remote import RemoteTokenizer
from services.tokenizer.chat import IMAGE_PLACEHOLDER, ChatError
from tests.services.engine.test_llm_chat import ask, data_url

pytestmark = pytest.mark.timeout(120)
BUDGET = 256 - 4  # max_model_len 256 less max_tokens 4: what the gateway passes


@pytest.fixture(scope="module")
def address():
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.entrypoints.tokenizer", "--model", "tiny", "--grpc-addr", "127.0.0.1:0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield f"127.0.0.1:{json.loads(proc.stdout.readline())['grpc_port']}"
    finally:
        proc.terminate()
        proc.wait(30)


def call(address: str, method: str, *args):
    async def run():
        tokenizer = RemoteTokenizer(address)
        try:
            return await getattr(tokenizer, method)(*args)
        finally:
            await tokenizer.close()

    return asyncio.run(run())


def test_an_image_counts_as_its_placeholder_and_its_url_as_text_is_refused_by_its_tokens(address):
    url = data_url(32, 28, seed=1)  # the served-ranks test's image: 3,734 characters of base64
    placeholder = call(address, "encode", IMAGE_PLACEHOLDER)[-1]
    rendered = call(address, "render_chat", {"messages": ask(url)}, BUDGET)
    assert rendered.token_ids.count(placeholder) == 1 and rendered.image_urls == [url]
    assert len(rendered.token_ids) < 40  # the text, the template and one placeholder
    num_url_tokens = len(call(address, "encode", url))
    assert num_url_tokens > BUDGET
    with pytest.raises(ValueError, match=f"^the prompt is {num_url_tokens} tokens, over the {BUDGET} tokens"):
        call(address, "encode", url, BUDGET)
    as_text = {"messages": [{"role": "user", "content": [{"type": "text", "text": url}]}]}
    with pytest.raises(ChatError, match=f"tokens, over the {BUDGET} tokens the context leaves"):
        call(address, "render_chat", as_text, BUDGET)


def test_a_refusal_quoting_a_long_value_is_invalid_argument_not_a_failed_service(address):
    """The recipe quotes a bare-string image_url whole; past the client's metadata limit (8 KiB) the status
    arrived as RESOURCE_EXHAUSTED, which the gateway answers as a 503 (the service failed)."""
    url = "data:image/png;base64," + "A" * 200_000
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": url}]}]}
    with pytest.raises(ChatError, match=r"expected struct ChatCompletionImageUrl"):
        call(address, "render_chat", body, BUDGET)


def test_render_chat_takes_the_bodys_protocol(address):
    """Responses and Anthropic Messages bodies render as the recipe converts them; a chat of the same turn
    renders to the same ids; an unknown protocol is refused."""
    from model.deepseek_v41.tokenizer import v41_tokenizer_path
    from services.tokenizer.chat import ChatRenderer

    local = ChatRenderer(v41_tokenizer_path())
    chat = call(address, "render_chat", {"messages": [{"role": "user", "content": "Hi"}]}, BUDGET)
    responses = call(address, "render_chat", {"input": "Hi"}, BUDGET, "responses")
    messages = call(
        address, "render_chat", {"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]}, BUDGET, "messages"
    )
    assert responses.token_ids == chat.token_ids == local.render({"input": "Hi"}, "responses").token_ids
    assert messages.token_ids == chat.token_ids
    with pytest.raises(ChatError, match="protocol"):
        call(address, "render_chat", {"input": "Hi"}, BUDGET, "smoke-signals")


def test_detokenize_keeps_special_tokens_when_asked(address):
    async def run(skip):
        tokenizer = RemoteTokenizer(address)
        try:
            detokenizer = tokenizer.detokenizer(skip)
            return await detokenizer.push([0, 19923]) + await detokenizer.finish()
        finally:
            await tokenizer.close()

    assert asyncio.run(run(False)) == "<｜begin▁of▁sentence｜>Hello" and asyncio.run(run(True)) == "Hello"


def test_token_texts_are_each_ids_own_string_and_bytes_in_one_call(address):
    """Logprobs' token strings and bytes (a request's tokens and their top-n) come back in one Decode call, each id
    alone: its string as the tokenizer decodes it with special tokens kept, its bytes its own, so the pieces of a
    character split over tokens (each string only U+FFFD) join into the character."""
    from model.deepseek_v41.tokenizer import load_v41_tokenizer

    local = load_v41_tokenizer()
    octopus = local.encode(" 🐙", add_special_tokens=False).ids  # one character, several tokens
    ids = [0, 19923, 2058, 1, 128821, *octopus]
    calls = []

    async def run():
        tokenizer = RemoteTokenizer(address)
        decode = tokenizer.stub.Decode

        async def counted(request, **kwargs):
            calls.append(len(request.token_ids))
            return await decode(request, **kwargs)

        tokenizer.stub.Decode = counted
        try:
            return await tokenizer.token_texts(ids), await tokenizer.token_texts([])
        finally:
            await tokenizer.close()

    (strings, token_bytes), none = asyncio.run(run())
    assert strings == [local.decode([t], skip_special_tokens=False) for t in ids] and none == ([], [])
    assert calls == [len(ids)]
    assert len(octopus) > 1 and b"".join(token_bytes[5:]).decode() == " 🐙"
    assert token_bytes[:5] == [s.encode() for s in strings[:5]]  # whole characters: their strings' UTF-8


def test_the_tokenizer_process_does_its_one_time_work_before_it_serves(monkeypatch):
    """The pool's threads, the first encode and chat rendering and the tokens' bytes are made before SERVING."""
    from services.entrypoints import tokenizer as entrypoint
    from services.tokenizer.service import TokenizerApi

    seen: list[str] = []
    warm = TokenizerApi.warm

    async def warm_and_note(api):
        await warm(api)
        seen.append("warm")

    async def serve(server, **kwargs):  # where the real one binds the port and says SERVING
        seen.append("serving")
        return 0

    monkeypatch.setattr(TokenizerApi, "warm", warm_and_note)
    monkeypatch.setattr(entrypoint, "serve_until_signalled", serve)
    assert asyncio.run(entrypoint.serve("tiny", "127.0.0.1:0")) == 0
    assert seen == ["warm", "serving"]
