"""kernels/device.py: the grid-sizing fact and the uploads that never wait for the device."""

import pytest
import torch

from kernels.device import num_sms, upload, upload_into


def test_num_sms_stands_in_off_the_gpu():
    assert num_sms(torch.device("cpu"), off_gpu=7) == 7


def test_upload_and_upload_into_on_the_cpu_copy_the_values():
    host = torch.arange(6).view(2, 3)
    assert torch.equal(upload(host, "cpu"), host)
    buf = torch.zeros(2, 3, dtype=torch.long)
    upload_into(buf, host)
    assert torch.equal(buf, host)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_uploads_do_not_synchronise():
    """Queued behind a long kernel, the uploads return at once (sync debug mode would raise on a
    synchronising copy), and the values arrive in stream order."""
    a = torch.randn(4096, 4096, device="cuda")
    host = torch.arange(1000)
    buf = torch.zeros(1000, dtype=torch.long, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _ = a @ a  # keeps the stream busy
        got = upload(host, "cuda")
        upload_into(buf, host)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got.cpu(), host) and torch.equal(buf.cpu(), host)
    same = torch.arange(3, device="cuda")
    assert upload(same, "cuda") is same or torch.equal(upload(same, "cuda"), same)
