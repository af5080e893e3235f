"""Training backends behind one small interface: train a shard, report checkpoints, write the adapter.

Rules of this file:
- A backend has a ``name`` and ``train(request, on_checkpoint) -> TrainResult``; a worker picks
  one with ``select_backend(runtime)`` from the job's ``runtime`` and never looks inside.
- "peft" runs in this process on torch (CPU or CUDA; bf16 where the GPU supports it).
- "unsloth" needs a CUDA GPU and must be imported before transformers/peft, and its install pins
  its own torch/transformers, so it runs as a child process (``unsloth_runner``) with the Python
  of its own environment (``INFERNET_UNSLOTH_PYTHON``, default this interpreter). The child
  writes checkpoint events and the result as ``EVENT_PREFIX``/``RESULT_PREFIX`` JSON lines on
  stdout (agent/train/child.py); anything else it prints is passed through to our stderr.
- Selecting unsloth without a GPU fails at once with one line, before any work (``cuda_available``,
  the one place that asks torch; tests stand in for it to run the worker's unsloth path on a CPU).
- ``select_backend(runtime, processes)`` with ``processes`` > 1 and peft: data parallel over that many
  processes (agent/train/parallel.py), which reads its rank 0 child with the same lines (``read_child``).
- The request file also carries the base model's file hashes this process knows
  (model.FILE_HASHES), so the child checks the model's hash without reading it again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Protocol

import torch

from agent.train.child import read_child
from agent.train.config import TrainError
from agent.train.recorder import OnCheckpoint
from agent.train.run import TrainRequest, TrainResult, train_shard


class Backend(Protocol):
    name: str

    def train(self, request: TrainRequest, on_checkpoint: OnCheckpoint | None = None) -> TrainResult: ...


class PeftBackend:
    name = "peft"

    def train(self, request: TrainRequest, on_checkpoint: OnCheckpoint | None = None) -> TrainResult:
        return train_shard(request, on_checkpoint, backend="peft")


class UnslothBackend:
    name = "unsloth"

    def __init__(self, python: str | None = None):
        self.python = python or os.environ.get("INFERNET_UNSLOTH_PYTHON", sys.executable)

    def train(self, request: TrainRequest, on_checkpoint: OnCheckpoint | None = None) -> TrainResult:
        request.run_dir.mkdir(parents=True, exist_ok=True)
        from agent.train.model import FILE_HASHES, resolve_model_dir

        data = request.to_json()
        # the base model's file hashes we already know, so the child does not read the model again
        data["file_hashes"] = [[list(key), digest] for key, digest in
                               FILE_HASHES.under(resolve_model_dir(request.config.base_model))]
        with tempfile.NamedTemporaryFile("w", suffix=".json", dir=request.run_dir, delete=False) as handle:
            json.dump(data, handle)
        try:
            return self._run(Path(handle.name), on_checkpoint)
        finally:
            os.unlink(handle.name)

    def _run(self, request_path: Path, on_checkpoint: OnCheckpoint | None) -> TrainResult:
        child = subprocess.Popen(
            [self.python, "-m", "agent.train.unsloth_runner", str(request_path)],
            stdout=subprocess.PIPE, text=True, bufsize=1,
        )
        with child:
            result, error = read_child(child, on_checkpoint)
        if result is None:
            raise TrainError(error or f"unsloth runner exited with status {child.returncode} and no result")
        return result


def cuda_available() -> bool:
    """Whether this process sees a CUDA GPU: what ``select_backend`` asks before it starts unsloth."""
    return torch.cuda.is_available()


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
