"""What the engine keeps per live request besides the scheduler's state, and the sampling rows it derives."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.engine.config import EngineConfig
from services.engine.outputs import RequestOutput
from services.engine.sampling_params import SamplingParams
from services.worker.sampling.sampler import SamplingRow


@dataclass
class LiveRequest:
    # What the caller gets: the tokens so far, logprobs, the finish.
    output: RequestOutput
    params: SamplingParams
    # The draw's seed: the params' (choice i's stream where n > 1), or one drawn for a seedless request.
    seed: int
    # The banned ids, sorted; with the end token while first_n_no_eos applies.
    banned: tuple[int, ...]
    banned_with_eos: tuple[int, ...] = field(default=())
    # The end and stop tokens with the bans: banned while min_tokens applies.
    banned_with_stops: tuple[int, ...] = field(default=())
    # The request's slot in the worker's token counts (the penalties), None without penalties.
    history: int | None = None
    # The prompt to open ``history`` with, until the request's first sampled row has carried it.
    history_prompt: tuple[int, ...] | None = None
    # n > 1: the user's request id this choice belongs to (None: the request is its own).
    group: str | None = None
    # A group's prefix: the prompt but its last token, prefilled once, then forked into the choices.
    is_prefix: bool = False
    # Structured output: the request's xgrammar GrammarMatcher, set once its grammar has compiled (None: none).
    matcher: object | None = None

    def sampling_rows(self, n: int, seqlen_k: int, num_out: int, config: EngineConfig) -> list[SamplingRow]:
        """The request's ``n`` sampled rows of a step whose last row is at ``seqlen_k`` − 1, with ``num_out``
        output tokens before them. The first row carries ``history_prompt`` (then cleared: the worker opens the
        slot with it)."""
        if self.is_prefix:  # its one row outputs the prompt's last token
            prompt = self.output.prompt_token_ids
            return [SamplingRow(0.0, -1, 1.0, self.seed, seqlen_k, None, (), 0, prompt[-1])]
        p = self.params
        rows = []
        for j in range(n):
            if num_out + j < p.min_tokens:
                banned = self.banned_with_stops
            elif num_out + j < config.first_n_no_eos:
                banned = self.banned_with_eos
            else:
                banned = self.banned
            rows.append(
                SamplingRow(
                    temperature=p.temperature,
                    top_k=p.top_k if p.top_k > 0 else -1,
                    top_p=p.top_p,
                    seed=self.seed,
                    position=seqlen_k - n + 1 + j,
                    forced_top_k=config.forced_top_k,
                    banned_token_ids=banned,
                    num_logprobs=p.logprobs or 0,
                    forced_token_id=p.forced_token_ids[num_out + j] if num_out + j < len(p.forced_token_ids) else None,
                    logit_bias=p.logit_bias,
                    presence_penalty=p.presence_penalty,
                    frequency_penalty=p.frequency_penalty,
                    repetition_penalty=p.repetition_penalty,
                    min_p=p.min_p,
                    history=self.history,
                    history_prompt=self.history_prompt,
                )
            )
            self.history_prompt = None  # opened by the worker with this row
        return rows
