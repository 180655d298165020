"""Why a request ended: one enum from the Rust scheduler to the APIs."""

from __future__ import annotations

from enum import StrEnum


class FinishReason(StrEnum):
    """The scheduler's reasons (`scheduler_rs.FinishReason`, same members and values), as strings: a member
    is its value in JSON, OpenAI responses and metric labels. `tests/services/proto/test_generated.py`
    checks the members against Rust's and shinkai.v1's."""

    STOP = "stop"  # the end token (unless ignored) or a stop token id
    LENGTH = "length"  # max_tokens or the model's maximum length
    ABORT = "abort"  # aborted by the client or the server
    PREEMPTED = "preempted"  # stopped to free blocks for others (preemption mode "stop")
    ERROR = "error"  # the request cannot go on, or a step failed

    @classmethod
    def of(cls, reason) -> FinishReason:
        """The member for a `scheduler_rs.FinishReason`."""
        return cls(reason.value)
