"""Chat rendering's refusals stay short: a value the recipe quotes is cut, so a bare-string data URL cannot
make a 400's body or a gRPC status megabytes long."""

import pytest

from model.deepseek_v41.tokenizer import v41_tokenizer_path
from services.tokenizer.chat import MAX_ECHO_CHARS, MAX_ERROR_CHARS, ChatError, ChatRenderer, bounded


@pytest.fixture(scope="module")
def renderer():
    return ChatRenderer(v41_tokenizer_path())


def test_a_bare_string_image_url_is_refused_with_its_value_cut(renderer):
    url = "data:image/png;base64," + "A" * 100_000  # OpenAI's form is {"url": ...}; the recipe refuses a string
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": url}]}]}
    with pytest.raises(ChatError) as caught:
        renderer.render(body)
    message = str(caught.value)
    assert len(message) <= MAX_ERROR_CHARS
    assert f'"{url[:MAX_ECHO_CHARS]}…" ({len(url)} characters)' in message
    assert "expected struct ChatCompletionImageUrl" in message  # what the client must change


def test_bounded_keeps_short_values_and_cuts_a_long_text_in_its_middle():
    short = 'messages: invalid type: string "hello", expected a map'
    assert bounded(short) == short
    long = "x" * 1000 + " the end"  # nothing quoted: only the overall cut applies
    out = bounded(long)
    assert len(out) <= MAX_ERROR_CHARS and out.startswith("xxx") and out.endswith(" the end") and " … " in out
