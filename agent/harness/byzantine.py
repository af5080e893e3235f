"""Workers that misbehave on purpose, for the harness only: an agent gets one through
``Agent(..., hooks=AgentHooks(training=byzantine(mode)))`` (agent/hooks.py), never from its config.

Modes: ``random_adapter`` (noise instead of the trained adapter), ``forged_chain`` (a self-consistent
proof chain over batches it did not train on), ``wrong_base`` (trains another base model and claims
none), ``stale_start`` (ignores the round's aggregate), ``crash`` (faulty, not Byzantine: its
training always fails), ``stall_once`` (faulty: its first shard waits ``STALL_SECONDS`` before
training, as a worker on a full disk or a stopped machine does, so its lease runs out meanwhile; a
stall the worker itself cut short, by cancelling that attempt, is recorded in ``stall_cut_short``),
``disk_full_once`` (faulty: its first shard fails as a full disk fails a write, ENOSPC, so it gives the shard back
for its own machine, an excused attempt, IPIP-0004 §5), ``mute_once`` (faulty: through its first shard it sends
no heartbeat and stalls ``STALL_SECONDS`` before training, as a worker cut off from its peers does while it works,
so its coordinator revokes the lease, IPIP-0004 §5.3; the revoke it then hears stops that attempt: ``stall_cut_short``), ``wrong_lr`` (trains at 1.5 times the job's learning rate: its proof, adapter and start all check out, and
only the replay rejects it, after the coordinator may have announced an early start with it, IPIP-0006 §2.9).
"""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import trio

from agent.hooks import HonestTraining
from agent.train.runner import run_torch

MISBEHAVIOURS = ("random_adapter", "forged_chain", "wrong_base", "stale_start", "crash", "stall_once", "wrong_lr",
                 "disk_full_once", "mute_once")
FAULTY = ("crash", "stall_once", "disk_full_once", "mute_once")  # faulty, not Byzantine: such a worker may coordinate
STALL_SECONDS = 120.0


class Byzantine(HonestTraining):
    def __init__(self, mode: str) -> None:
        if mode not in MISBEHAVIOURS:
            raise ValueError(f"unknown misbehaviour {mode!r}; expected one of {', '.join(MISBEHAVIOURS)}")
        self.mode = mode
        self.stalled = False
        self.stall_cut_short = False  # stall_once: the worker cancelled the stalled attempt (drop_stale)
        self.disk_filled = False  # disk_full_once: its first shard failed already
        self.muted = False  # mute_once: no heartbeats now (through its first shard)

    def before_training(self) -> None:
        if self.mode == "crash":
            raise RuntimeError("training crashed (harness: this worker's training always fails)")
        if self.mode == "disk_full_once" and not self.disk_filled:
            self.disk_filled = True
            raise OSError(errno.ENOSPC, "No space left on device (harness: this worker's first shard)")

    async def base_model(self, home: Path) -> str | None:
        if self.mode in ("stall_once", "mute_once") and not self.stalled:
            self.stalled = True
            self.muted = self.mode == "mute_once"
            try:
                await trio.sleep(STALL_SECONDS)
            except trio.Cancelled:
                self.stall_cut_short = True
                raise
            finally:
                self.muted = False
        if self.mode != "wrong_base":
            return None
        from agent.train.tiny import tiny_model

        return str(await trio.to_thread.run_sync(run_torch, tiny_model, home / "models", 7))

    def heartbeats_muted(self) -> bool:
        return self.muted

    def use_initial_adapter(self) -> bool:
        return self.mode != "stale_start"

    def adjust_config(self, config: Any) -> Any:
        if self.mode == "wrong_lr":  # trains at another rate: every check before the replay passes, the replay fails
            return config.with_(learning_rate=config.learning_rate * 1.5)
        return config.with_(base_model_sha256=None) if self.mode == "wrong_base" else config

    def after_training(self, adapter_dir: Path, proof_path: Path, head: bytes) -> bytes:
        if self.mode == "random_adapter":
            _randomise_adapter(adapter_dir)
        if self.mode == "forged_chain":
            head = _forge_chain(proof_path)
        return head


def byzantine(mode: str | None) -> HonestTraining:
    """The training hooks of a worker in ``mode`` (None: honest)."""
    return HonestTraining() if mode is None else Byzantine(mode)


def _randomise_adapter(adapter_dir: Path) -> None:
    """Byzantine: replace the trained adapter with noise of the same shapes."""
    import torch
    from safetensors.torch import load_file, save_file

    path = adapter_dir / "adapter_model.safetensors"
    tensors = {k: torch.randn_like(v) for k, v in load_file(str(path)).items()}
    save_file(tensors, str(path), metadata={"format": "pt"})


def _forge_chain(proof_path: Path) -> bytes:
    """Byzantine: claim different batches than were trained on, with a self-consistent chain."""
    from dataclasses import replace

    from protocol.proof import Commitment

    commitment = Commitment.from_json(json.loads(proof_path.read_text()))
    forged = tuple(replace(link, batches_digest=bytes(32)) for link in commitment.links)
    commitment = Commitment(commitment.header, forged)
    proof_path.write_text(json.dumps(commitment.to_json()))
    return commitment.head
