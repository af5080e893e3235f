"""What the test harness may inject into an agent, at construction only (``Agent(..., hooks=...)``):
never read from the operator's config, never set in production.

- ``observer``: the harness's tap (agent/harness/trace.py), called with ("recv", Received) for every
  verified message we receive and ("state", JobMirror, actions) for every state change; it must not raise.
- ``training``: how the worker role trains a shard. ``HonestTraining`` (the default) changes
  nothing; agent/harness/byzantine.py makes a worker Byzantine (or faulty) on purpose.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable


class HonestTraining:
    """The worker's training as the protocol asks. Each method is a point where a harness fault
    takes over; the honest answer leaves the work as it is."""

    def before_training(self) -> None:
        """Called once the shard is fetched, before anything else: may raise (a crashing worker)."""

    async def base_model(self, home: Path) -> str | None:
        """A base model to train on instead of our checked copy of the job's; None: ours."""
        return None

    def use_initial_adapter(self) -> bool:
        """Start from the round's aggregate (``initial_adapter_cid``)?"""
        return True

    def adjust_config(self, config: Any) -> Any:
        """The TrainConfig the shard trains with."""
        return config

    def after_training(self, adapter_dir: Path, proof_path: Path, head: bytes) -> bytes:
        """The trained adapter and proof may be altered here; returns the chain head to report."""
        return head

    def heartbeats_muted(self) -> bool:
        """Send no heartbeat now (the agent looks gone to its peers while it keeps working)?"""
        return False


@dataclass(frozen=True)
class AgentHooks:
    observer: Callable[..., None] | None = None
    training: HonestTraining = field(default_factory=HonestTraining)
