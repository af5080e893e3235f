"""One running agent: identity, network, content, store, and the roles it plays.

Rules of this file:
- ``Agent.run`` owns everything: the network and content rooms are opened around one nursery in
  which every task of the agent lives (gossip readers, heartbeats, ticks, the worker's claims and
  shard trainings, the coordinator's verifications and aggregations). Leaving ``run`` (``stop()``,
  cancellation or an error) ends them all.
- The roles see the agent through one port (agent/roles/port.py ``RolePort``), which ``Agent``
  satisfies. Each followed job has its own nursery (``job_tasks``, owned by agent/tasks.py ``own_job`` in
  the agent's nursery): the roles' tasks of a job (claim grants, verifications, aggregations, shard
  trainings, re-announcing, the budget watch) are started in it with ``spawn_in_job``; once the job
  ends they have ``Tasks.end_grace`` seconds to finish, then are cancelled. Waits on peers or a job
  (``wait_until``) wake on job changes, heartbeats and ended job tasks, each with a deadline.
- The test harness injects its hooks at construction (``hooks``: agent/hooks.py), never via the config.
- Peers are known by their signed ``cap`` and ``heartbeat`` messages. A peer is *live* while its
  heartbeats arrive (protocol/election.live_peers); a job's coordinator is elected among live peers
  whose capability can coordinate *that job* (protocol/election.eligible_for_job: it holds the base
  model and, for GPU jobs, a GPU), ourselves judged by the capability we last published.
- Following jobs (``follow_job``): an announcement by its submitter is followed once, within
  ``MAX_JOBS_FOLLOWED`` jobs in all and ``MAX_LIVE_JOBS_PER_SUBMITTER`` unended jobs per announcing
  peer (one identity cannot fill the room; IPIP-0004 §13). Our own jobs are held to the same limit
  when we announce them (agent/roles/submitter.py), so every follower can follow all of them. An
  ended job is forgotten ``Tasks.retention`` seconds after its tasks ended, or at once when a new
  job needs its room (the one that ended first goes first; never one whose tasks still run in their
  end grace: then the new job is refused): its mirror leaves ``jobs``, the roles drop what they kept
  for it (``forget``), its topic is left (``_leaving`` until done: it is not followed again before)
  and its reader ends. The store keeps it: ``load_job_view`` rebuilds it in the store's worker
  thread, the last ``REBUILT_VIEWS`` rebuilt ended jobs kept in memory, and an announcement of a job
  our store holds as ended is not followed.
- What we offer (agent/capability.py ``Capabilities``): hardware measured at start (agent/hardware.py),
  the base models we hold hashed (once per file size and mtime, the hashes kept in the store), our
  measured speeds; all go into the signed ``cap``, which goes out with the heartbeats that service
  sends, and at once to a peer that arrives or when what we offer changes.
- A restarted submitter learns what it missed from its live peers (sync.submitter_catch_up) and
  changes no election view until it has heard peers for ``missed_heartbeats`` heartbeats.
- Election view: a job's coordinator is elected once the job has been known for ``grace_seconds``
  (so that peers whose views converged agree on term 1), and stays until it falls silent; then the
  next peer by rendezvous takes the job with term + 1 (protocol/election.Coordination). A peer acts
  as coordinator only while its own view says so. Both the view changes and acting as coordinator
  need the job's submitter to be heard: in a partition the submitter's side decides.
- A job-topic message is recorded in the store once it applies to our mirror (a held one when it
  finally applies), in the order it applied, and before any action it caused is carried out; what
  our mirror refuses (a flood of well-signed junk from many identities, say) is never written to disk
  and is held in memory within per-signer bounds (protocol/mirror.py). Our own decisions (leases,
  verdicts, aggregates) are recorded when we make them, before they are published; our own worker
  messages when they come back to us. All of it goes through one function, ``commit``: store the
  outcome's evidence, publish what it sends, then carry out its actions and our roles' reactions.
  The writes (one fsync each) run in a worker thread (agent/writer.py), one at a time, so heartbeats
  and gossip never wait on the disk. So do the other writes made from the event loop:
  ledger entries, job rows and file hashes are queued (``write_soon``, agent/store.py ``later``) and
  made in order by the store writer task in that thread; the store probe before a claim
  (``can_take_work``) runs there too. Queued writes are made when the agent stops, and before any
  read of the store except on the event loop: there a read never waits for more than one commit
  in flight and may lag the queue by a moment, so a read that must see what was just queued (the
  bill's last entry, the row of a job just forgotten, a control command) awaits ``flush_writes``
  first. A full disk found by one makes us refuse new work, as for any write. Every decision we make
  is applied to our mirror at once (``decide``), stored, then gossiped. With a full disk the mirror may
  run ahead of the store (we then refuse new work); catch-up brings the rest back after a restart.
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import AsyncExitStack
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any, Callable

import trio

from agent.content.service import ContentService, open_content
from agent.net.errors import NetError
from agent.net.gossip import GossipConfig
from agent.net.host import NetConfig
from agent.net.stack import Network, open_network
from agent.config import AgentConfig  # noqa: F401 - re-exported: agent.node.AgentConfig
from agent.disk import Disk
from agent.capability import Capabilities
from agent.hooks import AgentHooks
from agent.ledger_sync import LedgerService
from agent.loopwatch import LoopWatch
from agent.ledger_sync import sync_loop as ledger_sync_loop
from agent.roles.coordinator import CoordinatorRole
from agent.roles.keep import KeepService
from agent.roles.submitter import SubmitterRole
from agent.roles.sync import (
    RESYNC_INTERVAL, SyncService, catch_up, needs_resync, resync, stalled, submitter_catch_up,
)
from agent.roles.worker import WorkerRole
from agent.store import Store, StoreFullError
from agent.peers import PeerInfo, PeerTable  # noqa: F401 - PeerInfo re-exported (tests, harness)
from agent.jobbook import TERMINAL_STATES, JobBook
from agent.tasks import Tasks
from agent.writer import StoreWriter
from agent.supervise import supervised
from protocol import messages as m
from protocol.mirror import JobMirror, Outcome
from protocol import state as st
from protocol.election import keep_or_elect
from protocol.identity import Identity

log = logging.getLogger(__name__)

MAX_JOBS_FOLLOWED = 256  # jobs followed at once; an ended job makes room for a new one
# jobs not yet ended followed per announcing peer; we announce no more of our own (IPIP-0004 §13)
MAX_LIVE_JOBS_PER_SUBMITTER = st.MAX_LIVE_JOBS_PER_SUBMITTER


STORE_OPEN_WAIT = 120  # seconds an agent starting on a full disk waits for room to open its store


class AgentStopped(Exception):
    """The agent was stopped before it had started (a SIGTERM while it waited to open its store)."""


FIRST_VIEW_WAIT = 5.0  # seconds past the grace a job's first election view waits for live peers' capabilities


class Agent:
    ledger_sync_interval = 10.0  # seconds between pulls of a job's ledger chains from its peers

    def __init__(self, identity: Identity, config: AgentConfig, *, clock: Callable[[], float] = time.time,
                 machine: Any = None, hooks: AgentHooks | None = None) -> None:
        self.identity = identity
        self.config = config
        self.clock = clock
        self.peer_id = identity.peer_id
        # the peers we hear: liveness, capabilities, who may coordinate (agent/peers.py)
        self.peer_table = PeerTable(self.peer_id, clock, config.heartbeat_seconds, config.missed_heartbeats,
                                    lambda: self.capabilities.coordinating())
        self.peers = self.peer_table.peers
        self.live_peers, self.eligible_coordinators = self.peer_table.live_peers, self.peer_table.eligible_coordinators
        self.hears_submitter = self.peer_table.hears_submitter
        self.net: Network | None = None
        self.content: ContentService | None = None
        self.started_at = 0.0
        self.disk = Disk(config.home, config.home / "work", config.home / "blocks", config.max_disk_gb,
                         config.disk_grace_seconds)  # use, collection and quota (agent/disk.py)
        # every write to our store, off the event loop, and what a full disk does (agent/writer.py)
        self.writer = StoreWriter(clock, self.work_dir, self.disk, self.collect_disk, self._tell_capability)
        self.store_limiter = self.writer.limiter
        self.write_soon, self.flush_writes, self.stored = self.writer.write_soon, self.writer.flush, self.writer.stored
        self.refuse_work, self.can_take_work = self.writer.refuse_work, self.writer.can_take_work
        self.ledger, self.save_job_row = self.writer.ledger, self.writer.save_job_row
        # the jobs we follow (their live mirrors) and those rebuilt from the store (agent/jobbook.py)
        self.book = JobBook(self.peer_id, clock, lambda: self.writer.store, self.writer.limiter)
        self.jobs = self.book.jobs
        self.job_view, self.load_job_view, self.rebuild_view = self.book.view, self.book.load, self.book.rebuild
        self.followed_view, self.unended_jobs = self.book.followed, self.book.unended
        self.loopwatch = LoopWatch()  # how long our event loop was blocked, and by what (agent/loopwatch.py)
        # the test harness's injections (agent/hooks.py): an observer tap, a Byzantine worker; never in production
        self.hooks = hooks or AgentHooks()
        # what we offer (machine, models, speeds), our signed capability and heartbeats (agent/capability.py)
        self.capabilities = Capabilities(config, clock, machine=machine, trains=config.accept_training,
                                         store_full=lambda: self.store_full, publish=lambda msg: self.publish(msg),
                                         write_soon=self.write_soon, store=lambda: self.store)
        self.worker = WorkerRole(self, self.hooks.training) if config.accept_training else None
        self.coordinator = CoordinatorRole(self)
        self.submitter = SubmitterRole(self)
        self.sync = SyncService(self)
        # a round's aggregate of our job, copied here before it is published (agent/roles/keep.py)
        self.keep = KeepService(self, self.jobs.get, self.submitter.keep_once)
        self.ledger_service = LedgerService(self)  # copies of the job's other chains (agent/ledger_sync.py)
        self.job_events = trio.Event()  # set (and replaced) whenever a job's state changes
        self._stopping = trio.Event()
        self.counters: Counter[str] = Counter()  # shards_trained, verdicts_accepted, ... (metrics, status)
        # who owns each task (the agent's services, a job's tasks) and the wake-up of every wait (agent/tasks.py)
        self.tasks = Tasks(clock, self.counters, self.jobs.get, self.forget_job)
        self.job_tasks = self.tasks.job_tasks
        self.service, self.one_shot, self.spawn = self.tasks.service, self.tasks.one_shot, self.tasks.spawn
        self.spawn_in_job, self.wait_until = self.tasks.spawn_in_job, self.tasks.wait_until
        self._notify = self.tasks.notify
        self._coordinating: set[bytes] = set()  # jobs whose pending work we took over as coordinator
        self._resyncing: set[bytes] = set()  # jobs whose mirror is being rebuilt (agent/roles/sync.py)
        self._last_resync: dict[bytes, float] = {}
        from agent.market import Reputations

        self.reputations = Reputations(self)
        self._disk_lock = trio.Lock()  # one disk collection at a time
        # blocks we added for a round of a job that no message may name yet (a proof's checkpoints, a
        # report or aggregate not yet published): kept from collection while the round is live
        self.held: dict[bytes, dict[int, set[str]]] = {}

    # -- life cycle -----------------------------------------------------------------------------

    @property
    def work_dir(self) -> Path:
        return self.config.home / "work"

    def addrs(self) -> list[str]:
        return self.net.host.addrs()

    def stop(self) -> None:
        self._stopping.set()

    @property
    def nursery(self) -> trio.Nursery | None:
        """The nursery every task of the agent lives in, while it runs (agent/tasks.py owns them)."""
        return self.tasks.nursery

    @nursery.setter
    def nursery(self, nursery: trio.Nursery | None) -> None:
        self.tasks.nursery = nursery

    @property
    def store(self) -> Store | None:
        """Our store (agent/store.py), open while we run; written through ``writer``."""
        return self.writer.store

    @store.setter
    def store(self, store: Store | None) -> None:
        self.writer.store = store

    @property
    def store_full(self) -> str | None:
        """Why we refuse new work (our store or work directory cannot be written), or None."""
        return self.writer.store_full

    def _tell_capability(self) -> None:
        """What we offer changed (we refuse work, or take it again): tell the peers at once, so that others
        coordinate our jobs meanwhile (a capability is otherwise published every 30 s)."""
        if self.nursery is not None:
            self.one_shot("capability", self._tell_peers)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        home = self.config.home
        home.mkdir(parents=True, exist_ok=True)
        self.work_dir.mkdir(exist_ok=True)
        net_config = NetConfig(listen=self.config.listen, bootstrap=self.config.bootstrap,
                               announce=self.config.announce, relay=self.config.relay)
        async with AsyncExitStack() as stack:
            self.store = stack.enter_context(await self._open_store(home))
            gossip_config = GossipConfig(max_rate=float(self.config.gossip_max_rate),
                                         max_burst=float(self.config.gossip_max_burst))
            self.net = await stack.enter_async_context(open_network(self.identity, net_config, gossip_config,
                                                                    clock=self.clock))
            if not self.net.host.addrs():  # py-libp2p logs a failed listen and carries on without it
                raise NetError(f"listen: cannot listen on {' '.join(self.config.listen)} "
                               "(address in use or not on this machine); choose another address or port")
            self.content = await stack.enter_async_context(
                open_content(self.net.host, self.net.discovery, home, ipfs_api=self.config.ipfs_api))
            self.sync.install(self.net.host)
            self.keep.install(self.net.host)
            self.ledger_service.install(self.net.host)
            await self.capabilities.measure()
            self.started_at = self.clock()
            try:
                await self._run_tasks(task_status)
            finally:
                self.writer.flush_now()  # the writes still queued, before the store closes

    async def _open_store(self, home: Path) -> Store:
        """Our store; on a full disk, tried again every second for ``STORE_OPEN_WAIT`` seconds (said in
        the log) before the StoreFullError ends the start. The soak filled a worker's disk 4 s after
        it restarted: SQLite could not grow its WAL at open ("disk I/O error") and the agent exited 1.
        A stop (SIGTERM) meanwhile ends the wait: ``AgentStopped``."""
        waited = 0
        while True:
            try:
                return Store.in_data_dir(home, self.identity)
            except StoreFullError as exc:
                if self._stopping.is_set():
                    raise AgentStopped("stopped while waiting for room to open the store") from None
                if waited >= STORE_OPEN_WAIT:
                    raise
                if waited % 30 == 0:
                    log.error("%s; trying again every second for up to %d s", exc, STORE_OPEN_WAIT - waited)
            with trio.move_on_after(1):
                await self._stopping.wait()
            waited += 1

    async def _run_tasks(self, task_status: Any) -> None:
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            self.service("store writer", self.writer.run)
            self.service("event loop watch", self.loopwatch.run)
            self.service("disk collection", self._collect_disk_loop)
            await self._resume_jobs()
            jobs_topic = await self.net.gossip.subscribe(m.TOPIC_JOBS)
            self.service("jobs topic reader", self._read_jobs_topic, jobs_topic)
            self.service("heartbeats", self.capabilities.heartbeats, self._coordinating_terms,
                         lambda: len(self.worker.active) if self.worker else 0)
            self.service("ticks", self._ticks)
            self.service("ledger sync", ledger_sync_loop, self, self.ledger_sync_interval)
            self.service("discovery", partial(self.net.discovery.maintain, advertise=self.worker is not None,
                                              interval=10.0))
            if self.worker is not None:
                self.service("claims", self.worker.claim_loop)
                if self.config.measure_speed:
                    from agent.market import measure_speeds

                    self.service("speed measurement", measure_speeds, self.capabilities)
            task_status.started(self)
            await self._stopping.wait()
            if self.worker is not None:
                await self.worker.release_all("the agent is shutting down")
            nursery.cancel_scope.cancel()

    # -- peers and election ----------------------------------------------------------------------

    def update_election(self, view: JobMirror, now: float) -> None:
        """Elect after the grace period; replace a coordinator that fell silent (term + 1). The first view
        also waits (at most ``FIRST_VIEW_WAIT`` s more) for the capability of every live peer: a peer whose
        capability we lack is not eligible in our view, and two peers that each lacked the other's both
        elected themselves in term 1 (the CLI job test under load; IPIP-0006 §1.3 rule 8 resolves it)."""
        if now - view.first_seen < self.config.grace_seconds or view.state.terminal:
            return
        if view.coordination.term == 0 and now - view.first_seen < self.config.grace_seconds + FIRST_VIEW_WAIT and \
                any(self.peer_table.capability_of(p) is None for p in self.live_peers()):
            return
        if not self.hears_submitter(view, settled=True):
            return  # cut off from the submitter (or just back): its side decides; we wait
        before = view.coordination
        view.coordination = keep_or_elect(before, self.eligible_coordinators(view.terms))
        if before.coordinator is not None and view.coordination.coordinator != before.coordinator:
            log.info("job %s: coordinator %s went silent; %s takes over in term %d",
                     view.job_id.hex()[:8], before.coordinator[-8:], (view.coordination.coordinator or "none")[-8:],
                     view.coordination.term)
            self.ledger(view.job_id, "coordinator", {"term": view.coordination.term,
                                                     "coordinator": view.coordination.coordinator or ""})

    def local_model(self, terms: m.JobTerms) -> str | None:
        """Our local copy of a job's base model (``models`` by name, or the path itself), or None."""
        models = dict(self.config.models)
        if terms.base_model in models:
            return models[terms.base_model]
        return terms.base_model if Path(terms.base_model).is_dir() else None

    def is_coordinator(self, view: JobMirror) -> bool:
        """Do we act as the job's coordinator now? Our view names us, its grace period is over, we hear
        the submitter, and our mirror is not catching up on history: a coordinator restarted from its
        store believed itself term 1's coordinator again while the others had moved to term 2, and the
        two granted conflicting leases until the job ran out of attempts (the soak, issue 21)."""
        return view.coordination.is_coordinator(self.peer_id) and not view.catching_up and \
            self.clock() - view.first_seen >= self.config.grace_seconds and self.hears_submitter(view)

    # -- gossip in ---------------------------------------------------------------------------------

    async def publish(self, message: Any) -> None:
        await self.net.gossip.publish(message)

    async def _read_jobs_topic(self, subscription: Any) -> None:
        async for received in subscription:
            msg, signer, now = received.message, received.signer, self.clock()
            if self.hooks.observer is not None:
                self.hooks.observer("recv", received)
            if isinstance(msg, m.Heartbeat):
                arrived = self.peer_table.heard(signer, msg, now)
                if arrived and signer != self.peer_id and self.capabilities.tell_arrival(now):
                    self.one_shot("capability", self._tell_peers)
                self._notify()  # wait_until: someone may wait for a peer to be heard
                for entry in msg.coordinating:
                    view = self.jobs.get(entry.job_id)
                    if view is not None and signer != self.peer_id:  # (what was held for its term may apply)
                        await self.commit(view, view.observe_term(signer, entry.term, now,
                                                                  self.eligible_coordinators(view.terms)))
            elif isinstance(msg, m.Capability):
                self.peer_table.told(signer, msg, now)
                self._notify()
            elif isinstance(msg, m.JobAnnouncement):
                await self.follow_job(msg.terms, signer, received.envelope.to_bytes())
            elif isinstance(msg, m.JobCancel):
                view = self.jobs.get(msg.job_id)
                if view is not None and signer == view.terms.submitter:
                    await self.commit(view, view.cancel(msg.reason, now))

    async def _resume_jobs(self) -> None:
        """Rebuild the mirror of every unfinished job in our store, as if its messages arrived again.

        A restarted agent carries on where it was: the stored envelopes of each job's topic are
        replayed in stored order (``JobMirror.replay``: our own decisions as when we made them), with
        each envelope's own timestamp as the clock. The election view starts over with a fresh grace
        period, so we do not crown ourselves before the peers' heartbeats
        arrive; lease expiry and take-over then follow from the ticks as for any job.
        """
        for record in self.store.jobs():
            if record.state in TERMINAL_STATES:
                continue
            view = self.rebuild_view(record)
            view.catching_up = record.terms.submitter != self.peer_id  # until the submitter's history is in
            self.book.add(view)
            await self.nursery.start(self.tasks.own_job, record.job_id)
            log.info("job %s: resumed from the store: %s, round %d, term %d", record.job_id.hex()[:8],
                     view.state.phase.value, view.state.round, view.coordination.term)
            if view.state.phase.value != record.state:  # queued: a full disk makes us refuse work, not stop
                self.write_soon(self.store.update_job, record.job_id, self.clock(), state=view.state.phase.value,
                                round=view.state.round)
            subscription = await self.net.gossip.subscribe(m.job_topic(record.job_id))
            self.nursery.start_soon(partial(self._read_job_topic, view, subscription, True, resumed=True))  # supervised
            if record.terms.submitter == self.peer_id:
                self.spawn_in_job(view.job_id, self.submitter.resume, view)
            if self.worker is not None:
                self.worker.consider(view)
                self.spawn_in_job(view.job_id, self.worker.release_stale, view)
            self.one_shot(f"job {view.job_id.hex()[:8]}: provide again", self._provide_again, view)

    async def _provide_again(self, view: JobMirror) -> None:
        """After a restart our address changed: provide again the job's aggregates and adapters we hold."""
        from protocol.cid import parse_cid

        cids = [a.adapter_cid for a in view.aggregates.values()]
        cids += [report.adapter_cid for report, _ in view.reports.values()]
        for text in cids:
            cid = parse_cid(text)
            if self.content.store.has(cid):
                with trio.move_on_after(30):
                    await self.net.discovery.provide(cid)

    async def follow_job(self, terms: m.JobTerms, signer: str, envelope: bytes | None = None) -> JobMirror | None:
        """Start following a job we saw announced (once); subscribe to its topic."""
        job_id = terms.job_id()
        if job_id in self.jobs:
            return self.jobs[job_id]
        if signer != terms.submitter:
            log.warning("job %s announced by %s, not its submitter; ignored", job_id.hex()[:8], signer[-8:])
            return None
        if job_id in self.book.leaving:  # forgotten a moment ago: its topic is still being left (forget_job)
            if signer != self.peer_id:  # the jobs topic's reader waits for nobody: its next announcement will do
                log.debug("job %s: its topic is still being left; not followed again yet", job_id.hex()[:8])
                return None
            await self.wait_until(lambda: job_id not in self.book.leaving, 15)  # leave() gives up after 10 s
            if job_id in self.jobs:
                return self.jobs[job_id]
        if signer != self.peer_id and self.store.pending():
            await self.flush_writes()  # _room_to_follow reads the job's row: that of a job just forgotten is queued
            if job_id in self.jobs:
                return self.jobs[job_id]
        if signer != self.peer_id and not self._room_to_follow(job_id, signer):
            return None
        now = self.clock()
        role = "submitter" if signer == self.peer_id else ("worker" if self.worker else "observer")
        if not self.stored(self.store.add_job, terms, role, now):
            if signer == self.peer_id:
                raise StoreFullError(self.store_full or "the store cannot be written")
            return None  # we cannot keep its evidence: we do not follow it (refused, logged)
        if envelope is not None:
            self.stored(self.store.record, envelope, now)
        view = JobMirror(terms, now, self.peer_id)
        view.catching_up = signer != self.peer_id  # until the submitter's history is in (_read_job_topic)
        self.book.add(view)
        await self.nursery.start(self.tasks.own_job, job_id)
        subscription = await self.net.gossip.subscribe(m.job_topic(job_id))
        # the job may have a history we missed (we joined late, or were down): ask its submitter
        self.nursery.start_soon(self._read_job_topic, view, subscription, True)  # its reading loop is supervised
        if self.worker is not None:
            self.worker.consider(view)
        return view

    def _room_to_follow(self, job_id: bytes, signer: str) -> bool:
        """May we follow a job ``signer`` (not us) announced? Not if our store holds it as ended (we
        forgot it: an old announcement came again), nor past ``MAX_LIVE_JOBS_PER_SUBMITTER`` unended
        jobs of that signer, nor past ``MAX_JOBS_FOLLOWED`` unended jobs; an ended job, the one that
        ended first, is forgotten to make room, never one whose tasks still run (its end grace)."""
        record = self.store.job(job_id)
        if record is not None and record.state in TERMINAL_STATES:
            return False
        live = [v for v in self.jobs.values() if not v.state.terminal]
        if len(self.unended_jobs(signer)) >= MAX_LIVE_JOBS_PER_SUBMITTER:
            self.counters["jobs_not_followed"] += 1
            log.debug("job %s: %s already has %d jobs we follow; not followed", job_id.hex()[:8], signer[-8:],
                      MAX_LIVE_JOBS_PER_SUBMITTER)
            return False
        if len(self.jobs) < MAX_JOBS_FOLLOWED:
            return True
        if len(live) >= MAX_JOBS_FOLLOWED:
            self.counters["jobs_not_followed"] += 1
            log.debug("job %s: we follow %d jobs already; not followed", job_id.hex()[:8], len(live))
            return False
        # an ended job whose tasks still run (its end grace: the decision that ended it being published)
        # is never forgotten: without any other, the new job is refused as when all are live
        ended = [j for j, v in self.jobs.items() if v.state.terminal and j not in self.job_tasks]
        if not ended:
            self.counters["jobs_not_followed"] += 1
            log.debug("job %s: we follow %d jobs already, none ended long enough to forget; not followed",
                      job_id.hex()[:8], len(self.jobs))
            return False
        now = self.clock()
        self.forget_job(min(ended, key=lambda j: self.tasks.ended_at.get(j, now)))
        return True

    def forget_job(self, job_id: bytes) -> None:
        """Stop following a job that ended: its mirror leaves ``jobs`` (it counts no more toward
        MAX_JOBS_FOLLOWED), its tasks are cancelled, its topic is left (in the background, within 10 s)
        and its reader ends. The store keeps the job and its evidence."""
        view = self.jobs.get(job_id)
        if view is None or not view.state.terminal:
            return
        del self.jobs[job_id]
        self.writer.forget(job_id)
        self._last_resync.pop(job_id, None)
        self._coordinating.discard(job_id)
        self.tasks.drop(job_id)
        self.coordinator.forget(job_id)
        if self.worker is not None:
            self.worker.forget(job_id)
        self.ledger_service.forget(job_id)
        log.info("job %s: ended (%s); no longer followed", job_id.hex()[:8], view.state.phase.value)
        self.book.leaving.add(job_id)  # not followed again until its topic is left (a new subscription would be closed)

        async def leave() -> None:
            try:
                with trio.move_on_after(10):
                    await self.net.gossip.unsubscribe(m.job_topic(job_id))
            finally:
                self.book.leaving.discard(job_id)
                self._notify()

        self.nursery.start_soon(leave)
        self._notify()

    async def _read_job_topic(self, view: JobMirror, subscription: Any, catch_up_first: bool = False, *,
                              resumed: bool = False) -> None:
        """Apply the job topic's messages to our mirror; first, if asked, catch up on the job's history
        from its submitter, or, if we are the submitter and ``resumed`` it after a restart, from its
        live peers (live messages wait in the subscription meanwhile; agent/roles/sync.py)."""
        synced: set[bytes] = set()
        try:
            if catch_up_first and view.terms.submitter != self.peer_id:  # (catching_up set when followed)
                synced = await catch_up(self, view)
            elif catch_up_first and resumed:
                synced = await submitter_catch_up(self, view)
        except StoreFullError as exc:
            self.refuse_work(exc)
        except Exception as exc:  # noqa: BLE001 - a failed catch-up is logged; live messages still apply
            self.counters["task_failures"] += 1
            log.error("job %s: catching up failed (%s: %s)", view.job_id.hex()[:8], type(exc).__name__, exc,
                      exc_info=exc)
        finally:
            view.catching_up = False
        if synced:
            self.apply_actions(view, ())
        await supervised(f"job {view.job_id.hex()[:8]} topic reader", self._apply_job_topic, view, subscription,
                         synced, counters=self.counters)

    async def _apply_job_topic(self, view: JobMirror, subscription: Any, synced: set[bytes]) -> None:
        async for received in subscription:
            if self.hooks.observer is not None:
                self.hooks.observer("recv", received)
            if self.jobs.get(view.job_id) is not view:
                break  # the job was forgotten (forget_job): what is still buffered is not applied
            if received.envelope.message_id in synced:
                continue  # already applied from the history
            await self.on_job_message(view, received)

    async def on_job_message(self, view: JobMirror, received: Any) -> None:
        """One verified message of the job's topic (``received``: message, signer, envelope): our mirror
        receives it, and we commit what it caused."""
        msg, signer, now = received.message, received.signer, self.clock()
        if isinstance(msg, m.ShardClaim):
            # a request to the coordinator, not a change of the job: never stored
            await self.coordinator.on_claim(view, msg, signer)
            return
        await self.commit(view, view.receive(msg, signer, now, self.eligible_coordinators(view.terms),
                                             received.envelope.to_bytes()))

    async def decide(self, view: JobMirror, decision: Any) -> bool:
        """Our own decision as the job's coordinator or judge (a lease, a verdict, an aggregate): signed,
        applied to our mirror, stored, published, then carried out (``commit``). False if the mirror
        refused it (it moved on meanwhile) or the disk is full: then it was not published."""
        outcome = view.decide(decision, self.clock(), self.net.gossip.seal(decision))
        return outcome.changed and await self.commit(view, outcome)

    async def commit(self, view: JobMirror, outcome: Outcome, *, act: bool = True) -> bool:
        """The one place where what our mirror did reaches the world (protocol/mirror.py), always in this
        order: store its evidence (one transaction), publish what goes out, then carry out its actions
        and our roles' reactions (``act=False``: history, nothing to carry out). A crash at any point
        leaves nothing published that is not stored. False (we refuse new work; nothing published,
        nothing carried out: the mirror moved, a restart catches up) if the disk is full."""
        if outcome.evidence and not await self.writer.store_evidence(outcome.evidence):
            return False
        if outcome.outgoing is not None:  # our decision: the first message its outcome applied (JobMirror.decide)
            await self.net.gossip.publish_sealed(outcome.applied[0][0], outcome.outgoing)
        if act and outcome.changed:
            self.apply_actions(view, outcome.actions)
            self.react(view, list(outcome.applied))  # this message and any held one it unblocked
        return True

    def react(self, view: JobMirror, applied: list[tuple[Any, str]]) -> None:
        """Our roles' reactions to messages the mirror applied: a lease for us, verdicts, aggregates."""
        for msg, by in applied:
            if self.worker is not None and isinstance(msg, m.ShardLease) and msg.worker == self.peer_id:
                self.worker.on_lease(view, msg)
            elif isinstance(msg, m.Verdict):
                self.submitter.on_verdict(view, msg)
            elif isinstance(msg, m.AggregatePublished):
                self.submitter.on_aggregate(view, msg, by)

    def apply_actions(self, view: JobMirror, actions: tuple[Any, ...] | None) -> None:
        """Carry out what the state machine asked for, in our roles; wake anyone waiting on the job."""
        if actions is None:
            return
        self.save_job_row(view)
        self.coordinator.on_actions(view, actions)
        if self.worker is not None:  # any change may free a shard for us (a verdict often returns no action)
            self.worker.wake()
        if self.hooks.observer is not None and actions:
            self.hooks.observer("state", view, actions)
        for action in actions:
            kind = _LEDGER_KIND.get(type(action).__name__)
            if kind is not None:
                log.info("job %s: %s", view.job_id.hex()[:8], action)
                self.ledger(view.job_id, kind, _action_data(action))
        self.job_events.set()
        self.job_events = trio.Event()
        self._notify()

    def hold(self, job_id: bytes, rnd: int, cid: Any) -> None:
        """Keep ``cid``, added for round ``rnd`` of the job, from disk collection while that round is
        live, though no message names it (agent/disk.py)."""
        self.held.setdefault(job_id, {}).setdefault(rnd, set()).add(str(cid))

    async def collect_disk(self) -> None:
        """Delete the blocks and work directories no job needs any more (agent/disk.py), measuring the
        home's use before and after; in a worker thread (one at a time)."""
        from agent import disk

        busy: dict[bytes, list[tuple[int, int, int]]] = {}
        for job_id, rnd, shard, attempt in (self.worker.active if self.worker else {}):
            busy.setdefault(job_id, []).append((rnd, shard, attempt))
        plans = [disk.plan_job(view, self.peer_id, busy.get(view.job_id, ()), self.held.get(view.job_id, {}))
                 for view in list(self.jobs.values())]
        for plan in plans:  # what the plans no longer hold is forgotten
            held = self.held.get(plan.job_id, {})
            for rnd in [r for r in held if r < plan.oldest]:
                del held[rnd]

        def collect() -> None:
            self.disk.observe()
            found = disk.collect(self.work_dir, self.content.store, plans, grace=self.disk.grace)
            self.disk.account(found)
            if found:
                self.disk.observe()
                log.info("disk: collected %d blocks and %d work directories (%.1f MB) no job needs; home uses "
                         "%.1f MB", found.blocks, found.dirs, found.bytes / 1e6, self.disk.usage.total / 1e6)

        async with self._disk_lock:
            await trio.to_thread.run_sync(collect)
            self.disk.collected_at = trio.current_time()

    async def _collect_disk_loop(self) -> None:
        from agent.disk import INTERVAL

        while True:
            await self.collect_disk()
            await trio.sleep(INTERVAL)

    async def _tell_peers(self) -> None:
        """Our capability now, for peers that have not heard it (arrived, or what we offer changed)."""
        with trio.move_on_after(10):
            await self.capabilities.publish()

    def _coordinating_terms(self) -> list[m.CoordinatorTerm]:
        """The jobs we coordinate now, for our heartbeats."""
        return [m.CoordinatorTerm(v.job_id, v.coordination.term) for v in self.jobs.values()
                if self.is_coordinator(v) and not v.state.terminal]

    def provide_soon(self, cid: Any) -> None:
        """Announce in the DHT that we hold ``cid``, in the background (at most 30 s, failures logged):
        nothing we must send waits on one DHT peer; those who need it first are told our peer ID."""
        async def provide() -> None:
            try:
                await self.net.discovery.provide(cid)
            except Exception as exc:  # noqa: BLE001 - best effort: the message names us as provider
                log.info("provide %s: %s", cid, exc)

        self.nursery.start_soon(provide)

    # -- the clock: elections, timers, rebuilds ------------------------------------------------------

    async def _ticks(self) -> None:
        while True:
            now = self.clock()
            for view in list(self.jobs.values()):
                await self._tick_job(view, now)
            self.capabilities.save_file_hashes()  # hashes taken in training, replay or verification threads
            await trio.sleep(0.5)

    async def _tick_job(self, view: JobMirror, now: float) -> None:
        """One tick of a job: the election, the state machine's clock, a rebuild if the mirror diverged,
        taking the job over when we were just elected, judging the coordinator's own reports."""
        before = view.coordination
        self.update_election(view, now)
        if view.coordination != before:
            await self._retry_held(view, now)
        await self.commit(view, view.tick(now))
        if view.job_id not in self._resyncing and \
                now - self._last_resync.get(view.job_id, 0.0) > RESYNC_INTERVAL and \
                (needs_resync(view, self.eligible_coordinators(view.terms), now) or stalled(view, self.peer_id, now)):
            self._last_resync[view.job_id] = now
            view.resynced_at = now  # what is held now does not ask for another rebuild (sync.needs_resync)
            self._resyncing.add(view.job_id)
            self.one_shot(f"job {view.job_id.hex()[:8]}: resync", self._resync, view)
        if not self.is_coordinator(view):
            self._coordinating.discard(view.job_id)
        elif view.job_id not in self._coordinating:  # newly elected, or resumed after a restart
            self._coordinating.add(view.job_id)
            self.coordinator.take_over(view)
        self.coordinator.judge_reports(view)  # the coordinator's own reports, if we are their judge

    async def _retry_held(self, view: JobMirror, now: float) -> None:
        """Our view of the job's term moved (an election tick, a coordinator's heartbeat): the messages
        held for that term may apply now -- e.g. the judge's verdict on our own report, which reached us
        before our own tick made us the coordinator (IPIP-0006 §1.3 rule 6); held until another message
        applied, it left our mirror a round behind the submitter's and the round never aggregated."""
        if view.pending:
            await self.commit(view, view.retry(now, self.eligible_coordinators(view.terms)))

    async def _resync(self, view: JobMirror) -> None:
        try:
            await self._resync_once(view)
        except StoreFullError as exc:
            self.refuse_work(exc)
        finally:
            self._resyncing.discard(view.job_id)

    async def _resync_once(self, view: JobMirror) -> None:
        if view.terms.submitter == self.peer_id:  # our history is the reference: ask peers what we missed
            await submitter_catch_up(self, view)
            return
        if await resync(self, view):  # (held live messages that apply on the rebuilt mirror are committed)
            if self.is_coordinator(view) and view.job_id in self._coordinating:
                # the rebuilt mirror's pending work (its replay's actions were nobody's): verify, aggregate
                self.coordinator.resume(view)

    async def wait_for(self, predicate: Callable[[], bool], timeout: float) -> None:
        """Wait until ``predicate()`` holds, re-checked whenever a job changes; TooSlowError after ``timeout``."""
        with trio.fail_after(timeout):
            while not predicate():
                with trio.move_on_after(1.0):
                    await self.job_events.wait()


_LEDGER_KIND = {"FailJob": "failed", "Done": "done", "CancelJob": "cancel"}


def _action_data(action: Any) -> dict:
    data = dict(action.__dict__)
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in data.items()
            if isinstance(v, (int, float, str, tuple)) and not (isinstance(v, float) and not math.isfinite(v))}
