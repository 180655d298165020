"""Admission per tenant: a limit on each tenant's live requests and on its queued prompt tokens, checked by the
user-facing front end before a request reaches an engine (docs/operations.md, "Fairness across clients").

A tenant is who a request is served for: the API key's owner (services/gateway/auth.py) when keys are on,
else the client's network address. The same name travels to the engine, whose waiting queue is fair across
tenants (docs/architecture.md, "The waiting queue's order"); admission keeps one tenant from filling the queue
in the first place.

Invariants:
- A request is counted from its admission until its last choice ends (final or abort): `Ticket.done`, once
  per choice. Its prompt tokens count as queued until its first token arrives (`Ticket.started`).
- A tenant over a limit gets 429 / RESOURCE_EXHAUSTED with ``retry-after`` (`TenantOverLimit`, turned into
  OpenAI's error shape by the front end), with nothing queued. A prompt is
  refused for its tokens only when the tenant already has queued ones: a tenant with nothing queued may
  always send one prompt, however long (the context length bounds it).
- A tenant's account goes when its last request does, so the accounts are as many as the live tenants.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

DEFAULT_MAX_REQUESTS_PER_TENANT = 256
"""A quarter of the engine's default queue (1024 unfinished requests): four tenants at their limit fit."""
DEFAULT_MAX_QUEUED_TOKENS_PER_TENANT = 262_144
"""64 prompts of 4,096 tokens waiting for their first token: one user's burst passes, a flood is held back."""
RETRY_AFTER_S = 1
"""The ``retry-after`` of a refusal: a tenant's requests end or start within a second under load."""


@dataclass(frozen=True)
class AdmissionLimits:
    max_requests: int = DEFAULT_MAX_REQUESTS_PER_TENANT  # live requests per tenant
    max_queued_tokens: int = DEFAULT_MAX_QUEUED_TOKENS_PER_TENANT  # prompt tokens per tenant before first tokens

    def __post_init__(self) -> None:
        for name in ("max_requests", "max_queued_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"the per-tenant {name} limit must be a positive integer, got {value!r}")


class TenantOverLimit(Exception):
    """A tenant is at one of its limits; retry after `retry_after_s`."""

    def __init__(self, why: str, retry_after_s: int = RETRY_AFTER_S) -> None:
        super().__init__(f"{why}; retry later")
        self.retry_after_s = retry_after_s


@dataclass
class _Account:
    num_requests: int = 0  # live requests
    num_queued_tokens: int = 0  # prompt tokens of the live requests that have no first token yet


class Ticket:
    """One admitted request's place in its tenant's account; every method is idempotent per choice."""

    def __init__(self, admission: Admission, tenant: str, num_prompt_tokens: int, num_choices: int) -> None:
        self.admission = admission
        self.tenant = tenant
        self.num_queued_tokens = num_prompt_tokens  # counted as queued until the first token
        self.num_choices_left = num_choices

    def started(self) -> None:
        """The request's first token arrived: its prompt no longer counts as queued."""
        if self.num_queued_tokens:
            self.admission.release_tokens(self.tenant, self.num_queued_tokens)
            self.num_queued_tokens = 0

    def done(self) -> None:
        """One choice ended (final or abort); the last one ends the request's count."""
        if self.num_choices_left == 0:
            return
        self.num_choices_left -= 1
        if self.num_choices_left == 0:
            self.started()
            self.admission.release_request(self.tenant)

    def cancel(self) -> None:
        """The request was never queued (refused by the engine, or its caller went away first)."""
        while self.num_choices_left:
            self.done()


class Admission:
    def __init__(self, limits: AdmissionLimits = AdmissionLimits()) -> None:
        self.limits = limits
        self.accounts: dict[str, _Account] = {}  # live tenants only

    def admit(self, tenant: str, num_prompt_tokens: int, num_choices: int = 1) -> Ticket:
        """Counts a request of ``tenant``, or raises TenantOverLimit (with nothing counted)."""
        account = self.accounts.get(tenant) or _Account()
        if account.num_requests >= self.limits.max_requests:
            raise TenantOverLimit(
                f"tenant {tenant!r} (an API key's owner or a client address) has {account.num_requests} live requests; "
                f"the limit is {self.limits.max_requests}"
            )
        queued = account.num_queued_tokens
        if queued and queued + num_prompt_tokens > self.limits.max_queued_tokens:
            raise TenantOverLimit(
                f"tenant {tenant!r} has {queued} prompt tokens queued; {num_prompt_tokens} more would pass the limit "
                f"of {self.limits.max_queued_tokens}"
            )
        account.num_requests += 1
        account.num_queued_tokens += num_prompt_tokens
        self.accounts[tenant] = account
        return Ticket(self, tenant, num_prompt_tokens, num_choices)

    def release_tokens(self, tenant: str, num_tokens: int) -> None:
        self.accounts[tenant].num_queued_tokens -= num_tokens

    def release_request(self, tenant: str) -> None:
        account = self.accounts[tenant]
        account.num_requests -= 1
        if account.num_requests == 0:
            del self.accounts[tenant]


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def add_admission_arguments(parser: argparse.ArgumentParser) -> None:
    """``--max-requests-per-tenant`` and ``--max-queued-tokens-per-tenant`` (of ``serve``, ``up`` and the
    gateway process). A tenant is an API key, or a client's network address when the API is open."""
    parser.add_argument(
        "--max-requests-per-tenant",
        type=_positive,
        default=DEFAULT_MAX_REQUESTS_PER_TENANT,
        help="live requests one API key (or client address, when open) may have; then 429 (default %(default)d)",
    )
    parser.add_argument(
        "--max-queued-tokens-per-tenant",
        type=_positive,
        default=DEFAULT_MAX_QUEUED_TOKENS_PER_TENANT,
        help="prompt tokens one API key (or client address) may have waiting for their first token; then 429 "
        "(default %(default)d)",
    )


def admission_limits(args: argparse.Namespace) -> AdmissionLimits:
    """The limits the flags of ``add_admission_arguments`` give."""
    return AdmissionLimits(
        max_requests=args.max_requests_per_tenant, max_queued_tokens=args.max_queued_tokens_per_tenant
    )


def admission_argv(limits: AdmissionLimits) -> list[str]:
    """The flags that give these limits to a gateway process (none for the defaults)."""
    if limits == AdmissionLimits():
        return []
    return [
        "--max-requests-per-tenant",
        str(limits.max_requests),
        "--max-queued-tokens-per-tenant",
        str(limits.max_queued_tokens),
    ]
