"""The load generator's token-id prompts: fixed per request index, of the asked length, in the vocabulary,
and distinct from the first token on (no shared prefixes for the prefix cache to exploit)."""

from services.client.loadgen import prompt_ids


def test_prompt_ids_are_fixed_sized_in_range_and_distinct():
    prompts = [prompt_ids(i, 512) for i in range(64)]
    assert prompts[5] == prompt_ids(5, 512) and all(len(p) == 512 for p in prompts)
    assert all(1000 <= t < 100_000 for p in prompts for t in p)
    assert len({p[0] for p in prompts}) == 64
    assert prompt_ids(3, 8, vocab_size=2000) != prompt_ids(3, 8)
