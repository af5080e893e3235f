"""Training backends behind one small interface: train a shard, report checkpoints, write the adapter.

Rules of this file:
- A backend has a ``name`` and ``train(request, on_checkpoint) -> TrainResult``; a worker picks
  one with ``select_backend(runtime)`` from the job's ``runtime`` and never looks inside.
- "peft" runs in this process on torch (CPU or CUDA; bf16 where the GPU supports it).
- "unsloth" needs a CUDA GPU and must be imported before transformers/peft, and its install pins
  its own torch/transformers, so it runs as a child process (``unsloth_runner``) with the Python
  of its own environment (``INFERNET_UNSLOTH_PYTHON``, default this interpreter). The child is
  warm: one per agent process, kept between shards and replays (``WarmChild``), so unsloth's
  start is paid once. It writes checkpoint events and the answer as ``EVENT_PREFIX`` and
  ``RESULT_PREFIX``/``VERDICT_PREFIX`` JSON lines on stdout (agent/train/child.py); anything else
  it prints is passed through to our stderr. A proof trained with unsloth is replayed with
  unsloth where this machine can run it (replay.replay_runtime): that replay is exact on the same
  device class, where peft's kernels drift from unsloth's.
- Selecting unsloth without a GPU fails at once with one line, before any work (``cuda_available``,
  the one place that asks torch; tests stand in for it to run the worker's unsloth path on a CPU).
- ``select_backend(runtime, processes)`` with ``processes`` > 1 and peft: data parallel over that many
  processes (agent/train/parallel.py), which reads its rank 0 child with the same lines (``read_child``).
- The request file also carries the base model's file hashes this process knows
  (model.FILE_HASHES), so the child checks the model's hash without reading it again.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
from typing import TYPE_CHECKING, Protocol

import torch

from agent.train.child import end_child, read_reply
from agent.train.config import TrainError
from agent.train.recorder import OnCheckpoint
from agent.train.run import TrainRequest, TrainResult, train_shard

if TYPE_CHECKING:
    from protocol.proof import SegmentVerdict


class Backend(Protocol):
    name: str

    def train(self, request: TrainRequest, on_checkpoint: OnCheckpoint | None = None) -> TrainResult: ...


class PeftBackend:
    name = "peft"

    def train(self, request: TrainRequest, on_checkpoint: OnCheckpoint | None = None) -> TrainResult:
        return train_shard(request, on_checkpoint, backend="peft")


class WarmChild:
    """One warm unsloth runner (agent/train/unsloth_runner.py without a request file): started at the first
    request, kept for the next ones, so unsloth's import, patching and compile are paid once per agent
    process rather than once per shard (issue 22). One request at a time (a lock); a child that died is
    started again at the next request; a request whose reading failed on our side kills it (its stdout
    would still hold that request's lines)."""

    def __init__(self, python: str):
        self.python = python
        self.process: subprocess.Popen | None = None
        self.started = 0  # processes started: a test and gpu_check read it
        self.requests: dict[str, int] = {}  # requests sent, by op
        self.lock = threading.Lock()

    def ask(self, request: dict, on_checkpoint: OnCheckpoint | None = None) -> tuple[str, str]:
        """Send one request; (kind, text) as child.read_reply answers it ("exit" becomes an "error" line)."""
        with self.lock:
            if self.process is None or self.process.poll() is not None:
                self.process = subprocess.Popen(
                    [self.python, "-m", "agent.train.unsloth_runner"],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
                self.started += 1
            process = self.process
            self.requests[request["op"]] = self.requests.get(request["op"], 0) + 1
            assert process.stdin is not None
            try:
                process.stdin.write(json.dumps(request) + "\n")
                process.stdin.flush()
            except OSError:
                pass  # it already ended (unsloth would not import): its last line says why
            try:
                kind, text = read_reply(process, on_checkpoint)
            except BaseException:
                self._end(process, kill=True)
                raise
            if kind == "exit":
                self._end(process)
                return "error", f"unsloth runner exited with status {process.returncode} and no result"
            return kind, text

    def close(self) -> None:
        with self.lock:
            if self.process is not None:
                self._end(self.process)

    def _end(self, process: subprocess.Popen, *, kill: bool = False) -> None:
        if kill:
            process.kill()
        end_child(process)
        if self.process is process:
            self.process = None


_WARM: dict[str, WarmChild] = {}
_WARM_LOCK = threading.Lock()


def warm_child(python: str) -> WarmChild:
    """This process's warm unsloth runner for interpreter ``python`` (one per interpreter)."""
    with _WARM_LOCK:
        if python not in _WARM:
            _WARM[python] = WarmChild(python)
        return _WARM[python]


@atexit.register
def _close_warm_children() -> None:
    for child in list(_WARM.values()):
        child.close()


class UnslothBackend:
    name = "unsloth"

    def __init__(self, python: str | None = None):
        self.python = python or os.environ.get("INFERNET_UNSLOTH_PYTHON", sys.executable)

    def train(self, request: TrainRequest, on_checkpoint: OnCheckpoint | None = None) -> TrainResult:
        request.run_dir.mkdir(parents=True, exist_ok=True)
        from agent.train.model import FILE_HASHES, resolve_model_dir

        # the base model's file hashes we already know, so the child does not read the model again
        hashes = [[list(key), digest] for key, digest in FILE_HASHES.under(resolve_model_dir(request.config.base_model))]
        kind, text = warm_child(self.python).ask(
            {"op": "train", "request": request.to_json(), "file_hashes": hashes}, on_checkpoint)
        if kind != "result":
            raise TrainError(text or "unsloth runner gave no result")
        return TrainResult.from_json(json.loads(text))

    def replay(self, request: dict) -> "SegmentVerdict":
        """replay.verify_segment with unsloth, in the warm child; ``request``: the replay request's fields
        (unsloth_runner.py). A child that cannot replay comes back as a rejected verdict with its line."""
        from protocol.proof import SegmentVerdict

        kind, text = warm_child(self.python).ask({"op": "replay", **request})
        if kind != "verdict":
            return SegmentVerdict(int(request["index"]), False, False, float("inf"),
                                  f"the unsloth replay failed: {text or 'no verdict'}")
        return SegmentVerdict(**json.loads(text))


def cuda_available() -> bool:
    """Whether this process sees a CUDA GPU: what ``select_backend`` asks before it starts unsloth."""
    return torch.cuda.is_available()


def unsloth_usable() -> bool:
    """Whether this process can train or replay with unsloth: a CUDA GPU and unsloth installed (or its
    interpreter named by INFERNET_UNSLOTH_PYTHON)."""
    from agent.hardware import unsloth_installed

    return cuda_available() and unsloth_installed()


def select_backend(runtime: str, processes: int = 1) -> Backend:
    """The backend for a job's ``runtime``; TrainError when this machine cannot run it. With
    ``processes`` > 1 the peft runtime trains data-parallel (agent/train/parallel.py); unsloth
    trains on one GPU whatever ``processes`` says."""
    if runtime == "peft":
        if processes > 1:
            from agent.train.parallel import DataParallelBackend

            return DataParallelBackend(processes)
        return PeftBackend()
    if runtime == "unsloth":
        if not cuda_available():
            raise TrainError("runtime unsloth needs a CUDA GPU; none found — use runtime: peft")
        return UnslothBackend()
    raise TrainError(f"unknown runtime {runtime!r} (known: peft, unsloth)")
