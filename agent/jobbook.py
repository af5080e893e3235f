"""JobBook: the jobs an agent follows (their live mirrors), and the mirrors of jobs it no longer follows.

Rules of this file:
- One service with one job (issue 23: the agent as a few services). ``jobs`` holds the live mirror
  (protocol/mirror.JobMirror) of each job we follow; the agent's follow/forget (agent/node.py) add and
  remove them. A job we do not follow (it ended before a restart, or was forgotten) is rebuilt from
  the store: its stored envelopes replayed in stored order (``rebuild``; every signature checked
  again), its state the stored one if that ended (a cancel is not a job-topic message). ``load`` does
  it in the store's worker thread, so the event loop runs on; the last ``REBUILT_VIEWS`` rebuilt ended
  jobs are kept (least recently shown dropped first), so ``job watch`` polling a forgotten job
  rebuilds it once.
- ``leaving``: forgotten jobs whose topic is still being left; they are not followed again before.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace
from typing import Any, Callable

import trio

from protocol import state as st
from protocol.mirror import JobMirror

REBUILT_VIEWS = 8  # ended jobs' mirrors rebuilt from the store (job show/watch/bill of a forgotten job), kept
TERMINAL_STATES = frozenset({"DONE", "FAILED", "CANCELLED"})


class JobBook:
    def __init__(self, me: str, clock: Callable[[], float], store: Callable[[], Any],
                 limiter: trio.CapacityLimiter) -> None:
        self.me = me
        self.clock = clock
        self.store = store  # the agent's store, once open
        self.limiter = limiter  # the store's worker thread (agent/writer.py)
        self.jobs: dict[bytes, JobMirror] = {}
        self.leaving: set[bytes] = set()  # forgotten jobs whose topic is being left (not followed again until done)
        self.rebuilt: OrderedDict[bytes, JobMirror] = OrderedDict()  # ended jobs' rebuilt mirrors, least recent first

    def followed(self, job_id: bytes) -> JobMirror | None:
        """Our live mirror of a job we follow now (a rebuild replaces it), or None: nothing is rebuilt."""
        return self.jobs.get(job_id)

    def unended(self, submitter: str) -> list[bytes]:
        """The jobs of ``submitter`` we follow that have not ended (MAX_LIVE_JOBS_PER_SUBMITTER)."""
        return [j for j, v in self.jobs.items() if v.terms.submitter == submitter and not v.state.terminal]

    def add(self, view: JobMirror) -> None:
        self.jobs[view.job_id] = view
        self.rebuilt.pop(view.job_id, None)

    def rebuild(self, record: Any) -> JobMirror:
        """A job's mirror rebuilt from the store: its stored envelopes replayed in stored order."""
        view = JobMirror(record.terms, self.clock(), self.me)
        for stored in self.store().envelopes(record.job_id, stored_order=True):
            view.replay(stored.message, stored.signer, stored.timestamp_ms / 1000.0)  # stored: nothing to do
        return view

    def view(self, job_id: bytes) -> JobMirror:
        """The live mirror of a job we follow, or one rebuilt from the store, here and now (LookupError
        if the store does not hold it): ``load`` does it off the event loop."""
        view = self._known(job_id)
        return view if view is not None else self._keep_rebuilt(job_id, self._stored(job_id))

    async def load(self, job_id: bytes) -> JobMirror:
        """``view`` for the control commands (``job show``, ``watch``, ``bill``...): a job we do not follow
        is rebuilt in the store's worker thread."""
        view = self._known(job_id)
        if view is not None:
            return view
        rebuilt = await trio.to_thread.run_sync(self._stored, job_id, limiter=self.limiter)
        view = self._known(job_id)  # followed again meanwhile: the live mirror
        return view if view is not None else self._keep_rebuilt(job_id, rebuilt)

    def _known(self, job_id: bytes) -> JobMirror | None:
        view = self.jobs.get(job_id)
        if view is None and job_id in self.rebuilt:
            self.rebuilt.move_to_end(job_id)
            view = self.rebuilt[job_id]
        return view

    def _stored(self, job_id: bytes) -> JobMirror:
        """A job's mirror rebuilt from the store, its state the stored one if that ended (any thread)."""
        record = self.store().job(job_id)
        if record is None:
            raise LookupError(f"job {job_id.hex()[:16]} is not in the store")
        view = self.rebuild(record)
        if record.state in TERMINAL_STATES and not view.state.terminal:  # a cancel is not a job-topic message
            view.state = replace(view.state, phase=st.JobPhase(record.state))
        return view

    def _keep_rebuilt(self, job_id: bytes, view: JobMirror) -> JobMirror:
        if view.state.terminal:  # an ended job's history no longer changes: kept, least recently used dropped
            self.rebuilt[job_id] = view
            self.rebuilt.move_to_end(job_id)
            while len(self.rebuilt) > REBUILT_VIEWS:
                self.rebuilt.popitem(last=False)
        return view
