"""Prompt logprobs (vLLM's ``prompt_logprobs``): the raw model's log-softmax at prompt rows, read at the next prompt
token, plus the top-n per row. The engine names the rows (``PromptRows``); the worker has the runner return every
row's logits for such a step and computes them on the device, read back with the step's result."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.device import upload


@dataclass(frozen=True)
class PromptRows:
    """Which rows of a step are prompt positions whose logprobs a request asked for."""

    rows: list[int]  # plan row indices (positions p < prompt length − 1), in plan order
    targets: list[int]  # per row: the prompt token at p + 1
    num_top: int  # top logprobs per row (the largest any of the step's requests asked for, 0 to 20)


@dataclass
class PromptLogprobs:
    """Per ``PromptRows`` row: the target's logprob and the top-n (id, logprob), on the runner's device."""

    logprobs: torch.Tensor  # fp32 [R]
    top_token_ids: torch.Tensor  # int64 [R, num_top]: by logprob, descending, ties to the lower id
    top_logprobs: torch.Tensor  # fp32 [R, num_top]
    ranks: torch.Tensor  # int64 [R]: vLLM's rank of the target, the number of tokens whose logprob is >= its own


def prompt_logprobs(logits: torch.Tensor, wanted: PromptRows) -> PromptLogprobs:
    """From every row's logits [N, V] (plan row order): the log-softmax (fp32) at ``wanted``'s rows."""
    device = logits.device
    rows = upload(torch.tensor(wanted.rows, dtype=torch.int64), device)
    targets = upload(torch.tensor(wanted.targets, dtype=torch.int64), device)
    lp = torch.log_softmax(logits[rows].float(), dim=-1)
    chosen = lp.gather(1, targets.unsqueeze(-1)).squeeze(-1)
    if wanted.num_top:
        order = torch.sort(lp, dim=-1, descending=True, stable=True).indices[:, : wanted.num_top].contiguous()
    else:
        order = torch.empty(len(wanted.rows), 0, dtype=torch.int64, device=device)
    ranks = (lp >= chosen.unsqueeze(-1)).sum(dim=-1)
    return PromptLogprobs(chosen, order, lp.gather(1, order), ranks)
