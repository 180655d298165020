"""Requests with n > 1 choices: the prompt but its last token is prefilled once as a hidden *prefix* request whose
one output is forced to the prompt's last token; the scheduler then forks it into the n choices, which share its
full blocks (each gets a copy of the partial block and of the state slot), and the prefix ends. Choice i computes
the prompt's last token itself and draws with ``SamplingParams.choice_seed(seed, i)``.

With prefix caching the prefix is hashed like any prompt: it resumes from the cache and leaves its blocks and
snapshots there, and the choices inherit its hash chain. The fork needs no step of the prefix in flight, so a step
that samples a prefix's row is read back at once under async scheduling (``samples_a_prefix``)."""

from __future__ import annotations

from collections.abc import Callable

from scheduler_rs import StepPlan
from services.engine.engine_parts import EngineParts
from services.engine.finish_reason import FinishReason
from services.engine.live_request import LiveRequest
from services.engine.outputs import RequestOutput
from services.engine.request_checks import choice_id
from services.engine.sampling_params import SamplingParams

# (user request id, prompt, params, seed, group, index) → a choice's LiveRequest (the engine's bookkeeping).
MakeChoice = Callable[[str, list[int], SamplingParams, int, str, int], LiveRequest]
# (engine id, prompt, params, seed, priority, tenant, group, index): queues a choice as a request of its own.
AddChoice = Callable[[str, list[int], SamplingParams, int, int, str, str, int], None]

_NO_ROOM = "not enough free blocks or state slots"  # the scheduler's fork refusal when its pools are short


class ChoiceGroups:
    """The engine's n > 1 requests: per user request id, the engine's ids of its choices (or of its prefix, until
    the fork)."""

    def __init__(
        self,
        parts: EngineParts,
        eos_token_id: int,
        make_choice: MakeChoice,
        add_choice: AddChoice,
    ) -> None:
        self.parts = parts
        self.requests = parts.requests  # the engine's live requests (the same dict)
        self.eos_token_id = eos_token_id
        self.structured = parts.structured
        self.hashes = parts.hashes  # the prefix cache's hash chains (None: caching off)
        self.make_choice = make_choice
        self.add_choice = add_choice
        self.members: dict[str, list[str]] = {}
        self._queued_as: dict[str, tuple[int, str]] = {}  # per group with a prefix: its (priority, tenant)

    def add_prefix(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        seed: int,
        ready: bool,
        priority: int,
        tenant: str,
    ) -> str:
        """Queues the group's prefix (``prompt`` but its last token); returns its engine id. The caller hashes it."""
        prefix = choice_id(request_id, None)
        self.parts.scheduler.add_request(
            prefix,
            prompt[:-1],
            max_tokens=2,
            eos_token_id=self.eos_token_id,
            ignore_eos=True,
            schedulable=self.structured.hold(prefix, params, ready),
            constrained=params.constraint is not None,
            priority=priority,
            tenant=tenant,
        )
        self.requests[prefix] = LiveRequest(
            RequestOutput(request_id, prompt), params, seed, (), group=request_id, is_prefix=True
        )
        self.members[request_id] = [prefix]
        self._queued_as[request_id] = (priority, tenant)
        return prefix

    def samples_a_prefix(self, plan: StepPlan) -> bool:
        """Whether the step samples some prefix's row (its fork follows at the step's update)."""
        for request_id, n in zip(plan.request_ids, plan.num_sample_rows.tolist()):
            req = self.requests.get(request_id)
            if n and req is not None and req.is_prefix:
                return True
        return False

    def fork(self, prefix: str) -> None:
        """The prefix has computed the prompt but its last token (and taken that token as its output): its
        choices fork from it, each with its own seed stream, and the prefix ends (its blocks stay held by them).
        A choice the pools have no room to fork (a state slot, its partial block) is queued as a request of its
        own instead, with the full prompt: it waits for room like any request (resuming from the prefix's
        snapshot where the prefix cache holds it) and gives the same tokens."""
        req = self.requests.pop(prefix)
        user_id, params, prompt = req.group, req.params, req.output.prompt_token_ids
        assert user_id is not None
        priority, tenant = self._queued_as.pop(user_id)
        members = []
        for i in range(params.n):
            member = choice_id(user_id, i)
            # The fork counts the prompt's last token as an output already: one more than the choice's own.
            own = params.resolved_max_tokens(len(prompt), self.parts.config.max_model_len)
            try:
                self.parts.scheduler.fork(
                    prefix,
                    member,
                    max_tokens=own + 1,
                    eos_token_id=self.eos_token_id,
                    ignore_eos=params.ignore_eos,
                    stop_token_ids=list(params.stop_token_ids),
                )
            except RuntimeError as err:
                if _NO_ROOM not in str(err):
                    raise
                seed = params.choice_seed(req.seed, i)
                self.add_choice(member, list(prompt), params, seed, priority, tenant, user_id, i)
                self._copy_prompt_logprobs(req, self.requests[member])
                members.append(member)
                continue
            if self.hashes is not None:
                self.hashes.fork(prefix, member)
            choice = self.make_choice(user_id, prompt, params, params.choice_seed(req.seed, i), user_id, i)
            if params.constraint is not None:  # each choice its own matcher; the prefix waited for the compile
                choice.matcher = self.structured.matcher(params.constraint)
            self._copy_prompt_logprobs(req, choice)
            self.requests[member] = choice
            members.append(member)
        self.parts.scheduler.abort(prefix)
        self._forget_prefix(prefix)
        self.members[user_id] = members

    @staticmethod
    def _copy_prompt_logprobs(prefix: LiveRequest, choice: LiveRequest) -> None:
        choice.output.prompt_logprobs = prefix.output.prompt_logprobs  # the prefix computed them
        choice.output.prompt_top_logprobs = prefix.output.prompt_top_logprobs
        choice.output.prompt_ranks = prefix.output.prompt_ranks

    def end_prefix(self, prefix: str, reason: FinishReason) -> list[RequestOutput]:
        """A prefix that ended before its fork: each of its n choices ends, empty, for the same reason."""
        req = self.requests.pop(prefix)
        self._forget_prefix(prefix)
        assert req.group is not None
        del self.members[req.group]
        self._queued_as.pop(req.group, None)
        prompt = req.output.prompt_token_ids
        return [RequestOutput(req.group, prompt, finish_reason=reason, index=i) for i in range(req.params.n)]

    def finish(self, request_id: str, req: LiveRequest, reason: FinishReason) -> RequestOutput | None:
        """A member ended (popped from the live requests already): its output stands for the request when it is
        the prefix (choice 0, aborted before the fork); None otherwise (the member leaves its group)."""
        assert req.group is not None
        if req.is_prefix:
            self._forget_prefix(request_id)
            del self.members[req.group]
            self._queued_as.pop(req.group, None)
            return RequestOutput(req.group, req.output.prompt_token_ids, finish_reason=reason, index=0)
        members = self.members[req.group]
        members.remove(request_id)
        if not members:
            del self.members[req.group]
        return None

    def clear(self) -> list[str]:
        """Forgets every group (their members have left the live requests); returns their user request ids."""
        user_ids = list(self.members)
        self.members.clear()
        self._queued_as.clear()
        return user_ids

    def _forget_prefix(self, prefix: str) -> None:
        self.parts.worker.release(prefix)
        if self.hashes is not None:
            self.hashes.drop(prefix)
