"""The compiler's vocabulary: no grammar state allows one of the tokenizer's added tokens (``<｜User｜>``, the
sequence tokens, image placeholders, ...) as a single token: not inside a JSON string, a regex's free text, or a
tool call's reasoning and raw string parameter; only structural tags may write their markup tokens (``</think>``,
``｜DSML｜``), where their grammar puts them. The end token is allowed where a grammar ends."""

from __future__ import annotations

import json

import pytest

from model.deepseek_v41.tokenizer import load_v41_tokenizer
from services.engine.structured.constraint import Constraint
from services.engine.structured.grammars import MARKUP_TOKENS, GrammarCompiler
from services.engine.structured.tool_calls import ToolCallGrammar
from services.worker.sampling.token_bitmask import allowed_tokens

pytestmark = pytest.mark.timeout(300)

EOS = 1  # DeepSeek-V4.1's end token, <｜end▁of▁sentence｜>
TEXT_SCHEMA = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
TOOL = {
    "type": "function",
    "function": {"name": "w", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


@pytest.fixture(scope="module")
def setup():
    tok = load_v41_tokenizer()
    grammars = GrammarCompiler(tok, tok.get_vocab_size(), EOS)
    # The added tokens but the end token (the compiler's stop token: allowed wherever a grammar may end).
    added = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if i != EOS}
    yield tok, grammars, added
    grammars.close()


def _allowed_after(setup, constraint: Constraint, text: str) -> set[int]:
    """The token ids the grammar allows after ``text`` (fed as the tokenizer's ordinary tokens)."""
    tok, grammars, _ = setup
    matcher = grammars.matcher(grammars.compile(constraint).result())
    ids = tok.encode(text, add_special_tokens=False).ids if text else []
    for t in ids:
        assert matcher.accept_token(t), (text, t)
    mask = grammars.bitmask(1)
    matcher.fill_next_token_bitmask(mask, 0)
    return set(allowed_tokens(mask, grammars.vocab_size, "cpu")[0].nonzero().flatten().tolist())


def test_no_added_token_inside_a_json_string_or_free_regex_text(setup):
    _, _, added = setup
    for constraint, text in (
        (Constraint("json_schema", json.dumps(TEXT_SCHEMA)), '{"s": "ab'),
        (Constraint("regex", r"(.|\n){0,40}"), "hello"),
    ):
        allowed = _allowed_after(setup, constraint, text)
        assert len(allowed) > 100_000  # free text: almost every ordinary token
        assert not allowed & set(added.values()), sorted(allowed & set(added.values()))[:8]
    assert EOS in _allowed_after(setup, Constraint("regex", "ab"), "ab")  # the end token, once the grammar ends


def test_a_tool_call_grammar_writes_its_markup_tokens_and_no_other_added_token(setup):
    _, _, added = setup
    markup = {added[t] for t in MARKUP_TOKENS}
    others = set(added.values()) - markup
    grammar = ToolCallGrammar([TOOL], named=True, thinking=True).constraint()
    reasoning = _allowed_after(setup, grammar, "Let me think")
    assert added["</think>"] in reasoning and not reasoning & others
    assert added["<｜User｜>"] not in reasoning and added["<think>"] not in reasoning
    call = '</think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="w">\n<｜DSML｜ parameter name="city" string="true">Pa'
    raw = _allowed_after(setup, grammar, call)
    assert len(raw) > 100_000 and not raw & others


def test_the_parallel_fill_gives_each_matchers_own_mask(setup):
    """``GrammarCompiler.fill`` (xgrammar's batch matcher, several threads) writes each matcher's row as its own
    ``fill_next_token_bitmask`` does, rows in any order and the others untouched."""
    tok, grammars, _ = setup
    texts = ['{"s": "a', '{"s"', "{", '{"s": "ab"}']
    compiled = grammars.compile(Constraint("json_schema", json.dumps(TEXT_SCHEMA))).result()
    matchers = []
    for text in texts:
        matcher = grammars.matcher(compiled)
        for t in tok.encode(text, add_special_tokens=False).ids:
            assert matcher.accept_token(t)
        matchers.append(matcher)
    rows = [4, 0, 2, 5]
    mask = grammars.bitmask(6)
    grammars.fill(matchers, mask, rows)
    for matcher, row in zip(matchers, rows):
        alone = grammars.bitmask(1)
        matcher.fill_next_token_bitmask(alone, 0)
        assert bool((mask[row] == alone[0]).all()), row
    assert bool((mask[[1, 3]] == -1).all())
