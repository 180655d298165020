"""The handoff of a norm's FP8 quantisation to the projections reading its output: what matches, what not."""

from __future__ import annotations

import torch

from services.worker.fp8_handoff import Fp8Handoff


def _stored(rows: int = 3, channels: int = 200):
    handoff = Fp8Handoff()
    y = torch.randn(rows, channels, dtype=torch.bfloat16)
    q = torch.zeros(rows, 256, dtype=torch.float8_e4m3fn)
    s = torch.ones(rows, 2)
    handoff.put("attn_norm", y, (q, s))
    return handoff, y, q, s


def test_the_norms_output_and_its_views_take_the_stored_quantisation():
    handoff, y, q, s = _stored()
    for x in (y, y.view(1, 3, 200)[0], y.unsqueeze(0), y.view(3, 200)):
        a = handoff.take(x, 256)
        assert a is not None and a[0] is q and a[1] is s


def test_anything_else_is_quantised_by_the_caller():
    handoff, y, _, _ = _stored()
    assert handoff.take(y.clone(), 256) is None  # the same values elsewhere: not the norm's output
    assert handoff.take(y[1:], 256) is None  # other rows
    assert handoff.take(y[:, :128], 256) is None  # other channels (and not contiguous)
    assert handoff.take(y.float(), 256) is None
    assert handoff.take(y, 384) is None  # a projection padded to another width
    assert handoff.take(y.view(2, 300), 256) is None  # the same bytes, other rows


def test_an_in_place_write_to_the_output_invalidates_it():
    handoff, y, _, _ = _stored()
    y[0, 0] += 1
    assert handoff.take(y, 256) is None
    handoff, y, _, _ = _stored()
    y.view(600)[5] = 0  # through a view: views share the version counter
    assert handoff.take(y, 256) is None


def test_one_slot_per_site_and_drop():
    handoff, y, q, _ = _stored()
    y2 = torch.randn(3, 200, dtype=torch.bfloat16)
    handoff.put("q_norm", y2, (q, torch.ones(3, 2)))
    assert handoff.take(y, 256) is not None and handoff.take(y2, 256) is not None
    handoff.put("attn_norm", y2.clone(), (q, torch.ones(3, 2)))  # the next layer's norm at the site
    assert handoff.take(y, 256) is None
    handoff.drop("q_norm")
    assert handoff.take(y2, 256) is None
