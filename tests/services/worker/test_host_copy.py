"""The host copy of a step's outputs: the same values in fresh host tensors, and on a GPU a wait for the
copies only, not for work queued after them."""

import pytest
import torch

from kernels.sampler_output import SamplerOutput
from services.worker.host_copy import HostCopy, host_sampled, sampled_copy


def test_a_copy_holds_the_values_in_its_own_storage():
    a, b = torch.arange(6).view(2, 3), torch.tensor([True, False])
    copy = HostCopy([a, b])
    a.add_(100)  # a later write to the source does not reach the copy
    got = copy.get()
    assert [t.tolist() for t in got] == [[[0, 1, 2], [3, 4, 5]], [True, False]]
    assert got[0].dtype == a.dtype and got[0].untyped_storage().data_ptr() != a.untyped_storage().data_ptr()


def test_sampled_round_trips_field_by_field():
    s = SamplerOutput(
        token_ids=torch.tensor([4, 5]),
        logprobs=torch.tensor([-0.5, -1.0]),
        top_token_ids=torch.tensor([[4], [5]]),
        top_logprobs=torch.tensor([[-0.5], [-1.0]]),
        errors=torch.tensor([False, True]),
    )
    back = host_sampled(sampled_copy(s))
    for name in ("token_ids", "logprobs", "top_token_ids", "top_logprobs", "errors"):
        assert torch.equal(getattr(back, name), getattr(s, name)), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_get_waits_for_the_copies_not_for_work_queued_after_them():
    x = torch.arange(1000, device="cuda")
    copy = HostCopy([x])
    torch.cuda._sleep(2_000_000_000)  # ~1 s of device time queued behind the copy (the next step)
    later = torch.cuda.Event()
    later.record()
    got = copy.get()
    assert not later.query()  # get returned while the work after the copy still runs
    assert got[0].is_pinned() and got[0].tolist() == list(range(1000))
    torch.cuda.synchronize()
