"""Each token's own bytes: a byte-level vocabulary's tokens read back through GPT-2's alphabet, added tokens as their
text's UTF-8; the bytes of any text's tokens join into the text."""

from model.deepseek_v41.tokenizer import load_v41_tokenizer
from services.tokenizer.token_bytes import TokenBytes, byte_alphabet


def test_the_alphabet_spells_every_byte_once():
    alphabet = byte_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert alphabet["A"] == 65 and alphabet["Ġ"] == 32  # GPT-2's space


def test_every_texts_tokens_join_into_its_bytes():
    tokenizer = load_v41_tokenizer()
    token_bytes = TokenBytes(tokenizer)
    for text in ["The deep sea", "é 深海 🐙 hi", "\x00\t\n tab", "emoji 👩‍👩‍👧 done"]:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert b"".join(token_bytes(ids)) == text.encode(), text
    assert token_bytes([0, 128821]) == ["<｜begin▁of▁sentence｜>".encode(), b"<think>"]
