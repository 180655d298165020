"""The attention kernels' bf16-dot path (``dot_fp32=False``, the FP8 engine's) emulated on the CPU.

Triton 3.6's interpreter stores bf16 as raw uint16 and multiplies those integers in ``tl.dot``
(garbage), and it casts fp32 → bf16 by truncation. ``bf16_interpreter()`` patches both for the
duration of a block: bf16 dot operands are widened exactly to fp32 (bf16 × bf16 products are exact in
fp32, as on the tensor cores, which accumulate in fp32) and fp32 → bf16 casts round to nearest even
(as compiled code does). The kernels then run their OWN bf16 path, line for line (masks, casts, P
rounding, loop bounds), on CPU tensors; only the summation order of the dots differs from the GPU.

Two checks (``python -m tests.kernels.bf16_emulation``, ~1–2 min on the 2-core dev machine):

1. kernel: ``sparse_prefill_attention`` and ``sparse_decode_attention`` with ``dot_fp32=False`` at each
   tiny config's attention shapes (oracle: 4 heads, rope 16, window 8, top-k 4; wide: 8 heads, rope
   32, window 4, top-k 5; nocand: window 16, top-k 3), against the fp32 reference and against a torch
   emulation of "q → bf16, P → bf16" only. A defect beyond those two roundings shows as an error far
   above the torch emulation's.
2. engine: the FP8 test's three configs (tests/services/worker/kernel_model/test_backend.py ``FP8_CASES``)
   on its CPU floor kernel set (torch references) with the prefill and decode attention swapped for
   the interpreted kernels' bf16 path: mean KL vs the fp32 reference, to set against the floor 0.080
   and the H200's 0.225. ``--full`` adds a set with the compressor, the indexer (its f16-dot path) and
   mHC interpreted too: every kernel wired with prefill attention, GEMMs left to the torch references.

Measured on the CPU: kernels within 1.0–4.0e-4 of the torch emulation (1.5–2.2e-3
from the reference); engine mean KL 0.0798 floor, 0.0819 with the attention kernels' bf16 path, 0.0820
with every kernel wired since (per config 0.0722 / 0.0975 / 0.0762): the logic of the new kernels at
the tiny shapes does not explain the H200's 0.225.

``--bisect cuda`` (a Hopper GPU, one call): the compiled FP8 engine with one stage at a time put back to the
0.081 wiring (attention fp32 dots; prefill attention → torch reference; compressor + indexer → torch;
mHC → the model's): the stage whose removal restores ~0.08 holds the GPU-only defect.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import time
from types import SimpleNamespace

import numpy as np
import torch


@contextlib.contextmanager
def bf16_interpreter():
    """Patch Triton's interpreter: exact bf16 ``tl.dot`` (fp32 accumulate) and RNE fp32 → bf16 casts."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    dot, cast = InterpreterBuilder.create_dot, InterpreterBuilder.cast_impl

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:  # stored as uint16: the fp32 with those top 16 bits, exactly
            return (h.data.astype(np.uint32) << 16).view(np.float32)
        return h.data

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
            assert d.data.dtype == np.float32, "bf16 dots accumulate in fp32 here"
            return TensorHandle(np.matmul(widen(a), widen(b), dtype=np.float32) + d.data, d.dtype.scalar)
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            x = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            return TensorHandle(x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16), dst_type.scalar)
        return cast(self, src, dst_type)

    InterpreterBuilder.create_dot, InterpreterBuilder.cast_impl = create_dot, cast_impl
    try:
        yield
    finally:
        InterpreterBuilder.create_dot, InterpreterBuilder.cast_impl = dot, cast


# ---------------------------------------------------------------- 1. kernel at the tiny shapes


def decode_bf16(q, ring, state_slots, positions, window, kv_pool, selected, sink, freqs, scale):
    """``reference.sparse_decode_attention`` with exactly the two documented roundings of the kernels'
    bf16 path: q → bf16 (RNE) for QK, and the unnormalised P = exp(s − max) → bf16 for PV (the
    denominator from fp32 P, as the online softmax's l)."""
    from model.deepseek_v41.quant import COMPRESSED_KV_BLOCK, dequantize_fp4_cache, dequantize_fp8_cache

    num_rows, num_heads, dim = q.shape
    ring_size = ring.shape[1]
    pos = positions.long()
    win_pos = pos[:, None] - window + 1 + torch.arange(window, device=q.device)
    raw = ring[state_slots.long()[:, None], win_pos % ring_size]
    win = dequantize_fp8_cache(raw[..., :dim].view(torch.float8_e4m3fn), raw[..., dim:].view(torch.float8_e8m0fnu))
    epb = kv_pool.shape[1]
    sel = selected.long()
    ent_raw = kv_pool[sel.clamp_min(0) // epb, sel.clamp_min(0) % epb]
    ent = dequantize_fp4_cache(
        ent_raw[..., : dim // 2], ent_raw[..., dim // 2 :].view(torch.float8_e4m3fn), COMPRESSED_KV_BLOCK
    )
    keys = torch.cat((win, ent), dim=1).float()  # exact in bf16
    allowed = torch.cat((win_pos >= 0, sel >= 0), dim=1)
    logits = torch.einsum("rhd,rtd->rht", q.float().to(torch.bfloat16).float(), keys) * scale
    logits = logits.masked_fill(~allowed[:, None, :], -torch.inf)
    m = logits.amax(-1, keepdim=True).clamp_min(-1.0e30)
    p = torch.exp(logits - m)
    denom = p.sum(-1, keepdim=True) + torch.exp(sink.float().view(1, num_heads, 1) - m)
    out = torch.einsum("rht,rtd->rhd", p.to(torch.bfloat16).float(), keys) / denom
    rot = 2 * freqs.shape[0]
    angles = pos.float()[:, None] * freqs.float()[None, :]
    even, odd = out[..., dim - rot :: 2], out[..., dim - rot + 1 :: 2]
    cos, sin = torch.cos(angles)[:, None, :], torch.sin(angles)[:, None, :]
    out = out.clone()
    out[..., dim - rot :: 2] = even * cos + odd * sin
    out[..., dim - rot + 1 :: 2] = odd * cos - even * sin
    return out.to(q.dtype)


def prefill_bf16(*args):
    """``reference.sparse_prefill_attention`` with ``decode_bf16``'s roundings (it calls the decode
    reference through its own module, ``kernels.reference_attention``)."""
    from kernels import reference_attention

    saved = reference_attention.sparse_decode_attention
    reference_attention.sparse_decode_attention = decode_bf16
    try:
        return reference_attention.sparse_prefill_attention(*args)
    finally:
        reference_attention.sparse_decode_attention = saved


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


ATTENTION_SHAPES = (("oracle", 3, 2), ("oracle", 6, 5), ("wide", 2, 1), ("nocand", 2, 1))
"""(config, layer, its KV source): a ratio-2 and a ratio-1 layer of oracle, a ratio-2 layer of the others."""


def kernel_table() -> list[dict]:
    """Each tiny config's attention shapes: prefill (tests/kernels/test_prefill_attention.py's chunk
    problem: a fresh prompt, chunks reaching into the ring, one longer than ring − window, a one-row
    request) and decode (test_decode_attention.py's, whole rows and 3 splits). Relative L2 errors."""
    from kernels import reference
    from kernels.interpret import interpreter, load_interpreted
    from model.deepseek_v41.quant import quantize_fp8_cache
    from model.deepseek_v41.rope import rope_frequencies
    from services.worker.state.cache_engine import CacheEngine, ring_size
    from tests.kernels.test_decode_attention import _fill_cache
    from tests.kernels.test_prefill_attention import _args, _chunk_problem
    from tests.model.deepseek_v41.oracle_configs import CASES

    configs = {c.name: c.cfg for c in CASES}
    prefill, decode = load_interpreted("prefill_attention"), load_interpreted("decode_attention")
    rows = []
    for name, layer, source in ATTENTION_SHAPES:
        cfg = configs[name]
        heads, scale = cfg.num_attention_heads, cfg.head_dim**-0.5
        gen = torch.Generator().manual_seed(layer)
        prob = _chunk_problem(cfg, layer, source, gen)
        prob["q"] = torch.randn(prob["pos"].numel(), heads, cfg.head_dim, generator=gen)
        prob["sink"] = torch.randn(heads, generator=gen)
        prob["freqs"] = rope_frequencies(cfg, compressed=bool(cfg.ratio(layer)))
        args = _args(cfg, prob, prob["q"], quantize_fp8_cache(prob["k"]))
        cache = CacheEngine(cfg, 16, num_blocks=64, num_state_slots=8, ring=ring_size(cfg))
        d = _fill_cache(cache, cfg, layer, source, 6, 40, gen)
        dargs = (
            torch.randn(6, heads, cfg.head_dim, generator=gen),
            d["ring"],
            d["slots"],
            d["pos"],
            cfg.sliding_window,
            d["kv_pool"],
            d["selected"],
            prob["sink"],
            prob["freqs"],
            scale,
        )
        want = {
            "prefill": reference.sparse_prefill_attention(*args),
            "decode": reference.sparse_decode_attention(*dargs),
        }
        emulated = {"prefill": prefill_bf16(*args), "decode": decode_bf16(*dargs)}
        with interpreter(), bf16_interpreter():
            got = {
                "prefill": prefill.sparse_prefill_attention(*args, dot_fp32=False),
                "prefill fp32 dots": prefill.sparse_prefill_attention(*args, dot_fp32=True),
                "decode": decode.sparse_decode_attention(*dargs, dot_fp32=False, splits=1),
                "decode 3 splits": decode.sparse_decode_attention(*dargs, dot_fp32=False, splits=3),
            }
        for kind, out in got.items():
            base = kind.split()[0]
            rows.append(
                dict(
                    shape=f"{name} layer {layer} (H {heads}, rope {2 * cfg.qk_rope_head_dim // 2}, "
                    f"w {cfg.sliding_window}, k {cfg.index_topk})",
                    kind=kind,
                    finite=bool(out.isfinite().all()),
                    vs_ref=_rel(out, want[base]),
                    torch_vs_ref=_rel(emulated[base], want[base]),
                    vs_torch=_rel(out, emulated[base]),
                )
            )
    return rows


# ---------------------------------------------------------------- 2. the FP8 engine on the CPU


def with_attention(kernels, dot_fp32: bool, prefill=None, decode=None):
    """``kernels`` with its prefill and decode attention (or the modules given) called with ``dot_fp32``
    whatever TritonAttention passes (it passes True for interpreted sets, which could not run bf16 dots)."""
    # A set already wrapped here keeps its modules in ``module``: unwrap, so the last force wins.
    prefill = prefill or getattr(kernels.prefill_attention, "module", kernels.prefill_attention)
    decode = decode or getattr(kernels.decode_attention, "module", kernels.decode_attention)
    forced = dot_fp32
    return dataclasses.replace(
        kernels,
        decode_attention=SimpleNamespace(
            module=decode,
            sparse_decode_attention=lambda *a, dot_fp32=None, **k: decode.sparse_decode_attention(
                *a, dot_fp32=forced, **k
            ),
        ),
        prefill_attention=SimpleNamespace(
            module=prefill,
            sparse_prefill_attention=lambda *a, dot_fp32=None, **k: prefill.sparse_prefill_attention(
                *a, dot_fp32=forced, **k
            ),
        ),
    )


def emulated_kernels():
    """The FP8 test's floor KernelSet (torch references) with prefill and decode attention replaced by
    the interpreted kernels on their bf16-dot path. Calls must run inside ``interpreter()`` and
    ``bf16_interpreter()``."""
    from kernels.interpret import load_interpreted
    from services.worker.kernel_model.kernel_set import KernelSet

    return with_attention(
        KernelSet.references(), False, load_interpreted("prefill_attention"), load_interpreted("decode_attention")
    )


def every_step_kernel():
    """``emulated_kernels`` plus the other kernels wired with prefill attention, interpreted: compressor
    (fp32 dots for fp32 models, as compiled), indexer on its f16-dot path (the GPU's: TritonAttention passes
    dot_fp32 only for interpreted sets; its PTX dequantisation needs 4-byte aligned keys, and the tiny
    models' 17-byte index keys take the byte path on the GPU too) and mHC. GEMMs, norms, router: torch."""
    from kernels.interpret import load_interpreted

    indexer = load_interpreted("indexer")
    return dataclasses.replace(
        emulated_kernels(),
        compressor=load_interpreted("compressor"),
        mhc=load_interpreted("mhc"),
        indexer=SimpleNamespace(
            indexer_select=lambda *a, dot_fp32=None, **k: indexer.indexer_select(*a, dot_fp32=False, **k)
        ),
    )


def engine_kl(make, names: tuple[str, ...], device: str = "cpu", precision: str = "fp8") -> str:
    """The FP8 engine on ``device`` with the KernelSet ``make()`` over FP8_CASES (of ``names``): pooled KL
    vs the CPU fp32 reference, as test_gpu_fp8_engine_kl_and_top1_against_cpu_reference computes it."""
    from tests.services.worker import test_kernel_backend as t

    parts, start = [], time.time()
    for name, budget in t.FP8_CASES:
        if name not in names:
            continue
        c = t.case(name)
        emulate = (lambda: contextlib.ExitStack()) if device != "cpu" else _emulating
        with emulate():
            model = copy.deepcopy(c.model).to(device)
            logits = t.drive(c, t.runner_for(c, model, budget, precision, make()), budget)
        parts.append(t._kl_report(c, logits))
    n, margin = sum(p["positions"] for p in parts), sum(p["margin_rows"] for p in parts)
    return (
        f"mean KL {sum(p['mean_kl'] * p['positions'] for p in parts) / n:.4f}  max KL "
        f"{max(p['max_kl'] for p in parts):.3f}  top-1 {sum(p['top1'] * p['margin_rows'] for p in parts) / margin:.3f}"
        f"  per config " + " / ".join(f"{p['mean_kl']:.4f}" for p in parts) + f"  ({time.time() - start:.0f} s)"
    )


@contextlib.contextmanager
def _emulating():
    from kernels.interpret import interpreter

    with interpreter(), bf16_interpreter():
        yield


def engine_table(names: tuple[str, ...], full: bool) -> None:
    from services.worker.kernel_model.kernel_set import KernelSet

    sets = [
        ("floor (torch references)", KernelSet.references),
        ("floor + attention kernels, bf16 path", emulated_kernels),
    ]
    if full:
        sets.append(("+ compressor, indexer (f16), mHC kernels", every_step_kernel))
    for label, make in sets:
        print(f"{label:44s} {engine_kl(make, names)}", flush=True)


def bisect(names: tuple[str, ...], device: str) -> None:
    """(H200) The compiled FP8 engine with one part at a time put back to what it was at KL 0.081: a
    stage whose removal brings the KL back to ~0.08 holds the defect. ``device`` "cpu": the same
    plumbing on ``every_step_kernel`` (interpreted, bf16 attention emulated; slow)."""
    from kernels import reference
    from services.worker.kernel_model.kernel_set import KernelSet

    torch.backends.cuda.matmul.allow_tf32 = False
    base = KernelSet.compiled if device != "cpu" else every_step_kernel
    torch_prefill = SimpleNamespace(
        sparse_prefill_attention=lambda *a, dot_fp32=None, **k: reference.sparse_prefill_attention(*a)
    )
    variants = [
        ("every kernel (as shipped)", base),
        ("attention kernels with fp32 dots", lambda: with_attention(base(), True)),
        ("prefill attention: torch reference", lambda: dataclasses.replace(base(), prefill_attention=torch_prefill)),
        ("compressor + indexer: torch", lambda: dataclasses.replace(base(), compressor=None, indexer=None)),
        ("mHC: the model's", lambda: dataclasses.replace(base(), mhc=None)),
        (
            "all three back (the 0.081 wiring)",
            lambda: dataclasses.replace(
                base(), prefill_attention=torch_prefill, compressor=None, indexer=None, mhc=None
            ),
        ),
    ]
    for label, make in variants:
        print(f"{device} {label:40s} {engine_kl(make, names, device)}", flush=True)
    # Every kernel on the fp32 path, on all three configs (the GPU fp32 test without a rounding hook ran
    # only oracle's short small_case): fp32-noise flips only, ≲ 1e-3 mean KL, unless a kernel is wrong
    # at wide / nocand shapes or at these lengths whatever the dot precision.
    # (On the CPU, every_step_kernel keeps the attention on its emulated bf16 path: measured 0.0138 on oracle,
    # the torch emulation's "fp32 + attention q, P → bf16" 0.014 of docs/accuracy.md.)
    print(f"{device} {'fp32 precision, every kernel':40s} {engine_kl(base, names, device, 'fp32')}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels-only", action="store_true", help="skip the engine runs")
    parser.add_argument("--configs", default="oracle,wide,nocand")
    parser.add_argument("--full", action="store_true", help="also the compressor, indexer and mHC kernels (slow)")
    parser.add_argument(
        "--bisect",
        metavar="DEVICE",
        help="cuda (H200): the compiled engine with one stage at a time put back; cpu: its plumbing, interpreted",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.bisect:  # before any interpreted kernel runs in this process (compiled ones on the GPU)
        bisect(tuple(args.configs.split(",")), args.bisect)
        return 0
    print(
        "1. kernels, bf16 path emulated: relative L2 error vs the fp32 reference, vs the torch emulation of q, P → bf16"
    )
    for r in kernel_table():
        print(
            f"  {r['shape']:45s} {r['kind']:18s} finite {r['finite']!s:5s} vs ref {r['vs_ref']:.2e}  "
            f"torch emulation vs ref {r['torch_vs_ref']:.2e}  kernel vs torch emulation {r['vs_torch']:.2e}"
        )
    if not args.kernels_only:
        print("2. the FP8 engine (FP8_CASES) on the CPU: KL vs the fp32 reference")
        engine_table(tuple(args.configs.split(",")), args.full)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
