"""Rules across a job's rounds: the learning rate of each round (IPIP-0006 §2.5; spec keys
``training.schedule``, ``training.warmup_rounds``) and when a job may stop early (§2.6, ``stop_when``).

Rules of this file:
- A round's inner learning rate is a pure function of the job's terms and the round number, so
  every worker of a round trains with the same rate and a verifier replays with it: nothing about
  the rate is the worker's to choose or to report.
- Within a round the rate depends only on the step's place in the round (``inner_rate_factor``:
  ``constant``, or ``triangle``), never on where the round falls in the job beyond its round rate:
  a verifier replaying a segment knows both.
- ``constant``: the spec's rate in every round. ``cosine``: the spec's rate at round 1 (after
  warm-up), decaying by half a cosine to ``min_ratio`` times it at the last round. Warm-up rounds
  ramp linearly: round r <= W trains at r/(W+1) of the rate.
- A round's steps: ``max_steps`` a round, but ``first_round_steps[r - 1]`` for the job's first rounds when
  the job names them (``round_steps``), and a shard's sample stream goes on where the round before it
  stopped (``stream_offset``). Shorter first rounds average the workers while the adapter moves most
  (IPIP-0006 §2.5).
- A job stops after round r < rounds when its stop rule holds on the validation losses the
  coordinator signed into the aggregates of rounds 1..r (``should_stop``): the latest is below
  ``validation_loss_below``, or the best of the last ``patience_rounds`` rounds is no better than
  the best before them. Every follower checks the coordinator's ``final`` flag against it.
This module imports no torch.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "cosine")
INNER_SCHEDULES = ("constant", "triangle")
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


def inner_rate_factor(schedule: str, step: int, steps: int) -> float:
    """The factor on the round's rate at optimizer step ``step`` (0-based) of a round of ``steps``
    steps (IPIP-0006 §2.5, ``training.inner_schedule``). ``constant``: 1. ``triangle``: a linear
    warm-up over the first w = max(1, steps // 10) steps, (step + 1) / (w + 1), then a linear decay
    from 1 at step w to MIN_RATIO at the last step. The step within the round is known to every
    verifier of a segment, so a replay takes the same rate at every step."""
    if schedule not in INNER_SCHEDULES:
        raise ValueError(f"unknown inner schedule {schedule!r}; known: {', '.join(INNER_SCHEDULES)}")
    if not 0 <= step < max(steps, 1):
        raise ValueError(f"step {step} is outside a round of {steps} steps")
    if schedule == "constant" or steps <= 1:
        return 1.0
    warm = max(1, steps // 10)
    if step < warm:
        return (step + 1) / (warm + 1)
    span = steps - 1 - warm
    return 1.0 if span <= 0 else 1.0 - (1.0 - MIN_RATIO) * (step - warm) / span


def round_steps(max_steps: int, first_round_steps: tuple[int, ...] | list[int], rnd: int) -> int:
    """Optimizer steps a shard trains in round ``rnd`` (1-based): ``first_round_steps[rnd - 1]`` for the job's
    first rounds, else ``max_steps`` (0: the shard's epochs decide, as before; a job that names first rounds'
    steps sets ``max_steps``)."""
    if rnd < 1:
        raise ValueError(f"round {rnd} is outside 1..")
    return first_round_steps[rnd - 1] if rnd <= len(first_round_steps) else max_steps


def stream_offset(steps: int, first_round_steps: tuple[int, ...] | list[int], rnd: int) -> int:
    """The position in a shard's sample stream of round ``rnd``'s step 0: the steps of the rounds before it,
    ``first_round_steps`` for the first ones and ``steps`` (the job's steps a round after them) for the rest;
    (rnd - 1) x steps when the job names no first rounds."""
    if rnd < 1:
        raise ValueError(f"round {rnd} is outside 1..")
    first = list(first_round_steps[:rnd - 1])
    return sum(first) + (rnd - 1 - len(first)) * steps


def should_stop(validation_loss_below: float, patience_rounds: int, losses: list[float | None]) -> bool:
    """Whether a job with this stop rule ends after the round whose loss is ``losses[-1]``.

    ``losses`` are the signed validation losses of rounds 1..r in order (None: not scored). A
    condition set to 0 is off; a round that was not scored never stops the job.
    """
    if not losses or losses[-1] is None:
        return False
    if validation_loss_below > 0 and losses[-1] < validation_loss_below:
        return True
    if patience_rounds > 0 and len(losses) > patience_rounds:
        before = [x for x in losses[:-patience_rounds] if x is not None]
        recent = [x for x in losses[-patience_rounds:] if x is not None]
        if before and recent and min(recent) >= min(before):
            return True
    return False


def is_final(rounds: int, validation_loss_below: float, patience_rounds: int, losses: list[float | None]) -> bool:
    """Whether the aggregate of round len(losses) ends the job: the last round, or the stop rule holds
    (``should_stop``; a job without one has both conditions 0). ``losses``: the signed validation
    losses of rounds 1..r. The coordinator sets ``final`` by this and every follower checks it."""
    return len(losses) >= rounds or should_stop(validation_loss_below, patience_rounds, losses)
