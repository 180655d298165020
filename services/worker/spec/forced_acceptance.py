"""The benchmark switch of speculative decoding: every draft is accepted independently with probability a.

Random weights make real acceptance meaningless (a random draft almost never matches), so the speed of
speculation at a given acceptance rate is measured by forcing it, as DeepInfer's forced load balance
does for experts. The target still verifies every draft row (the real cost); only the verdict is
replaced: a request that verifies k drafts accepts the leading run of successes of k independent
Bernoulli(a) draws, then emits the target's greedy token at the row after them. Tokens are therefore not
the model's; this is for timing only (temperature 0 only, so the token after the drafts is defined
without a draw).

The draft's confidences are replaced by the true chances a^(j+1), so varlen verification ranks drafts
by what will happen.
"""

from __future__ import annotations

import random


class ForcedAcceptance:
    def __init__(self, probability: float, seed: int = 0) -> None:
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"the forced acceptance probability must be in [0, 1], got {probability}")
        self.probability = probability
        self._random = random.Random(seed)

    def num_accepted(self, num_drafts: int) -> int:
        """Leading successes of ``num_drafts`` independent Bernoulli(a) draws."""
        for j in range(num_drafts):
            if self._random.random() >= self.probability:
                return j
        return num_drafts

    def confidences(self, num_drafts: int) -> list[float]:
        """Chance that draft j passes with every draft before it: a^(j + 1)."""
        return [self.probability ** (j + 1) for j in range(num_drafts)]
