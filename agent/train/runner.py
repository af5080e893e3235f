"""Running training code from the agent's roles: one torch lock per process, and a job's terms
turned into the TrainConfig agent/train needs (protocol/mirror.py's JobMirror does no I/O and knows
nothing of torch)."""

from __future__ import annotations

import threading
from typing import Any

from agent.train.config import TrainConfig
from protocol import messages as m

TORCH_LOCK = threading.Lock()
"""Held while a thread trains or replays. Loading models through transformers is not thread-safe,
so agents sharing one process (tests, the harness) take turns; an agent in its own process never waits."""


def run_torch(fn, *args):
    """Run ``fn(*args)`` under TORCH_LOCK (meant for trio.to_thread.run_sync).

    The first imports of transformers/peft (and accelerate, bitsandbytes behind them) happen under
    the lock too: two threads importing them at once hit their circular imports half-initialised
    ("cannot import name 'dispatch_model' from partially initialized module"), most readily on a
    fresh install whose bytecode is not compiled yet.
    """
    with TORCH_LOCK:
        import peft  # noqa: F401
        import transformers  # noqa: F401

        return fn(*args)


def train_config(terms: m.JobTerms, base_model_path: str, *, round: int = 1, **local: Any) -> TrainConfig:
    """What agent/train needs from the terms to train (or replay) round ``round`` (TrainConfig.from_terms)."""
    return TrainConfig.from_terms(terms, base_model_path, round=round, **local)
