"""One running agent: identity, network, content, store, and the roles it plays.

Rules of this file:
- ``Agent.run`` owns everything: the network and content rooms are opened around one nursery in
  which every task of the agent lives (gossip readers, heartbeats, ticks, the worker's claims and
  shard trainings, the coordinator's verifications and aggregations). Leaving ``run`` (``stop()``,
  cancellation or an error) ends them all.
- The roles never see the agent: each is built with the few services it uses (agent/roles/port.py
  lists them: ``Local``, ``PeerTable``, ``Tasks``, ``Blocks``, ``Evidence``, ...). Each followed job
  has its own nursery (``job_tasks``, owned by agent/tasks.py ``own_job`` in the agent's nursery): the roles' tasks of a job (claim grants, verifications, aggregations, shard
  trainings, re-announcing, the budget watch) are started in it with ``spawn_in_job``; once the job
  ends they have ``Tasks.end_grace`` seconds to finish, then are cancelled. Waits on peers or a job
  (``wait_until``) wake on job changes, heartbeats and ended job tasks, each with a deadline.
- The test harness injects its hooks at construction (``hooks``: agent/hooks.py), never via the config.
- Peers are known by their signed ``cap`` and ``heartbeat`` messages. A peer is *live* while its
  heartbeats arrive (protocol/election.live_peers); a job's coordinator is elected among live peers
  whose capability can coordinate *that job* (protocol/election.eligible_for_job: it holds the base
  model and, for GPU jobs, a GPU), ourselves judged by the capability we last published.
- Following jobs (agent/following.py ``Following``): an announcement by its submitter is followed once,
  within ``MAX_JOBS_FOLLOWED`` jobs in all and ``MAX_LIVE_JOBS_PER_SUBMITTER`` unended jobs per announcing
  peer (IPIP-0004 §13); an ended job is forgotten after ``Tasks.retention`` seconds, or when a new job
  needs its room. The store keeps it: ``load_job_view`` rebuilds it in the store's worker thread, the
  last ``REBUILT_VIEWS`` rebuilt ended jobs kept in memory (agent/jobbook.py).
- What we offer (agent/capability.py ``Capabilities``): hardware measured at start (agent/hardware.py),
  the base models we hold hashed (once per file size and mtime, the hashes kept in the store), our
  measured speeds; all go into the signed ``cap``, which goes out with the heartbeats that service
  sends, and at once to a peer that arrives or when what we offer changes.
- A restarted submitter learns what it missed from its live peers (sync.submitter_catch_up) and
  changes no election view until it has heard peers for ``missed_heartbeats`` heartbeats.
- Elections, the state machines' timers, rebuilds of a diverged mirror and taking a job over run on one
  clock, ``JobClock`` (agent/jobclock.py); a peer acts as a job's coordinator only while its own view
  says so (``is_coordinator``).
- A job-topic message is recorded in the store once it applies to our mirror (a held one when it
  finally applies), in the order it applied, and before any action it caused is carried out; what
  our mirror refuses (a flood of well-signed junk from many identities, say) is never written to disk
  and is held in memory within per-signer bounds (protocol/mirror.py). Our own decisions (leases,
  verdicts, aggregates) are recorded when we make them, before they are published; our own worker
  messages when they come back to us. All of it goes through one function, ``commit``
  (agent/evidence.py ``Evidence``): store the outcome's evidence, publish what it sends, then carry out
  its actions and our roles' reactions (``changed``).
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
from agent.blocks import Blocks
from agent.disk import Disk
from agent.evidence import Evidence
from agent.capability import Capabilities
from agent.hooks import AgentHooks
from agent.ledger_sync import LedgerService
from agent.loopwatch import LoopWatch
from agent.ledger_sync import sync_loop as ledger_sync_loop
from agent.roles.coordinator import CoordinatorRole
from agent.roles.keep import KeepService
from agent.roles.port import Local
from agent.roles.submitter import SubmitterRole
from agent.roles.sync import JobSync, SyncService
from agent.roles.worker import WorkerRole
from agent.store import Store
from agent.peers import PeerInfo, PeerTable  # noqa: F401 - PeerInfo re-exported (tests, harness)
from agent.jobbook import JobBook
from agent.following import Following
from agent.jobclock import JobClock
from agent.tasks import Tasks
from agent.writer import StoreWriter
from protocol import messages as m
from protocol.mirror import JobMirror
from protocol.identity import Identity

log = logging.getLogger(__name__)


class Agent:
    ledger_sync_interval = 10.0  # seconds between pulls of a job's ledger chains from its peers

    def __init__(self, identity: Identity, config: AgentConfig, *, clock: Callable[[], float] = time.time,
                 machine: Any = None, hooks: AgentHooks | None = None) -> None:
        self.identity = identity
        self.clock = clock
        self.peer_id = identity.peer_id
        self.counters: Counter[str] = Counter()  # shards_trained, verdicts_accepted, ... (metrics, status)
        self._config = config
        # the peers we hear: liveness, capabilities, who may coordinate (agent/peers.py)
        self.peer_table = PeerTable(self.peer_id, clock, config.heartbeat_seconds, config.missed_heartbeats,
                                    lambda: self.capabilities.coordinating(), config.grace_seconds)
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
        self.job_events = trio.Event()  # set (and replaced) whenever a job's state changes
        self._stopping = trio.Event()
        # who owns each task (the agent's services, a job's tasks) and the wake-up of every wait (agent/tasks.py)
        self.tasks = Tasks(clock, self.counters, self.jobs.get, self.forget_job)
        self.job_tasks = self.tasks.job_tasks
        self.service, self.one_shot, self.spawn = self.tasks.service, self.tasks.one_shot, self.tasks.spawn
        self.spawn_in_job, self.wait_until = self.tasks.spawn_in_job, self.tasks.wait_until
        self._notify = self.tasks.notify
        # what we say on a job's topic and keep as proof, in the one commit order (agent/evidence.py)
        self.evidence = Evidence(self.writer, clock, lambda: self.net, self.changed)
        self.publish, self.decide, self.commit = self.evidence.publish, self.evidence.decide, self.evidence.commit
        # content fetched and added, held from collection, announced in the DHT (agent/blocks.py)
        self.hold = self.disk.hold  # a block no message names yet, kept from collection (agent/disk.py)
        self.blocks = Blocks(lambda: self.content, lambda: self.net, self.tasks, self.hold)
        self.provide_soon = self.blocks.provide_soon
        # catching up on a job's history, rebuilding and repairing its mirror (agent/roles/sync.py)
        self.jobsync = JobSync(self.peer_id, clock, self.peer_table, self.tasks, self.writer, lambda: self.net,
                               self.commit, reach=lambda peer: self.content.reach(peer))
        # which jobs we follow, their topics read, resumed after a restart, forgotten (agent/following.py)
        self.following = Following(self.peer_id, clock, self.counters, self.book, self.tasks, self.writer,
                                   lambda: self.net, lambda: self.content.store, trains=config.accept_training,
                                   receive=self.on_job_message, settled=lambda view: self.apply_actions(view, ()),
                                   sync=self.jobsync,
                                   on_follow=self._followed, on_resume=self._resumed, on_forget=self._forgotten,
                                   observer=self.hooks.observer, peers=self.peer_table,
                                   capabilities=self.capabilities, commit=self.commit)
        # the roles, each built with the services it uses (agent/roles/port.py), never with the agent
        self.local = Local(self.peer_id, config, clock, self.capabilities, self.counters)
        roles = (self.local, self.peer_table, self.tasks, self.blocks, self.evidence)
        self.worker = WorkerRole(*roles, self.book, self.hooks.training) if config.accept_training else None
        self.coordinator = CoordinatorRole(*roles, lambda: self.net)
        self.submitter = SubmitterRole(*roles, self.following)
        self.sync = SyncService(lambda: self.store)  # serves our history of any job (agent/roles/sync.py)
        # a round's aggregate of our job, copied here before it is published (agent/roles/keep.py)
        self.keep = KeepService(self.local, self.peer_table, self.jobs.get, self.submitter.keep_once)
        self.ledger_service = LedgerService(self)  # copies of the job's other chains (agent/ledger_sync.py)
        # elections, the state machines' timers, rebuilds, taking a job over (agent/jobclock.py)
        self.jobclock = JobClock(self.peer_id, clock, self.peer_table, self.jobs, self.tasks,
                                 self.coordinator, self.jobsync, commit=self.commit, ledger=self.ledger,
                                 refuse_work=self.refuse_work, repair=config.repair_from_senders,
                                 rebuilt=self._rebuilt)
        from agent.market import Reputations

        self.reputations = Reputations(self)
        self.peer_table.reputations = self.reputations.get

    # -- life cycle -----------------------------------------------------------------------------

    @property
    def work_dir(self) -> Path:
        return self.config.home / "work"

    @property
    def config(self) -> AgentConfig:
        """Our settings (agent/config.py), read by every service."""
        return self._config

    @config.setter
    def config(self, config: AgentConfig) -> None:
        """Settings replaced while we run (the tests do): every service reads the new ones."""
        self._config = config
        if hasattr(self, "local"):
            self.local.config = config
            self.peer_table.grace_seconds = config.grace_seconds  # the election's (agent/jobclock.py reads it there)

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
            self.one_shot("capability", self.capabilities.tell_peers)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        home = self.config.home
        home.mkdir(parents=True, exist_ok=True)
        self.work_dir.mkdir(exist_ok=True)
        net_config = NetConfig(listen=self.config.listen, bootstrap=self.config.bootstrap,
                               announce=self.config.announce, relay=self.config.relay)
        async with AsyncExitStack() as stack:
            self.store = stack.enter_context(await self.writer.open(home, self.identity, self._stopping))
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

    async def _run_tasks(self, task_status: Any) -> None:
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            self.service("store writer", self.writer.run)
            self.service("event loop watch", self.loopwatch.run)
            self.service("disk collection", self.disk.every_interval, self.collect_disk)
            await self.following.resume_jobs()
            jobs_topic = await self.net.gossip.subscribe(m.TOPIC_JOBS)
            self.service("jobs topic reader", self.following.read_jobs_topic, jobs_topic)
            self.service("heartbeats", self.capabilities.heartbeats, self.jobclock.coordinating_terms,
                         lambda: len(self.worker.active) if self.worker else 0, self.hooks.training.heartbeats_muted)
            # (file hashes taken in training, replay or verification threads are saved after each pass)
            self.service("ticks", self.jobclock.run, self.capabilities.save_file_hashes)
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

    def is_coordinator(self, view: JobMirror) -> bool:
        """Do we act as the job's coordinator now? (agent/jobclock.py)"""
        return self.jobclock.is_coordinator(view)

    # -- gossip in ---------------------------------------------------------------------------------

    async def follow_job(self, terms: m.JobTerms, signer: str, envelope: bytes | None = None) -> JobMirror | None:
        """Start following a job we saw announced (once; agent/following.py)."""
        return await self.following.follow_job(terms, signer, envelope)

    def forget_job(self, job_id: bytes) -> None:
        """Stop following a job that ended (agent/following.py); the store keeps it."""
        self.following.forget_job(job_id)

    def _followed(self, view: JobMirror) -> None:
        if self.worker is not None:
            self.worker.consider(view)

    def _resumed(self, view: JobMirror) -> None:
        """A job of our store taken up again after a restart: by us as its submitter, by our worker."""
        if view.terms.submitter == self.peer_id:
            self.spawn_in_job(view.job_id, self.submitter.resume, view)
        if self.worker is not None:
            self.worker.consider(view)
            self.spawn_in_job(view.job_id, self.worker.release_stale, view)

    def _rebuilt(self, view: JobMirror) -> None:
        """Our mirror of a job was rebuilt (or repaired) from a peer's history: a live lease to us it holds now is
        trained (``WorkerRole.take_leases``)."""
        if self.worker is not None:
            self.worker.take_leases(view)

    def _forgotten(self, job_id: bytes) -> None:
        """A job we no longer follow: every role drops what it kept for it."""
        self.jobclock.forget(job_id)
        self.disk.forget(job_id)
        self.coordinator.forget(job_id)
        if self.worker is not None:
            self.worker.forget(job_id)
        self.ledger_service.forget(job_id)

    async def on_job_message(self, view: JobMirror, received: Any) -> None:
        """One verified message of the job's topic (``received``: message, signer, envelope): our mirror
        receives it, and we commit what it caused."""
        msg, signer, now = received.message, received.signer, self.clock()
        if isinstance(msg, m.ShardClaim):
            # a request to the coordinator, not a change of the job: never stored
            await self.coordinator.on_claim(view, msg, signer)
            return
        if isinstance(msg, m.EarlyStart):
            # a promise to the workers it names, not a change of the job: never stored (IPIP-0006 §2.9)
            if self.worker is not None:
                self.worker.on_early_start(view, msg, signer)
            self.submitter.on_early_start(view, msg, signer)
            return
        await self.commit(view, view.receive(msg, signer, now, self.eligible_coordinators(view.terms),
                                             received.envelope.to_bytes()))

    def changed(self, view: JobMirror, actions: tuple[Any, ...] | None, applied: list[tuple[Any, str]]) -> None:
        """What a committed outcome asks for (agent/evidence.py ``commit``): its actions, then our roles' reactions."""
        self.apply_actions(view, actions)
        self.react(view, applied)

    def react(self, view: JobMirror, applied: list[tuple[Any, str]]) -> None:
        """Our roles' reactions to messages the mirror applied: a lease for us, verdicts, aggregates."""
        for msg, by in applied:
            if self.worker is not None and isinstance(msg, m.ShardLease) and msg.worker == self.peer_id:
                self.worker.on_lease(view, msg)
            elif isinstance(msg, m.ShardReport):
                self.submitter.on_report(view, msg, by)
                if self.worker is not None:
                    self.worker.on_report(view, msg, by)
            elif isinstance(msg, m.ShardRevoke) and msg.worker == self.peer_id and by != self.peer_id:
                # the coordinator stopped hearing us (IPIP-0004 §5.3): our heartbeats did not reach it, or our loop
                # stalled; the attempt is no longer ours (the worker stops training it: drop_stale)
                self.counters["our_leases_revoked"] += 1
                log.warning("job %s round %d shard %d: our lease of attempt %d was revoked: the coordinator had not "
                            "heard us for %.0f s (a network cut, or this agent's event loop stalled)",
                            view.job_id.hex()[:8], msg.round, msg.shard, msg.attempt, msg.silent_seconds)
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

    async def collect_disk(self, grace: float | None = None) -> None:
        """Delete the blocks and work directories no job we follow needs any more (agent/disk.py); ``grace``: the
        age under which a file is kept whatever the rules say (default: the configured one)."""
        await self.disk.collect_jobs(list(self.jobs.values()), self.peer_id,
                                     self.worker.active if self.worker else (), self.content.store, grace=grace)

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
