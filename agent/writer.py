"""StoreWriter: every write an agent makes to its store, off the event loop, and what a full disk does.

Rules of this file:
- One service with one job (issue 23: the agent as a few services): the agent's writes to its store
  (agent/store.py) run in a worker thread, one at a time (``limiter``), in order, so heartbeats and
  gossip never wait on the disk.
- Evidence (``store_evidence``: the envelopes a mirror's outcome applied, agent/evidence.py ``Evidence.commit``) is
  written in one transaction and awaited: nothing is published or carried out before it is stored.
  Everything else (ledger entries, job rows, file hashes) is queued (``write_soon``, agent/store.py
  ``later``) and made in order by ``run`` (the store writer task); ``flush`` makes the queue now, for
  a read that must see what was just queued.
- A full disk never brings the agent down: any write that meets it makes us refuse new work
  (``refuse_work``: ``store_full`` says why; ``tell`` tells the agent, which publishes its
  capability at once so the next peer by rank coordinates our jobs) until ``can_take_work`` finds room
  again (a one-page store write, a 1 MiB write in the work directory, and the disk quota); on a full
  disk it collects what no job needs at once, with a grace of seconds, not minutes.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, Callable

import trio

from agent.disk import FULL_GRACE
from agent.store import FULL_ERRNOS, Store, StoreFullError

log = logging.getLogger(__name__)

WORK_PROBE_BYTES = 1 << 20
STORE_OPEN_WAIT = 120  # seconds an agent starting on a full disk waits for room to open its store
FULL_COLLECT_EVERY = 5.0  # seconds: at most one collection this often while the disk is full (or over the quota)


class StoreNotOpened(Exception):
    """The agent was stopped before it had started (a SIGTERM while it waited to open its store)."""


class StoreWriter:
    def __init__(self, clock: Callable[[], float], work_dir: Path, disk: Any,
                 collect_disk: Callable[..., Awaitable[None]], tell: Callable[[], None]) -> None:
        self.clock = clock
        self.work_dir = work_dir
        self.disk = disk  # agent/disk.Disk: its quota is checked before new work
        self.collect_disk = collect_disk
        self.tell = tell  # we start refusing work, or take it again: the agent tells its peers
        self.store: Store | None = None  # set once the agent opened it
        self.limiter = trio.CapacityLimiter(1)  # store writes in a worker thread, one at a time, in order
        self.store_full: str | None = None  # why we refuse new work: our store cannot be written (disk full)
        self._full_logged = 0.0
        self._queued = trio.Event()  # set when write_soon queued a write for run()
        self._job_rows: dict[bytes, tuple[str, int, int]] = {}  # (state, round, term) last written per job

    async def open(self, home: Path, identity: Any, stopping: trio.Event) -> Store:
        """Our store; on a full disk, tried again every second for ``STORE_OPEN_WAIT`` seconds (said in
        the log) before the StoreFullError ends the start. The soak filled a worker's disk 4 s after
        it restarted: SQLite could not grow its WAL at open ("disk I/O error") and the agent exited 1.
        ``stopping`` set meanwhile (a SIGTERM) ends the wait: ``StoreNotOpened``."""
        waited = 0
        while True:
            try:
                return Store.in_data_dir(home, identity)
            except StoreFullError as exc:
                if stopping.is_set():
                    raise StoreNotOpened("stopped while waiting for room to open the store") from None
                if waited >= STORE_OPEN_WAIT:
                    raise
                if waited % 30 == 0:
                    log.error("%s; trying again every second for up to %d s", exc, STORE_OPEN_WAIT - waited)
            with trio.move_on_after(1):
                await stopping.wait()
            waited += 1

    # -- evidence: awaited -----------------------------------------------------------------------------

    async def store_evidence(self, evidence: tuple[bytes, ...]) -> bool:
        """Store envelopes a mirror applied, in that order, in one commit made in a worker thread (the
        event loop runs on while the disk syncs). False (and we refuse new work) if the disk is full."""
        now, store = self.clock(), self.store

        def write() -> None:
            with store.transaction():
                for data in evidence:
                    store.record(data, now)

        try:
            await trio.to_thread.run_sync(write, limiter=self.limiter)
        except StoreFullError as exc:
            self.refuse_work(exc)
            return False
        return True

    # -- queued writes ---------------------------------------------------------------------------------

    def write_soon(self, write: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Queue a store write whose result we do not wait for; ``run`` makes it in a worker thread, in
        order after those queued before (agent/store.py ``later``/``flush``)."""
        self.store.later(write, *args, **kwargs)
        self._queued.set()

    def ledger(self, job_id: bytes, kind: str, data: dict) -> None:
        """Append an entry to our chain of the job's ledger: queued (a failure is logged, or on a full
        disk makes us refuse work: the ledger never stops the agent)."""
        self.write_soon(self.store.append_event, job_id, kind, data, self.clock())

    def save_job_row(self, view: Any) -> None:
        """Write the job's summary (state, round, term) to the store when it changed since we last did:
        one commit per change, not one per applied message (the envelopes are the evidence)."""
        row, job_id, store = (view.state.phase.value, view.state.round, view.coordination.term), view.job_id, self.store
        if self._job_rows.get(job_id) == row:
            return
        self._job_rows[job_id] = row

        def write() -> None:  # in the store writer's thread; its error is the queue's (``flush``)
            written = False
            try:
                store.update_job(job_id, self.clock(), state=row[0], round=row[1], coordinator_term=row[2])
                written = True
            finally:
                if not written and self._job_rows.get(job_id) == row:
                    self._job_rows.pop(job_id, None)  # not written: written again at the next change

        self.write_soon(write)

    def forget(self, job_id: bytes) -> None:
        self._job_rows.pop(job_id, None)

    async def run(self) -> None:
        """Make the queued store writes in a worker thread (``limiter``: one store thread at a time,
        evidence commits included); a full disk makes us refuse new work, other errors are logged.
        While it runs, reads of the store on the event loop thread do not make the queued writes
        (agent/store.py ``loop_thread``): they could lag them by a moment; ``flush`` where that
        matters. It wakes at least once a second, so errors of queued writes that another thread's
        read made are acted on (a full disk: refuse work) promptly."""
        self.store.loop_thread = threading.get_ident()
        try:
            while True:
                self._queued = trio.Event()
                if self.store.pending():
                    await self.flush()
                with trio.move_on_after(1):
                    await self._queued.wait()
        finally:
            self.store.loop_thread = None

    async def flush(self) -> None:
        """Make the queued store writes now, in the store's worker thread (``run``'s step; also for a
        read on the event loop that must see what was just queued: a ledger entry, a job row). A full
        disk makes us refuse new work; other errors are logged."""
        for exc in await trio.to_thread.run_sync(self.store.flush, limiter=self.limiter):
            if isinstance(exc, StoreFullError):
                self.refuse_work(exc)
            else:
                log.warning("store: %s", exc)

    def flush_now(self) -> None:
        """The agent stops: make the writes still queued here and now."""
        if self.store is None:
            return
        for exc in self.store.flush():
            log.warning("store: %s", exc)

    # -- a full disk -----------------------------------------------------------------------------------

    def stored(self, write: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
        """Run a store write; if the disk is full, refuse new work (``refuse_work``) and return False
        instead of raising: a full disk must not bring the agent down."""
        try:
            write(*args, **kwargs)
            return True
        except StoreFullError as exc:
            self.refuse_work(exc)
            return False

    def refuse_work(self, exc: Exception) -> None:
        """Our store cannot be written: claim no shard, follow no new job and stop being eligible to
        coordinate (``tell``: our capability says so at once, so the next peer by rank takes our
        jobs) until it can (re-checked every claim interval); say why in the log (once a minute) and in
        ``agent status``."""
        now = self.clock()
        if self.store_full is None:
            self.tell()
        self.store_full = str(exc)
        if now - self._full_logged > 60:
            self._full_logged = now
            log.error("refusing new work: %s", exc)

    async def can_take_work(self) -> bool:
        """Is there room to keep the evidence of new work? A small test write (one page, one fsync, in
        the store's worker thread), made before each claim and, while we refuse work, every claim
        interval; clears ``store_full`` when it passes. When the disk is full, what no job needs is
        collected at once (at most every ``FULL_COLLECT_EVERY`` seconds), young files but the last
        ``FULL_GRACE`` seconds' included, and the probe made again: the collection every ``INTERVAL``
        with its grace of minutes left a full agent idle for two and a half minutes (issue 24: the demo
        on a 600 MB disk stalled from 30 s to 180 s, its coordinator silent meanwhile)."""
        try:
            try:
                await self._probe()
            except StoreFullError:
                if trio.current_time() - self.disk.collected_at <= FULL_COLLECT_EVERY:
                    raise
                await self.collect_disk(grace=min(self.disk.grace, FULL_GRACE))
                await self._probe()
            if self.disk.quota is not None:
                if trio.current_time() - self.disk.collected_at > FULL_COLLECT_EVERY:  # at most every 5 s while we refuse
                    await self.collect_disk()
                self.disk.check_claim()
        except StoreFullError as exc:  # a full disk, or our quota (agent/disk.py DiskQuotaError)
            self.refuse_work(exc)
            return False
        if self.store_full is not None:
            log.warning("the store can be written again: taking new work")
            self.store_full = None
            self.tell()
        return True

    async def _probe(self) -> None:
        await trio.to_thread.run_sync(self.store.probe_write, limiter=self.limiter)
        await trio.to_thread.run_sync(probe_work_dir, self.work_dir)


def probe_work_dir(work_dir: Path) -> None:
    """A 1 MiB write (fsynced, then removed) in the work directory, where shards, checkpoints and bundles
    go: StoreFullError when it does not fit. The store's probe alone passed on a full disk (SQLite had
    free pages inside its file) while every shard failed with ENOSPC: a worker claimed, failed and gave
    back the same shard three times in a second and the job failed (the soak, issue 25)."""
    probe = work_dir / ".probe-write"
    try:
        work_dir.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as file:
            file.write(b"\0" * WORK_PROBE_BYTES)
            file.flush()
            os.fsync(file.fileno())
    except OSError as exc:
        if exc.errno in FULL_ERRNOS:
            raise StoreFullError(f"{work_dir}: no room for new work ({exc.strerror})") from None
        raise
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
