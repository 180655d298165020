"""Incremental detokenization: text deltas that never split a UTF-8 character.

Invariant: the deltas of ``push`` followed by ``finish`` concatenate to exactly
``tokenizer.decode(all ids, skip_special_tokens)``, the text `LLM.generate` returns.

Byte-level BPE decodes an incomplete UTF-8 sequence at the end as U+FFFD, and appending tokens only
rewrites that incomplete tail. So each push decodes the ids from the last *anchor* (a token boundary where
everything before it has been emitted as complete text), holds back trailing U+FFFD, and emits the rest;
``finish`` flushes the held-back tail, genuine U+FFFD included. Decoding restarts from the anchor, so a
request costs O(n · window) rather than O(n²).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        # ids[:anchor] decode to exactly the text emitted before `emitted_since_anchor`.
        self._anchor = 0
        # Text emitted from the ids after the anchor.
        self._emitted_since_anchor = ""

    def _decode_from_anchor(self) -> str:
        return self.tokenizer.decode(self.token_ids[self._anchor :], skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: Sequence[int]) -> str:
        """Adds tokens; returns the new complete text (may be empty)."""
        self.token_ids.extend(int(t) for t in token_ids)
        text = self._decode_from_anchor()
        stable = text.rstrip(REPLACEMENT)
        if not stable.startswith(self._emitted_since_anchor):
            return ""  # decoding rewrote emitted text: wait for finish (not seen with byte-level BPE)
        delta = stable[len(self._emitted_since_anchor) :]
        if stable == text:  # nothing held back: everything so far is complete, move the anchor
            self._anchor = len(self.token_ids)
            self._emitted_since_anchor = ""
        else:
            self._emitted_since_anchor = stable
        return delta

    def finish(self) -> str:
        """Returns whatever was held back; the stream's text is complete after this."""
        text = self._decode_from_anchor()
        delta = text[len(self._emitted_since_anchor) :] if text.startswith(self._emitted_since_anchor) else ""
        self._anchor = len(self.token_ids)
        self._emitted_since_anchor = ""
        return delta
