"""Proof-of-training recorder: checkpoints on disk and the hash chain over them.

Rules of this file:
- Every ``checkpoint_every`` optimizer steps, and after the last step, the recorder hashes the
  adapter and the optimizer state (protocol.proof.tensor_set_hash), digests the batch indices of
  the steps since the previous checkpoint, appends a ChainLink with their mean loss, saves the
  checkpoint, rewrites ``proof.json``, and only then calls ``on_checkpoint``: a commitment is
  never announced before the bytes it commits to are on disk. On a GPU (``background``) the hashing
  and writing run in one writer thread while the next steps train, and the training thread announces
  each checkpoint once written, in order, at a later step or at ``finish``. When a data-parallel group trains
  (loop.py), rank 0 records and ``before_commit`` first checks that every rank holds the state the
  link names (loop.same_on_every_rank); the other ranks record nothing.
- A checkpoint is a directory ``checkpoints/step-NNNNNN/``:
      adapter_model.safetensors  adapter_config.json   the adapter (loadable by stock peft)
      optimizer.safetensors                            AdamW state, see loop.py for the names
      state.json                                       step, link, head, RNG rule
  Step 0 (the initial adapter, and the optimizer state training starts from: empty unless the
  job carries it across rounds) is saved too, so segment 0 can be replayed.
  It is written to a temporary directory and renamed into place: never half-written.
- The RNG state at a step boundary is fully given by (seed, step) because the loop reseeds at
  every step (protocol.proof.step_seed); state.json records that rule and the seed rather than opaque
  generator bytes.
- Everything is safetensors or JSON. Loading checks the tensors against the caller's expected
  hashes; nothing from a peer is unpickled.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

from agent.train.model import save_adapter, tensors_hash
from protocol.proof import ChainLink, Commitment, CommitmentHeader, batches_digest

RNG_RULE = "torch.manual_seed(sha256('infernet/step-rng/v1\\0' || u64 seed || u64 step)[:8] & (2**63-1)) before each step"


def is_checkpoint(step: int, every: int, total_steps: int) -> bool:
    """Whether the chain gets a link after optimizer step ``step`` (1-based): every ``every`` steps and the last."""
    return step % every == 0 or step == total_steps


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


@dataclass(frozen=True)
class CheckpointEvent:
    """What a worker announces after each checkpoint (and where the bytes are)."""

    index: int  # link index in the chain = segment index
    step: int
    link: ChainLink
    head: bytes
    path: Path

    def to_json(self) -> dict:
        return {"index": self.index, "step": self.step, "link": self.link.to_json(),
                "head": self.head.hex(), "path": str(self.path)}

    @classmethod
    def from_json(cls, obj: dict) -> "CheckpointEvent":
        return cls(int(obj["index"]), int(obj["step"]), ChainLink.from_json(obj["link"]),
                   bytes.fromhex(obj["head"]), Path(obj["path"]))


OnCheckpoint = Callable[[CheckpointEvent], None]


def _done(event: CheckpointEvent) -> Future:
    future: Future = Future()
    future.set_result(event)
    return future


def write_checkpoint(directory: Path, model: Any, adapter: dict[str, torch.Tensor],
                     optimizer: dict[str, torch.Tensor], state: dict) -> None:
    """Write one checkpoint directory atomically (temporary sibling, then rename). ``model`` None: the tensors
    only, no adapter_config.json (a verifier's copy of a round's start it holds, which a replay reads as is)."""
    staging = directory.with_name(f".{directory.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    if model is None:
        staging.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in adapter.items()}, str(staging / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
    else:
        save_adapter(staging, model, adapter)
    save_file({k: v.contiguous() for k, v in optimizer.items()}, str(staging / "optimizer.safetensors"),
              metadata={"format": "pt"})
    (staging / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(directory, ignore_errors=True)
    os.rename(staging, directory)


def read_checkpoint(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """(adapter tensors, optimizer tensors, state.json) of a checkpoint directory."""
    adapter = load_file(str(directory / "adapter_model.safetensors"))
    optimizer = load_file(str(directory / "optimizer.safetensors"))
    state = json.loads((directory / "state.json").read_text())
    return adapter, optimizer, state


class ProofRecorder:
    """Extends the chain as a session trains and saves the checkpoint each link commits to."""

    def __init__(self, header: CommitmentHeader, run_dir: Path, total_steps: int,
                 on_checkpoint: OnCheckpoint | None = None,
                 before_commit: Callable[[ChainLink], None] | None = None):
        self.header = header
        self.run_dir = run_dir
        self.total_steps = total_steps
        self.on_checkpoint = on_checkpoint
        self.before_commit = before_commit  # data parallel: raises unless every rank holds this state
        self.links: list[ChainLink] = []
        self.head = header.genesis()
        self.pending_indices: list[tuple[int, ...]] = []
        self.pending_losses: list[float] = []
        self._writer: Any = None  # the background writer (``background``), else checkpoints commit inline
        self._queue: list[Future] = []  # committed or committing checkpoints not yet announced

    @property
    def commitment(self) -> Commitment:
        return Commitment(self.header, tuple(self.links))

    def start(self, session: Any) -> None:
        """Save the step-0 checkpoint: the initial adapter and optimizer state the header names
        (no optimizer state unless the job carries it across rounds)."""
        adapter, optimizer = session.adapter_tensors(), session.optimizer_tensors()
        state = {"step": 0, "index": None, "head": self.head.hex(), "seed": self.header.seed, "rng": RNG_RULE}
        write_checkpoint(self.checkpoint_dir(0), session.model, adapter, optimizer, state)
        self._write_proof()

    def checkpoint_dir(self, step: int) -> Path:
        return self.run_dir / "checkpoints" / checkpoint_name(step)

    def after_step(self, session: Any, step: int, indices: tuple[int, ...], loss: float) -> None:
        """Record one finished step; at a checkpoint step, commit it (in the background, see ``background``)."""
        self.pending_indices.append(indices)
        self.pending_losses.append(loss)
        self.deliver()
        if not is_checkpoint(step, self.header.checkpoint_every, self.total_steps):
            return
        adapter, optimizer = session.adapter_tensors(), session.optimizer_tensors()
        digest = batches_digest(self.pending_indices)
        mean_loss = sum(self.pending_losses) / len(self.pending_losses)
        self.pending_indices, self.pending_losses = [], []
        if self._writer is None:
            self._queue.append(_done(self._commit(session.model, step, adapter, optimizer, digest, mean_loss)))
        else:
            self._queue.append(self._writer.submit(self._commit, session.model, step, adapter, optimizer, digest,
                                                   mean_loss))
        self.deliver()

    def background(self) -> None:
        """Hash and write checkpoints in one background thread while training goes on (a GPU session; on the
        CPU the thread would take the training's own cores). ``adapter_tensors`` and ``optimizer_tensors``
        are copies, so the next steps cannot change what the thread hashes. The link
        order, the bytes on disk before an announcement and ``on_checkpoint``'s thread stay as they are:
        events are delivered by the training thread, in order, at the next step or at ``finish``."""
        from concurrent.futures import ThreadPoolExecutor

        if self.before_commit is None and self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")

    def deliver(self, *, wait: bool = False) -> None:
        """Announce the committed checkpoints, in order (``wait``: all of them, waiting for the writer)."""
        while self._queue and (wait or self._queue[0].done()):
            event = self._queue.pop(0).result()  # a failed write raises here, in the training thread
            if self.on_checkpoint is not None:
                self.on_checkpoint(event)

    def finish(self) -> None:
        """Wait for every checkpoint to be written and announced; stop the writer."""
        try:
            self.deliver(wait=True)
        finally:
            self.close()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None

    def _commit(self, model: Any, step: int, adapter: dict[str, torch.Tensor], optimizer: dict[str, torch.Tensor],
                digest: bytes, loss: float) -> CheckpointEvent:
        link = ChainLink(step=step, adapter_hash=tensors_hash(adapter), optimizer_hash=tensors_hash(optimizer),
                         batches_digest=digest, loss=loss)
        if self.before_commit is not None:
            self.before_commit(link)
        self.head = link.extend(self.head)
        self.links.append(link)
        event = CheckpointEvent(len(self.links) - 1, step, link, self.head, self.checkpoint_dir(step))
        state = {"step": step, "index": event.index, "head": self.head.hex(), "link": link.to_json(),
                 "seed": self.header.seed, "rng": RNG_RULE}
        write_checkpoint(event.path, model, adapter, optimizer, state)
        self._write_proof()
        return event

    def _write_proof(self) -> None:
        path = self.run_dir / "proof.json"
        staging = path.with_name(".proof.json.partial")
        staging.write_text(json.dumps(self.commitment.to_json(), indent=2) + "\n")
        os.replace(staging, path)
