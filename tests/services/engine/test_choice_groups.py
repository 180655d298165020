"""n > 1 choices (services/engine/choice_groups.py) when the pools have no room to fork every choice: the prefix
has its slot, the other requests theirs, and the fork would need one more slot per choice. A choice that does not
fit is queued as a request of its own (with the full prompt) and gives the tokens it gives with room to spare,
with the prefix cache on and off (batch-invariant mode)."""

from __future__ import annotations

import pytest
import torch

from services.engine import LLM, SamplingParams

ENGINE = dict(device="cpu", batch_invariant=True, max_model_len=256, block_size=16)

pytestmark = pytest.mark.usefixtures("pools_checked_after_every_step")  # conftest.py


def _tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def _choices(source, max_num_seqs: int, caching: bool) -> list[tuple]:
    """Three requests decoding while an n = 3 request arrives: its choices' (tokens, logprobs) by index."""
    llm = LLM(source=source, max_num_seqs=max_num_seqs, enable_prefix_caching=caching, **ENGINE)
    engine = llm.engine
    for k in range(2):
        engine.add_request(f"beside{k}", _tokens(k, 20), SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(2):
        engine.step()
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=3, logprobs=1, ignore_eos=True)
    engine.add_request("g", [0, *_tokens(9, 40)], params)
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == "g" and out.finish_reason is not None:
                finals[out.index] = (out.token_ids, out.logprobs, out.finish_reason)
    s = engine.stats()
    assert s.free_state_slots == s.total_state_slots
    return [finals[i] for i in range(3)]


@pytest.mark.parametrize("caching", [False, True])
def test_choices_without_room_to_fork_wait_as_requests_and_give_the_same_tokens(draft_source, caching):
    # 4 sequences: two decoding, the prefix, then room to fork one choice; the other two wait for slots.
    tight = _choices(draft_source, 4, caching)
    roomy = _choices(draft_source, 8, caching)
    assert tight == roomy
    assert len({tuple(t) for t, _, _ in tight}) == 3
