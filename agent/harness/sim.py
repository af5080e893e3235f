"""A deterministic discrete-event simulator of the job protocol: many agents, many jobs, one seed.

It answers what the protocol does at a scale no test can run (a thousand agents, a hundred jobs,
hours of churn): how many jobs publish, how fast, at what message cost, how often coordinators
fail over, whether Byzantine work gets through. The document is ``ipips/0009-simulation.md``.

Rules of this file:

- The protocol is the real one. Every peer's mirror of a job is a ``protocol.state.JobState``
  moved only by ``protocol.state.step``; every election view is a ``protocol.election.Coordination``
  moved by ``keep_or_elect`` and ``check_message``; Byzantine detection is ``select_segments``
  over a seed fixed after the report, as a verifier does. What agents do with the machine's
  answers mirrors agent/node.py and agent/roles/*.py (named at each handler); this file decides
  no protocol question itself.
- Nothing real: virtual time (a heap of events, seconds from 0), no I/O, no libp2p, no torch,
  no wall clock. One ``random.Random(seed)`` draws everything in event order, so the same config
  and seed give the same run, event for event (``Result.digest`` hashes the event trace).
- The model, in short (each number is a ``SimConfig`` field):
    * agents: Ed25519 identities; a fraction are workers (``accept_training``), every agent can
      coordinate; a worker holds the base models of ``jobs_per_worker`` random jobs and follows
      those; the ``candidates`` top-ranked peers of each job follow it too (its possible
      coordinators), and so does the submitter. Only followers keep a mirror (the rest would
      ignore the job's topic). One shard at a time per worker (``max_concurrent_shards = 1``).
    * network: each job-topic message goes from its publisher to every subscribed follower with
      a log-normal latency and an independent loss (what GossipSub's repair leaves); a partition
      cuts messages and heartbeats between two sides until it heals. Heartbeats are not events:
      liveness is computed from when a peer was last reachable (left, partitioned), exactly as
      ``live_peers`` would see it with ``heartbeat_seconds`` x ``missed_heartbeats`` of silence.
      Heartbeats are counted (online time / interval) and carry coordinator terms at a heal.
    * churn: non-submitter agents leave at ``churn`` per hour (Poisson), half gracefully
      (releasing their lease), half by crashing, and return after an exponential time with an
      empty memory (a restarted process): they follow jobs again at the next re-announcement,
      with a mirror that missed the history. Submitters stay: they serve the shards by CID.
    * work: a shard takes ``shard_minutes`` x the worker's speed factor (log-normal), after a
      fetch; ``checkpoints`` evenly spaced commitments extend the lease. Training, replays and
      aggregation take one per-agent lock (agent/train/runner.py TORCH_LOCK), so a coordinator's
      verifications wait for its own training. A replay costs ``verify_segments / checkpoints`` of
      a shard; aggregation ``aggregate_seconds``.
    * Byzantine workers fake ``fake_fraction`` of their segments (a random set fixed before the
      verifier draws) and save that much time; a verifier rejects the report when its drawn
      segments hit a faked one, so rejection happens with probability ``catch_probability``.
      Byzantine peers coordinate honestly (a lying coordinator is not modelled).
- ``reorder_buffer`` and ``catch_up`` are built into the agent (agent/roles/job.py holds refused
  messages and retries them; agent/roles/sync.py fetches a job's history from its submitter for a
  returning agent, and rebuilds a mirror that holds a coordinator's decision it cannot apply) and
  on by default. The other remedies (``coordinators_train = False``, ``verdict_margin``) are
  what-if switches for changes the agent does not have yet; the defaults are the agent as built.
  Not modelled: the agent's rule that only the submitter's side of a partition elects and decides
  (IPIP-0006 §1.3).
- Claims a coordinator ignores are repeated by the real claim loop every 2 s until either side's
  view changes; those repeats are counted, not run (``_ignore_claims``), which keeps a thousand
  agents with stale mirrors affordable.
- The submitter's mirror is the job's record: its outcome, reason, reassignments and failovers
  are what a submitter would see. A run ends when every submitter's mirror is terminal, or at
  ``hours``; the job deadline (``max_runtime_hours``) bounds every job, so none can hang.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from protocol import state as st
from protocol.election import Coordination, keep_or_elect, rank_peers
from protocol.errors import StateError
from protocol.identity import Identity
from protocol.proof import catch_probability, faked_segments, segment_selection_seed, select_segments

HOUR = 3600.0

# Job-topic message kinds (protocol/messages.py type tags).
CLAIM, LEASE, RELEASE, CKPT = "claim", "lease", "release", "ckpt"
REPORT, VERDICT, AGGREGATE = "report", "verdict", "aggregate"
MESSAGE_KINDS = (CLAIM, LEASE, RELEASE, CKPT, REPORT, VERDICT, AGGREGATE)
COORDINATOR_KINDS = frozenset({LEASE, VERDICT, AGGREGATE})


@dataclass(frozen=True)
class Partition:
    """From ``start`` to ``end`` (seconds), ``members`` cannot reach anyone else, nor be reached.

    ``coordinator_of`` names a job instead: the side is that job's coordinator (in its
    submitter's view) at ``start``.
    """

    start: float
    end: float
    members: frozenset[int] = frozenset()
    coordinator_of: int | None = None


@dataclass(frozen=True)
class SimConfig:
    agents: int = 1000
    jobs: int = 100
    churn: float = 0.1  # fraction of (non-submitter) agents leaving per hour
    byzantine: float = 0.05  # fraction of agents that are Byzantine workers
    fake_fraction: float = 1.0  # share of its segments a Byzantine worker fakes
    hours: float = 8.0  # simulated time limit
    seed: int = 0
    # who is who
    worker_fraction: float = 0.8
    jobs_per_worker: int = 2
    candidates: int = 5
    # the network
    latency_median: float = 0.1
    latency_sigma: float = 0.6
    loss: float = 0.001
    partitions: tuple[Partition, ...] = ()
    offline_minutes: float = 15.0
    graceful_fraction: float = 0.5
    # agent settings (agent/node.py AgentConfig and SubmitterRole defaults)
    heartbeat_seconds: float = 1.0
    missed_heartbeats: int = 5
    grace_seconds: float = 3.0
    claim_interval: float = 1.0
    reannounce_seconds: float = 60.0
    # the job spec (infernet.train.yml)
    shards: int = 6
    rounds: int = 2
    lease_seconds: float = 3600.0
    max_retries: int = 2
    min_accepted_fraction: float = 1.0
    checkpoints: int = 6  # proof segments per shard (steps / checkpoint_every)
    verify_segments: int = 2
    max_runtime_hours: float = 6.0
    announce_minutes: float = 10.0  # jobs are announced uniformly over this window
    # the work
    shard_minutes: float = 20.0
    speed_sigma: float = 0.4
    fetch_seconds: float = 30.0
    aggregate_seconds: float = 60.0
    worker_failure: float = 0.0  # chance an honest attempt fails and is released
    # the defaults are the agent as built; the rest are what-if remedies (see the module docstring)
    coordinators_train: bool = True  # a coordinator still claims shards of other jobs
    reorder_buffer: bool = True  # mirrors keep refused messages and retry them after each change (built)
    catch_up: bool = True  # a mirror that returns, or falls behind, copies a peer's (agent/roles/sync.py)
    sync_after: float = 5.0  # catch_up: a refused message waiting this long means the mirror fell behind
    verdict_margin: float = 0.0  # a coordinator withholds a verdict this close to its window's end

    @property
    def silence(self) -> float:
        return self.heartbeat_seconds * self.missed_heartbeats


@dataclass(frozen=True)
class Msg:
    """A job-topic message, at the level of protocol/messages.py (the fields the roles read)."""

    kind: str
    job: int
    sender: int
    round: int
    shard: int = 0
    attempt: int = 0
    worker: int = -1  # lease/verdict: the worker it names
    term: int = 0  # coordinator messages
    accepted: bool = False
    reason: str = ""
    faked: frozenset[int] = frozenset()  # a report: the segments its worker faked (the model's truth)


class Mirror:
    """One agent's JobView (agent/roles/job.py): the state machine, the election view, the reports."""

    __slots__ = ("job", "state", "view", "first_seen", "late", "reports", "tick_at", "pending")

    def __init__(self, job: "SimJob", now: float, late: bool) -> None:
        self.job = job
        self.state = st.new_job(job.config)
        self.view = Coordination(job.job_id)
        self.first_seen = now
        self.late = late  # followed at a re-announcement: missed the history before it
        self.reports: dict[tuple[int, int, int], tuple[int, frozenset[int]]] = {}
        self.tick_at: float | None = None
        self.pending: list[tuple[float, Msg]] = []  # reorder_buffer: refused messages, when received


class SimAgent:
    __slots__ = ("index", "peer", "speed", "worker", "byzantine", "submitter", "follows", "trains", "online", "epoch",
                 "joined_at", "left_at", "online_seconds", "mirrors", "lease", "torch_free", "banned", "running",
                 "last_claim", "poll_pending")

    def __init__(self, index: int, peer: str, speed: float) -> None:
        self.index = index
        self.peer = peer
        self.speed = speed
        self.worker = False
        self.byzantine = False
        self.submitter = False
        self.follows: list[int] = []  # jobs this agent subscribes to, in order
        self.trains: set[int] = set()  # jobs whose base model this worker holds (WorkerRole.candidates)
        self.online = True
        self.epoch = 0  # bumped when it leaves or returns: events of an earlier life are void
        self.joined_at = 0.0
        self.left_at = -math.inf
        self.online_seconds = 0.0
        self.mirrors: dict[int, Mirror] = {}
        self.lease: tuple[int, int, int, int] | None = None  # (job, round, shard, attempt) being trained
        self.torch_free = 0.0  # when the agent's training/replay lock is next free
        self.banned: dict[int, set[int]] = {}  # coordinator: workers rejected per job (in memory only)
        self.running: set[tuple] = set()  # coordinator tasks under way
        self.last_claim: dict[int, float] = {}
        self.poll_pending = False


@dataclass
class SimJob:
    index: int
    job_id: bytes
    submitter: int
    config: st.JobConfig
    ranking: tuple[int, ...]  # agent indices in election order (protocol.election.rank_peers)
    announce_at: float
    subscribers: dict[int, None] = field(default_factory=dict)  # followers online with a mirror
    ignored_claimants: dict[int, float] = field(default_factory=dict)  # worker -> since when its claims are ignored
    outcome: str = "RUNNING"  # the submitter's mirror: DONE / FAILED / RUNNING
    reason: str = ""
    ended_at: float | None = None
    messages: Counter = field(default_factory=Counter)
    reassignments: int = 0
    reopen_reasons: Counter = field(default_factory=Counter)
    failovers: int = 0
    takeovers: int = 0  # coordinators that took the job over (term > 1)
    late_takeovers: int = 0  # ... with a mirror that missed the job's history (a returning agent)
    byzantine_rejected: int = 0
    byzantine_accepted: int = 0
    honest_accepted: int = 0
    published_at: float | None = None  # when a coordinator published the final aggregate (the truth)


@dataclass
class Result:
    config: SimConfig
    jobs: list[SimJob]
    sim_seconds: float
    events: int
    heartbeats: float
    refused: Counter
    mirrors: int  # mirrors held at the end by online followers
    mirrors_diverged: int  # ... whose job phase or round differs from the submitter's
    syncs: int  # catch_up: mirrors that copied a peer's
    digest: str

    def summary(self) -> dict[str, Any]:
        """The figures of the run, as plain values."""
        cfg, jobs = self.config, self.jobs
        done = [j for j in jobs if j.outcome == "DONE"]
        failed = [j for j in jobs if j.outcome == "FAILED"]
        times = sorted((j.ended_at - j.announce_at) / 60 for j in done)
        messages = Counter()
        for j in jobs:
            messages.update(j.messages)
        byz_rejected = sum(j.byzantine_rejected for j in jobs)
        byz_accepted = sum(j.byzantine_accepted for j in jobs)
        byz_reports = byz_rejected + byz_accepted
        n, k = cfg.checkpoints, cfg.verify_segments
        m = faked_segments(n, cfg.fake_fraction)
        reopen = Counter()
        for j in jobs:
            reopen.update(j.reopen_reasons)
        return {
            "jobs": len(jobs),
            "done": len(done),
            "failed": len(failed),
            "running_at_end": len(jobs) - len(done) - len(failed),
            "completion_rate": len(done) / len(jobs) if jobs else 0.0,
            "published": sum(1 for j in jobs if j.published_at is not None),
            "published_but_failed": sum(1 for j in failed if j.published_at is not None),
            "publish_minutes_p50": _percentile(times, 0.50),
            "publish_minutes_p95": _percentile(times, 0.95),
            "messages_per_job": sum(messages.values()) / len(jobs) if jobs else 0.0,
            "messages_by_kind": {kind: messages[kind] for kind in MESSAGE_KINDS},
            "heartbeats": round(self.heartbeats),
            "reassignments": sum(j.reassignments for j in jobs),
            "reassignment_reasons": dict(reopen.most_common()),
            "failovers": sum(j.failovers for j in jobs),
            "takeovers": sum(j.takeovers for j in jobs),
            "late_takeovers": sum(j.late_takeovers for j in jobs),
            "byzantine_rejected": byz_rejected,
            "byzantine_accepted": byz_accepted,
            "byzantine_escape_rate": byz_accepted / byz_reports if byz_reports else 0.0,
            "byzantine_escape_expected": 1.0 - catch_probability(n, k, m),
            "honest_accepted": sum(j.honest_accepted for j in jobs),
            "failure_reasons": dict(Counter(_reason_kind(j.reason) for j in failed).most_common()),
            "refused_events": dict(self.refused.most_common()),
            "mirrors": self.mirrors,
            "mirrors_diverged": self.mirrors_diverged,
            "mirror_syncs": self.syncs,
            "sim_hours": self.sim_seconds / HOUR,
            "events": self.events,
            "digest": self.digest,
        }


def _percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1)]


def _reason_kind(reason: str) -> str:
    """A reason with its numbers taken out, so that reasons of the same kind group together."""
    return re.sub(r"\d+(\.\d+)?", "#", re.sub(r"12D3KooW\w+", "<peer>", reason))


class Simulation:
    def __init__(self, config: SimConfig) -> None:
        self.cfg = config
        self.rng = random.Random(config.seed)
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable, tuple]] = []
        self._seq = 0
        self._trace = hashlib.sha256()
        self.events = 0
        self.refused: Counter = Counter()
        self.partitions: list[tuple[float, float, frozenset[int]]] = []
        # coordinator agent -> the (agent, job) views naming it: who must re-elect when it falls silent
        self._viewers: dict[int, dict[tuple[int, int], None]] = {}
        self._running_jobs = config.jobs
        self._state_refusals = 0
        self.syncs = 0  # catch_up: mirrors that copied a peer's
        self._build()

    # -- set-up -------------------------------------------------------------------------------

    def _build(self) -> None:
        cfg, rng = self.cfg, self.rng
        identities = [Identity(hashlib.sha256(f"infernet/sim/{cfg.seed}/{i}".encode()).digest())
                      for i in range(cfg.agents)]
        self.agents = [SimAgent(i, ident.peer_id, rng.lognormvariate(0.0, cfg.speed_sigma))
                       for i, ident in enumerate(identities)]
        self.by_peer = {a.peer: a.index for a in self.agents}
        order = list(range(cfg.agents))
        rng.shuffle(order)
        n_workers = round(cfg.worker_fraction * cfg.agents)
        for i in order[:n_workers]:
            self.agents[i].worker = True
        for i in order[:round(cfg.byzantine * cfg.agents)]:  # Byzantine peers are workers
            self.agents[i].byzantine = True
        submitters = order[n_workers:] + order[:n_workers]  # non-workers submit first
        peers = [a.peer for a in self.agents]
        self.jobs: list[SimJob] = []
        for j in range(cfg.jobs):
            job_id = hashlib.sha256(f"infernet/sim/job/{cfg.seed}/{j}".encode()).digest()
            ranking = tuple(self.by_peer[p] for p in rank_peers(job_id, peers))
            submitter = submitters[j % len(submitters)]
            announce_at = rng.uniform(0.0, cfg.announce_minutes * 60)
            config = st.JobConfig(shards=cfg.shards, rounds=cfg.rounds, lease_seconds=cfg.lease_seconds,
                                  max_retries=cfg.max_retries, min_accepted_fraction=cfg.min_accepted_fraction,
                                  deadline=announce_at + cfg.max_runtime_hours * HOUR)
            self.jobs.append(SimJob(j, job_id, submitter, config, ranking, announce_at))
            self.agents[submitter].submitter = True
        workers = [a for a in self.agents if a.worker]
        for a in workers:
            for j in rng.sample(range(cfg.jobs), min(cfg.jobs_per_worker, cfg.jobs)):
                a.follows.append(j)
                a.trains.add(j)
        for job in self.jobs:
            for i in (job.submitter,) + job.ranking[: cfg.candidates]:
                if job.index not in self.agents[i].follows:
                    self.agents[i].follows.append(job.index)
        for job in self.jobs:
            self._at(job.announce_at, self._announce, job.index)
        if cfg.churn > 0:
            for a in self.agents:
                if not a.submitter:
                    self._at(rng.expovariate(cfg.churn / HOUR), self._leave, a.index, a.epoch)
        for p in cfg.partitions:
            self._at(p.start, self._partition_start, p)

    # -- the event loop -----------------------------------------------------------------------

    def _at(self, when: float, handler: Callable, *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (when, self._seq, handler, args))

    def run(self) -> Result:
        limit = self.cfg.hours * HOUR
        while self._queue:
            when, _seq, handler, args = heapq.heappop(self._queue)
            if when > limit:
                break
            self.now = when
            self.events += 1
            self._trace.update(f"{when:.6f} {handler.__name__} {args[0] if args else ''}\n".encode())
            handler(*args)
            if not self._running_jobs:
                break
        end = self.now = min(self.now, limit)
        for job in self.jobs:
            for worker in list(job.ignored_claimants):
                self._resume_claims(job, worker)
        heartbeats = sum(a.online_seconds + (end - a.joined_at if a.online else 0.0)
                         for a in self.agents) / self.cfg.heartbeat_seconds
        mirrors = diverged = 0
        for job in self.jobs:
            self._trace.update(f"{job.index} {job.outcome} {job.reason} {job.ended_at}\n".encode())
            if job.index not in self.agents[job.submitter].mirrors:
                continue  # not announced yet
            record = self.agents[job.submitter].mirrors[job.index].state
            for index in job.subscribers:
                state = self.agents[index].mirrors[job.index].state
                mirrors += 1
                diverged += (state.phase, state.round) != (record.phase, record.round)
        return Result(self.cfg, self.jobs, end, self.events, heartbeats, self.refused, mirrors, diverged,
                      self.syncs, self._trace.hexdigest())

    def _latency(self) -> float:
        return self.rng.lognormvariate(math.log(self.cfg.latency_median), self.cfg.latency_sigma)

    # -- liveness and election (agent/node.py: eligible_coordinators, update_election) -----------

    def _separated(self, a: int, b: int, when: float) -> bool:
        return any(start <= when < end and ((a in side) != (b in side)) for start, end, side in self.partitions)

    def _last_heard(self, observer: int, peer: int) -> float:
        """When ``observer`` last got a heartbeat from ``peer`` (now if it is still getting them)."""
        agent, heard = self.agents[peer], self.now
        if not agent.online:
            heard = agent.left_at
        for start, end, side in self.partitions:
            if (observer in side) != (peer in side) and start <= heard < end:
                heard = start
        return heard

    def _live(self, observer: int, peer: int) -> bool:
        """protocol.election.live_peers as ``observer`` sees ``peer``; every agent can coordinate."""
        return peer == observer or self.now - self._last_heard(observer, peer) < self.cfg.silence

    def _eligible(self, agent: SimAgent, mirror: Mirror) -> frozenset[str]:
        """The part of the eligible live set that keep_or_elect consults: the current coordinator if
        live, and the best-ranked live peer (the rendezvous winner of the whole set)."""
        eligible = set()
        current = mirror.view.coordinator
        if current is not None and self._live(agent.index, self.by_peer[current]):
            eligible.add(current)
        for peer in mirror.job.ranking:
            if self._live(agent.index, peer):
                eligible.add(self.agents[peer].peer)
                break
        return frozenset(eligible)

    def _set_view(self, agent: SimAgent, mirror: Mirror, view: Coordination) -> None:
        old = mirror.view
        if old.coordinator is not None:
            self._viewers.get(self.by_peer[old.coordinator], {}).pop((agent.index, mirror.job.index), None)
        if view.coordinator is not None:
            self._viewers.setdefault(self.by_peer[view.coordinator], {})[(agent.index, mirror.job.index)] = None
        mirror.view = view
        job = mirror.job
        if agent.index == job.submitter and old.coordinator is not None and view.coordinator != old.coordinator:
            job.failovers += 1

    def _past_grace(self, mirror: Mirror) -> bool:
        # the election is scheduled at first_seen + grace exactly; float sums may land a hair short
        return self.now - mirror.first_seen >= self.cfg.grace_seconds - 1e-6

    def _is_coordinator(self, agent: SimAgent, mirror: Mirror) -> bool:
        return mirror.view.coordinator == agent.peer and self._past_grace(mirror)

    def _elect(self, index: int, epoch: int, job_index: int) -> None:
        """Agent.update_election, then take_over if we just became the coordinator (Agent._ticks)."""
        agent = self.agents[index]
        mirror = agent.mirrors.get(job_index)
        if agent.epoch != epoch or mirror is None:
            return
        if not self._past_grace(mirror) or mirror.state.terminal:
            return
        was = self._is_coordinator(agent, mirror)
        view = keep_or_elect(mirror.view, self._eligible(agent, mirror))
        if view != mirror.view:
            self._set_view(agent, mirror, view)
        if self._is_coordinator(agent, mirror) and not was:
            self._take_over(agent, mirror)
        self._wake(agent)

    def _silent(self, index: int, epoch: int) -> None:
        """``index`` left ``silence`` seconds ago and has not returned: views naming it re-elect."""
        if self.agents[index].epoch != epoch:
            return
        for viewer, job in list(self._viewers.get(index, {})):
            self._elect(viewer, self.agents[viewer].epoch, job)

    def _partition_start(self, partition: Partition) -> None:
        side = partition.members
        if partition.coordinator_of is not None:
            job = self.jobs[partition.coordinator_of]
            mirror = self.agents[job.submitter].mirrors.get(job.index)
            coordinator = mirror.view.coordinator if mirror else None
            side = frozenset({self.by_peer[coordinator]}) if coordinator else frozenset()
        self.partitions.append((partition.start, partition.end, side))
        self._at(self.now + self.cfg.silence, self._partition_noticed)
        self._at(partition.end + self.cfg.heartbeat_seconds, self._heartbeat_terms)

    def _partition_noticed(self) -> None:
        for agent in self.agents:
            for job in list(agent.mirrors):
                self._elect(agent.index, agent.epoch, job)

    def _heartbeat_terms(self) -> None:
        """After a heal, heartbeats carry each coordinator's (job, term) claims to everyone
        (Agent._read_jobs_topic -> JobView.check_coordinator): a deposed coordinator learns the
        higher term and steps down."""
        for job in self.jobs:
            claims = [(a, a.mirrors[job.index].view.term) for a in self.agents
                      if a.online and job.index in a.mirrors and self._is_coordinator(a, a.mirrors[job.index])]
            for follower in list(job.subscribers):
                agent = self.agents[follower]
                for coordinator, term in claims:
                    if coordinator is not agent and not self._separated(coordinator.index, follower, self.now):
                        self._check_coordinator(agent, agent.mirrors[job.index], coordinator.index, term)

    def _check_coordinator(self, agent: SimAgent, mirror: Mirror, signer: int, term: int) -> bool:
        """JobView.check_coordinator: does a coordinator message pass our election view?"""
        signer_peer = self.agents[signer].peer
        live = frozenset({signer_peer}) if self._live(agent.index, signer) else frozenset()
        try:
            view = mirror.view.check_message(signer_peer, term, live)
        except StateError:
            self.refused["coordinator"] += 1
            return False
        if view != mirror.view:
            self._set_view(agent, mirror, view)
            self._wake(agent)
        return True

    # -- following jobs (Agent.follow_job, SubmitterRole.announce/_reannounce) ------------------

    def _announce(self, job_index: int) -> None:
        job = self.jobs[job_index]
        job.messages["announce"] += 1
        for agent in self.agents:
            if job_index in agent.follows and agent.online:
                delay = 0.0 if agent.index == job.submitter else self._latency()
                self._at(self.now + delay, self._follow, agent.index, agent.epoch, job_index, False)

    def _follow(self, index: int, epoch: int, job_index: int, late: bool) -> None:
        agent = self.agents[index]
        if agent.epoch != epoch or not agent.online or job_index in agent.mirrors:
            return
        job = self.jobs[job_index]
        if late and job.outcome != "RUNNING":
            return  # the submitter stopped re-announcing
        mirror = agent.mirrors[job_index] = Mirror(job, self.now, late)
        job.subscribers[index] = None
        if late and self.cfg.catch_up:  # the remedy: a returning agent fetches the state from a peer
            record = self.agents[job.submitter].mirrors.get(job_index)
            if record is not None and record.view.coordinator is not None:
                self._set_view(agent, mirror, record.view)  # where to ask: the coordinator it names
                self._sync(agent, mirror)
        self._schedule_tick(agent, mirror)
        self._at(self.now + self.cfg.grace_seconds, self._elect, index, epoch, job_index)

    # -- the state machine (JobView.step / apply / apply_decision, Agent.apply_actions) --------

    def _step(self, agent: SimAgent, mirror: Mirror, event: Any) -> tuple | None:
        try:
            mirror.state, actions = st.step(mirror.state, event, self.now)
        except StateError:
            self.refused[type(event).__name__] += 1
            self._state_refusals += 1
            return None
        self._schedule_tick(agent, mirror)
        job = mirror.job
        if job.ignored_claimants and (actions or not isinstance(event, st.Tick)):
            if agent.index in job.ignored_claimants:
                self._resume_claims(job, agent.index)  # its own view changed: it may claim elsewhere
            elif not isinstance(event, (st.CheckpointSeen, st.LeaseGranted)) and self._is_coordinator(agent, mirror):
                for worker in list(job.ignored_claimants):  # the coordinator's view changed: it may grant now
                    self._resume_claims(job, worker)
        return actions

    def _schedule_tick(self, agent: SimAgent, mirror: Mirror) -> None:
        state = mirror.state
        if state.terminal:
            return
        timers = [s.expires_at for s in state.shards if s.expires_at is not None]
        timers += [t for t in (state.expires_at, state.config.deadline) if t is not None]
        if not timers:
            return
        when = min(timers)
        if mirror.tick_at is None or when < mirror.tick_at or mirror.tick_at < self.now:
            mirror.tick_at = when
            self._at(when, self._tick, agent.index, agent.epoch, mirror.job.index)

    def _tick(self, index: int, epoch: int, job_index: int) -> None:
        agent = self.agents[index]
        mirror = agent.mirrors.get(job_index)
        if agent.epoch != epoch or mirror is None:
            return
        if mirror.tick_at is not None and mirror.tick_at <= self.now:
            mirror.tick_at = None
        actions = self._step(agent, mirror, st.Tick())
        if actions:
            self._after(agent, mirror, actions)
            self._retry_pending(agent, mirror)

    def _apply(self, agent: SimAgent, mirror: Mirror, msg: Msg) -> tuple | None:
        """JobView.apply: worker messages by everyone, coordinator messages if the view passes them."""
        signer = self.agents[msg.sender].peer
        if msg.kind == CKPT:
            return self._step(agent, mirror, st.CheckpointSeen(msg.round, msg.shard, signer, msg.attempt))
        if msg.kind == REPORT:
            actions = self._step(agent, mirror, st.ReportReceived(msg.round, msg.shard, signer, msg.attempt))
            if actions is not None:
                mirror.reports[(msg.round, msg.shard, msg.attempt)] = (msg.sender, msg.faked)
            return actions
        if msg.kind == RELEASE:
            return self._step(agent, mirror, st.Released(msg.round, msg.shard, signer, msg.attempt))
        if msg.sender == agent.index or not self._check_coordinator(agent, mirror, msg.sender, msg.term):
            return None
        return self._apply_decision(agent, mirror, msg)

    def _apply_decision(self, agent: SimAgent, mirror: Mirror, msg: Msg) -> tuple | None:
        if msg.kind == LEASE:
            return self._step(agent, mirror, st.LeaseGranted(msg.round, msg.shard, self.agents[msg.worker].peer))
        if msg.kind == VERDICT:
            return self._step(agent, mirror, st.VerdictGiven(msg.round, msg.shard, msg.attempt, msg.accepted,
                                                             msg.reason))
        return self._step(agent, mirror, st.AggregatePublished(msg.round, f"sim-aggregate-{msg.job}-{msg.round}"))

    def _after(self, agent: SimAgent, mirror: Mirror, actions: tuple) -> None:
        """Agent.apply_actions: the coordinator acts, the submitter records, workers look for work."""
        if self._is_coordinator(agent, mirror):
            for action in actions:
                if isinstance(action, st.StartVerification):
                    self._start_verification(agent, mirror, (action.round, action.shard, action.attempt))
                elif isinstance(action, st.Aggregate):
                    self._start_aggregation(agent, mirror, action.round)
        if agent.index == mirror.job.submitter:
            self._record(mirror.job, actions)
        if agent.worker and any(isinstance(a, (st.ReopenShard, st.StartRound, st.Done, st.FailJob)) for a in actions):
            self._wake(agent)  # a shard to claim, or (coordinators_train off) a job no longer ours

    def _record(self, job: SimJob, actions: tuple) -> None:
        if job.outcome != "RUNNING":
            return
        for action in actions:
            if isinstance(action, st.ReopenShard):
                job.reassignments += 1
                job.reopen_reasons[_reason_kind(action.reason)] += 1
            elif isinstance(action, (st.FailJob, st.CancelJob)):
                job.outcome, job.reason, job.ended_at = "FAILED", action.reason, self.now
                self._running_jobs -= 1
            elif isinstance(action, st.Done):
                job.outcome, job.ended_at = "DONE", self.now
                self._running_jobs -= 1

    # -- messages -------------------------------------------------------------------------------

    def _publish(self, agent: SimAgent, msg: Msg) -> None:
        """Gossip ``msg`` on its job's topic; our own worker messages reach our own mirror at once."""
        job = self.jobs[msg.job]
        job.messages[msg.kind] += 1
        mirror = agent.mirrors.get(msg.job)
        if msg.kind in (CKPT, REPORT, RELEASE) and mirror is not None:
            actions = self._apply(agent, mirror, msg)
            if actions:
                self._after(agent, mirror, actions)
        loss = self.cfg.loss
        for index in job.subscribers:
            if index == agent.index or self._separated(agent.index, index, self.now):
                continue
            if msg.kind == CLAIM:  # only a coordinator acts on a claim (Agent._read_job_topic)
                other = self.agents[index]
                if not self._is_coordinator(other, other.mirrors[msg.job]):
                    continue
            if loss and self.rng.random() < loss:
                continue
            self._at(self.now + self._latency(), self._deliver, index, self.agents[index].epoch, msg)

    def _deliver(self, index: int, epoch: int, msg: Msg) -> None:
        """Agent._read_job_topic."""
        agent = self.agents[index]
        mirror = agent.mirrors.get(msg.job)
        if agent.epoch != epoch or mirror is None:
            return
        if msg.kind == CLAIM:
            self._on_claim(agent, mirror, msg)
            return
        refusals = self._state_refusals
        if self._apply_message(agent, mirror, msg):
            self._retry_pending(agent, mirror)
        elif self.cfg.reorder_buffer and self._state_refusals > refusals:
            mirror.pending.append((self.now, msg))  # perhaps early: its predecessor may still come
            if self.cfg.catch_up:
                self._at(self.now + self.cfg.sync_after, self._sync_if_behind, index, epoch, msg.job)

    def _sync_if_behind(self, index: int, epoch: int, job_index: int) -> None:
        """catch_up remedy: a message still refused ``sync_after`` seconds on means we missed something."""
        agent = self.agents[index]
        mirror = agent.mirrors.get(job_index)
        if agent.epoch == epoch and mirror is not None and mirror.pending \
                and self.now - mirror.pending[0][0] >= self.cfg.sync_after - 1e-6:
            self._sync(agent, mirror)

    def _sync(self, agent: SimAgent, mirror: Mirror) -> bool:
        """catch_up remedy: take the job's state from a peer that holds it, the coordinator if we
        can reach it, else the submitter (a request/response the protocol does not have yet)."""
        job = mirror.job
        sources = [self.by_peer[mirror.view.coordinator]] if mirror.view.coordinator else []
        sources.append(job.submitter)
        for index in sources:
            source = self.agents[index].mirrors.get(job.index)
            if index == agent.index or source is None or not self.agents[index].online \
                    or self._separated(agent.index, index, self.now):
                continue
            mirror.state, mirror.reports, mirror.late, mirror.pending = source.state, dict(source.reports), False, []
            if source.view.term >= mirror.view.term:
                self._set_view(agent, mirror, source.view)
            self.syncs += 1
            if agent.index == job.submitter and source.state.terminal:  # the record learns the end
                done = source.state.phase is st.JobPhase.DONE
                self._record(job, (st.Done(source.state.published[-1]) if done else st.FailJob(source.state.reason),))
            self._schedule_tick(agent, mirror)
            self._wake(agent)
            return True
        return False

    def _apply_message(self, agent: SimAgent, mirror: Mirror, msg: Msg) -> bool:
        actions = self._apply(agent, mirror, msg)
        if actions is None:
            return False
        self._after(agent, mirror, actions)
        if msg.kind == LEASE and msg.worker == agent.index and agent.worker:
            self._on_lease(agent, mirror, msg)
        return True

    def _retry_pending(self, agent: SimAgent, mirror: Mirror) -> None:
        """reorder_buffer remedy: after the mirror moved, apply what it refused before, until nothing
        more applies; a message waits at most lease_seconds."""
        progress = True
        while progress and mirror.pending:
            progress = False
            mirror.pending = [(t, m) for t, m in mirror.pending if self.now - t < self.cfg.lease_seconds][-64:]
            for entry in list(mirror.pending):
                if self._apply_message(agent, mirror, entry[1]):
                    mirror.pending.remove(entry)
                    progress = True

    # -- the worker (WorkerRole) --------------------------------------------------------------

    def _wake(self, agent: SimAgent) -> None:
        if agent.worker and agent.online and agent.lease is None and not agent.poll_pending:
            agent.poll_pending = True
            self._at(self.now + self.rng.uniform(0.0, self.cfg.claim_interval), self._claim, agent.index, agent.epoch)

    def _claim(self, index: int, epoch: int) -> None:
        """One pass of WorkerRole.claim_loop: claim an OPEN shard of the first job that has one."""
        agent = self.agents[index]
        if agent.epoch != epoch:
            return
        agent.poll_pending = False
        if agent.lease is not None:
            return
        if not self.cfg.coordinators_train and any(
                not m.state.terminal and self._is_coordinator(agent, m) for m in agent.mirrors.values()):
            return  # the remedy: a coordinator keeps its lock for replays (woken when it steps down)
        waiting = False
        for job_index, mirror in agent.mirrors.items():
            state = mirror.state
            if job_index not in agent.trains or index in mirror.job.ignored_claimants \
                    or state.phase not in (st.JobPhase.ANNOUNCED, st.JobPhase.TRAINING):
                continue
            coordinator = mirror.view.coordinator
            if coordinator in (None, agent.peer) or _held_by(state, agent.peer):
                continue
            open_shards = [s.index for s in state.shards if s.phase is st.ShardPhase.OPEN]
            if not open_shards:
                continue
            waiting = True
            if self.now - agent.last_claim.get(job_index, -math.inf) < 2 * self.cfg.claim_interval:
                continue
            agent.last_claim[job_index] = self.now
            self._publish(agent, Msg(CLAIM, job_index, index, state.round, self.rng.choice(open_shards)))
            break
        if waiting:  # the loop goes round again while there is something to claim
            agent.poll_pending = True
            self._at(self.now + self.cfg.claim_interval, self._claim, index, epoch)

    def _ignore_claims(self, job: SimJob, worker: int) -> None:
        """The coordinator ignored a claim of ``worker``. The real claim loop repeats it every
        2 x claim_interval while the worker's mirror shows an OPEN shard, and the coordinator keeps
        ignoring it until its own view changes; the simulator counts those repeats instead of
        running them, until either view changes (``_resume_claims``)."""
        job.ignored_claimants.setdefault(worker, self.now)

    def _resume_claims(self, job: SimJob, worker: int) -> None:
        since = job.ignored_claimants.pop(worker)
        job.messages[CLAIM] += int((self.now - since) / (2 * self.cfg.claim_interval))
        self._wake(self.agents[worker])

    def _on_lease(self, agent: SimAgent, mirror: Mirror, lease: Msg) -> None:
        """WorkerRole.on_lease and _train_and_report: fetch, train under the lock, commit, report."""
        if agent.lease is not None:
            return
        cfg, rng = self.cfg, self.rng
        key = (lease.job, lease.round, lease.shard, lease.attempt)
        agent.lease = key
        start = max(self.now + cfg.fetch_seconds * rng.lognormvariate(0.0, 0.3), agent.torch_free)
        duration = cfg.shard_minutes * 60 * agent.speed * rng.lognormvariate(0.0, 0.1)
        faked: frozenset[int] = frozenset()
        if agent.byzantine:
            faked = frozenset(rng.sample(range(cfg.checkpoints), faked_segments(cfg.checkpoints, cfg.fake_fraction)))
            duration = duration * (1 - len(faked) / cfg.checkpoints) + 60.0  # faking saves the work
        agent.torch_free = start + duration
        fails_at = math.inf
        if not agent.byzantine and cfg.worker_failure and rng.random() < cfg.worker_failure:
            fails_at = start + rng.uniform(0.0, duration)
            self._at(fails_at, self._worker_message, agent.index, agent.epoch, key, RELEASE, faked)
        for i in range(1, cfg.checkpoints + 1):
            if start + duration * i / cfg.checkpoints < fails_at:
                self._at(start + duration * i / cfg.checkpoints, self._worker_message, agent.index, agent.epoch,
                         key, CKPT, faked)
        if fails_at == math.inf:
            self._at(start + duration + 5.0, self._worker_message, agent.index, agent.epoch, key, REPORT, faked)

    def _worker_message(self, index: int, epoch: int, key: tuple, kind: str, faked: frozenset[int]) -> None:
        agent = self.agents[index]
        if agent.epoch != epoch:
            return
        job, rnd, shard, attempt = key
        self._publish(agent, Msg(kind, job, index, rnd, shard, attempt, faked=faked,
                                 reason="training failed" if kind == RELEASE else ""))
        if kind in (REPORT, RELEASE):
            agent.lease = None
            self._wake(agent)

    # -- the coordinator (CoordinatorRole) ------------------------------------------------------

    def _on_claim(self, agent: SimAgent, mirror: Mirror, claim: Msg) -> None:
        """CoordinatorRole.on_claim: never to ourselves, a rejected worker, or one holding a lease."""
        state, job, worker = mirror.state, mirror.job, claim.sender
        if not self._is_coordinator(agent, mirror):
            return
        open_shards = [s.index for s in state.shards if s.phase is st.ShardPhase.OPEN]
        if claim.round != state.round or state.phase not in (st.JobPhase.ANNOUNCED, st.JobPhase.TRAINING) \
                or worker == agent.index or worker in agent.banned.get(claim.job, ()) \
                or _held_by(state, self.agents[worker].peer) or not open_shards:
            self._ignore_claims(job, worker)
            return
        shard = claim.shard if claim.shard in open_shards else open_shards[0]
        actions = self._step(agent, mirror, st.LeaseGranted(state.round, shard, self.agents[worker].peer))
        grant = next((a for a in actions or () if isinstance(a, st.PublishLease)), None)
        if grant is None:
            return
        self._after(agent, mirror, actions)
        self._publish(agent, Msg(LEASE, claim.job, agent.index, grant.round, grant.shard, grant.attempt, worker,
                                 mirror.view.term))

    def _take_over(self, agent: SimAgent, mirror: Mirror) -> None:
        """CoordinatorRole.take_over: resume what the mirror says is pending."""
        job, state = mirror.job, mirror.state
        for worker in list(job.ignored_claimants):  # a new coordinator may grant what the old one ignored
            self._resume_claims(job, worker)
        if mirror.view.term > 1:  # a failover, not the job's first coordinator
            job.takeovers += 1
            job.late_takeovers += mirror.late
        for shard in state.shards:
            if shard.phase is st.ShardPhase.REPORTED:
                self._start_verification(agent, mirror, (state.round, shard.index, shard.attempt))
        if state.phase is st.JobPhase.AGGREGATING:
            self._start_aggregation(agent, mirror, state.round)

    def _start_verification(self, agent: SimAgent, mirror: Mirror, key: tuple[int, int, int]) -> None:
        task = ("verify", mirror.job.index) + key
        if task in agent.running or key not in mirror.reports:
            return
        agent.running.add(task)
        cfg = self.cfg
        start = max(self.now + cfg.fetch_seconds * self.rng.lognormvariate(0.0, 0.3), agent.torch_free)
        replay = cfg.shard_minutes * 60 * agent.speed * min(cfg.verify_segments, cfg.checkpoints) / cfg.checkpoints
        agent.torch_free = start + replay
        nonce = self.rng.randbytes(16)  # drawn after the report: the worker could not know it
        self._at(start + replay, self._verified, agent.index, agent.epoch, mirror.job.index, key, nonce)

    def _verified(self, index: int, epoch: int, job_index: int, key: tuple[int, int, int], nonce: bytes) -> None:
        agent = self.agents[index]
        if agent.epoch != epoch:
            return
        agent.running.discard(("verify", job_index) + key)
        mirror = agent.mirrors[job_index]
        if not self._is_coordinator(agent, mirror):
            return
        worker, faked = mirror.reports[key]
        head = hashlib.sha256(repr((mirror.job.job_id, key, worker)).encode()).digest()  # the report's chain head
        segments, caught = replay_check(head, nonce, self.cfg.checkpoints, self.cfg.verify_segments, faked)
        accepted = not caught
        reason = (f"replayed segments {list(segments)} within the proof rules" if accepted
                  else f"segment {caught[0]} does not replay")
        if not accepted:
            agent.banned.setdefault(job_index, set()).add(worker)
        rnd, shard, attempt = key
        expires = mirror.state.shards[shard].expires_at
        if self.cfg.verdict_margin and expires is not None and self.now > expires - self.cfg.verdict_margin:
            self.refused["verdict withheld"] += 1  # the remedy: others' windows may already have closed
            return
        actions = self._step(agent, mirror, st.VerdictGiven(rnd, shard, attempt, accepted, reason))
        if actions is None:
            return  # too late: the verification window closed and the shard moved on
        job = mirror.job
        if faked and accepted:
            job.byzantine_accepted += 1
        elif faked:
            job.byzantine_rejected += 1
        else:
            job.honest_accepted += 1
        self._after(agent, mirror, actions)
        self._publish(agent, Msg(VERDICT, job_index, index, rnd, shard, attempt, worker, mirror.view.term,
                                 accepted, reason))

    def _start_aggregation(self, agent: SimAgent, mirror: Mirror, rnd: int) -> None:
        task = ("aggregate", mirror.job.index, rnd)
        if task in agent.running:
            return
        agent.running.add(task)
        cfg = self.cfg
        start = max(self.now + cfg.fetch_seconds * self.rng.lognormvariate(0.0, 0.3), agent.torch_free)
        agent.torch_free = start + cfg.aggregate_seconds * agent.speed
        self._at(agent.torch_free, self._aggregated, agent.index, agent.epoch, mirror.job.index, rnd)

    def _aggregated(self, index: int, epoch: int, job_index: int, rnd: int) -> None:
        agent = self.agents[index]
        if agent.epoch != epoch:
            return
        agent.running.discard(("aggregate", job_index, rnd))
        mirror = agent.mirrors[job_index]
        if not self._is_coordinator(agent, mirror):
            return
        msg = Msg(AGGREGATE, job_index, index, rnd, term=mirror.view.term)
        actions = self._apply_decision(agent, mirror, msg)
        if actions is None:
            return
        if rnd == self.cfg.rounds and mirror.job.published_at is None:
            mirror.job.published_at = self.now
        self._after(agent, mirror, actions)
        self._publish(agent, msg)

    # -- churn ----------------------------------------------------------------------------------

    def _leave(self, index: int, epoch: int) -> None:
        agent = self.agents[index]
        if agent.epoch != epoch:
            return
        if agent.lease is not None and self.rng.random() < self.cfg.graceful_fraction:
            job, rnd, shard, attempt = agent.lease  # WorkerRole.release_all on a clean shutdown
            self._publish(agent, Msg(RELEASE, job, index, rnd, shard, attempt, reason="the agent is shutting down"))
        agent.online = False
        agent.left_at = self.now
        agent.online_seconds += self.now - agent.joined_at
        agent.epoch += 1
        for job_index, mirror in agent.mirrors.items():
            self.jobs[job_index].subscribers.pop(index, None)
            if index in self.jobs[job_index].ignored_claimants:
                self._resume_claims(self.jobs[job_index], index)
            self._set_view(agent, mirror, Coordination(mirror.job.job_id))
        agent.mirrors = {}
        agent.lease = None
        agent.torch_free = 0.0
        agent.banned = {}
        agent.running = set()
        agent.last_claim = {}
        agent.poll_pending = False
        self._at(self.now + self.cfg.silence, self._silent, index, agent.epoch)
        self._at(self.now + self.rng.expovariate(1.0 / (self.cfg.offline_minutes * 60)), self._join, index, agent.epoch)

    def _join(self, index: int, epoch: int) -> None:
        agent = self.agents[index]
        if agent.epoch != epoch:
            return
        agent.online = True
        agent.joined_at = self.now
        agent.epoch += 1
        period = self.cfg.reannounce_seconds
        for job_index in agent.follows:  # followed again at the job's next re-announcement
            job = self.jobs[job_index]
            if job.announce_at <= self.now and job.outcome == "RUNNING":
                next_announce = job.announce_at + period * math.ceil((self.now - job.announce_at) / period)
                self._at(next_announce + self._latency(), self._follow, index, agent.epoch, job_index, True)
        self._at(self.now + self.rng.expovariate(self.cfg.churn / HOUR), self._leave, index, agent.epoch)


def replay_check(head: bytes, nonce: bytes, n_segments: int, k: int,
                 faked: frozenset[int]) -> tuple[tuple[int, ...], list[int]]:
    """What a verifier's replay finds: the segments it draws (protocol.proof.select_segments from a
    seed fixed after the report) and, sorted, the faked ones among them. Over random nonces a report
    with m faked segments is caught with probability ``catch_probability(n, k, m)``."""
    segments = select_segments(segment_selection_seed(head, nonce), n_segments, k)
    return segments, sorted(faked.intersection(segments))


def _held_by(state: st.JobState, peer: str) -> bool:
    """JobView.held_by: the worker holds a lease (or awaits a verdict) in this job."""
    return any(s.worker == peer and s.phase in (st.ShardPhase.LEASED, st.ShardPhase.REPORTED) for s in state.shards)


def simulate(config: SimConfig) -> Result:
    """Run one simulation to its end and return its result."""
    return Simulation(config).run()
