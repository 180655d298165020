"""The worker's per-request last tokens (async scheduling's next-step inputs)."""

import torch

from kernels.sampler_output import SamplerOutput
from services.worker.worker import last_tokens


def _sampled(tokens, errors):
    n = len(tokens)
    return SamplerOutput(
        token_ids=torch.tensor(tokens),
        logprobs=torch.zeros(n),
        top_token_ids=torch.zeros(n, 0, dtype=torch.long),
        top_logprobs=torch.zeros(n, 0),
        errors=torch.tensor(errors),
    )


def test_last_tokens_take_each_requests_last_row_and_mark_failures():
    # Requests sample 1, 0, 2 and 1 rows; the third request's first row failed.
    sampled = _sampled([11, 12, 13, 14], [False, True, False, False])
    assert last_tokens(sampled, [1, 0, 2, 1]).tolist() == [11, -1, -1, 14]
    assert last_tokens(_sampled([], []), [0, 0]).tolist() == [-1, -1]
