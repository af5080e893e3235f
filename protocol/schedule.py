"""Learning-rate schedules across a job's rounds: a protocol rule (IPIP-0006 §2.5; spec keys
``training.schedule``, ``training.warmup_rounds``).

Rules of this file:
- A round's inner learning rate is a pure function of the job's terms and the round number, so
  every worker of a round trains with the same rate and a verifier replays with it: nothing about
  the rate is the worker's to choose or to report.
- Within a round the rate is constant: a round is one lease's training, and its replayed segments
  must not depend on where a step falls in the job.
- ``constant``: the spec's rate in every round. ``cosine``: the spec's rate at round 1 (after
  warm-up), decaying by half a cosine to ``min_ratio`` times it at the last round. Warm-up rounds
  ramp linearly: round r <= W trains at r/(W+1) of the rate.
This module imports no torch.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "cosine")
MIN_RATIO = 0.1


def round_learning_rate(base: float, rnd: int, rounds: int, *, schedule: str = "constant",
                        warmup_rounds: int = 0, min_ratio: float = MIN_RATIO) -> float:
    """The inner learning rate of round ``rnd`` (1-based) of a ``rounds``-round job."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
    if not 1 <= rnd <= rounds:
        raise ValueError(f"round {rnd} is outside 1..{rounds}")
    if rnd <= warmup_rounds:
        return base * rnd / (warmup_rounds + 1)
    if schedule == "constant":
        return base
    decay_rounds = rounds - warmup_rounds
    if decay_rounds <= 1:
        return base
    progress = (rnd - warmup_rounds - 1) / (decay_rounds - 1)
    return base * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
