"""verify_half: the static verify that processes the step's logits itself gives the eager path's tokens and logprobs
in the engine loop, for rows with temperatures, top-k, top-p, bans, bias and top-n logprobs."""

import pytest

from services.engine import SamplingParams
from services.worker.device_sampling import SamplingKey
from services.worker.sampler import Sampler
from tests.services.worker.test_speculator import NEXTN, generate, line, source  # noqa: F401

PROMPTS = [[0, *range(3, 3 + n)] for n in (5, 9, 2, 7)]

PARAMS = [
    SamplingParams(max_tokens=10, temperature=0.9, seed=11, top_k=6, ignore_eos=True, logprobs=3),
    SamplingParams(max_tokens=7, temperature=0, ignore_eos=True, banned_token_ids=(5, 9, 17)),
    SamplingParams(max_tokens=12, temperature=1.2, seed=12, top_p=0.7, ignore_eos=True, logit_bias=((3, 4.0),)),
    SamplingParams(max_tokens=5, temperature=0.6, seed=13, ignore_eos=True, banned_token_ids=(4,),
                   logit_bias=((8, -2.5), (40, 1.5))),
]


@pytest.mark.parametrize("mode", ["rejection", "deterministic"])
def test_the_static_processing_gives_the_eager_paths_tokens_and_logprobs(source, monkeypatch, mode):
    """Eager: the eager proposal and verify half, ``Sampler.process`` every step. Static: the static proposal and
    verify (eagerly: the code the graphs capture), every step's processing inside the static verify (keys with
    ranking, bans and bias)."""
    curve = line(1.0, 0.02)  # varlen: requests verify different numbers of drafts
    want, _ = generate(source, PARAMS, prompts=PROMPTS, nextn=NEXTN, spec_sampling=mode, curve=curve)
    calls = [0]
    process = Sampler.process

    def counting(self, *args, **kwargs):
        calls[0] += 1
        return process(self, *args, **kwargs)

    monkeypatch.setattr(Sampler, "process", counting)
    got, spec = generate(source, PARAMS, prompts=PROMPTS, nextn=NEXTN, spec_sampling=mode,
                         curve=curve, static_proposal=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]
    keys = {k.sampling for k in spec.verify_graphs.static}
    assert SamplingKey(True, 16, 16) in keys  # ranked (top-n, top-k, top-p), banned and biased rows
    # This config's draft window fits every step's entries (prefill too), so no step ran the eager processing.
    assert calls[0] == 0 and spec.num_drafts_verified > 0
