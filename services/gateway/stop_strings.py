"""Stop strings matched on a request's detokenized text as it arrives, across token boundaries.

The first match is the one that ends earliest in the text (of two ending at the same character, the longer);
the text is cut before it, or after it with ``include`` (vLLM's ``include_stop_str_in_output``). Invariants:
- the texts `push` returns, followed by `flush` when no match came, concatenate to exactly `reference_cut`
  of the whole text, however the text was split into pushes;
- text `push` returns never holds a character that a later push could make part of a match: only the
  longest tail that is a proper prefix of some stop string is held back, so no stop text is ever emitted
  (without ``include``), and a match always lies inside the held tail plus the new text.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_STOP_STRINGS = 4  # as OpenAI
MAX_STOP_CHARS = 1024  # characters of one stop string


def first_match(text: str, stops: Sequence[str]) -> tuple[int, int] | None:
    """(start, end) of the stop string that ends first in ``text`` (ties: the one starting first), or None."""
    best: tuple[int, int] | None = None
    for stop in stops:
        start = text.find(stop)
        if start < 0:
            continue
        end = start + len(stop)
        if best is None or (end, start) < (best[1], best[0]):
            best = (start, end)
    return best


def reference_cut(text: str, stops: Sequence[str], include: bool) -> tuple[str, bool]:
    """The text a request returns when ``text`` is all it generated: (cut text, whether a stop matched)."""
    match = first_match(text, stops)
    if match is None:
        return text, False
    return text[: match[1] if include else match[0]], True


class StopStrings:
    """One request's stop strings; feed it the text deltas in order."""

    def __init__(self, stops: Sequence[str], include: bool = False) -> None:
        if not stops or any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = tuple(stops)
        self.include = include  # the matched stop string is part of the returned text
        self.matched: str | None = None  # the stop string that ended the text, once one has
        self._held = ""  # received, not yet returned: the longest tail that begins some stop string

    def push(self, text: str) -> str:
        """The part of the text so far that is safe to return now. After a match (`matched` set) it ends at
        the match, and later pushes return nothing."""
        if self.matched is not None:
            return ""
        buffer = self._held + text
        match = first_match(buffer, self.stops)
        if match is not None:
            start, end = match
            self.matched = buffer[start:end]
            self._held = ""
            return buffer[: end if self.include else start]
        keep = self._prefix_tail(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """The held-back tail, at the end of a text that matched no stop string."""
        held, self._held = self._held, ""
        return held

    def _prefix_tail(self, buffer: str) -> int:
        """Length of the longest tail of ``buffer`` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest
