"""How busy a job kept its workers: training time, idle time between rounds, the round's fixed cost.

Pure arithmetic over what a job's mirror (or a harness trace) already holds, no I/O. The inputs:

- one ``Trained`` per shard report: the worker, the round, when the report arrived (``end``) and the
  seconds of training it states (``seconds``: the signed ``metrics.train_seconds`` of the report);
  the training is taken to have run in ``[end - seconds, end]``, so the report's trip over the
  network counts as idle, not as training;
- when each round's aggregate arrived (``round_ends``) and when the job's first round began
  (``start``: its first lease).

The figures (issue 24 §3, §5):

- per worker: ``training`` (its seconds of training), ``idle`` (the gaps between its training
  intervals, from its first start to its last end, in seconds) and ``utilization`` =
  training / (training + idle): 1.0 means it never waited between shards;
- per round: ``wall`` (aggregate r-1 to aggregate r; round 1 from ``start``), ``busiest`` (the most
  seconds one worker trained in it) and ``fixed`` = wall - busiest: what the round cost beyond its
  critical path of training (leases, fetches, replay verification, aggregation, scoring);
- for the job: ``utilization`` (the workers' training over their spans, all together),
  ``training_seconds`` over ``wall_seconds``: ``speedup`` = machines' worth of training per second of
  the job's wall time (W x utilization when W workers all took part). The speedup over one of its
  workers that the submitter gets is that times the job's distributed efficiency E (model quality
  per unit of compute, measured by scripts/bench_quality.py), which a running job cannot measure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Trained:
    worker: str
    round: int
    end: float
    seconds: float


@dataclass(frozen=True)
class WorkerFigures:
    training: float
    idle: float
    shards: int

    @property
    def utilization(self) -> float:
        busy = self.training + self.idle
        return self.training / busy if busy > 0 else 0.0


@dataclass(frozen=True)
class RoundFigures:
    round: int
    wall: float
    busiest: float
    training: float  # all workers together

    @property
    def fixed(self) -> float:
        return max(0.0, self.wall - self.busiest)

    @property
    def utilization(self) -> float:
        """The critical path's share of the round: busiest / wall."""
        return min(1.0, self.busiest / self.wall) if self.wall > 0 else 0.0


@dataclass(frozen=True)
class Utilization:
    workers: dict[str, WorkerFigures] = field(default_factory=dict)
    rounds: list[RoundFigures] = field(default_factory=list)

    @property
    def training_seconds(self) -> float:
        return sum(w.training for w in self.workers.values())

    @property
    def wall_seconds(self) -> float:
        return sum(r.wall for r in self.rounds)

    @property
    def utilization(self) -> float:
        busy = sum(w.training + w.idle for w in self.workers.values())
        return self.training_seconds / busy if busy > 0 else 0.0

    @property
    def speedup(self) -> float:
        """Machines' worth of training per second of wall time over the finished rounds."""
        wall = self.wall_seconds
        trained = sum(r.training for r in self.rounds)
        return trained / wall if wall > 0 else 0.0

    @property
    def fixed_per_round(self) -> float:
        return sum(r.fixed for r in self.rounds) / len(self.rounds) if self.rounds else 0.0

    def as_json(self) -> dict:
        return {
            "utilization": round(self.utilization, 4), "speedup": round(self.speedup, 3),
            "training_seconds": round(self.training_seconds, 3), "wall_seconds": round(self.wall_seconds, 3),
            "fixed_per_round": round(self.fixed_per_round, 3),
            "workers": {w: {"training": round(f.training, 3), "idle": round(f.idle, 3), "shards": f.shards,
                            "utilization": round(f.utilization, 4)} for w, f in sorted(self.workers.items())},
            "rounds": [{"round": r.round, "wall": round(r.wall, 3), "busiest": round(r.busiest, 3),
                        "training": round(r.training, 3), "fixed": round(r.fixed, 3),
                        "utilization": round(r.utilization, 4)} for r in self.rounds],
        }


def measure(trained: list[Trained], round_ends: dict[int, float], start: float | None) -> Utilization:
    """The figures of the module docstring. Rounds count once their aggregate is in ``round_ends``
    and the one before it (or ``start``) is known; training is clipped to be non-negative."""
    intervals: dict[str, list[tuple[float, float]]] = {}
    for t in trained:
        seconds = max(0.0, t.seconds)
        intervals.setdefault(t.worker, []).append((t.end - seconds, t.end))
    workers = {}
    for worker, spans in intervals.items():
        spans.sort()
        idle, reach = 0.0, spans[0][1]
        for begin, end in spans[1:]:
            idle += max(0.0, begin - reach)
            reach = max(reach, end)
        workers[worker] = WorkerFigures(sum(e - b for b, e in spans), idle, len(spans))
    rounds = []
    for rnd in sorted(round_ends):
        begin = round_ends.get(rnd - 1) if rnd > 1 else start
        if begin is None:
            continue
        per_worker: dict[str, float] = {}
        for t in trained:
            if t.round == rnd:
                per_worker[t.worker] = per_worker.get(t.worker, 0.0) + max(0.0, t.seconds)
        rounds.append(RoundFigures(rnd, max(0.0, round_ends[rnd] - begin), max(per_worker.values(), default=0.0),
                                   sum(per_worker.values())))
    return Utilization(workers, rounds)


def of_mirror(view: Any) -> "Utilization":
    """How busy a job kept its workers, read off its mirror (protocol/mirror.JobMirror): every report's
    signed training seconds, ending when the report applied there; rounds between the aggregates' arrivals."""
    trained = []
    for key, (report, signer) in view.reports.items():
        end, leased = view.applied_at.get(("report", key)), view.applied_at.get(("lease", key))
        if end is None:
            continue
        seconds = report.metrics.get("train_seconds", 0.0)
        seconds = seconds if isinstance(seconds, (int, float)) and math.isfinite(seconds) else 0.0
        # a worker states its own seconds: never more than since its lease applied here
        trained.append(Trained(signer, key[0], end, min(seconds, end - leased) if leased is not None else seconds))
    ends = {rnd: view.applied_at[("aggregate", rnd)] for rnd in view.aggregates if ("aggregate", rnd) in view.applied_at}
    starts = [t for (kind, key), t in view.applied_at.items() if kind == "lease" and key[0] == 1]
    return measure(trained, ends, min(starts) if starts else None)
