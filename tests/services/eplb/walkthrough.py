"""The walkthrough's EPLB cases (5 or 4 experts, 2 GPUs, 3 slots per GPU, 2 steps), as loads[step][expert].

Its text lost the load tables; these loads reproduce every number it quotes.
"""

import numpy as np

# Pass 3 "A full EPLB run": e0 = (90, 90), e1 = (20, 40), e2 = (20, 40), e3 = (40, 20), e4 = (30, 10).
FULL_RUN = np.array([[90, 20, 20, 40, 30], [90, 40, 40, 20, 10]])

# Pass 3 "When greedy makes it worse".
GREEDY_WORSE = np.array([[92, 71, 52, 82, 61], [70, 23, 88, 79, 50]])

# Pass 4 "Complete the expert placement": e0 = (10, 20), e1 = (30, 40), e2 = (40, 20), e3 = (120, 100).
# Derived from its numbers: start-up GPU1 at 140 and 130, GPU0 at 60 and 50 (moe_lb 270 / 190); e3's two
# copies at 60 and 50; three copies at 40 and 33.3 with e2 at 40 (step 0) and e1 at 40 (step 1); stage B
# order e3, e3, e3, e1, e2, e0.
PASS4 = np.array([[10, 30, 40, 120], [20, 40, 20, 100]])
