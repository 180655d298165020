"""Where the FP8 path's KL on the random tiny models comes from (docs/accuracy.md): CPU, torch only.

The bed is the three random oracle configs (tests/model/deepseek_v41/oracle_configs.py: oracle, wide,
nocand; vocabulary 256) with test_model_runner's prompts (37, 20, 45, 9 tokens + 5 fed back), the same
models and tokens as tests/services/worker/kernel_model/test_backend.py's FP8 KL test, but run as full
sequences (the cached engine equals the full-sequence model to fp32 noise; chunking does not change a
per-token rounding). Statistics are services/bench/accuracy.py's ``row_stats``: KL(ref ‖ ours) in
fp64 over every fed position, top-1 agreement where the reference's top-2 margin ≥ 0.05, the
reference's entropy.

Tables:
 1. KL vs a relative perturbation x·(1 + ε·N(0,1)) at one place (every attention output, every MoE
    input, or every FP8 activation site of the converted model instead of its e4m3 rounding), with
    the discrete mechanisms on or switched off: cache rounding (FP8 window K, FP4 entries and index
    q/k → identity), indexer selection (index_topk and candidate blocks ≥ every visible entry), MoE
    routing (top-k = all experts). The log-log slope says smooth (2) or flips (≈1).
 2. The FP8 format floor (the model converted by services/worker/kernel_model/backend.convert_model on
    the kernels' torch references, as the GPU test's floor) plus, emulated in torch, the GPU kernels'
    own roundings: attention q → bf16 and P → bf16 before PV (decode and prefill kernels), the
    indexer's q / 2^k → f16, mHC's tf32 split.
 3. The same architecture with residual branches (attention wo_b, expert and shared-expert w2) scaled
    by 2^-k (exact in FP8): fp32 vs FP8 formats, with the reference's entropy and margins and how far
    the layers move the output at all (KL to the embedding-only model).

Run: python -m tests.services.worker.kl_attribution [--quick]   (torch pinned to one thread; a few minutes)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import time
from types import SimpleNamespace

import torch

import model.deepseek_v41.attention as attention_mod
import model.deepseek_v41.compressor as compressor_mod
import model.deepseek_v41.indexer as indexer_mod
from kernels import reference
from model.deepseek_v41.attention import Attention
from model.deepseek_v41.indexer import Indexer
from model.deepseek_v41.init import random_checkpoint
from model.deepseek_v41.loader import assign_weights
from model.deepseek_v41.mhc import HyperConnection, Mix, sinkhorn
from model.deepseek_v41.model import DeepseekV41
from model.deepseek_v41.moe import MoE
from model.deepseek_v41.tokenizer import engram_token_map
from services.bench.accuracy import MARGIN, row_stats, scale_branches
from services.worker.kernel_model.backend import convert_model
from services.worker.kernel_model.fp8_linear import GroupedKernelLinear
from services.worker.kernel_model.kernel_set import KernelSet
from tests.model.deepseek_v41.oracle_configs import CASES, finish
from tests.model.deepseek_v41.oracle_harness import toy_tokenizer

PROMPTS = (37, 20, 45, 9)  # test_model_runner's
MAX_TOKENS = 5
EPSILONS = (1e-5, 1e-4, 1e-3, 1e-2)
MECHANISMS = ("cache", "select", "route")


# ---------------------------------------------------------------- models and KL


def build(name: str) -> SimpleNamespace:
    """One oracle config: model (fp32), ids [B, S] (right-padded), valid [B, S] (fed positions)."""
    case = next(c for c in CASES if c.name == name)
    token_map, num = engram_token_map(toy_tokenizer(case.cfg.vocab_size))
    cfg = finish(case.cfg, num)
    model = DeepseekV41(cfg, token_map, num)
    assign_weights(model, random_checkpoint(cfg, case.seed))
    g = torch.Generator().manual_seed(case.seed)
    seqs = [torch.randint(3, cfg.vocab_size, (n + MAX_TOKENS,), generator=g) for n in PROMPTS]
    fed = [s[:-1] for s in seqs]
    ids = torch.zeros(len(fed), max(map(len, fed)), dtype=torch.long)
    valid = torch.zeros(ids.shape, dtype=torch.bool)
    for b, s in enumerate(fed):
        ids[b, : len(s)], valid[b, : len(s)] = s, True
    return SimpleNamespace(name=name, model=model.eval(), ids=ids, valid=valid)


NOISE = torch.Generator()


@torch.no_grad()
def logits(case: SimpleNamespace, model=None) -> torch.Tensor:
    """[R, V] fp32 over the fed positions; the noise generator restarts, so runs are repeatable."""
    NOISE.manual_seed(1234)
    return (model or case.model)(case.ids)[case.valid]


def stats(ref: torch.Tensor, ours: torch.Tensor) -> dict[str, float]:
    s = row_stats(ref, ours)
    wide = s["margin"] >= MARGIN
    return {
        "mean": float(s["kl"].mean()),
        "max": float(s["kl"].max()),
        "top1": float(s["agree"][wide].double().mean()) if wide.any() else math.nan,
        "H": float(s["entropy"].mean()),
        "margin": float(s["margin"].median()),
        "rows": len(s["kl"]),
    }


def pooled(parts: list[dict[str, float]]) -> dict[str, float]:
    """Row-weighted means over the configs (max of maxima)."""
    n = sum(p["rows"] for p in parts)
    out = {k: sum(p[k] * p["rows"] for p in parts) / n for k in ("mean", "top1", "H", "margin")}
    out["max"] = max(p["max"] for p in parts)
    return out


def noisy(x: torch.Tensor, eps: float) -> torch.Tensor:
    n = torch.randn(x.shape, generator=NOISE, dtype=torch.float32)
    return (x.float() * (1 + eps * n)).to(x.dtype)


# ---------------------------------------------------------------- switches


@contextlib.contextmanager
def patched(obj, name: str, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def mechanisms_off(model, off: set[str]) -> contextlib.ExitStack:
    """Switch discrete mechanisms off (in place for the module attributes; the stack undoes the rest)."""
    stack = contextlib.ExitStack()
    identity = lambda x, *a, **k: x  # noqa: E731
    if "cache" in off:
        stack.enter_context(patched(attention_mod, "fake_quant_fp8_e4m3", identity))
        stack.enter_context(patched(compressor_mod, "fake_quant_compressed_kv", identity))
        stack.enter_context(patched(indexer_mod, "fake_quant_indexer", identity))
    for m in model.modules():
        if "select" in off and isinstance(m, Attention):
            m.index_topk, m.candidate_topk_blocks = 10**6, 10**6
        if "route" in off and hasattr(m, "top_k") and hasattr(m, "gate_weight"):
            m.top_k = m.gate_weight.shape[0]
    return stack


def hook_site(model, site: str, eps: float) -> list:
    """Relative noise at every attention output ("attn_out") or MoE input ("moe_in")."""
    handles = []
    for block in model.layers:
        if site == "attn_out":
            handles.append(block.attn.register_forward_hook(lambda m, a, out: (noisy(out[0], eps), out[1])))
        elif site == "moe_in":
            handles.append(block.ffn.register_forward_pre_hook(lambda m, a: (noisy(a[0], eps), *a[1:])))
    return handles


# ---------------------------------------------------------------- the FP8 format model (torch references)

ACT = {"mode": "fp8", "eps": 0.0}
"""Activation sites of the converted model: "fp8" (e4m3 1×128, the format), "none", "noise" (eps)."""
_quantize_act = reference.quantize_act


def _act_sites(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if ACT["mode"] == "fp8":
        return _quantize_act(x)
    y = x.float() if ACT["mode"] == "none" else noisy(x.float(), ACT["eps"])
    return y, torch.ones(*x.shape[:-1], x.shape[-1] // reference.GROUP)


def reference_kernels() -> KernelSet:
    """``KernelSet.references()`` (the FP8 floor) without the attention slots, with
    ``quantize_act`` looked up at call time so ACT switches it."""
    return KernelSet(
        SimpleNamespace(rmsnorm=reference.rmsnorm),
        SimpleNamespace(quantize_act=lambda x: reference.quantize_act(x)),
        SimpleNamespace(moe_router=lambda *a: _record("route", reference.moe_router(*a))),
        KernelSet.references().moe_grouped_gemm,
        SimpleNamespace(),
        interpreted=True,
    )


def _project_out(self, out, angles):  # Attention.project_out with a converted (grouped) wo_a
    out = attention_mod.apply_rope(out, angles, inverse=True)
    grouped = out.reshape(*out.shape[:2], self.num_groups, -1)
    if isinstance(self.wo_a, GroupedKernelLinear):
        return self.wo_b(self.wo_a(grouped))
    w = self.wo_a.weight.view(self.num_groups, -1, grouped.shape[-1])
    return self.wo_b(torch.einsum("bsgi,gri->bsgr", grouped, w).flatten(2))


def fp8_model(model):
    m = copy.deepcopy(model)
    convert_model(m, "fp8", reference_kernels())
    return m


# ---------------------------------------------------------------- GPU kernel roundings, in torch

KERNEL = {"q_bf16": False, "p_bf16": False, "idx_f16": False, "mhc_tf32": False}


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def sink_attention(q, kv, allowed, sink, scale):
    """model.attention.sink_attention with the attention kernels' roundings (KERNEL q_bf16, p_bf16):
    q·k with bf16 q (keys are exact in bf16), unnormalised P = exp(s − max) rounded to bf16 for PV,
    the denominator from fp32 P plus exp(sink − max), as decode_attention's online softmax."""
    b, s, h, _ = q.shape
    qf = _bf16(q.float()) if KERNEL["q_bf16"] else q.float()
    logits = torch.einsum("bshd,btd->bhst", qf, kv.float()) * scale
    logits = logits.masked_fill(~allowed.unsqueeze(1), -torch.inf)
    m = logits.amax(-1, keepdim=True)
    p = torch.exp(logits - m)
    denom = p.sum(-1, keepdim=True) + torch.exp(sink.float().view(1, h, 1, 1) - m)
    pv = _bf16(p) if KERNEL["p_bf16"] else p
    return (torch.einsum("bhst,btd->bshd", pv, kv.float()) / denom.permute(0, 2, 1, 3)).to(q.dtype)


_scores_quantized = Indexer.scores_quantized


def _scores_f16(self, q, x, keys, visible):
    """The indexer kernel's query: q / Q_h in f16, Q_h = 2^floor(log2 max|q[h]|) (keys are exact)."""
    if KERNEL["idx_f16"]:
        qmax = q.abs().amax(-1, keepdim=True).clamp_min(2.0**-126)
        pow2 = torch.exp2(torch.floor(torch.log2(qmax)))
        q = (q / pow2).half().float() * pow2
    return _scores_quantized(self, q, x, keys, visible)


_hc_forward = HyperConnection.forward


def _tf32_hi(x: torch.Tensor) -> torch.Tensor:
    return (x.contiguous().view(torch.int32) & -8192).view(torch.float32)


def _tf32_rna(x: torch.Tensor) -> torch.Tensor:
    bits = x.contiguous().view(torch.int32)
    return ((bits + 4096) & -8192).view(torch.float32)


def _hc_tf32(self, h):
    """kernels/mhc.py's projection: fn = hi + lo (hi exact in tf32), v = v_hi + v_lo; three tf32 dots."""
    if not KERNEL["mhc_tf32"]:
        return _hc_forward(self, h)
    n = self.n
    flat = h.flatten(2).float()
    fn_hi = _tf32_hi(self.fn.float())
    fn_lo = _tf32_rna(self.fn.float() - fn_hi)
    v_hi = _tf32_hi(flat)
    v_lo = _tf32_rna(flat - v_hi)
    dot = lambda a, b: torch.nn.functional.linear(a.double(), b.double())  # noqa: E731  (products exact, fp32 sums ≈)
    proj = (dot(v_hi, fn_hi) + dot(v_hi, fn_lo) + dot(v_lo, fn_hi)).float()
    m = proj * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
    scales = torch.cat((self.scale[0].expand(n), self.scale[1].expand(n), self.scale[2].expand(n * n)))
    lg = torch.addcmul(self.base, m, scales)
    return Mix(
        torch.sigmoid(lg[..., :n]) + self.eps,
        2 * torch.sigmoid(lg[..., n : 2 * n]),
        sinkhorn(lg[..., 2 * n :].unflatten(-1, (n, n)), self.iters, self.eps),
    )


@contextlib.contextmanager
def kernel_roundings(**on: bool):
    old = dict(KERNEL)
    KERNEL.update(on)
    try:
        yield
    finally:
        KERNEL.update(old)


# ---------------------------------------------------------------- discrete decisions

RECORD: dict[str, list[torch.Tensor]] | None = None
"""While set: every MoE routing ([T, k] experts), indexer selection ([B, S, k]) and candidate mask."""


def _record(kind: str, out):
    if RECORD is not None:
        t = out[1] if kind == "route" else out
        RECORD.setdefault(kind, []).append(t.sort(-1).values if kind != "candidates" else t)
    return out


_route, _select, _candidates = MoE.route, attention_mod.select_entries, attention_mod.candidate_mask


def installed() -> contextlib.ExitStack:
    """The switches above patched into the model's modules (all off until set: ACT "fp8" is the format,
    KERNEL flags False, RECORD None). The CPU tables run inside; the GPU check does not."""
    stack = contextlib.ExitStack()
    for obj, name, value in (
        (reference, "quantize_act", _act_sites),  # moe_grouped_gemm's own quantisations look it up at call time
        (Attention, "project_out", _project_out),
        (attention_mod, "sink_attention", sink_attention),
        (Indexer, "scores_quantized", _scores_f16),
        (HyperConnection, "forward", _hc_tf32),
        (MoE, "route", lambda self, x: _record("route", _route(self, x))),
        (attention_mod, "select_entries", lambda *a, **k: _record("selected", _select(*a, **k))),
        (attention_mod, "candidate_mask", lambda *a, **k: _record("candidates", _candidates(*a, **k))),
    ):
        stack.enter_context(patched(obj, name, value))
    return stack


def decisions(case, model) -> dict[str, list[torch.Tensor]]:
    global RECORD
    RECORD = {}
    try:
        logits(case, model)
        return RECORD
    finally:
        RECORD = None


def flipped(case, ref: dict, ours: dict) -> dict[str, tuple[int, int]]:
    """Per kind: (decisions that differ, decisions) over layers × fed positions."""
    valid = case.valid
    out = {}
    for kind in ("route", "selected", "candidates"):
        diff = total = 0
        for a, b in zip(ref.get(kind, []), ours.get(kind, [])):
            if kind == "route":
                a, b = a.view(*valid.shape, -1), b.view(*valid.shape, -1)
            d = (a != b).flatten(2).any(-1)[valid]
            diff, total = diff + int(d.sum()), total + d.numel()
        out[kind] = (diff, total)
    return out


# ---------------------------------------------------------------- experiments

SETTINGS = (
    ("all on", set()),
    ("no cache rounding", {"cache"}),
    ("select all entries", {"select"}),
    ("route to all experts", {"route"}),
    ("all three off", set(MECHANISMS)),
)
SITES = ("attn_out", "moe_in", "fp8_sites")


def slope(eps: tuple[float, ...], kls: list[float]) -> float:
    """Least-squares slope of log KL against log ε (2: smooth, ≈1: discrete flips)."""
    xs, ys = [math.log(e) for e in eps], [math.log(max(k, 1e-300)) for k in kls]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def table_scaling(cases, eps: tuple[float, ...]) -> None:
    print(
        f"\n## 1. mean KL vs relative noise ε at one site (pooled over {', '.join(c.name for c in cases)}; "
        f"slope = d log KL / d log ε)"
    )
    print(f"{'mechanisms':22} {'site':10} " + " ".join(f"{e:>9.0e}" for e in eps) + f" {'slope':>6} {'FP8 fmt':>9}")
    for label, off in SETTINGS:
        per_site: dict[str, list[list[dict]]] = {s: [[] for _ in eps] for s in SITES}
        fmt = []
        for c in cases:
            model = copy.deepcopy(c.model)
            with mechanisms_off(model, off):
                ref = logits(c, model)
                for site in ("attn_out", "moe_in"):
                    for i, e in enumerate(eps):
                        handles = hook_site(model, site, e)
                        per_site[site][i].append(stats(ref, logits(c, model)))
                        for hd in handles:
                            hd.remove()
                fp8 = fp8_model(model)
                fmt.append(stats(ref, logits(c, fp8)))  # the FP8 format floor under this setting
                ACT["mode"] = "none"
                base = logits(c, fp8)
                ACT["mode"] = "noise"
                for i, e in enumerate(eps):
                    ACT["eps"] = e
                    per_site["fp8_sites"][i].append(stats(base, logits(c, fp8)))
                ACT["mode"] = "fp8"
        for site in SITES:
            kls = [pooled(p)["mean"] for p in per_site[site]]
            tail = f" {pooled(fmt)['mean']:>9.3g}" if site == SITES[0] else ""
            print(f"{label:22} {site:10} " + " ".join(f"{k:>9.2e}" for k in kls) + f" {slope(eps, kls):>6.2f}{tail}")


def table_tiny_noise(cases, eps: tuple[float, ...], seeds: tuple[int, ...]) -> None:
    print("\n## 1b. The model as is, noise at fp32-rounding size (mean KL / max KL / top-1), per noise seed")
    refs = [logits(c) for c in cases]
    for seed in seeds:
        for e in eps:
            row = []
            for site in ("attn_out", "moe_in"):
                parts = []
                for c, ref in zip(cases, refs):
                    handles = hook_site(c.model, site, e)
                    with torch.no_grad():
                        NOISE.manual_seed(seed)
                        parts.append(stats(ref, c.model(c.ids)[c.valid]))
                    for hd in handles:
                        hd.remove()
                p = pooled(parts)
                row.append(f"{site} {p['mean']:.2e} / {p['max']:.3f} / {p['top1']:.3f}")
            print(f"seed {seed} ε {e:.0e}: " + "   ".join(row))


KERNEL_ROWS = (
    ("FP8 formats (torch refs: the floor)", True, {}),
    ("  + attention q → bf16", True, {"q_bf16": True}),
    ("  + attention P → bf16", True, {"p_bf16": True}),
    ("  + attention q, P → bf16", True, {"q_bf16": True, "p_bf16": True}),
    ("  + indexer q/2^k → f16", True, {"idx_f16": True}),
    ("  + mHC tf32 split", True, {"mhc_tf32": True}),
    ("  + all kernel roundings", True, {k: True for k in KERNEL}),
    ("fp32 + attention q, P → bf16", False, {"q_bf16": True, "p_bf16": True}),
    ("fp32 + all kernel roundings", False, {k: True for k in KERNEL}),
    ("FP8 act sites off (bf16 expert outputs only)", None, {}),
)


def table_kernels(cases) -> None:
    print("\n## 2. KL(fp32 reference ‖ …): the FP8 format floor plus the GPU kernels' roundings in torch")
    print(f"{'variant':46} {'mean KL':>9} {'max KL':>8} {'top-1':>7}   per config (mean KL)")
    refs = [(c, logits(c), fp8_model(c.model)) for c in cases]
    for label, fp8, on in KERNEL_ROWS:
        parts = []
        with kernel_roundings(**on):
            for c, ref, f in refs:
                if fp8 is None:
                    ACT["mode"] = "none"
                parts.append(stats(ref, logits(c, f if fp8 in (True, None) else None)))
                ACT["mode"] = "fp8"
        p = pooled(parts)
        print(
            f"{label:46} {p['mean']:>9.3g} {p['max']:>8.3g} {p['top1']:>7.3f}   "
            + " ".join(f"{q['mean']:.3g}" for q in parts)
        )


def scaled(model, k: int, head: float = 1.0):
    """Residual branches (attention wo_b, routed and shared w2) × 2^-k (k None: × 0), head × ``head``."""
    m = copy.deepcopy(model)
    scale_branches(m, k)
    with torch.no_grad():
        m.head.weight.mul_(head)
    return m


def table_init(cases, ks: tuple[int, ...], heads: tuple[float, ...]) -> None:
    print("\n## 3. Same architecture, residual branches × 2^-k: KL(fp32 ‖ FP8 formats) (pooled)")
    print(
        f"{'k':>3} {'head':>5} {'mean KL':>9} {'max KL':>8} {'top-1':>7} {'ref H':>6} {'med margin':>10} "
        f"{'layers move':>11} {'bf16 attn':>9}"
    )
    for head in heads:
        for k in ks:
            parts, moved, attn = [], [], []
            for c in cases:
                m = scaled(c.model, k, head)
                ref = logits(c, m)
                parts.append(stats(ref, logits(c, fp8_model(m))))
                moved.append(stats(ref, logits(c, scaled(c.model, None, head))))
                with kernel_roundings(q_bf16=True, p_bf16=True):
                    attn.append(stats(ref, logits(c, m)))
            p = pooled(parts)
            print(
                f"{k:>3} {head:>5g} {p['mean']:>9.3g} {p['max']:>8.3g} {p['top1']:>7.3f} {p['H']:>6.3f} "
                f"{p['margin']:>10.3f} {pooled(moved)['mean']:>11.3g} {pooled(attn)['mean']:>9.3g}"
            )


def table_flips(cases, ks: tuple[int, ...]) -> None:
    print("\n## 4. Discrete decisions the FP8 formats flip (share of layer × position decisions unlike fp32's)")
    print(f"{'k':>3} {'MoE expert set':>15} {'indexer top-k':>14} {'cand. blocks':>13}")
    for k in ks:
        sums = {kind: [0, 0] for kind in ("route", "selected", "candidates")}
        for c in cases:
            m = scaled(c.model, k)
            for kind, (d, t) in flipped(c, decisions(c, m), decisions(c, fp8_model(m))).items():
                sums[kind][0] += d
                sums[kind][1] += t
        print(f"{k:>3} " + " ".join(f"{d / max(t, 1):>{w}.1%}" for (d, t), w in zip(sums.values(), (15, 14, 13))))


def gpu_dots(device: str = "cuda") -> None:
    """On an H200: the GPU kernel engine's KL on the FP8 test's three configs (tests/services/worker/
    test_kernel_backend.py ``FP8_CASES``, its CPU fp32 reference) with the attention kernels' dot
    precision forced (TritonAttention.fp32_dots): fp8 as shipped (bf16 q, P), fp8 with fp32 dots, fp32
    with bf16 dots. Expected from the torch emulation (table 2): ≈ 0.08, ≈ 0.08 and ≈ 0.02.
    ``device`` "cpu" runs the plumbing on the torch-reference kernel set (no dots to force)."""
    from services.worker.attention.triton_backend import TritonAttention
    from tests.services.worker.kernel_model import test_backend as t

    torch.backends.cuda.matmul.allow_tf32 = False
    init = TritonAttention.__init__
    for precision, force in (("fp8", None), ("fp8", True), ("fp32", False), ("fp32", None)):

        def forced(self, *a, force=force, **k):
            init(self, *a, **k)
            if force is not None:
                self.fp32_dots = force

        parts = []
        with patched(TritonAttention, "__init__", forced):
            for name, budget in t.FP8_CASES:
                c = t.case(name)
                model = copy.deepcopy(c.model).to(device)
                kernels = KernelSet.references() if device == "cpu" else None
                parts.append(t._kl_report(c, t.drive(c, t.runner_for(c, model, budget, precision, kernels), budget)))
        n, rows = sum(p["positions"] for p in parts), sum(p["margin_rows"] for p in parts)
        mean = sum(p["mean_kl"] * p["positions"] for p in parts) / n
        print(
            f"{device} {precision} fp32_dots={'as shipped' if force is None else force}: mean KL "
            f"{mean:.4g}, max KL {max(p['max_kl'] for p in parts):.3g}, "
            f"top-1 {sum(p['top1'] * p['margin_rows'] for p in parts) / rows:.3f}; per config "
            + " ".join(f"{p['mean_kl']:.3g}" for p in parts)
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="oracle config only, fewer points")
    parser.add_argument(
        "--gpu-dots",
        action="store_true",
        help="(CUDA) the engine's KL with the attention kernels' dot precision forced; see gpu_dots",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.gpu_dots:
        gpu_dots()
        return 0
    torch.use_deterministic_algorithms(True)
    start = time.time()
    cases = [build(n) for n in (("oracle",) if args.quick else ("oracle", "wide", "nocand"))]
    print(
        f"KL attribution on {', '.join(c.name for c in cases)}: {sum(int(c.valid.sum()) for c in cases)} positions, "
        f"vocabulary {cases[0].model.cfg.vocab_size} (ln V = {math.log(cases[0].model.cfg.vocab_size):.3f})"
    )
    with installed():
        table_scaling(cases, EPSILONS[1:3] if args.quick else EPSILONS)
        table_tiny_noise(cases, (1e-7, 1e-6, 1e-5), (0,) if args.quick else (0, 1))
        table_kernels(cases)
        table_init(cases, (0, 3) if args.quick else (0, 1, 2, 3, 4, 5, 6), (1.0,) if args.quick else (1.0, 4.0))
        table_flips(cases, (0, 4))
    print(f"\n{time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
