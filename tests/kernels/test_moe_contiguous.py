"""kernels/moe_contiguous.py against its torch reference ``deepgemm_moe.contiguous_layout`` (``contiguous_rows``,
``quant_fp8.quantize_act``, the gathers, ``contiguous_slots``), byte for byte: interpreted on CPU at counts of 0,
multiples of the alignment and one either side of them, one expert holding every token, spans longer than a row
program, and slots past the counts holding wrong token ids and NaN weights; compiled on a GPU at v41-s1's layer."""

from __future__ import annotations

import pytest
import torch

from kernels import deepgemm_moe
from kernels.interpret import interpreter, load_interpreted
from kernels.reference import GROUP, route_metadata


def _meta(counts: list[int], num_tokens: int, top_k: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A masked layout with these counts (capacity T): each expert's tokens in order, its slots past the count
    holding a wrong but valid token id and a NaN weight (what a layout kernel leaves there), ``slot_of`` [T, k]
    every live slot once (in a shuffled order), then slot 0 for the dead picks."""
    assert sum(counts) <= num_tokens * top_k and max(counts) <= num_tokens
    num_groups = len(counts)
    row_ids = torch.full((num_groups, num_tokens), num_tokens - 1, dtype=torch.int32)
    route_w = torch.full((num_groups, num_tokens), float("nan"))
    for e, c in enumerate(counts):
        row_ids[e, :c] = torch.randperm(num_tokens, generator=gen)[:c].sort().values.to(torch.int32)
        route_w[e, :c] = torch.rand(c, generator=gen)
    slots = [e * num_tokens + j for e, c in enumerate(counts) for j in range(c)]
    slots = torch.tensor(slots, dtype=torch.long)[torch.randperm(len(slots), generator=gen)]
    slot_of = torch.cat((slots, torch.zeros(num_tokens * top_k - len(slots), dtype=torch.long)))
    return {
        "counts": torch.tensor(counts, dtype=torch.int32),
        "row_ids": row_ids,
        "route_w": route_w,
        "slot_of": slot_of.view(num_tokens, top_k),
    }


def _x(num_tokens: int, channels: int, dtype: torch.dtype, gen: torch.Generator, device: str = "cpu") -> torch.Tensor:
    x = torch.randn(num_tokens, channels, generator=gen, device=device) * 3
    x[0] = 0.0  # an all-zero row: the smallest scale
    x[1, :GROUP] *= 2.0**-12  # a group of e4m3 subnormals
    return x.to(dtype)


def _assert_same(
    got: deepgemm_moe.ContiguousRows, want: deepgemm_moe.ContiguousRows, counts: torch.Tensor, align: int
) -> None:
    """Every field equal (dtypes too); the activations on the spans' rows (those past the last span are left
    unwritten: DeepGEMM skips their blocks)."""
    spans = int(((counts.long() + align - 1) // align * align).sum())
    for name in ("m_indices", "tokens", "route_w", "rows_of"):
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype and torch.equal(g, w), name
    assert got.a[0].shape == want.a[0].shape and got.a[1].shape == want.a[1].shape
    assert got.a[0].dtype == torch.float8_e4m3fn and got.a[1].dtype == torch.float32
    assert torch.equal(got.a[0][:spans].view(torch.uint8), want.a[0][:spans].view(torch.uint8))
    assert torch.equal(got.a[1][:spans], want.a[1][:spans])


CASES = {
    # name: (counts, T, k, align)
    "zero, multiples and align±1": ([0, 4, 8, 3, 5, 0, 1], 11, 2, 4),
    "one expert holds every token": ([0, 21, 0], 21, 1, 4),
    "no live slot": ([0, 0, 0, 0], 6, 2, 4),
    "spans longer than a row program": ([31, 33, 0, 32], 40, 3, 32),
}


@pytest.mark.parametrize("per_row", [False, True], ids=["quantise then gather", "quantise per row"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", list(CASES))
def test_interpreted_layout_equals_the_torch_layout(case, dtype, per_row):
    counts, num_tokens, top_k, align = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    meta = _meta(counts, num_tokens, top_k, gen)
    # Nine groups: not a power of two (the scales' padding), 288 words (a whole step of the gather and a part).
    x = _x(num_tokens, 9 * GROUP, dtype, gen)
    kernel, quant = load_interpreted("moe_contiguous"), load_interpreted("quant_fp8")
    with interpreter():
        got = kernel.contiguous_layout(x, meta, align, per_row=per_row)
        want = deepgemm_moe.contiguous_layout(x, meta, align, quant.quantize_act)
    _assert_same(got, want, meta["counts"], align)
    assert got.a[0].shape[0] == deepgemm_moe.contiguous_size(num_tokens * top_k, len(counts), align)


def test_the_rows_are_gathered_from_the_bytes_read_fewer_way():
    """v41's R = 7 rows per token (top-6 + shared) in bf16: x once, then the e4m3 rows 7 times, beats x's row 7
    times (12 against 8.25 bytes per channel); one row per token reads fewer quantising each row from x."""
    kernel = load_interpreted("moe_contiguous")
    x = torch.zeros(4, GROUP, dtype=torch.bfloat16)
    assert not kernel.quantizes_per_row(x, 4 * 7)
    assert not kernel.quantizes_per_row(x.float(), 4 * 7)
    assert kernel.quantizes_per_row(x, 4 * 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("per_row", [False, True], ids=["quantise then gather", "quantise per row"])
def test_gpu_layout_equals_the_torch_layout_at_v41_shapes(per_row):
    """v41-s1's prefill layer: T = 4096, 48 routed experts top-6 plus the shared one, D' 5120, DeepGEMM's
    alignment 128; the slots past the counts hold wrong token ids and NaN weights."""
    from kernels import moe_contiguous
    from kernels.quant_fp8 import quantize_act

    num_tokens, num_experts, top_k, align = 4096, 48, 6, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    experts = torch.rand(num_tokens, num_experts, device="cuda", generator=gen).argsort(-1)[:, :top_k]
    shared = torch.full((num_tokens, 1), num_experts, device="cuda")
    route_w = torch.rand(num_tokens, top_k + 1, device="cuda", generator=gen)
    meta = dict(route_metadata(torch.cat((experts, shared), 1), route_w, num_experts + 1))
    used = torch.arange(num_tokens, device="cuda") < meta["counts"][:, None]
    meta["row_ids"] = torch.where(used, meta["row_ids"], num_tokens - 1)
    meta["route_w"] = torch.where(used, meta["route_w"], float("nan"))
    x = _x(num_tokens, 5120, torch.bfloat16, gen, "cuda")
    got = moe_contiguous.contiguous_layout(x, meta, align, per_row=per_row)
    want = deepgemm_moe.contiguous_layout(x, meta, align, quantize_act)
    _assert_same(got, want, meta["counts"], align)


@pytest.mark.parametrize("per_row", [True, False], ids=["quantise-per-row", "copy-words"])
def test_it_compiles_for_sm90_on_this_cpu(per_row, private_triton_cache):
    """The interpreter runs branches that the compiler rejects (a name bound in both arms of the kernel's ``if`` with
    two types failed on the H200): Triton builds sm_90a code here, no device needed (scripts/dev/compile_sm90.py)."""
    import importlib.util
    from pathlib import Path

    from kernels import moe_contiguous as m

    path = Path(__file__).resolve().parents[2] / "scripts" / "dev" / "compile_sm90.py"
    spec = importlib.util.spec_from_file_location("compile_sm90", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    sig = dict(
        src_ptr="*bf16" if per_row else "*i32",
        src_scale_ptr="*fp32",
        counts_ptr="*i32",
        row_ids_ptr="*i32",
        route_w_ptr="*fp32",
        slot_of_ptr="*i64",
        a_q_ptr="*fp8e4nv" if per_row else "*i32",
        a_s_ptr="*fp32",
        m_ptr="*i32",
        token_ptr="*i32",
        w_ptr="*fp32",
        rows_of_ptr="*i64",
        num_rows="i32",
        num_picks="i32",
        capacity="i32",
        src_row_stride="i32",
    )
    const = dict(
        NUM_GROUPS=49,
        G_PAD=64,
        ALIGN=128,
        ROW_SIZE=5120 if per_row else 1280,
        SCALES=40,
        SCALES_PAD=64,
        PER_ROW=per_row,
        ROWS=m.ROWS,
        BLOCK_WORDS=m.BLOCK_WORDS,
        BLOCK_PICKS=m.BLOCK_PICKS,
        GROUP=m.GROUP,
    )
    _, report = tool.compile_sm90(m._contiguous_kernel, sig, const)
    assert "spill" in report  # ptxas's resource report: the kernel was built
