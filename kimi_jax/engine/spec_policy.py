"""When a speculative verify step pays for itself.

A verify step runs every active row over ``k + 1`` positions, so it costs more than the one-token step: on the H200
with kimi-k3.1-reduced (bench/spec_decode.py, bench/RESULTS.md) 1.6x at one sequence (five tokens route to more
experts than one) and 1.2x at 32.  Drafts that are rejected make it pure loss (0.62x / 0.84x throughput when every
draft fails).  So before each step the engine asks whether the expected output of a verify step beats the one-token
step's per unit of time:

    (n + sum over drafting rows of E[accepted]) / n  >  cost      (n = active rows, cost = t_verify / t_step)

with ``E[accepted] = a + a^2 + ... + a^v`` for ``v`` drafts and a per-sequence acceptance rate ``a`` (the chance
that one more draft is kept, tracked as a running mean of kept / drafted over the sequence's verify steps, starting
at ``prior``).  A sequence whose drafts keep failing stops causing verify steps; its rate drifts back towards the
prior while it decodes one token at a time, so it is tried again later (text can turn repetitive).  ``cost`` is
measured by the engine unless given: the medians of both programs' recent wall times, kept per batch occupancy
(active rows rounded up to a power of two: a verify step of 32 rows is not compared with a one-token step of 1);
until both have been timed at an occupancy it is ``initial_cost``, and until ``min_samples`` verify steps have been
timed there it is at most ``initial_cost``.  Medians and that cap because one slow step must not switch
speculation off for good: on the H200 (session 26) a running mean took the first verify step of 32 rows -- right
after the batch's prefills, whose time a step's wall clock can absorb -- at 3.2x a step against the 1.2x the
throughput shows, and a policy that stops verifying never times another verify step to correct it.

Which steps verify never changes what is sampled -- both programs draw from the target distribution -- only how
fast it comes out.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Optional


class SpecPolicy:
    def __init__(self, adaptive: bool = True, cost: Optional[float] = None, *, prior: float = 0.5,
                 initial_cost: float = 1.5, rate_weight: float = 0.3, recovery: float = 1 / 16,
                 window: int = 16, min_samples: int = 3):
        """``adaptive=False``: verify whenever some row has drafts.  ``cost``: a fixed verify / step time ratio
        (None: measured).  ``rate_weight``: weight of the newest verify step in a sequence's acceptance rate;
        ``recovery``: fraction of the way back to ``prior`` a rate moves per step without drafts verified;
        ``window``: recent wall times kept per (occupancy, program); ``min_samples``: verify steps timed at an
        occupancy before its measured ratio may exceed ``initial_cost``."""
        if cost is not None and not cost > 0:
            raise ValueError(f"speculative cost ratio must be positive, got {cost}")
        self.adaptive, self.fixed_cost = bool(adaptive), cost
        self.prior, self.initial_cost = float(prior), float(initial_cost)
        self.rate_weight, self.recovery = rate_weight, recovery
        self.window, self.min_samples = int(window), int(min_samples)
        self.rates: dict = {}
        self._times: dict = {}  # (occupancy bucket, verify?) -> deque of the step's recent wall times

    @staticmethod
    def _bucket(active_rows: int) -> int:
        return 1 << max(int(active_rows) - 1, 0).bit_length()

    # ---------------------------------------------------------------------------------------------- the decision
    def cost(self, active_rows: int) -> float:
        """Verify step time over one-token step time (>= 1) at this many active rows."""
        if self.fixed_cost is not None:
            return max(1.0, self.fixed_cost)
        b = self._bucket(active_rows)
        steps, verifies = self._times.get((b, False)), self._times.get((b, True))
        if not steps or not verifies:
            return self.initial_cost
        ratio = max(1.0, statistics.median(verifies) / statistics.median(steps))
        return ratio if len(verifies) >= self.min_samples else min(ratio, self.initial_cost)

    def rate(self, seq_id) -> float:
        return self.rates.get(seq_id, self.prior)

    def expected_accepted(self, seq_id, drafts: int) -> float:
        a = self.rate(seq_id)
        return sum(a ** i for i in range(1, drafts + 1))

    def worth_verifying(self, drafts: dict, active_rows: int, sure: Optional[dict] = None) -> bool:
        """``drafts``: {sequence id: number of drafts}; ``active_rows``: rows the step advances; ``sure``:
        {sequence id: how many of its drafts lead the list and are certain to be kept} (a guide forces them)."""
        if not drafts:
            return False
        if not self.adaptive:
            return True
        sure = sure or {}
        gain = sum(sure.get(s, 0) + self.expected_accepted(s, v - sure.get(s, 0)) for s, v in drafts.items())
        n = max(active_rows, 1)
        return (n + gain) > self.cost(n) * n

    # ---------------------------------------------------------------------------------------------- what happened
    def observe(self, seq_id, drafted: int, accepted: int) -> None:
        """A verify step kept ``accepted`` of the sequence's ``drafted`` drafts (certain ones left out)."""
        if drafted > 0:
            a = self.rate(seq_id)
            self.rates[seq_id] = a + self.rate_weight * (accepted / drafted - a)

    def idle(self, seq_id) -> None:
        """A step in which the sequence had no drafts verified: its rate drifts back towards the prior."""
        a = self.rates.get(seq_id)
        if a is not None:
            self.rates[seq_id] = a + self.recovery * (self.prior - a)

    def timed(self, verify: bool, seconds: float, active_rows: int) -> None:
        """Wall time of one step over ``active_rows`` rows (dispatch to results on the host)."""
        self._times.setdefault((self._bucket(active_rows), bool(verify)), deque(maxlen=self.window)).append(seconds)

    def forget(self, seq_id) -> None:
        self.rates.pop(seq_id, None)
