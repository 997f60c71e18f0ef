"""When a speculative verify step pays for itself.

A verify step runs every active row over ``k + 1`` positions, so it costs more than the one-token step: on the H200
with kimi-k3.1-reduced (`bench/spec_decode.py`) 1.8x at one sequence (five tokens route
to more experts than one) and 2.0x at 32.  Drafts that are rejected make it pure loss (0.62x / 0.83x throughput when
every draft fails).  So before each step the engine asks whether the expected output of a verify step beats the one-token
step's per unit of time:

    (n + sum over drafting rows of E[accepted]) / n  >  cost      (n = active rows, cost = t_verify / t_step)

with ``E[accepted] = a + a^2 + ... + a^v`` for ``v`` drafts and a per-sequence acceptance rate ``a``: the chance
that the next draft is kept, given the ones before it were.  Under that model a verify step is a run of kept drafts
ended by one rejection (or by running out of drafts), so ``a`` is estimated from counts as

    a = (kept + prior * prior_weight) / (kept + rejections + prior_weight)

over the sequence's verify steps, older steps discounted by ``memory`` per step.  (An earlier estimate, a running
mean of kept / drafted moved 0.3 of the way per step from the prior, was both slow -- three steps that kept all 4
drafts left it at 0.83 -- and biased low: under the prefix model kept / drafted is E / v, not a; at a = 0.9 and 4
drafts it expected 2.2 kept where 3.1 are.)  A sequence whose drafts keep failing stops causing verify
steps; while it decodes one token at a time its counts shrink by ``recovery`` per step, so its rate drifts back
towards the prior and it is tried again later (text can turn repetitive).  ``cost`` is
measured by the engine unless given: the medians of both kinds of steps' recent wall times (each from its inputs
to its tokens handed out, timed after the device has finished the work queued before it), kept per batch occupancy
(active rows rounded up to a power of two: a verify step of 32 rows is not compared with a one-token step of 1);
until both have been timed at an occupancy it is ``initial_cost``, and until ``min_samples`` verify steps have been
timed there it is at most ``initial_cost``.  Medians and that cap because one slow step must not switch
speculation off for good: on the H200 a running mean took the first verify step of 32 rows -- right
after the batch's prefills, whose time a step's wall clock can absorb -- at 3.2x a step against the 1.2x the
throughput shows, and a policy that stops verifying never times another verify step to correct it.  The medians
were not enough (4.3-4.4x at 32 rows, the policy stopped verifying drafts that were all kept): prefill
chunks are dispatched without being read back, so the next step's wall clock waited for them.  Timed after them,
a verify step of 32 rows is 2.0x a one-token step, and the adaptive policy matches "always" on
repetitive text (1.12x) while keeping 0.95x where every draft fails ("always": 0.83x).

Which steps verify never changes what is sampled -- both programs draw from the target distribution -- only how
fast it comes out.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Optional


class SpecPolicy:
    def __init__(self, adaptive: bool = True, cost: Optional[float] = None, *, prior: float = 0.5,
                 initial_cost: float = 1.5, prior_weight: float = 1.0, memory: float = 0.85,
                 recovery: float = 1 / 16, window: int = 16, min_samples: int = 3):
        """``adaptive=False``: verify whenever some row has drafts.  ``cost``: a fixed verify / step time ratio
        (None: measured).  ``prior`` / ``prior_weight``: the acceptance rate before any verify step and how many
        drafts' worth of evidence it counts for; ``memory``: factor on a sequence's past counts at each new verify
        step (0.85: weight 1/(1 - 0.85) ≈ 7 steps); ``recovery``: fraction of its counts a sequence loses per step
        without drafts verified (its rate moves that way back towards the prior);
        ``window``: recent wall times kept per (occupancy, program); ``min_samples``: verify steps timed at an
        occupancy before its measured ratio may exceed ``initial_cost``."""
        if cost is not None and not cost > 0:
            raise ValueError(f"speculative cost ratio must be positive, got {cost}")
        self.adaptive, self.fixed_cost = bool(adaptive), cost
        if not 0.0 <= prior <= 1.0 or not prior_weight > 0 or not 0.0 <= memory <= 1.0 or not 0.0 <= recovery <= 1.0:
            raise ValueError(f"speculative policy needs 0 <= prior, memory, recovery <= 1 and prior_weight > 0, got "
                             f"{prior}, {memory}, {recovery}, {prior_weight}")
        self.prior, self.initial_cost = float(prior), float(initial_cost)
        self.prior_weight, self.memory, self.recovery = float(prior_weight), float(memory), float(recovery)
        self.window, self.min_samples = int(window), int(min_samples)
        self.counts: dict = {}  # sequence id -> [kept drafts, rejections], discounted
        self._times: dict = {}  # (occupancy bucket, verify?) -> deque of the step's recent wall times

    @property
    def measures(self) -> bool:
        """Whether the decision uses measured step times (adaptive, cost not fixed): the engine then makes sure
        each timed step's wall time is its own (no earlier work still queued on the device)."""
        return self.adaptive and self.fixed_cost is None

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
        """The sequence's estimated chance that a draft is kept, given the drafts before it were."""
        kept, rejected = self.counts.get(seq_id, (0.0, 0.0))
        return (kept + self.prior * self.prior_weight) / (kept + rejected + self.prior_weight)

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
        """A verify step kept ``accepted`` of the sequence's ``drafted`` drafts (certain ones left out): ``accepted``
        kept drafts, then one rejection unless all were kept."""
        if drafted > 0:
            kept, rejected = self.counts.get(seq_id, (0.0, 0.0))
            accepted = min(max(int(accepted), 0), int(drafted))
            self.counts[seq_id] = (self.memory * kept + accepted,
                                   self.memory * rejected + (1.0 if accepted < drafted else 0.0))

    def idle(self, seq_id) -> None:
        """A step in which the sequence had no drafts verified: its counts shrink, so its rate drifts back towards
        the prior."""
        counts = self.counts.get(seq_id)
        if counts is not None:
            keep = 1.0 - self.recovery
            self.counts[seq_id] = (keep * counts[0], keep * counts[1])

    def timed(self, verify: bool, seconds: float, active_rows: int) -> None:
        """Wall time of one step over ``active_rows`` rows: from its inputs to its tokens handed out (what the
        engine spends per step, not just the device's part)."""
        self._times.setdefault((self._bucket(active_rows), bool(verify)), deque(maxlen=self.window)).append(seconds)

    def forget(self, seq_id) -> None:
        self.counts.pop(seq_id, None)
