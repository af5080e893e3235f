"""The harness's trace: one JSON object per line for every message an agent received, every state
change, every fault and every check, with the time since the run started.

Lines (all have ``t``, seconds since the start, and ``kind``):
- ``{"kind": "start", "scenario", "seed", "agents": {name: peer_id}}``
- ``{"kind": "recv", "agent", "type", "from", "topic": "jobs"|"job", "job"?, ...message fields}``:
  a verified message as delivered to ``agent``; peers are written by harness name (``w1``),
  bytes as hex (the first 16 digits), long text cut at 200 characters.
- ``{"kind": "state", "agent", "job", "phase", "round", "term", "coordinator", "actions": [...]}``
- ``{"kind": "fault", "fault", "target"?, ...}``, ``{"kind": "job", "job", "name"}`` (announced)
- ``{"kind": "check", "name", "ok", "detail"}``, ``{"kind": "end", "ok", "seconds", "phase"}``

Heartbeats are many and say little: they are counted in the summary, and written only when
``heartbeats=True``.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import IO, Any, Callable

MAX_TEXT = 200


class Trace:
    def __init__(self, path: Path | None, *, heartbeats: bool = False,
                 names: Callable[[str | None], str] = lambda p: (p or "none")[-8:]) -> None:
        self.path = path
        self.heartbeats = heartbeats
        self.names = names
        self.started = time.monotonic()
        self.received: Counter[str] = Counter()  # message type -> deliveries, over all agents
        self.lines = 0
        self._file: IO[str] | None = open(path, "w", encoding="utf-8") if path is not None else None

    def now(self) -> float:
        return round(time.monotonic() - self.started, 3)

    def write(self, kind: str, **data: Any) -> None:
        self.lines += 1
        if self._file is not None:
            self._file.write(json.dumps({"t": self.now(), "kind": kind, **data}, default=str) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- the agents' tap ----------------------------------------------------------------------------

    def observe(self, name: str, agent: Any, kind: str, args: tuple) -> None:
        """The observer (agent/hooks.py ``AgentHooks.observer``) of the agent called ``name``."""
        try:
            if kind == "recv":
                received = args[0]
                msg = received.message
                self.received[msg.TYPE] += 1
                if msg.TYPE == "heartbeat" and not self.heartbeats:
                    return
                topic = "jobs" if received.topic.endswith("/jobs") else "job"
                self.write("recv", agent=name, type=msg.TYPE, **{"from": self.names(received.signer)}, topic=topic,
                           **self.fields(msg))
            elif kind == "state":
                view, actions = args
                self.write("state", agent=name, job=view.job_id.hex()[:16], phase=view.state.phase.value,
                           round=view.state.round, term=view.coordination.term,
                           coordinator=self.names(view.coordination.coordinator),
                           actions=[self.action(a) for a in actions])
        except Exception as exc:  # noqa: BLE001 - a trace must never disturb an agent
            self.write("trace-error", agent=name, error=repr(exc)[:MAX_TEXT])

    def action(self, action: Any) -> dict:
        return {"action": type(action).__name__, **self.fields(action)}

    def fields(self, obj: Any) -> dict:
        out: dict[str, Any] = {}
        if not is_dataclass(obj):
            return out
        for f in fields(obj):
            value = getattr(obj, f.name)
            out[f.name] = self.value(f.name, value)
        return {k: v for k, v in out.items() if v is not _SKIP}

    def value(self, name: str, value: Any) -> Any:
        if isinstance(value, bytes):
            return value.hex()[:16]
        if isinstance(value, Enum):
            return value.value
        if isinstance(value, str):
            if name in ("worker", "submitter", "coordinator") or value.startswith("12D3Koo"):
                return self.names(value)
            return value[:MAX_TEXT]
        if isinstance(value, (bool, int, float)) or value is None:
            return value
        if isinstance(value, tuple) and all(isinstance(v, (int, str)) for v in value):
            return list(value)[:64]
        if isinstance(value, dict):
            return {str(k)[:40]: (v if isinstance(v, (int, float, str, bool)) else str(v)[:40])
                    for k, v in list(value.items())[:16]}
        return _SKIP


_SKIP = object()


def read_trace(path: Path) -> list[dict]:
    """The lines of a trace file (for tests and tools)."""
    with open(path, encoding="utf-8") as file:
        return [json.loads(line) for line in file if line.strip()]
