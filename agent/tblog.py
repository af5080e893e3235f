"""Training curves where ML engineers look for them: TensorBoard event files (issue 27).

Rules of this file:
- Events are written with torch's ``SummaryWriter`` (the ``tensorboard`` package's format; nothing
  hand-written), into a log directory ``tensorboard --logdir`` reads. Without the ``tensorboard``
  package ``open_log`` returns None and the caller says so in one line; nothing else changes.
- Each (tag, step) is written once per ``ScalarLog``: a caller that polls (``job watch``) hands it
  the whole picture each time and only new points are written. A log opened ``fresh`` first removes
  the event files an earlier log of ours left in that directory (ours end in ``.infernet``), so
  a watch started again does not draw every point twice.
- ``local_scalars`` maps one line of a local run's metrics.jsonl; ``job_scalars`` maps a job's
  detail (control.job_detail, what ``job watch`` polls): each round's validation loss (aggregate and
  base), each shard attempt's checkpoint losses by worker (steps counted on across rounds), verdicts,
  and each round's wall, training and fixed seconds and the workers' utilization.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

SUFFIX = ".infernet"


class ScalarLog:
    def __init__(self, logdir: Path, *, fresh: bool = True):
        from torch.utils.tensorboard import SummaryWriter

        logdir.mkdir(parents=True, exist_ok=True)
        if fresh:
            for old in logdir.glob(f"events.out.tfevents.*{SUFFIX}"):
                old.unlink()
        self.logdir = logdir
        self.writer = SummaryWriter(str(logdir), filename_suffix=SUFFIX)
        self.seen: set[tuple[str, int]] = set()
        self.broken = ""

    def add(self, tag: str, value: float | None, step: int) -> bool:
        """Write one scalar unless (tag, step) is written already or the value is missing; whether it wrote."""
        if value is None or (tag, step) in self.seen:
            return False
        self.seen.add((tag, step))
        self.writer.add_scalar(tag, float(value), int(step))
        return True

    def add_all(self, scalars: Iterator[tuple[str, float | None, int]]) -> int:
        """Write the new points; a log that cannot be written (a full disk) stops, ``broken`` says why,
        and the caller's work goes on: curves are never worth failing a run or a watch for."""
        if self.broken:
            return 0
        try:
            written = sum(self.add(tag, value, step) for tag, value, step in scalars)
            if written:
                self.writer.flush()
            return written
        except OSError as error:
            self.broken = f"TensorBoard log {self.logdir}: {error.strerror or error}; no more points written"
            return 0

    def close(self) -> None:
        try:
            self.writer.close()
        except OSError as error:
            self.broken = self.broken or f"TensorBoard log {self.logdir}: {error.strerror or error}"


def open_log(logdir: Path, *, fresh: bool = True) -> ScalarLog | None:
    """A log in ``logdir``, or None when the tensorboard package is not installed; OSError when ``logdir``
    cannot be made or written."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:  # torch's SummaryWriter needs it
        return None
    return ScalarLog(logdir, fresh=fresh)


MISSING = "TensorBoard logs need the tensorboard package (pip install 'infernet-agent[viz]'); none written"


def local_scalars(line: dict) -> Iterator[tuple[str, float | None, int]]:
    """One metrics.jsonl line of a local run (agent/train/run.py) as scalars at its step."""
    step = int(line["step"])
    yield "train/loss", line.get("loss"), step
    yield "train/learning_rate", line.get("learning_rate"), step
    yield "train/tokens_per_s", line.get("tokens_per_s"), step
    yield "validation/loss", line.get("validation_loss"), step


def job_scalars(job: dict) -> Iterator[tuple[str, float | None, int]]:
    """A job's detail document (what ``job watch`` polls) as scalars."""
    for aggregate in job.get("aggregates", []):
        yield "validation/aggregate", aggregate.get("validation_loss"), aggregate["round"]
        yield "validation/base", aggregate.get("base_validation_loss"), aggregate["round"]
        yield "validation/reward_accuracy", aggregate.get("reward_accuracy"), aggregate["round"]  # a DPO job's
        yield "validation/reward_margin", aggregate.get("reward_margin"), aggregate["round"]
    # each shard's curve by worker, its steps counted on across rounds (a round's steps start where the last ended)
    offsets: dict[int, int] = {}
    for curve in sorted(job.get("curves", []), key=lambda c: (c["round"], c["shard"], c["attempt"])):
        shard, offset = curve["shard"], offsets.get(curve["shard"], 0)
        worker = (curve.get("worker") or "unknown")[-8:]
        for step, loss in curve["points"]:
            yield f"train_loss/shard{shard}/{worker}", loss, offset + step
        if curve.get("accepted"):
            offsets[shard] = offset + max((step for step, _ in curve["points"]), default=0)
    verdicts = job.get("verdicts") or {}
    rounds_done = len(job.get("aggregates", []))
    yield "verdicts/accepted", verdicts.get("accepted"), rounds_done
    yield "verdicts/rejected", verdicts.get("rejected"), rounds_done
    utilization = job.get("utilization") or {}
    for entry in utilization.get("rounds", []):
        yield "rounds/wall_seconds", entry.get("wall"), entry["round"]
        yield "rounds/training_seconds", entry.get("training"), entry["round"]
        yield "rounds/fixed_seconds", entry.get("fixed"), entry["round"]
        yield "rounds/utilization", entry.get("utilization"), entry["round"]
