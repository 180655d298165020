"""The served step loop of a data-parallel rank: `EngineService`'s step thread when its engine has a vote.

Every rank steps while any rank has work (the idle ones run placeholder steps); while none has, each waits
for a request or its idle wait between votes, and the loop ends when every rank is stopping. Every rank
makes the same votes in the same order. A work-left vote that finds no rank with work marks the group idle
in every rank's scheduler, so the first step after it votes at an ANY point: a lone request prefills at once.

Any failure in a step or vote breaks the group for good: the service is told why (``ServiceSteps.lose``),
this rank leaves the group so its peers' next collective fails at once instead of at ``rank_timeout_s``,
and every request that still arrives ends with "error" until the service stops.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from services.engine.engine import Engine
from services.engine.parallel.vote import HostVote
from services.worker.parallel.groups import close_rank_groups

log = logging.getLogger("shinkai.engine")


@dataclass(frozen=True)
class ServiceSteps:
    """What the loop drives in its service: callables the service hands over, each run on the step thread."""

    apply_commands: Callable[[], None]  # applies the queued adds, images and aborts (between steps only)
    step: Callable[[], None]  # one engine step, its outputs delivered; raises when the step fails
    publish: Callable[[], None]  # the engine's stats become the readers' snapshot
    wait: Callable[[], None]  # returns when a command arrives or after the idle wait
    stopping: Callable[[], bool]  # the service is stopping and no command is queued
    lose: Callable[[str], None]  # the group is lost: record why and end every live request with "error"
    end_all: Callable[[str], None]  # ends every request the engine holds with "error", giving back its blocks


class LockstepLoop:
    def __init__(self, engine: Engine, vote: HostVote, steps: ServiceSteps) -> None:
        self.engine = engine
        self.vote = vote  # the group's host vote (the engine's scheduler holds the same one)
        self.steps = steps

    def run(self) -> None:
        """Steps in lockstep until every rank is stopping; on a failure, loses the group and refuses what
        still arrives until the service stops."""
        steps, vote = self.steps, self.vote
        try:
            while True:
                steps.apply_commands()
                stopping = steps.stopping()
                busy = vote.any_rank(self.engine.has_unfinished())
                if busy:
                    steps.step()
                steps.publish()
                if not busy:
                    self.engine.scheduler.mark_group_idle()
                    if vote(stopping, "all"):
                        return
                    steps.wait()
        except Exception as err:  # noqa: BLE001 - a lost peer, a failed collective or step: the group is over
            log.exception("the data-parallel group is lost; ending every request with 'error'")
            self._lose(f"{type(err).__name__}: {err}".splitlines()[0][:300])
        while not steps.stopping():  # refuse whatever still arrives
            steps.apply_commands()
            steps.end_all("the data-parallel group is lost")
            steps.wait()

    def _lose(self, why: str) -> None:
        self.steps.lose(why)
        try:
            close_rank_groups()  # the peers' next collective fails at once instead of at rank_timeout_s
        except Exception:  # noqa: BLE001 - already broken; leaving is best effort
            log.warning("leaving the broken data-parallel group failed", exc_info=True)
        self.steps.publish()
