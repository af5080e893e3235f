"""What a training child process says on its stdout, and how its parent reads it.

A shard trained outside this process (the unsloth runner, agent/train/unsloth_runner.py; rank 0 of a
data-parallel group, agent/train/parallel.py) reports on stdout, one line each: ``EVENT_PREFIX`` and a
checkpoint event (JSON) after each checkpoint, ``RESULT_PREFIX`` and the train result (JSON) at the end,
or ``ERROR_PREFIX`` and one line on failure; a warm unsloth child answers a replay request with
``VERDICT_PREFIX`` and the segment verdict (JSON), and stays up for the next request. A parent reads one
answer with ``read_reply`` (backends.WarmChild), or a child's whole output with ``read_child`` (parallel.py:
rank 0 exits after its answer). Here, below both, so neither imports the other back (issue 23).
"""

from __future__ import annotations

import json
import subprocess
import sys

from agent.train.recorder import CheckpointEvent, OnCheckpoint
from agent.train.run import TrainResult

EVENT_PREFIX = "INFERNET-EVENT "
RESULT_PREFIX = "INFERNET-RESULT "
ERROR_PREFIX = "INFERNET-ERROR "
VERDICT_PREFIX = "INFERNET-VERDICT "
READY_LINE = "INFERNET-READY"
"""A warm child (the unsloth runner without a request file) says this once its imports are done."""


def read_child(child: subprocess.Popen, on_checkpoint: OnCheckpoint | None) -> tuple[TrainResult | None, str | None]:
    """Read a training child's stdout to its end (``read_reply``, then whatever it prints after its answer to
    our stderr): (its result, None), or (None, its error line, or None when it gave neither)."""
    kind, text = read_reply(child, on_checkpoint)
    assert child.stdout is not None
    for line in child.stdout:
        sys.stderr.write(line)
    if kind == "result":
        return TrainResult.from_json(json.loads(text)), None
    return None, text if kind == "error" else None


def read_reply(child: subprocess.Popen, on_checkpoint: OnCheckpoint | None) -> tuple[str, str]:
    """Read a warm child's stdout up to its answer to one request: checkpoint events to ``on_checkpoint``,
    other lines to our stderr; then ``("result" | "verdict", JSON text)``, ``("error", one line)``, or
    ``("exit", "")`` when the child's stdout ended first (it died)."""
    assert child.stdout is not None
    for line in iter(child.stdout.readline, ""):
        if line.startswith(EVENT_PREFIX):
            if on_checkpoint is not None:
                on_checkpoint(CheckpointEvent.from_json(json.loads(line[len(EVENT_PREFIX):])))
        elif line.startswith(RESULT_PREFIX):
            return "result", line[len(RESULT_PREFIX):]
        elif line.startswith(VERDICT_PREFIX):
            return "verdict", line[len(VERDICT_PREFIX):]
        elif line.startswith(ERROR_PREFIX):
            return "error", line[len(ERROR_PREFIX):].strip()
        elif line.strip() != READY_LINE:
            sys.stderr.write(line)
    return "exit", ""


def end_child(process: subprocess.Popen, grace: float = 10.0) -> None:
    """Stop a child that reads its stdin: close stdin (it exits), then SIGTERM, then SIGKILL, ``grace``
    seconds apart; close its stdout. Never raises."""
    try:
        if process.stdin is not None:
            process.stdin.close()
    except OSError:
        pass
    for stop in (process.terminate, process.kill, None):
        try:
            process.wait(timeout=grace)
            break
        except subprocess.TimeoutExpired:
            if stop is None:
                break
            stop()
    if process.stdout is not None:
        process.stdout.close()
