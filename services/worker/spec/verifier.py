"""Speculative verification: which of a request's drafts the target accepts, and the token after them.

A request that verifies k drafts has 1 + k target rows. Row j (j = 0..k) holds the target's processed
distribution p_j (``Sampler.process``: bans, temperature, top-k, top-p) for the token at position P + j,
where P is the position of the request's next token; draft j is the token the draft proposed for
position P + j, drawn from its own processed distribution q_j. The request emits its accepted drafts
and then one target token: 1 to k + 1 tokens per step.

Invariants, both modes:
- A draft counts only if every earlier draft of the request passed (accepted drafts are a prefix).
- Every random draw is keyed by (seed, position, case) (kernels/philox.py), never by row or batch.
- Temperature 0: draft j is accepted exactly when it equals argmax p_j (ties to the lowest id), and the
  token after the accepted drafts is the argmax of its row.

``"rejection"`` (speculative sampling; the walkthrough's "Accepting a draft"):

    draft j   accepted iff u(seed, P + j, ACCEPT) < exp(min(log p_j(d_j) − log q_j(d_j), 0))
    first rejected j: the token ~ norm(max(p_j − q_j, 0)) with the bits of (seed, P + j, RESAMPLE)
    all accepted:     the token ~ p_k with the bits of (seed, P + k, SAMPLE)

  Emitted tokens are distributed as the target's, but which tokens come out depends on how many drafts
  were verified. Drafts draw with their own key (seed + DRAFT_SEED_OFFSET), independent of the target's.

``"deterministic"`` (position-keyed Gumbel-max coupling):

    G_x(v)             = Gumbel noise of draw_bits_per_token(seed, x)[v]: one vector per position
    target's token at x = argmax_v log p_x(v) + G_x(v)     an exact sample of p_x
    draft's token at x  = argmax_v log q_x(v) + G_x(v)     the same noise
    draft j accepted iff it equals the target's token at P + j; the token after the accepted drafts is
    the target's token at its position

  Every emitted token is the target's own sample at its position given the prefix, so a seeded request's
  tokens do not depend on how many drafts are verified for it, on its batch, or on timing. The price:
  a draft passes with probability Σ_v 1 / Σ_w max(p_w / p_v, q_w / q_v) instead of Σ_v min(p_v, q_v)
  (docs/speculative.md has both, measured).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.device import upload
from kernels.philox import COUPLING_WORD, DRAW_BITS, MASK32, DrawCase, draw_bits, draw_bits_per_token, philox4x32
from services.worker.sampling.sampler import accept_draft, integer_masses, pick_from_bits, sample_from_bits

SPEC_SAMPLING = ("rejection", "deterministic")
DRAFT_SEED_OFFSET = 1_000_000_007  # the draft's key is seed + this (DeepInfer's offset), mod 2**64


@dataclass(frozen=True)
class Verdict:
    """The outcome for N requests that verified up to K drafts each."""

    num_accepted: torch.Tensor  # int64 [N]: drafts accepted, a prefix of the request's drafts
    tokens: torch.Tensor  # int64 [N, K + 1]: columns 0 … num_accepted are emitted (the accepted drafts, then
    #                       the target's token); later columns are not emitted


def _positions(positions: Sequence[int] | torch.Tensor, n: int, width: int) -> list[list[int]]:
    """Host positions [N][width]: P + j per request (a device tensor is read once; host lists are not)."""
    first = positions.flatten().tolist() if isinstance(positions, torch.Tensor) else list(positions)
    if len(first) != n:
        raise ValueError(f"{n} requests but {len(first)} first positions")
    if any(not 0 <= p < (1 << 60) - width for p in first):
        raise ValueError(f"a draw's position must be in [0, 2**60), got first positions {first}")
    return [[p + j for j in range(width)] for p in first]


def _draw(seeds: Sequence[int], positions: list[list[int]], case: DrawCase, device: torch.device) -> torch.Tensor:
    """Bits for every (request, column): seeds [N], host positions [N][W] → int64 [N, W] on ``device``, drawn
    on the host and copied without waiting for the device."""
    n, w = len(positions), len(positions[0]) if positions else 0
    flat_seeds = [s for s in seeds for _ in range(w)]
    bits = draw_bits(flat_seeds, [p for row in positions for p in row], case, "cpu").view(n, w)
    return upload(bits, device)


def _on(values: Sequence | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor on ``device``: a tensor as is (cast), host values copied without waiting for the device."""
    if isinstance(values, torch.Tensor):
        return values.to(device=device, dtype=dtype)
    return upload(torch.tensor(list(values), dtype=dtype), device)


def _verified(num_drafts: Sequence[int] | torch.Tensor | None, n: int, k: int, device: torch.device) -> torch.Tensor:
    """Bool [N, K]: draft j of request i is verified (j < num_drafts[i]); None = all K. Host counts are
    checked on the host; a tensor's are read back to check them."""
    if num_drafts is None:
        return torch.ones(n, k, dtype=torch.bool, device=device)
    if not isinstance(num_drafts, torch.Tensor):
        counts = list(num_drafts)
        if any(not 0 <= c <= k for c in counts):
            raise ValueError(f"num_drafts must be in [0, {k}], got {counts}")
        return upload(torch.arange(k) < torch.tensor(counts, dtype=torch.int64).view(n, 1), device)
    counts = torch.as_tensor(num_drafts, dtype=torch.int64, device=device).view(n, 1)
    if bool((counts < 0).any()) or bool((counts > k).any()):
        raise ValueError(f"num_drafts must be in [0, {k}], got {counts.flatten().tolist()}")
    return torch.arange(k, device=device) < counts


def _prefix(passed: torch.Tensor) -> torch.Tensor:
    """Drafts accepted: the length of the leading run of passes. passed bool [N, K] → int64 [N]."""
    return passed.to(torch.int64).cumprod(dim=-1).sum(dim=-1)


def _passes_rejection(target_probs: torch.Tensor, draft_probs: torch.Tensor, coin_bits: torch.Tensor) -> torch.Tensor:
    """The accept coin of every draft: [N, K] probabilities of the drafts → bool [N, K]."""
    return accept_draft(target_probs.log(), draft_probs.log(), coin_bits)


def _passes_coupled(drafts: torch.Tensor, target_tokens: torch.Tensor) -> torch.Tensor:
    """A coupled draft passes iff it is the target's own token at its position: [N, K] → bool [N, K]."""
    return drafts == target_tokens


def verify_rejection(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    drafts: torch.Tensor,
    seeds: Sequence[int],
    positions: Sequence[int] | torch.Tensor,
    greedy: torch.Tensor,
    num_drafts: Sequence[int] | torch.Tensor | None = None,
) -> Verdict:
    """target_probs [N, K+1, V], draft_probs [N, K, V], drafts int64 [N, K]; one seed, first position P and
    greedy flag per request; ``num_drafts`` [N] verifies only each request's first drafts (None: all K)."""
    n, width, _ = target_probs.shape
    k = width - 1
    device = target_probs.device
    greedy = _on(greedy, torch.bool, device).view(n)
    pos = _positions(positions, n, width)  # host [N][K+1]
    draws = {
        case: _draw(seeds, [p[:k] for p in pos] if case == DrawCase.ACCEPT else pos, case, device)
        for case in (DrawCase.ACCEPT, DrawCase.RESAMPLE, DrawCase.SAMPLE)
    }
    return rejection_verdict(
        target_probs, draft_probs, drafts.to(device), greedy, _verified(num_drafts, n, k, device), draws
    )


def rejection_verdict(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    drafts: torch.Tensor,
    greedy: torch.Tensor,
    verified: torch.Tensor,
    draws: dict[DrawCase, torch.Tensor],
) -> Verdict:
    """``verify_rejection`` on the device, with no host read and fixed shapes (what a CUDA graph captures):
    target_probs [N, K+1, V], draft_probs [N, K, V], drafts int64 [N, K], greedy bool [N], verified bool [N, K];
    ``draws`` int64 per case, ACCEPT [N, K] (columns P … P+K−1), RESAMPLE and SAMPLE [N, K+1] (P … P+K)."""
    n, width, _ = target_probs.shape
    k = width - 1
    num_accepted = torch.zeros(n, dtype=torch.int64, device=target_probs.device)
    if k:
        index = drafts.unsqueeze(-1)
        t = target_probs[:, :k].gather(-1, index).squeeze(-1)  # [N, K]
        d = draft_probs.gather(-1, index).squeeze(-1)
        sampled = _passes_rejection(t, d, draws[DrawCase.ACCEPT])
        exact = drafts == target_probs[:, :k].argmax(-1)
        num_accepted = _prefix(torch.where(greedy.unsqueeze(-1), exact, sampled) & verified)
    at = num_accepted.unsqueeze(-1)  # [N, 1]
    last = target_probs.gather(1, at.unsqueeze(-1).expand(n, 1, target_probs.shape[2]))[:, 0]  # [N, V]: the row
    #                                                            whose token follows the accepted drafts
    rejected = num_accepted < verified.sum(-1)
    dist = last
    if k:
        q_at = at.clamp(max=k - 1).unsqueeze(-1).expand(n, 1, draft_probs.shape[2])
        residual = (last - draft_probs.gather(1, q_at)[:, 0]).clamp_min(0)
        # A rejection needs p(d) < q(d), so p exceeds q somewhere; a residual whose integer mass rounds to
        # zero (p ≈ q to 2⁻³¹) falls back to p.
        usable = rejected & (integer_masses(residual).sum(-1) > 0)
        dist = torch.where(usable.unsqueeze(-1), residual, last)
    # The draw at P + num_accepted: every column's drawn, the accepted count's picked on the device.
    bits = torch.where(
        rejected, draws[DrawCase.RESAMPLE].gather(1, at)[:, 0], draws[DrawCase.SAMPLE].gather(1, at)[:, 0]
    )
    # dist is a softmax row, or a residual of finite nonnegative values whose integer mass is > 0 (usable) and
    # below the row's: what pick_from_bits needs, so sample_from_bits' host checks are not needed.
    token = torch.where(greedy, last.argmax(-1), pick_from_bits(dist, bits))
    tokens = torch.cat((drafts, drafts.new_zeros(n, 1)), dim=1).scatter(1, at, token.unsqueeze(-1))
    return Verdict(num_accepted, tokens)


def device_draws(seeds: torch.Tensor, positions: torch.Tensor, case: DrawCase) -> torch.Tensor:
    """``draw_bits`` on the device: seeds int64 [N] (two's complement), positions int64 [N, W] (in [0, 2⁶⁰), the
    caller's guarantee) → int64 [N, W], the same counter layout (stream low, stream high, 0, 0) without its
    host loop or checks."""
    stream = 3 * positions + int(case)  # [N, W] < 2⁶²
    key = torch.stack((seeds & MASK32, (seeds >> 32) & MASK32), dim=-1).unsqueeze(1)  # [N, 1, 2]
    zero = torch.zeros_like(stream)
    counter = torch.stack((stream & MASK32, stream >> 32, zero, zero), dim=-1)  # [N, W, 4]
    return philox4x32(counter, key.expand(*stream.shape, 2))[..., 0] >> (32 - DRAW_BITS)


def gumbel_noise(
    seeds: Sequence[int],
    positions: Sequence[int] | torch.Tensor,
    vocab_size: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """G [n, V] float64: −log(−log u) with u = (bits + ½) / 2³¹ ∈ (0, 1), keyed by (seed, position, token)."""
    bits = draw_bits_per_token(seeds, positions, vocab_size, device)
    u = (bits.to(torch.float64) + 0.5) / float(1 << 31)
    return -torch.log(-torch.log(u))


def coupled_tokens(
    logprobs: torch.Tensor, seeds: Sequence[int], positions: Sequence[int] | torch.Tensor, greedy: torch.Tensor
) -> torch.Tensor:
    """argmax_v logprobs[v] + G(seed, position)[v] per row (argmax alone for greedy rows): logprobs [n, V]
    of a processed distribution (dropped tokens −inf) → int64 [n]. Ties go to the lowest id."""
    noisy = logprobs.to(torch.float64) + gumbel_noise(seeds, positions, logprobs.shape[-1], logprobs.device)
    greedy = torch.as_tensor(greedy, dtype=torch.bool, device=logprobs.device)
    return torch.where(greedy, logprobs.argmax(-1), noisy.argmax(-1))


def verify_deterministic(
    target_logprobs: torch.Tensor,
    drafts: torch.Tensor,
    seeds: Sequence[int],
    positions: Sequence[int] | torch.Tensor,
    greedy: torch.Tensor,
    num_drafts: Sequence[int] | torch.Tensor | None = None,
) -> Verdict:
    """target_logprobs [N, K+1, V], drafts int64 [N, K] (drawn by ``coupled_tokens`` from the draft's
    processed logprobs with the same seeds and positions); arguments otherwise as ``verify_rejection``."""
    n, width, _ = target_logprobs.shape
    k = width - 1
    device = target_logprobs.device
    greedy = _on(greedy, torch.bool, device).view(n)
    pos = _on(_positions(positions, n, width), torch.int64, device)  # [N, K+1]
    signed = _on([signed_seed(s) for s in seeds], torch.int64, device)
    return deterministic_verdict(
        target_logprobs, drafts.to(device), signed, pos, greedy, _verified(num_drafts, n, k, device)
    )


def deterministic_verdict(
    target_logprobs: torch.Tensor,
    drafts: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    greedy: torch.Tensor,
    verified: torch.Tensor,
) -> Verdict:
    """``verify_deterministic`` on the device, with no host read and fixed shapes: target_logprobs [N, K+1, V],
    drafts int64 [N, K], seeds int64 [N] (two's complement), positions int64 [N, K+1] (P + j, ≥ 0), greedy
    bool [N], verified bool [N, K]."""
    n, width, _ = target_logprobs.shape
    k = width - 1
    logprobs = target_logprobs.flatten(0, 1)  # [N·(K+1), V]
    signed = seeds.unsqueeze(1).expand(n, width).flatten()
    noisy = logprobs.to(torch.float64) + coupling_noise(signed, positions.flatten(), logprobs.shape[-1])
    flat_greedy = greedy.unsqueeze(1).expand(n, width).flatten()
    # coupled_tokens' values without its host checks: the target's token at each position [N, K+1]
    target = torch.where(flat_greedy, logprobs.argmax(-1), noisy.argmax(-1)).view(n, width)
    num_accepted = _prefix(_passes_coupled(drafts, target[:, :k]) & verified)
    return Verdict(num_accepted, target)


def signed_seed(seed: int) -> int:
    """A seed mod 2⁶⁴ as its two's-complement int64."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed & (1 << 63) else seed


def coupling_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``gumbel_noise`` (fp64 [B, V]) for device seeds (two's-complement int64) and positions int64 [B]
    (positions ≥ 0, the caller's guarantee): ``draw_bits_per_token``'s counter layout without its host check."""
    stream = 3 * positions + int(DrawCase.SAMPLE)
    key = torch.stack((seeds & MASK32, (seeds >> 32) & MASK32), dim=-1).unsqueeze(1)  # [B, 1, 2]
    token = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    counter = torch.stack(
        torch.broadcast_tensors(
            (stream & MASK32).unsqueeze(1),
            (stream >> 32).unsqueeze(1),
            token.unsqueeze(0),
            torch.full((1, 1), COUPLING_WORD, dtype=torch.int64, device=seeds.device),
        ),
        dim=-1,
    )  # [B, V, 4]
    bits = philox4x32(counter, key)[..., 0] >> (32 - DRAW_BITS)
    u = (bits.to(torch.float64) + 0.5) / float(1 << 31)
    return -torch.log(-torch.log(u))


def draft_tokens(
    spec_sampling: str,
    probs: torch.Tensor,
    logprobs: torch.Tensor,
    seeds: Sequence[int],
    positions: Sequence[int] | torch.Tensor,
    greedy: torch.Tensor,
) -> torch.Tensor:
    """The draft's token per row from its processed distribution (probs, logprobs [n, V]) at ``positions`` [n]:
    "rejection" draws with the draft's own key, "deterministic" couples to the target's noise."""
    greedy = torch.as_tensor(greedy, dtype=torch.bool, device=probs.device)
    if spec_sampling == "deterministic":
        return coupled_tokens(logprobs, seeds, positions, greedy)
    if spec_sampling != "rejection":
        raise ValueError(f"spec_sampling must be one of {SPEC_SAMPLING}, got {spec_sampling!r}")
    keys = [(s + DRAFT_SEED_OFFSET) % (1 << 64) for s in seeds]
    bits = draw_bits(keys, torch.as_tensor(positions).flatten().tolist(), DrawCase.SAMPLE, probs.device)
    return torch.where(greedy, probs.argmax(-1), sample_from_bits(probs, bits))


def coupling_acceptance(p: torch.Tensor, q: torch.Tensor) -> float:
    """Probability that the Gumbel-coupled samples of p and q [V] agree: Σ_v 1 / Σ_w max(p_w/p_v, q_w/q_v)
    over the v both can take (the event is a Gumbel-max over c_w = max(log p_w − log p_v, log q_w − log q_v))."""
    total = 0.0
    for v in torch.nonzero((p > 0) & (q > 0)).flatten().tolist():
        ratio = torch.maximum(p.double() / float(p[v]), q.double() / float(q[v]))
        total += 1.0 / float(ratio.sum())
    return total


def rejection_acceptance(p: torch.Tensor, q: torch.Tensor) -> float:
    """Probability that rejection sampling accepts a draft from q under the target p: Σ_v min(p_v, q_v)."""
    return float(torch.minimum(p.double(), q.double()).sum())
