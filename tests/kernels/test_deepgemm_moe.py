"""kernels/deepgemm_moe.py: the contiguous layout's rows, ``m_indices`` and slot map against a loop over the
experts, and the whole layer on the CPU with a torch stand-in for ``deep_gemm`` (its documented semantics,
NaN wherever it leaves rows unwritten, so a row read from there shows), on the torch contiguous layout and on
kernels/moe_contiguous.py's (tested byte for byte in test_moe_contiguous.py); on a Hopper GPU with ``deep_gemm``
installed, its grouped GEMMs against the exact product and its layer against the torch reference."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kernels import deepgemm_moe, reference
from kernels.fp8_weights import quantize_weight_block128
from kernels.interpret import interpreter, load_interpreted
from kernels.reference import quantize_act, route_metadata
from tests.tolerances import FP8_LINEAR_REL


def fake_deep_gemm(align: int = 4) -> SimpleNamespace:
    """``deep_gemm``'s two grouped FP8 GEMMs in torch: the fp32 product of the dequantised operands cast to bf16
    (what the kernels compute up to summation order); pad rows (``m_indices`` −1) and masked rows ≥ masked_m
    come out NaN, and the scale flags are checked as ``deepgemm_moe`` must pass them."""

    def contiguous(a, b, d, m_indices, disable_ue8m0_cast=False):
        assert disable_ue8m0_cast and a[1].dtype == b[1].dtype == torch.float32 and m_indices.dtype == torch.int32
        assert d.shape[0] % align == 0 and m_indices.shape == (d.shape[0],)
        d.fill_(float("nan"))
        for e in m_indices.unique().tolist():
            if e >= 0:
                r = m_indices == e
                rows = (a[0][r][None], a[1][r][None])
                d[r] = deepgemm_moe.exact_grouped(rows, b[0][e : e + 1], b[1][e : e + 1])[0].to(d.dtype)

    def masked(a, b, d, masked_m, expected_m, disable_ue8m0_cast=False):
        assert disable_ue8m0_cast and masked_m.dtype == torch.int32 and expected_m >= 1
        d.fill_(float("nan"))
        for e, m in enumerate(masked_m.tolist()):
            d[e, :m] = deepgemm_moe.exact_grouped(
                (a[0][e : e + 1, :m], a[1][e : e + 1, :m]), b[0][e : e + 1], b[1][e : e + 1]
            )[0].to(d.dtype)

    return SimpleNamespace(
        m_grouped_fp8_gemm_nt_contiguous=contiguous,
        m_grouped_fp8_gemm_nt_masked=masked,
        get_mk_alignment_for_contiguous_layout=lambda: align,
    )


def test_contiguous_rows_pad_each_span_and_mark_the_pads():
    counts, capacity, align, num_slots = torch.tensor([3, 0, 5, 8, 1]), 9, 4, 20
    flat, m_indices, starts = deepgemm_moe.contiguous_rows(counts, capacity, align, num_slots)
    want_idx, want_starts = [], []
    for e, c in enumerate(counts.tolist()):
        want_starts.append(len(want_idx))
        want_idx += [e if j < c else -1 for j in range(-(-c // align) * align)]
    rows = -(-(num_slots + 5 * (align - 1)) // align) * align  # the most the spans can take: fixed by the shapes
    want_idx += [-1] * (rows - len(want_idx))
    assert m_indices.tolist() == want_idx and starts.tolist() == want_starts and m_indices.dtype == torch.int32
    real = m_indices >= 0
    want_flat = [e * capacity + j for e, c in enumerate(counts.tolist()) for j in range(c)]
    assert flat[real].tolist() == want_flat
    assert (flat[~real] == 0).all()  # pad rows: slot 0, masked by the callers


def test_contiguous_rows_fit_the_worst_counts():
    """Every expert one past a multiple of the alignment: the most pad rows the counts can need."""
    align, capacity = 4, 9
    counts = torch.tensor([5, 1, 9, 1])
    flat, m_indices, _ = deepgemm_moe.contiguous_rows(counts, capacity, align, int(counts.sum()))
    assert int((m_indices >= 0).sum()) == int(counts.sum()) and flat.numel() % align == 0


def test_contiguous_slots_address_the_same_rows_as_the_masked_slots():
    gen = torch.Generator().manual_seed(1)
    num_tokens, num_experts, top_k = 11, 6, 3
    experts = torch.rand(num_tokens, num_experts, generator=gen).argsort(-1)[:, :top_k]
    meta = route_metadata(experts, torch.rand(num_tokens, top_k, generator=gen), num_experts)
    flat, _, starts = deepgemm_moe.contiguous_rows(meta["counts"], num_tokens, 4, meta["slot_of"].numel())
    masked_rows = torch.randn(num_experts * num_tokens, 5, generator=gen)  # a value per masked slot
    contiguous = masked_rows[flat]
    got = contiguous[deepgemm_moe.contiguous_slots(meta["slot_of"], starts, num_tokens)]
    assert torch.equal(got, masked_rows[meta["slot_of"]])


def _layer(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, device: str, seed: int):
    """A random layer in ``KernelMoE``'s layout: routed experts plus the shared one (every token, weight 1)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    stacked = num_experts + 1

    def weights(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [
            quantize_weight_block128(torch.randn(n, k, device=device, generator=gen) * 0.1) for _ in range(stacked)
        ]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    experts = torch.rand(num_tokens, num_experts, device=device, generator=gen).argsort(-1)[:, :top_k]
    shared = torch.full((num_tokens, 1), num_experts, device=device)
    route_w = torch.cat(
        (torch.rand(num_tokens, top_k, device=device, generator=gen), torch.ones(num_tokens, 1, device=device)), 1
    )
    meta = route_metadata(torch.cat((experts, shared), 1), route_w, stacked)
    x = torch.randn(num_tokens, hidden, device=device, generator=gen).to(torch.bfloat16)
    return x, meta, (*weights(2 * inter, hidden), *weights(hidden, inter))


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def _interpreted_layout(x: torch.Tensor, meta: dict, align: int) -> deepgemm_moe.ContiguousRows:
    with interpreter():
        return load_interpreted("moe_contiguous").contiguous_layout(x, meta, align)


@pytest.mark.parametrize(
    "masked,layout",
    [(False, None), (False, _interpreted_layout), (True, None)],
    ids=["contiguous torch layout", "contiguous layout kernel", "masked"],
)
def test_the_layer_through_a_stand_in_matches_the_reference(monkeypatch, masked, layout):
    """Both layouts feed every slot's row to its own expert and combine the right rows (a wrong row or expert is
    off by O(1); a pad or masked-off row read is NaN), the contiguous one through its torch form and through
    ``kernels.moe_contiguous`` (interpreted). Masked slots past the counts hold junk token ids, as the layout
    kernel leaves them: they must not be gathered."""
    monkeypatch.setattr(deepgemm_moe, "module", lambda: fake_deep_gemm(4))
    x, meta, weights = _layer(num_tokens=13, num_experts=6, top_k=2, hidden=256, inter=128, device="cpu", seed=3)
    meta = dict(meta)
    used = torch.arange(13) < meta["counts"][:, None]
    meta["row_ids"] = torch.where(used, meta["row_ids"], 10**6)
    got = deepgemm_moe.experts(
        x,
        meta,
        *weights,
        10.0,
        quantize_act,
        reference.swiglu_quant,
        reference.moe_combine,
        masked=masked,
        layout=layout,
    )
    want = reference.moe_experts(
        x, meta | {"row_ids": torch.where(used, meta["row_ids"], 0)}, *weights, 10.0, shared_last=True
    )
    # The same e4m3 operands; the paths differ by the bf16 rounding of gate/up before the SwiGLU (the reference
    # keeps fp32), which moves the rare e4m3 code of h, and by the bf16 down output: within one FP8 cast's error.
    assert torch.isfinite(got).all()
    assert _rel(got, want) <= FP8_LINEAR_REL


@pytest.mark.parametrize("layout", [None, _interpreted_layout], ids=["torch layout", "layout kernel"])
def test_no_live_row_gives_no_real_row(monkeypatch, layout):
    """With every count 0 the layout has only pad rows (DeepGEMM skips their blocks): nothing is gathered from a
    masked slot, so junk token ids there are never read."""
    seen: list[torch.Tensor] = []
    fake = fake_deep_gemm(4)

    def contiguous(a, b, d, m, **kw):
        seen.append(m)
        fake.m_grouped_fp8_gemm_nt_contiguous(a, b, d, m, **kw)

    monkeypatch.setattr(
        deepgemm_moe,
        "module",
        lambda: SimpleNamespace(
            m_grouped_fp8_gemm_nt_contiguous=contiguous, get_mk_alignment_for_contiguous_layout=lambda: 4
        ),
    )
    x, meta, weights = _layer(num_tokens=4, num_experts=3, top_k=1, hidden=128, inter=128, device="cpu", seed=0)
    meta = dict(meta) | {"counts": torch.zeros_like(meta["counts"]), "row_ids": torch.full_like(meta["row_ids"], 10**6)}
    deepgemm_moe.experts(
        x,
        meta,
        *weights,
        10.0,
        quantize_act,
        reference.swiglu_quant,
        reference.moe_combine,
        masked=False,
        layout=layout,
    )
    assert len(seen) == 2 and all((m == -1).all() for m in seen)


def test_on_unless_the_flag_says_triton_and_a_cpu_never_has_it(monkeypatch):
    monkeypatch.delenv(deepgemm_moe.ENV, raising=False)
    assert deepgemm_moe.requested()
    monkeypatch.setenv(deepgemm_moe.ENV, "deepgemm")
    assert deepgemm_moe.requested()
    monkeypatch.setenv(deepgemm_moe.ENV, "triton")
    assert not deepgemm_moe.requested()
    assert not deepgemm_moe.available(torch.device("cpu"))


def _has_deep_gemm() -> bool:
    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
    return hopper and deepgemm_moe.module() is not None


DEEP_GEMM = pytest.mark.skipif(not _has_deep_gemm(), reason="needs a Hopper GPU with deep_gemm installed")


@pytest.mark.gpu
@DEEP_GEMM
def test_gpu_probe_passes():
    assert deepgemm_moe.available(torch.device("cuda"))


@pytest.mark.gpu
@DEEP_GEMM
@pytest.mark.parametrize("masked", [False, True])
def test_gpu_layer_matches_the_reference_as_the_triton_layer_does(masked):
    """DeepGEMM's layer (v41-s1's hidden and intermediate, fewer experts) against the torch reference, beside the
    grouped Triton layer's own error on the same operands."""
    from kernels.moe_combine import moe_combine
    from kernels.moe_contiguous import contiguous_layout
    from kernels.moe_grouped_gemm import moe_experts
    from kernels.quant_fp8 import quantize_act as quantize_act_gpu
    from kernels.quant_fp8 import swiglu_quant as swiglu_quant_gpu

    x, meta, weights = _layer(num_tokens=256, num_experts=8, top_k=2, hidden=5120, inter=2304, device="cuda", seed=5)
    got = deepgemm_moe.experts(
        x,
        meta,
        *weights,
        10.0,
        quantize_act_gpu,
        swiglu_quant_gpu,
        moe_combine,
        masked=masked,
        layout=contiguous_layout,
    )
    want = reference.moe_experts(x, meta, *weights, 10.0, shared_last=True)
    triton = moe_experts(x, meta, *weights, 10.0, shared_last=True)
    print(
        f"\nDeepGEMM {'masked' if masked else 'contiguous'} layer vs reference {_rel(got, want):.3g}, "
        f"Triton {_rel(triton, want):.3g}"
    )
    assert torch.isfinite(got).all() and _rel(got, want) <= FP8_LINEAR_REL
