"""Each token's own bytes, for logprobs' ``bytes`` (OpenAI's: the token's UTF-8 bytes, so a client can join the
pieces of a character that several tokens share, where each piece's decoded string is only U+FFFD).

A byte-level BPE vocabulary (V4.1's, a ``ByteLevel`` decoder) spells each token's bytes in GPT-2's byte-to-character
alphabet, which is read back here; an added token (``<｜User｜>``, ``</think>``, ...) is its text's UTF-8. A tokenizer
of another kind gives each token's decoded string's UTF-8."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet read backwards: the character that spells each byte -> the byte. The printable
    bytes spell themselves; the rest (controls, space, 127-160, 173) take the characters from 256 up, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            alphabet[chr(256 + extra)] = b
            extra += 1
    return alphabet


class TokenBytes:
    """``token_bytes(ids)``: each id's bytes. Built once per tokenizer (a ``tokenizers.Tokenizer``)."""

    def __init__(self, tokenizer: Any) -> None:
        import tokenizers

        self.tokenizer = tokenizer
        self.byte_level = isinstance(getattr(tokenizer, "decoder", None), tokenizers.decoders.ByteLevel)
        self.added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self.alphabet = byte_alphabet()

    def __call__(self, token_ids: Sequence[int]) -> list[bytes]:
        return [self.one(t) for t in token_ids]

    def one(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode()
        spelt = self.tokenizer.id_to_token(token_id) if self.byte_level else None
        if spelt is not None and all(c in self.alphabet for c in spelt):
            return bytes(self.alphabet[c] for c in spelt)
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()
