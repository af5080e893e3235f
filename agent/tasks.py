"""Tasks: who owns each task an agent runs, and the one wake-up every wait of the agent uses.

Rules of this file:
- One service with one job (issue 23: the agent as a few services). Every task has an owner:
  a long-lived service of the agent (``service``: supervised, restarted after a failure,
  agent/supervise.py), a one-shot task of the agent's (``one_shot``/``spawn``: its exception logged,
  never the end of the agent), or a task of one job (``spawn_in_job``), owned by that job's own
  nursery (``own_job``, started in the agent's nursery when the job is followed).
- A job's tasks end with the job: once it ended (or is no longer followed) they have ``end_grace`` seconds
  to finish what they were doing (the publication of the decision that ended it), then whatever
  still runs is cancelled. The ended job is then followed ``retention`` seconds more, then
  forgotten (``forget``, the agent's).
- Waits (``wait_until``) wake on ``notify``: a job changed, a peer was heard, a job task ended;
  each wait has a deadline.
"""

from __future__ import annotations

import logging
import math
from functools import partial
from typing import Any, Callable

import trio

from agent.supervise import guarded, supervised

log = logging.getLogger(__name__)


class Tasks:
    def __init__(self, clock: Callable[[], float], counters: Any, followed: Callable[[bytes], Any],
                 forget: Callable[[bytes], None], end_grace: float = 30.0, retention: float = 3600.0) -> None:
        self.clock = clock
        self.counters = counters
        self.followed = followed  # the job's mirror while we follow it, else None
        self.forget = forget  # stop following an ended job
        self.end_grace = end_grace
        self.retention = retention
        self.nursery: trio.Nursery | None = None  # the agent's, while it runs
        self.job_tasks: dict[bytes, trio.Nursery] = {}  # each followed job's own nursery (spawn_in_job)
        self.ended_at: dict[bytes, float] = {}  # followed jobs that ended: when their tasks were done
        self._changes = trio.Event()  # set (and replaced) when a job changes, a peer is heard or a job task ends

    # -- the agent's own tasks -------------------------------------------------------------------------

    def service(self, name: str, fn: Callable[..., Any], *args: Any) -> None:
        """Start a long-lived task of the agent's, supervised (agent/supervise.py): an exception in it is
        logged and the task restarted after a backoff; it never ends the agent."""
        self.nursery.start_soon(partial(supervised, name, fn, *args, counters=self.counters))

    def one_shot(self, name: str, fn: Callable[..., Any], *args: Any) -> None:
        """Start a one-shot task of the agent's whose exception is logged, never the end of the agent."""
        self.nursery.start_soon(partial(guarded, name, fn, *args, counters=self.counters))

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        """Start a task of the agent's own (it ends when the agent does; an exception in it is logged)."""
        self.one_shot(getattr(fn, "__name__", "task"), fn, *args)

    # -- a job's tasks ---------------------------------------------------------------------------------

    def spawn_in_job(self, job_id: bytes, fn: Callable[..., Any], *args: Any) -> bool:
        """Start a task owned by job ``job_id``: it is cancelled when the job ends (``own_job``). False
        (nothing started) if the job has no running tasks' owner: it ended, or we do not follow it."""
        nursery = self.job_tasks.get(job_id)
        if nursery is None:
            log.debug("job %s: ended; %s not started", job_id.hex()[:8], getattr(fn, "__name__", fn))
            return False

        async def task() -> None:
            try:
                await fn(*args)
            except Exception as exc:  # noqa: BLE001 - one task's bug must not cancel the job's others, nor the agent
                self.counters["task_failures"] += 1
                log.error("job %s: %s failed (%s: %s)", job_id.hex()[:8], getattr(fn, "__name__", fn),
                          type(exc).__name__, str(exc)[:300], exc_info=exc)
            finally:
                self.notify()  # own_job may be waiting for the last one

        nursery.start_soon(task)
        return True

    async def own_job(self, job_id: bytes, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """The owner of a job's tasks (start it with ``nursery.start``): once the job ends they have
        ``end_grace`` seconds to finish, then whatever still runs is cancelled. Leaving the agent
        cancels them all. The ended job is then followed ``retention`` seconds more before it is
        forgotten."""
        async with trio.open_nursery() as nursery:
            self.job_tasks[job_id] = nursery
            task_status.started()
            try:
                await self.wait_until(lambda: self.ended(job_id), math.inf)
                await self.wait_until(lambda: not nursery.child_tasks, self.end_grace)
            finally:
                if self.job_tasks.get(job_id) is nursery:
                    del self.job_tasks[job_id]
                nursery.cancel_scope.cancel()
        if self.followed(job_id) is not None:  # ended: followed a while longer (late verdicts, catch-up)
            self.ended_at[job_id] = self.clock()
            await trio.sleep(self.retention)
            self.forget(job_id)

    def ended(self, job_id: bytes) -> bool:
        view = self.followed(job_id)
        return view is None or view.state.terminal

    def drop(self, job_id: bytes) -> None:
        """The job is forgotten: its tasks are cancelled."""
        self.ended_at.pop(job_id, None)
        nursery = self.job_tasks.pop(job_id, None)
        if nursery is not None:
            nursery.cancel_scope.cancel()

    # -- waits -----------------------------------------------------------------------------------------

    def notify(self) -> None:
        """Something a wait may be waiting for happened: every ``wait_until`` checks its predicate again."""
        self._changes.set()
        self._changes = trio.Event()

    async def wait_until(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until ``predicate()`` holds, re-checked whenever a job
        changes, a peer's heartbeat or capability arrives, or a job's task ends; returns ``predicate()``."""
        with trio.move_on_after(timeout):
            while not predicate():
                await self._changes.wait()
        return predicate()
