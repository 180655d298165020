"""How a request enters the engine: checked (a clear error, nothing queued), queued in the scheduler (n > 1: as a
prefix and its choices, choice_groups.py), given its block hashes for the prefix cache (now, or when its images
arrive), and kept as a ``LiveRequest`` with its seed, bans and history slot."""

from __future__ import annotations

import random
from collections.abc import Sequence

from services.engine.choice_groups import ChoiceGroups
from services.engine.engine_parts import EngineParts
from services.engine.live_request import LiveRequest
from services.engine.outputs import RequestOutput
from services.engine.prefix.request_hashes import image_spans
from services.engine.request_checks import check_priority, choice_id, validate_request
from services.engine.sampling_params import SamplingParams


class RequestAdmission:
    def __init__(
        self,
        parts: EngineParts,
        *,
        vocab_size: int,
        eos_token_id: int,
        image_token_id: int | None,
    ) -> None:
        self.parts = parts
        self.requests = parts.requests  # the engine's live requests (the same dict)
        self.structured = parts.structured
        self.hashes = parts.hashes  # the prefix cache's hash chains (None: caching off)
        self.histories = parts.histories
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.image_token_id = image_token_id  # the model's image placeholder (None: no vision tower)
        self._seeds = random.SystemRandom()  # a seedless request's seed
        # n > 1: the prefixes and choices of each request.
        self.choices = ChoiceGroups(
            parts,
            eos_token_id,
            self._live,
            lambda member, prompt, params, seed, priority, tenant, group, index: self._queue(
                member, prompt, params, seed, True, priority, tenant, group, index
            ),
        )

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raises ValueError naming what is wrong; nothing is queued."""
        validate_request(prompt_token_ids, params, self.vocab_size, self.parts.config)
        in_process = self.parts.worker.in_process
        if (params.has_penalties or params.min_p or params.prompt_logprobs is not None) and not in_process:
            raise ValueError(
                "presence_penalty, frequency_penalty, repetition_penalty, min_p and prompt_logprobs need the "
                "in-process worker: the remote worker's protocol does not carry them yet"
            )
        self.structured.check(params, in_process)

    def add(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        ready: bool,
        priority: int,
        tenant: str,
    ) -> None:
        """``Engine.add_request`` (its docstring says what each argument means)."""
        check_priority(priority)
        self.validate(prompt_token_ids, params)
        if params.n > 1 and not ready:
            raise ValueError("n > 1 with images is not served yet: a recomputed choice would need the prefix's images")
        if self.is_live(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt = list(prompt_token_ids)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        if params.n == 1:
            self._queue(request_id, prompt, params, seed, ready, priority, tenant)
            return
        groups = self.choices.members
        if len(prompt) == 1:
            groups[request_id] = [choice_id(request_id, i) for i in range(params.n)]
            for i, member in enumerate(groups[request_id]):
                self._queue(member, prompt, params, params.choice_seed(seed, i), ready, priority, tenant, request_id, i)
            return
        prefix = self.choices.add_prefix(request_id, prompt, params, seed, ready, priority, tenant)
        self._hash(prefix, prompt[:-1], params, ready)

    def provide_images(self, request_id: str, rows) -> None:
        """``Engine.provide_images``: the worker takes a waiting request's image embeddings, and the request becomes
        schedulable (once its grammar is ready too)."""
        req = self.requests.get(request_id)
        if req is None:
            raise ValueError(f"no live request {request_id!r}")
        worker = self.parts.worker
        set_images = getattr(worker, "set_images", None)
        if set_images is None:  # a worker that takes no images (in-process and worker.v1 workers both do)
            raise ValueError(f"{type(worker).__name__} takes no image embeddings")
        set_images(request_id, req.output.prompt_token_ids, rows)
        self._hash(request_id, req.output.prompt_token_ids, req.params, True, rows)
        if not self.structured.images_arrived(request_id):  # else schedulable once its grammar is ready too
            self.parts.scheduler.set_schedulable(request_id)

    def is_live(self, request_id: str) -> bool:
        """The request (or, n > 1, some choice of it) is queued or running."""
        return request_id in self.requests or request_id in self.choices.members

    def _queue(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        seed: int,
        ready: bool,
        priority: int,
        tenant: str,
        group: str | None = None,
        index: int = 0,
    ) -> None:
        """Queues one request of the scheduler's (a user's request, or one choice of it) and keeps it live."""
        self.parts.scheduler.add_request(
            request_id,
            prompt,
            max_tokens=params.resolved_max_tokens(len(prompt), self.parts.config.max_model_len),
            eos_token_id=self.eos_token_id,
            ignore_eos=params.ignore_eos,
            stop_token_ids=list(params.stop_token_ids),
            schedulable=self.structured.hold(request_id, params, ready),
            constrained=params.constraint is not None,
            priority=priority,
            tenant=tenant,
        )
        self._hash(request_id, prompt, params, ready)
        self.requests[request_id] = self._live(group or request_id, prompt, params, seed, group, index)

    def _hash(self, request_id: str, prompt: list[int], params: SamplingParams, ready: bool, rows=None) -> None:
        """Gives the scheduler the request's block hashes: now, or (images pending) when its images arrive.
        A request that asks for prompt logprobs computes every position, so it never resumes from the cache."""
        if self.hashes is None or not ready:
            return
        spans = (
            image_spans(prompt, self.image_token_id, rows)
            if rows is not None and self.image_token_id is not None
            else ()
        )
        self.hashes.admit(request_id, prompt, params.cache_salt, spans, lookup=params.prompt_logprobs is None)

    def _live(
        self, user_id: str, prompt: list[int], params: SamplingParams, seed: int, group: str | None, index: int
    ) -> LiveRequest:
        """The engine's bookkeeping of one request of the scheduler's: its output, seed, bans and history slot."""
        banned = tuple(sorted(set(params.banned_token_ids)))
        stops = set(params.stop_token_ids) | ({self.eos_token_id} if not params.ignore_eos else set())
        history = self.histories.take() if params.has_penalties else None
        return LiveRequest(
            RequestOutput(user_id, prompt, top_logprobs=[] if params.logprobs else None, index=index),
            params,
            seed,
            banned,
            tuple(sorted(set(banned) | {self.eos_token_id})),
            tuple(sorted(set(banned) | stops)),
            history,
            tuple(prompt) if history is not None else None,
            group,
        )
