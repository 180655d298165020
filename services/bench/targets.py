"""A benchmark's figures against its targets: which are past them, said in the summary a person reads.

A summary that gives one ratio (the p50's) can read as a pass while another figure of the same measure (its
p99, its maximum) is many times over the target; here every figure with a target is compared, and each one
past it is named with how far.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    name: str  # the figure, as the summary names it ("p99 schedule+update")
    value: float  # the measured figure
    limit: float  # the target
    at_most: bool = True  # True: the figure must be ≤ limit (a time); False: ≥ limit (an agreement)

    @property
    def met(self) -> bool:
        return self.value <= self.limit if self.at_most else self.value >= self.limit

    def describe(self) -> str:
        relation = "≤" if self.at_most else "≥"
        verdict = "met" if self.met else "PAST THE TARGET"
        ratio = f", {self.value / self.limit:.2f}× the target" if self.at_most and self.limit > 0 else ""
        return f"{self.name} {self.value:g} (target {relation} {self.limit:g}{ratio}): {verdict}"


def past(targets: list[Target]) -> list[str]:
    """The names of the figures past their targets, in order."""
    return [t.name for t in targets if not t.met]


def verdict_lines(targets: list[Target]) -> list[str]:
    """One line per figure, then the verdict: every target met, or the figures past theirs named."""
    missed = past(targets)
    tail = "every target met" if not missed else f"PAST THE TARGET: {', '.join(missed)}"
    return [t.describe() for t in targets] + [tail]
