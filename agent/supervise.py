"""Supervised service tasks: one failing task is logged and restarted, never the end of the agent.

An agent's long-lived services (heartbeats, topic readers, ticks, ledger sync, discovery, claims)
each run in the agent's nursery. In trio an exception escaping one of them cancels the nursery, so
one bug in one service took the whole agent down, and with it every job it coordinated: on an H100
a capability that failed our own check (free VRAM above the declared total) ended every agent of a
GPU job from inside its heartbeat task (issue 22). ``supervised`` runs such a task; when it raises
(anything but a cancellation, which is how its owner ends it), the error is logged with its
traceback, counted (``task_restarts`` in the agent's counters, served as a metric) and the task is
started again after a backoff that grows with failures in a row (1, 2, 5, 10, 30, 60 s) and starts
over once a run lasted ``RESET_AFTER`` seconds. A task that returns is done.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import trio

log = logging.getLogger(__name__)

BACKOFF = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
RESET_AFTER = 60.0  # a run this long ends a streak of failures


async def supervised(name: str, fn: Callable[..., Awaitable[Any]], *args: Any, counters: Counter | None = None,
                     backoff: tuple[float, ...] = BACKOFF) -> None:
    """Run ``fn(*args)`` until it returns; restart it after each exception (logged, counted, backed off)."""
    streak = 0
    while True:
        started = trio.current_time()
        try:
            await fn(*args)
            return
        except Exception as exc:  # noqa: BLE001 - the point: a service's bug is logged, not fatal
            if trio.current_time() - started >= RESET_AFTER:
                streak = 0
            delay = backoff[min(streak, len(backoff) - 1)]
            streak += 1
            if counters is not None:
                counters["task_restarts"] += 1
            log.error("%s failed (%s: %s); restarting it in %.0f s", name, type(exc).__name__, str(exc)[:300], delay,
                      exc_info=exc)
            await trio.sleep(delay)


async def guarded(name: str, fn: Callable[..., Awaitable[Any]], *args: Any, counters: Counter | None = None) -> None:
    """Run a one-shot task ``fn(*args)``; an exception (not a cancellation) is logged and counted
    (``task_failures``) instead of cancelling its nursery and every task beside it."""
    try:
        await fn(*args)
    except Exception as exc:  # noqa: BLE001 - see supervised
        if counters is not None:
            counters["task_failures"] += 1
        log.error("%s failed (%s: %s)", name, type(exc).__name__, str(exc)[:300], exc_info=exc)
