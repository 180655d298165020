"""Stop strings on streamed text: a property test of the matcher and of a generation's cut, against the reference."""

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from observability.metrics import RequestMetrics
from services.engine.finish_reason import FinishReason
from services.engine.service import Delta
from services.gateway.generation import Generation
from services.gateway.stop_strings import StopStrings, reference_cut

# A small alphabet makes matches, near-matches and overlapping stop strings common.
ALPHABET = "ab c\n"
texts = st.text(ALPHABET, max_size=40)
stop_sets = st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=4)


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[i:j] for i, j in zip([0, *points], [*points, len(text)])]


@settings(max_examples=300, deadline=None)
@given(texts, stop_sets, st.booleans(), st.lists(st.integers(0, 40), max_size=12))
def test_pushed_pieces_equal_the_reference_cut(text, stops, include, cuts):
    matcher = StopStrings(stops, include)
    out = []
    for piece in split(text, cuts):
        emitted = matcher.push(piece)
        out.append(emitted)
        if not include:  # no stop text ever leaks, even split over pieces
            assert not any(s in "".join(out) for s in stops)
    if matcher.matched is None:
        out.append(matcher.flush())
    expected, matched = reference_cut(text, stops, include)
    assert "".join(out) == expected
    assert (matcher.matched is not None) == matched


class _Stream:
    def __init__(self, deltas):
        self.deltas = list(deltas)
        self.closed_after = None  # deltas read when close() came

    def __aiter__(self):
        return self

    async def __anext__(self):
        return self.deltas.pop(0)

    def close(self):
        if self.closed_after is None:
            self.closed_after = self.num_total - len(self.deltas)

    num_total = 0


class _Detokenizer:
    def __init__(self, pieces):
        self.pieces = pieces  # token id -> its text

    async def push(self, ids):
        return "".join(self.pieces[i] for i in ids)

    async def finish(self):
        return ""

    def close(self):
        pass


@settings(max_examples=150, deadline=None)
@given(
    texts.filter(bool),
    stop_sets,
    st.booleans(),
    st.lists(st.integers(0, 40), max_size=12),
    st.lists(st.integers(1, 3), min_size=1, max_size=20),
)
def test_a_generation_ends_at_the_matching_token(text, stops, include, cuts, delta_sizes):
    """Tokens are the text's pieces; deltas carry 1-3 tokens. The generation's text is the reference cut, its last
    delta ends at the token that completed the match (counts and logprobs cut there), and the engine's stream
    is closed (aborted) as soon as the match is seen."""
    tokens = split(text, cuts)
    deltas, i = [], 0
    for size in delta_sizes * len(tokens):
        if i >= len(tokens):
            break
        ids = list(range(i, min(i + size, len(tokens))))
        i += len(ids)
        done = i == len(tokens)
        deltas.append(Delta(ids, [-0.5] * len(ids), None, i, FinishReason.LENGTH if done else None))
    stream = _Stream(deltas)
    stream.num_total = len(deltas)
    generation = Generation(
        RequestMetrics(),
        stream,
        _Detokenizer(tokens),
        "r",
        "r",
        3,
        "completions",
        0.0,
        stop=StopStrings(stops, include),
    )

    async def read():
        return [piece async for piece in generation]

    pieces = asyncio.run(read())
    expected, matched = reference_cut(text, stops, include)
    assert "".join(p.text for p in pieces) == expected
    final = pieces[-1].delta
    if matched:
        # The first token whose text completes the match: the shortest prefix of tokens holding a match.
        num_tokens = next(n for n in range(1, len(tokens) + 1) if reference_cut("".join(tokens[:n]), stops, True)[1])
        assert final.finish_reason == FinishReason.STOP and final.num_output_tokens == num_tokens
        assert sum(len(p.delta.token_ids) for p in pieces) == num_tokens == sum(len(p.delta.logprobs) for p in pieces)
        assert stream.closed_after == len(pieces)  # aborted right at the delta holding the match
    else:
        assert final.finish_reason == FinishReason.LENGTH and final.num_output_tokens == len(tokens)
