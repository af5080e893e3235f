"""A deterministic discrete-event simulator of the job protocol: many agents, many jobs, one seed.

It answers what the protocol does at a scale no test can run (a thousand agents, a hundred jobs,
hours of churn): how many jobs publish, how fast, at what message cost, how often coordinators
fail over, whether Byzantine work gets through. The document is ``ipips/0009-simulation.md``.

Rules of this file:

- The protocol is the real one, and so is the mirror. Every follower's copy of a job is a
  ``protocol.mirror.JobMirror`` built from the job's real ``protocol.messages.JobTerms`` and fed the
  real job-topic messages (``ShardLease``, ``ShardRevoke``, ``CheckpointCommit``, ``ShardReport``, ``ShardRelease``,
  ``Verdict``, ``AggregatePublished``) with their signers' peer IDs, through its doors only:
  ``receive``, ``lease_for`` + ``decide``, ``replay``, ``tick``, ``observe_term``, ``retry``, ``adopt``.
  Its state machine, its election view (``coordination``) and its held messages with their limits
  (``PENDING_MAX``, ``PENDING_PER_SIGNER``, ``PENDING_SECONDS``, the checkpoint cap) are the agent's;
  this file keeps none of its own. Each door's ``Outcome`` is committed as agent/evidence.py ``Evidence.commit``
  does: store the evidence, publish what goes out, then act and react. Who may be leased is
  ``protocol.leasing.history_refusal`` over the mirror's verdicts (no ban is kept in memory); the view
  moves by ``keep_or_elect`` as ``JobClock.update_election`` moves it, and by the terms heartbeats carry
  (``observe_term``); not by rule 10's ``depose_unclaimed`` (IPIP-0006 §1.3: elections here are events,
  with no periodic tick to notice a live coordinator that never claims its term); Byzantine detection is ``select_segments`` over a seed fixed after the report, as
  a verifier does. What agents do with the outcomes mirrors agent/node.py and agent/roles/*.py (named
  at each handler); this file decides no protocol question itself.
- Nothing real around it: virtual time (a heap of events, seconds from 0), no I/O, no libp2p, no
  torch, no wall clock, no signatures. A message travels in an ``Envelope`` (signer, sender, signed
  time), the stand-in for the signed envelope: the mirror is given it as the envelope and hands it back
  as evidence, so an agent's store of a job (what a catch-up replays) is what its commits stored. What
  a Byzantine worker faked is the model's truth and never in a message: a side table keyed by (job,
  round, shard, attempt, worker). One ``random.Random(seed)`` draws everything in event order, so the
  same config and seed give the same run, event for event (``Result.digest`` hashes the event trace).
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
      Heartbeats are counted (online time / interval); the coordinator terms they carry reach a
      job's followers a heartbeat after a take-over, a new follower a heartbeat after it follows,
      and everyone a heartbeat after a partition heals.
    * churn: non-submitter agents leave at ``churn`` per hour (Poisson), half gracefully
      (releasing their lease), half by crashing, and return after an exponential time with an
      empty memory (a restarted process): they follow jobs again at the next re-announcement,
      with a mirror that missed the history. Submitters stay: they serve the shards by CID.
      A crashed lease holder's coordinator revokes its lease ``silent_holder_seconds`` after its last
      heartbeat (CoordinatorRole.revoke_silent with protocol/leasing.silent_holders, IPIP-0004 §5.3),
      checked from the crash (or a partition's start, or a lease granted to a worker gone since) and
      every ``silence`` after while the holder is gone, where the agent checks at every tick.
    * work: a shard takes ``shard_minutes`` x the worker's speed factor (log-normal), after a
      fetch; ``checkpoints`` evenly spaced commitments extend the lease. Training, replays and
      aggregation take one per-agent lock (agent/train/runner.py TORCH_LOCK), so a coordinator's
      verifications wait for its own training. A replay costs ``verify_segments / checkpoints`` of
      a shard; aggregation ``aggregate_seconds``.
    * Byzantine workers fake ``fake_fraction`` of their segments (a random set fixed before the
      verifier draws) and save that much time; a verifier rejects the report when its drawn
      segments hit a faked one, so rejection happens with probability ``catch_probability``.
      Byzantine peers coordinate honestly (a lying coordinator is not modelled).
- ``catch_up`` is built into the agent (agent/roles/sync.py) and on by default: a follower replays
  the submitter's history when it follows a job (``JobMirror.replay``); a mirror holding an eligible
  coordinator's decision it cannot apply for ``sync_after`` seconds is rebuilt from that history
  (``JobMirror.adopt``, at most once per ``resync_interval``); a submitter whose mirror holds such a
  decision, or stalls, receives its live peers' histories. ``reorder_buffer = False`` empties the
  mirror's held messages after each door (the agent before it held any). The other switches
  (``coordinators_train = False``, ``verdict_margin``) are what-ifs for changes the agent does not
  have yet; the defaults are the agent as built. Not modelled: the agent's rule that only the
  submitter's side of a partition elects and decides (IPIP-0006 §1.3), claim windows and
  reputation order, a worker stopping an attempt that is no longer its own (``drop_stale``).
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
import logging
import math
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from protocol import messages as m
from protocol import state as st
from protocol.election import keep_or_elect, rank_peers
from protocol.identity import Identity
from protocol.leasing import history_refusal, silent_holders, silent_seconds
from protocol.mirror import DECISIONS, JobMirror, Outcome, job_config
from protocol.resync import STALL_SECONDS, WORKER_MESSAGES, needs_resync, repair_sources, stall_after, stalled
from protocol.proof import catch_probability, faked_segments, segment_selection_seed, select_segments

HOUR = 3600.0

# Job-topic message kinds (protocol/messages.py type tags).
CLAIM, LEASE, RELEASE, CKPT = m.ShardClaim.TYPE, m.ShardLease.TYPE, m.ShardRelease.TYPE, m.CheckpointCommit.TYPE
REPORT, VERDICT, AGGREGATE = m.ShardReport.TYPE, m.Verdict.TYPE, m.AggregatePublished.TYPE
MESSAGE_KINDS = (CLAIM, LEASE, RELEASE, CKPT, REPORT, VERDICT, AGGREGATE)

# The agent's constants the simulator follows (agent/roles/sync.py and agent/node.py import trio, which
# the simulator must not load; the values are theirs)
TICK_SECONDS = 0.5  # agent/node.py _ticks: how often the agent checks a job (its resync rule here)
PEERS_ASKED = 8  # sync.PEERS_ASKED: a stalled (or behind) submitter asks at most this many live peers

# The job's content, by CID (the simulator fetches nothing: any well-formed CID will do)
CID = "bafkreifjjcie6lypi6ny7amxnfftagclbuxndqonfipmb64f2km2devei4"
CHECKPOINT_EVERY = 10  # optimizer steps between two checkpoint commits (the terms' proof.checkpoint_every)
NO_HASH = bytes(32)


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
    # the job spec (infernet.train.yml), made into the job's real JobTerms
    shards: int = 6
    rounds: int = 2
    lease_seconds: float = 3600.0  # whole seconds in the terms
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
    # the defaults are the agent as built; the rest are what-ifs (see the module docstring)
    coordinators_train: bool = True  # a coordinator still claims shards of other jobs
    reorder_buffer: bool = True  # the mirror holds refused messages (False: emptied after each door)
    catch_up: bool = True  # catch-up on follow, resync of a mirror that fell behind (agent/roles/sync.py)
    repair: bool = False  # a mirror holding worker messages asks their signers (protocol/resync.repair_sources; off
    # by default, as in the agent: IPIP-0004 §11.1 says why)
    sync_after: float = 5.0  # resync.RESYNC_HELD_SECONDS: a message held this long means the mirror fell behind
    resync_interval: float = 15.0  # resync.RESYNC_INTERVAL: at most one rebuild or repair of a mirror this often
    verdict_margin: float = 0.0  # a coordinator withholds a verdict this close to its window's end
    # a coordinator revokes the lease of a holder it has not heard for this long (CoordinatorRole.revoke_silent,
    # IPIP-0004 §5.3; the agent's silent_holder_seconds); 0: leases end only when they run out
    silent_holder_seconds: float = 15.0

    @property
    def silence(self) -> float:
        return self.heartbeat_seconds * self.missed_heartbeats


class Envelope:
    """A job-topic message on its way, standing in for its signed envelope: what the mirror is given as
    the envelope, keeps as evidence and a catch-up replays (``at``: the signer's clock when it signed).
    The mirror never reads an envelope's bytes, only hands them back, so this object takes their place
    (no signing, no encoding); an agent's store is the list of these its commits kept."""

    __slots__ = ("job", "msg", "signer", "sender", "at")

    def __init__(self, job: int, msg: Any, signer: str, sender: int, at: float) -> None:
        self.job = job
        self.msg = msg
        self.signer = signer
        self.sender = sender  # the signer's agent index
        self.at = at


class Followed:
    """One agent following one job: its mirror (the real ``JobMirror``), and what the agent keeps
    beside it (its store of the job's evidence, its timers, the view last seen, for the simulator's
    index of who names whom)."""

    __slots__ = ("job", "mirror", "view", "late", "tick_at", "store", "stored", "resynced", "check_at")

    def __init__(self, job: "SimJob", mirror: JobMirror, late: bool) -> None:
        self.job = job
        self.mirror = mirror
        self.view = mirror.coordination  # the view the simulator's index holds (``_sync_view``)
        self.late = late  # followed at a re-announcement: missed the history before it (until caught up)
        self.tick_at: float | None = None
        self.store: list[Envelope] = []  # the evidence committed, in order (agent/node.py _store_evidence)
        self.stored: set[int] = set()  # ids of those (the store keeps an envelope once)
        self.resynced = -math.inf  # JobClock.last_resync
        self.check_at: float | None = None  # when the resync rule is next checked


class SimAgent:
    __slots__ = ("index", "peer", "speed", "worker", "byzantine", "submitter", "follows", "trains", "online", "epoch",
                 "joined_at", "left_at", "online_seconds", "mirrors", "lease", "torch_free", "running",
                 "coordinating", "last_claim", "poll_pending")

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
        self.mirrors: dict[int, Followed] = {}
        self.lease: tuple[int, int, int, int] | None = None  # (job, round, shard, attempt) being trained
        self.torch_free = 0.0  # when the agent's training/replay lock is next free
        self.running: set[tuple] = set()  # coordinator tasks under way
        self.coordinating: set[int] = set()  # jobs taken over (JobClock.coordinating)
        self.last_claim: dict[int, float] = {}
        self.poll_pending = False


@dataclass
class SimJob:
    index: int
    job_id: bytes
    submitter: int
    terms: m.JobTerms
    config: st.JobConfig  # the state machine's settings, read off the terms (protocol.mirror.job_config)
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
    syncs: int  # catch_up: mirrors that took in a peer's history (follow, resync, submitter catch-up)
    digest: str
    mirror_warnings: Counter = field(default_factory=Counter)  # what the mirrors logged as warnings, by kind
    repairs: int = 0  # repairs asked of held worker messages' signers (protocol/resync.repair_sources)

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
            "mirror_repairs": self.repairs,
            "mirror_warnings": dict(self.mirror_warnings.most_common()),
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
        self.refused: Counter = Counter()  # what mirrors refused (their ``refused``), and verdicts withheld
        self.partitions: list[tuple[float, float, frozenset[int]]] = []
        # coordinator agent -> the (agent, job) views naming it: who must re-elect when it falls silent
        self._viewers: dict[int, dict[tuple[int, int], None]] = {}
        self._running_jobs = config.jobs
        self.syncs = 0  # catch_up: mirrors that took in a peer's history (follow, resync, submitter catch-up)
        self.repairs = 0  # repairs asked of held worker messages' signers (protocol/resync.repair_sources)
        # what Byzantine workers faked: (job, round, shard, attempt, worker peer) -> faked segments
        self.faked: dict[tuple[int, int, int, int, str], frozenset[int]] = {}
        # liveness: agents that left (index -> when), and the live sets handed to mirrors, per side
        self._left: dict[int, float] = {}
        self._live_version = 0
        self._live_sets: dict[tuple[bool, ...], tuple[int, float, frozenset[str]]] = {}
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
            submitter = submitters[j % len(submitters)]
            announce_at = rng.uniform(0.0, cfg.announce_minutes * 60)
            terms = self._terms(j, self.agents[submitter].peer, announce_at)
            job_id = terms.job_id()
            ranking = tuple(self.by_peer[p] for p in rank_peers(job_id, peers))
            self.jobs.append(SimJob(j, job_id, submitter, terms, job_config(terms), ranking, announce_at))
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

    def _terms(self, j: int, submitter: str, announce_at: float) -> m.JobTerms:
        """Job ``j``'s real terms: what the mirror reads its settings (and the checkpoint cap) off."""
        cfg = self.cfg
        return m.JobTerms(
            name=f"sim-{cfg.seed}-{j}", submitter=submitter, base_model=f"sim-model-{j}",
            base_model_sha256=hashlib.sha256(f"infernet/sim/model/{j}".encode()).digest(), method="lora",
            runtime="peft", seed=j, shards=tuple(m.ShardRef(i, CID, 100, 12) for i in range(cfg.shards)),
            validation_cid=None, training=m.TrainingTerms(1, 1e-3, 1, 1, 256, cfg.checkpoints * CHECKPOINT_EVERY),
            lora=m.LoraTerms(8, 16.0, 0.0, ("q_proj", "v_proj"), True),
            proof=m.ProofTerms(CHECKPOINT_EVERY, cfg.verify_segments, 1e-4), rounds=cfg.rounds, aggregation="fedavg",
            min_accepted_fraction=cfg.min_accepted_fraction, max_retries=cfg.max_retries,
            lease_seconds=int(cfg.lease_seconds), min_vram_gb=0.0,
            deadline=int(announce_at + cfg.max_runtime_hours * HOUR), price_per_hour=0.0, budget=0.0,
            created=int(announce_at))

    # -- the event loop -----------------------------------------------------------------------

    def _at(self, when: float, handler: Callable, *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (when, self._seq, handler, args))

    def run(self) -> Result:
        """Run to the end (every job ended, or ``hours``); the mirrors' warnings are counted, not logged."""
        counter = _CountWarnings()
        logger = logging.getLogger("protocol.mirror")
        logger.addFilter(counter)
        try:
            result = self._run()
        finally:
            logger.removeFilter(counter)
        result.mirror_warnings = counter.counts
        return result

    def _run(self) -> Result:
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
        for agent in self.agents:
            for f in agent.mirrors.values():
                self.refused.update(f.mirror.refused)
        mirrors = diverged = 0
        for job in self.jobs:
            self._trace.update(f"{job.index} {job.outcome} {job.reason} {job.ended_at}\n".encode())
            if job.index not in self.agents[job.submitter].mirrors:
                continue  # not announced yet
            record = self.agents[job.submitter].mirrors[job.index].mirror.state
            for index in job.subscribers:
                state = self.agents[index].mirrors[job.index].mirror.state
                mirrors += 1
                diverged += (state.phase, state.round) != (record.phase, record.round)
        return Result(self.cfg, self.jobs, end, self.events, heartbeats, self.refused, mirrors, diverged,
                      self.syncs, self._trace.hexdigest(), repairs=self.repairs)

    def _latency(self) -> float:
        return self.rng.lognormvariate(math.log(self.cfg.latency_median), self.cfg.latency_sigma)

    # -- liveness and election (agent/node.py: eligible_coordinators, update_election) -----------

    def _separated(self, a: int, b: int, when: float) -> bool:
        if not self.partitions:
            return False
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

    def _live_set(self, observer: int) -> frozenset[str]:
        """Agent.eligible_coordinators as ``observer`` sees them now: every live peer (``_live``), itself
        included. What a mirror's door is given as ``eligible``. Kept until a peer leaves, returns or
        falls silent, or a partition starts or ends (one set per side of the partitions)."""
        side = tuple(observer in members for _, _, members in self.partitions) if self.partitions else ()
        cached = self._live_sets.get(side)
        if cached is not None and cached[0] == self._live_version and self.now < cached[1]:
            return cached[2]
        now, silence = self.now, self.cfg.silence
        until = math.inf  # when the set next changes by itself (a peer's silence, a partition's end)
        if not self.partitions:
            live = [a.peer for a in self.agents if a.online]
            for index, left in self._left.items():
                if now - left < silence:
                    live.append(self.agents[index].peer)
                    until = min(until, left + silence)
        else:
            live = []
            for peer in range(len(self.agents)):
                heard = self._last_heard(observer, peer)
                if peer == observer or now - heard < silence:
                    live.append(self.agents[peer].peer)
                    if heard < now and peer != observer:
                        until = min(until, heard + silence)
            for start, end, _ in self.partitions:
                if now < end:
                    until = min(until, end)
        result = frozenset(live)
        self._live_sets[side] = (self._live_version, until, result)
        return result

    def _liveness_changed(self) -> None:
        self._live_version += 1
        cutoff = self.now - self.cfg.silence
        for index in [i for i, left in self._left.items() if left <= cutoff]:
            del self._left[index]

    def _eligible(self, agent: SimAgent, f: Followed) -> frozenset[str]:
        """The part of the eligible live set that keep_or_elect consults: the current coordinator if
        live, and the best-ranked live peer (the rendezvous winner of the whole set)."""
        eligible = set()
        current = f.mirror.coordination.coordinator
        if current is not None and self._live(agent.index, self.by_peer[current]):
            eligible.add(current)
        for peer in f.job.ranking:
            if self._live(agent.index, peer):
                eligible.add(self.agents[peer].peer)
                break
        return frozenset(eligible)

    def _sync_view(self, agent: SimAgent, f: Followed) -> None:
        """The mirror's election view moved (any door may move it): keep the index of who names whom,
        count the submitter's failovers, and step down or take over (JobClock.tick_job)."""
        view, old = f.mirror.coordination, f.view
        if view is old:
            return
        f.view = view
        if view.coordinator == old.coordinator:
            return
        key = (agent.index, f.job.index)
        if old.coordinator is not None:
            self._viewers.get(self.by_peer[old.coordinator], {}).pop(key, None)
        if view.coordinator is not None:
            self._viewers.setdefault(self.by_peer[view.coordinator], {})[key] = None
        job = f.job
        if agent.index == job.submitter and old.coordinator is not None:
            job.failovers += 1
        if view.coordinator is not None and not self._live(agent.index, self.by_peer[view.coordinator]):
            # a view taken from history may name a peer already silent: the agent's next election tick
            # replaces it (its _silent event, which re-elects the views naming it, may be past)
            self._at(self.now + TICK_SECONDS, self._elect, agent.index, agent.epoch, job.index)
        self._check_coordinating(agent, f)
        self._judge_reports(agent, f)
        self._wake(agent)

    def _unindex(self, agent: SimAgent, f: Followed) -> None:
        if f.view.coordinator is not None:
            self._viewers.get(self.by_peer[f.view.coordinator], {}).pop((agent.index, f.job.index), None)

    def _past_grace(self, f: Followed) -> bool:
        # the election is scheduled at first_seen + grace exactly; float sums may land a hair short
        return self.now - f.mirror.first_seen >= self.cfg.grace_seconds - 1e-6

    def _is_coordinator(self, agent: SimAgent, f: Followed) -> bool:
        """Agent.is_coordinator (a catch-up here is instant, so never under way)."""
        return f.mirror.coordination.coordinator == agent.peer and self._past_grace(f)

    def _check_coordinating(self, agent: SimAgent, f: Followed) -> None:
        """JobClock.tick_job: take the job over when we just became its coordinator; forget it when not."""
        if not self._is_coordinator(agent, f):
            agent.coordinating.discard(f.job.index)
        elif f.job.index not in agent.coordinating and not f.mirror.state.terminal:
            agent.coordinating.add(f.job.index)
            self._take_over(agent, f)

    def _elect(self, index: int, epoch: int, job_index: int) -> None:
        """JobClock.update_election (its view moved, what it held is tried again: JobClock._retry_held), then
        take_over if we just became the coordinator (JobClock.tick_job)."""
        agent = self.agents[index]
        f = agent.mirrors.get(job_index)
        if agent.epoch != epoch or f is None:
            return
        mirror = f.mirror
        if not self._past_grace(f) or mirror.state.terminal:
            return
        view = keep_or_elect(mirror.coordination, self._eligible(agent, f))
        if view is not mirror.coordination:
            mirror.coordination = view
            self._sync_view(agent, f)
            if mirror.pending:
                self._commit(agent, f, mirror.retry(self.now, self._live_set(index)))
        self._check_coordinating(agent, f)
        self._wake(agent)

    def _silent(self, index: int, epoch: int) -> None:
        """``index`` left ``silence`` seconds ago and has not returned: views naming it re-elect."""
        if self.agents[index].epoch != epoch:
            return
        self._liveness_changed()
        for viewer, job in list(self._viewers.get(index, {})):
            self._elect(viewer, self.agents[viewer].epoch, job)

    def _partition_start(self, partition: Partition) -> None:
        side = partition.members
        if partition.coordinator_of is not None:
            job = self.jobs[partition.coordinator_of]
            f = self.agents[job.submitter].mirrors.get(job.index)
            coordinator = f.mirror.coordination.coordinator if f else None
            side = frozenset({self.by_peer[coordinator]}) if coordinator else frozenset()
        self.partitions.append((partition.start, partition.end, side))
        self._liveness_changed()
        self._at(self.now + self.cfg.silence, self._partition_noticed)
        if self.cfg.silent_holder_seconds > 0:  # holders cut off from their coordinator fall silent to it
            for job in self.jobs:
                self._at(self.now + self._silent_holder_seconds() + self.cfg.heartbeat_seconds, self._revoke_silent,
                         job.index)
        self._at(partition.end + self.cfg.heartbeat_seconds, self._heartbeat_terms)

    def _partition_noticed(self) -> None:
        for agent in self.agents:
            for job in list(agent.mirrors):
                self._elect(agent.index, agent.epoch, job)

    # -- coordinator terms in heartbeats (agent/capability.py heartbeats, Agent._read_jobs_topic) ---------------

    def _heartbeat_terms(self) -> None:
        """After a heal, heartbeats carry each coordinator's (job, term) claims to everyone: a deposed
        coordinator learns the higher term and steps down."""
        for job in self.jobs:
            self._hear_terms(job, list(job.subscribers))

    def _announce_term(self, index: int, epoch: int, job_index: int) -> None:
        """A heartbeat after a take-over: the followers hear the coordinator's term."""
        agent = self.agents[index]
        f = agent.mirrors.get(job_index)
        if agent.epoch == epoch and f is not None and self._is_coordinator(agent, f):
            self._hear_terms(f.job, list(f.job.subscribers), (agent,))

    def _first_heartbeats(self, index: int, epoch: int, job_index: int) -> None:
        """A heartbeat after we followed a job: we hear its coordinators' terms."""
        agent = self.agents[index]
        if agent.epoch == epoch and job_index in agent.mirrors:
            self._hear_terms(self.jobs[job_index], [index])

    def _hear_terms(self, job: SimJob, followers: list[int], coordinators: tuple[SimAgent, ...] | None = None) -> None:
        if coordinators is None:
            coordinators = tuple(a for a in (self.agents[i] for i in job.subscribers)
                                 if self._is_coordinator(a, a.mirrors[job.index]))
        claims = [(c, c.mirrors[job.index].mirror.coordination.term) for c in coordinators
                  if not c.mirrors[job.index].mirror.state.terminal]
        for follower in followers:
            agent = self.agents[follower]
            f = agent.mirrors.get(job.index)
            if f is None:
                continue
            for coordinator, term in claims:
                if coordinator is not agent and not self._separated(coordinator.index, follower, self.now):
                    self._commit(agent, f, f.mirror.observe_term(coordinator.peer, term, self.now,
                                                                 self._live_set(follower)))

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
        f = agent.mirrors[job_index] = Followed(job, JobMirror(job.terms, self.now, agent.peer), late)
        job.subscribers[index] = None
        if index != job.submitter and self.cfg.catch_up:
            self._catch_up(agent, f)
        self._schedule_tick(agent, f)
        self._at(self.now + self.cfg.heartbeat_seconds, self._first_heartbeats, index, epoch, job_index)
        self._at(self.now + self.cfg.grace_seconds, self._elect, index, epoch, job_index)
        if index == job.submitter and self.cfg.catch_up:
            self._check_later(agent, f, self.now + self._stall_seconds() + TICK_SECONDS)

    # -- committing what a mirror did (Evidence.commit, Agent.apply_actions, react) -------------------------

    def _commit(self, agent: SimAgent, f: Followed, outcome: Outcome, *, act: bool = True) -> None:
        """Evidence.commit (agent/evidence.py): store the evidence, publish what goes out, then carry out the actions and the
        roles' reactions (``act=False``: history, only stored)."""
        if outcome.evidence:
            stored = f.stored
            for envelope in outcome.evidence:
                if id(envelope) not in stored:
                    stored.add(id(envelope))
                    f.store.append(envelope)
        if outcome.outgoing is not None:
            self._gossip(agent, outcome.outgoing)
        if not self.cfg.reorder_buffer and f.mirror.pending:
            f.mirror.pending.clear()  # the what-if: the agent before it held refused messages
        if f.mirror.coordination is not f.view:
            self._sync_view(agent, f)
        actions = outcome.actions
        if actions is None:
            return
        if not (actions and f.tick_at is not None and f.tick_at >= self.now
                and all(type(a) is st.ExtendLease for a in actions)):
            self._schedule_tick(agent, f)  # (a lease extended never brings the next timer closer)
        job = f.job
        if agent.index == job.submitter:
            self._record(job, f, actions if act else ())
        if not act:
            self._wake(agent)
            return
        self._apply_actions(agent, f, actions)
        for msg, _by in outcome.applied:  # Agent.react: a lease for us starts training (WorkerRole.on_lease)
            if type(msg) is m.ShardLease and msg.worker == agent.peer and agent.worker:
                self._on_lease(agent, f, msg)
        if any(type(a) is st.StartVerification for a in actions):
            self._judge_reports(agent, f)  # a report of the coordinator's own may fall to us
        if job.ignored_claimants:
            if agent.index in job.ignored_claimants:
                if outcome.applied or outcome.actions:
                    self._resume_claims(job, agent.index)  # its own view changed: it may claim elsewhere
            elif self._is_coordinator(agent, f) and (
                    any(type(msg) not in (m.CheckpointCommit, m.ShardLease) for msg, _ in outcome.applied)
                    or (not outcome.applied and outcome.actions)):
                for worker in list(job.ignored_claimants):  # the coordinator's view changed: it may grant now
                    self._resume_claims(job, worker)

    def _apply_actions(self, agent: SimAgent, f: Followed, actions: tuple) -> None:
        """Agent.apply_actions: the coordinator acts (CoordinatorRole.on_actions), workers look for work."""
        if actions and self._is_coordinator(agent, f):
            for action in actions:
                if isinstance(action, st.StartVerification):
                    if f.mirror.shard(action.shard).worker != agent.peer:  # our own: another peer judges it
                        self._start_verification(agent, f, m.attempt_of(action))
                elif isinstance(action, st.Aggregate):
                    self._start_aggregation(agent, f, action.round)
        if agent.worker and any(isinstance(a, (st.ReopenShard, st.StartRound, st.Done, st.FailJob)) for a in actions):
            self._wake(agent)  # a shard to claim, or (coordinators_train off) a job no longer ours

    def _record(self, job: SimJob, f: Followed, actions: tuple) -> None:
        """The submitter's record: reassignments as its mirror reopens shards, the outcome once it ends."""
        if job.outcome != "RUNNING":
            return
        for action in actions:
            if isinstance(action, st.ReopenShard):
                job.reassignments += 1
                job.reopen_reasons[_reason_kind(action.reason)] += 1
        state = f.mirror.state
        if state.terminal:
            done = state.phase is st.JobPhase.DONE
            job.outcome, job.reason, job.ended_at = ("DONE" if done else "FAILED"), state.reason, self.now
            self._running_jobs -= 1

    # -- the state machine's timers (Agent._ticks) --------------------------------------------

    def _schedule_tick(self, agent: SimAgent, f: Followed) -> None:
        state = f.mirror.state
        if state.terminal:
            return
        timers = [s.expires_at for s in state.shards if s.expires_at is not None]
        timers += [t for t in (state.expires_at, state.config.deadline) if t is not None]
        if not timers:
            return
        when = min(timers)
        if f.tick_at is None or when < f.tick_at or f.tick_at < self.now:
            f.tick_at = when
            self._at(when, self._tick, agent.index, agent.epoch, f.job.index)

    def _tick(self, index: int, epoch: int, job_index: int) -> None:
        agent = self.agents[index]
        f = agent.mirrors.get(job_index)
        if agent.epoch != epoch or f is None:
            return
        if f.tick_at is not None and f.tick_at <= self.now:
            f.tick_at = None
        self._commit(agent, f, f.mirror.tick(self.now))

    # -- messages -------------------------------------------------------------------------------

    def _publish(self, agent: SimAgent, job: SimJob, msg: Any) -> None:
        """Gossip a message of ours (a claim, a worker message); our own worker messages reach our own
        mirror at once (the echo)."""
        envelope = Envelope(job.index, msg, agent.peer, agent.index, self.now)
        f = agent.mirrors.get(job.index)
        if f is not None and type(msg) in WORKER_MESSAGES:
            self._commit(agent, f, f.mirror.receive(msg, agent.peer, self.now, self._live_set(agent.index), envelope))
        self._gossip(agent, envelope)

    def _decide(self, agent: SimAgent, f: Followed, decision: Any) -> bool:
        """Agent.decide: our decision applied to our mirror, stored, published, carried out; False if the
        mirror refused it (it moved on meanwhile)."""
        envelope = Envelope(f.job.index, decision, agent.peer, agent.index, self.now)
        outcome = f.mirror.decide(decision, self.now, envelope)
        if not outcome.changed:
            return False
        self._commit(agent, f, outcome)
        return True

    def _gossip(self, agent: SimAgent, envelope: Envelope) -> None:
        """Gossip on the job's topic to every subscribed follower but us (our decisions' echoes are skipped)."""
        job = self.jobs[envelope.job]
        kind = envelope.msg.TYPE
        job.messages[kind] += 1
        loss = self.cfg.loss
        for index in job.subscribers:
            if index == agent.index or self._separated(agent.index, index, self.now):
                continue
            if kind == CLAIM:  # only a coordinator acts on a claim (Agent._read_job_topic)
                other = self.agents[index]
                if not self._is_coordinator(other, other.mirrors[envelope.job]):
                    continue
            if loss and self.rng.random() < loss:
                continue
            self._at(self.now + self._latency(), self._deliver, index, self.agents[index].epoch, envelope)

    def _deliver(self, index: int, epoch: int, envelope: Envelope) -> None:
        """Agent.on_job_message: a claim goes to the coordinator role, anything else to the mirror."""
        agent = self.agents[index]
        f = agent.mirrors.get(envelope.job)
        if agent.epoch != epoch or f is None:
            return
        msg = envelope.msg
        if type(msg) is m.ShardClaim:
            self._on_claim(agent, f, envelope)
            return
        mirror = f.mirror
        self._commit(agent, f, mirror.receive(msg, envelope.signer, self.now, self._live_set(index), envelope))
        if self.cfg.catch_up and isinstance(msg, self._asks_history()) and mirror.pending and mirror.pending[-1][1] is msg:
            self._check_later(agent, f, self.now + self.cfg.sync_after + TICK_SECONDS)  # held: we may be behind

    # -- catching up (agent/roles/sync.py) ------------------------------------------------------

    def _stall_seconds(self) -> float:
        return stall_after(self.jobs[0].terms) if self.jobs else STALL_SECONDS

    def _catch_up(self, agent: SimAgent, f: Followed) -> None:
        """sync.catch_up: replay the submitter's history that is not in our store (history: stored,
        nothing carried out)."""
        job = f.job
        source = self.agents[job.submitter]
        held = source.mirrors.get(job.index)
        if held is None or not source.online or self._separated(agent.index, source.index, self.now):
            return
        replayed = 0
        for envelope in list(held.store):
            if id(envelope) in f.stored:
                continue
            self._commit(agent, f, f.mirror.replay(envelope.msg, envelope.signer, envelope.at, envelope),
                         act=False)
            replayed += 1
        f.late = False  # it holds the job's history now
        if replayed:
            self.syncs += 1
            self._rebuilt(agent, f)

    def _rebuilt(self, agent: SimAgent, f: Followed) -> None:
        """The mirror took in a peer's history: a claimant whose claims were ignored sees it anew."""
        if agent.index in f.job.ignored_claimants:
            self._resume_claims(f.job, agent.index)

    def _check_later(self, agent: SimAgent, f: Followed, when: float) -> None:
        if f.check_at is None or when < f.check_at:
            f.check_at = when
            self._at(when, self._resync_check, agent.index, agent.epoch, f.job.index)

    def _asks_history(self) -> tuple[type, ...]:
        """The held messages that may ask for history: decisions; with ``repair``, worker messages too."""
        return DECISIONS + WORKER_MESSAGES if self.cfg.repair else DECISIONS

    def _needs_resync(self, f: Followed, eligible: frozenset[str]) -> bool:
        """protocol/resync.needs_resync (an eligible coordinator's decision held over ``sync_after`` since the
        last rebuild), or for the submitter resync.stalled (nothing applied for a long while)."""
        return needs_resync(f.mirror, eligible, self.now, self.cfg.sync_after) or \
            stalled(f.mirror, f.mirror.me, self.now, STALL_SECONDS)

    def _resync_check(self, index: int, epoch: int, job_index: int) -> None:
        """JobClock.tick_job's resync rule, checked when it may hold: a rebuild from the submitter's history
        (sync.resync), or for the submitter a catch-up from its live peers (sync.submitter_catch_up)."""
        agent = self.agents[index]
        f = agent.mirrors.get(job_index)
        if agent.epoch != epoch or f is None or f.check_at is None or f.check_at > self.now:
            return
        f.check_at = None
        mirror = f.mirror
        if mirror.state.terminal:
            return
        sources: tuple[str, ...] | None = None  # () the submitter's history (or its live peers'); else signers'
        if self._needs_resync(f, self._live_set(index)):
            sources = ()
        elif self.cfg.repair:
            sources = repair_sources(mirror, self.now, self.cfg.sync_after) or None
        if sources is not None:
            if self.now - f.resynced <= self.cfg.resync_interval:
                self._check_later(agent, f, f.resynced + self.cfg.resync_interval + TICK_SECONDS)
                return
            f.resynced = mirror.resynced_at = self.now
            if sources:
                self._repair(agent, f, sources)
            elif index == f.job.submitter:
                self._submitter_catch_up(agent, f)
            else:
                self._resync(agent, f)
        if agent.epoch != epoch or f.mirror.state.terminal:
            return
        # when the rule may hold next: a held decision comes of age, or the submitter's job stalls
        since = mirror.resynced_at
        due = [seen + self.cfg.sync_after + TICK_SECONDS for seen, msg, _, _ in mirror.pending
               if isinstance(msg, self._asks_history()) and (since is None or seen > since)
               and seen + self.cfg.sync_after + TICK_SECONDS > self.now]
        if index == f.job.submitter:
            due.append(max(mirror.last_applied + self._stall_seconds(), self.now) + TICK_SECONDS)
        if due:
            self._check_later(agent, f, min(due))

    def _resync(self, agent: SimAgent, f: Followed) -> None:
        """sync.resync: rebuild the mirror from the submitter's whole history and adopt it in place, then
        commit what that did (reactions included); a coordinator resumes the rebuilt mirror's work."""
        job = f.job
        source = self.agents[job.submitter]
        held = source.mirrors.get(job.index)
        if held is None or not source.online or self._separated(agent.index, source.index, self.now) \
                or not held.store:
            return
        fresh = JobMirror(job.terms, f.mirror.first_seen, agent.peer)
        history = Outcome.join([fresh.replay(envelope.msg, envelope.signer, envelope.at, envelope)
                                for envelope in held.store])
        self._commit(agent, f, f.mirror.adopt(fresh, history, self.now, self._live_set(agent.index)))
        self.syncs += 1
        self._rebuilt(agent, f)
        if self._is_coordinator(agent, f) and job.index in agent.coordinating:
            self._resume(agent, f)

    def _submitter_catch_up(self, agent: SimAgent, f: Followed) -> None:
        """sync.submitter_catch_up: the submitter receives, as live messages at their signed time, what
        up to PEERS_ASKED live followers of the job (its coordinator first) stored and it did not; their
        actions are nobody's to carry out, only the reactions."""
        job, mirror = f.job, f.mirror
        live = [i for i in job.subscribers if i != agent.index and self._live(agent.index, i)
                and not self._separated(agent.index, i, self.now)]
        self.rng.shuffle(live)
        coordinator = self.by_peer.get(mirror.coordination.coordinator or "")
        live.sort(key=lambda i: i != coordinator)
        caught = self._receive_histories(agent, f, live[:PEERS_ASKED], vouch=True)
        if caught:
            self.syncs += 1
            self._rebuilt(agent, f)

    def _repair(self, agent: SimAgent, f: Followed, sources: tuple[str, ...]) -> None:
        """sync.repair: the signers of the worker messages our mirror holds are asked for their histories,
        received as the submitter's catch-up receives its peers' (those online and reachable answer)."""
        peers = [i for i in (self.by_peer.get(p) for p in sources) if i is not None and i != agent.index
                 and self.agents[i].online and not self._separated(agent.index, i, self.now)]
        self.repairs += 1
        if self._receive_histories(agent, f, peers, act=True):
            self.syncs += 1
            self._rebuilt(agent, f)
            if self._is_coordinator(agent, f) and f.job.index in agent.coordinating:
                self._resume(agent, f)

    def _receive_histories(self, agent: SimAgent, f: Followed, peers: list[int], *, act: bool = False,
                           vouch: bool = False) -> int:
        """sync._receive_histories: what each of ``peers`` stored of the job and we did not, received as live
        messages at their signed time; the held live ones tried once at the real now. How many applied.
        ``act``: what applied is carried out as for live messages (a repair: they are what we missed), else
        only the reactions (the submitter's catch-up: the past's actions are nobody's). ``vouch`` (the
        submitter's catch-up): the history of the view's coordinator vouches for its earlier terms'
        decisions (IPIP-0006 §1.3 rule 9), and is received once more at the end for what did not apply."""
        mirror = f.mirror
        caught = 0

        def receive(peer: int) -> None:
            nonlocal caught
            held = self.agents[peer].mirrors.get(f.job.index)
            for envelope in list(held.store) if held is not None else ():
                if id(envelope) in f.stored:
                    continue
                outcome = mirror.receive(envelope.msg, envelope.signer, envelope.at, self._live_set(agent.index),
                                         envelope, history=True,
                                         vouched=vouch and self.agents[peer].peer == mirror.coordination.coordinator)
                if outcome.changed:
                    caught += 1
                    if not act:
                        outcome = Outcome((), outcome.applied, outcome.evidence, outcome.outgoing)
                self._commit(agent, f, outcome)
            outcome = mirror.retry(self.now, self._live_set(agent.index))  # held live ones, at the real now
            self._commit(agent, f, Outcome((), outcome.applied, outcome.evidence) if outcome.changed and not act
                         else outcome)

        for peer in peers:
            receive(peer)
        coordinator = self.by_peer.get(mirror.coordination.coordinator or "")
        if vouch and coordinator in peers:
            receive(coordinator)
        return caught

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
                not f.mirror.state.terminal and self._is_coordinator(agent, f) for f in agent.mirrors.values()):
            return  # the what-if: a coordinator keeps its lock for replays (woken when it steps down)
        waiting = False
        for job_index, f in agent.mirrors.items():
            mirror = f.mirror
            state = mirror.state
            if job_index not in agent.trains or index in f.job.ignored_claimants \
                    or state.phase not in (st.JobPhase.ANNOUNCED, st.JobPhase.TRAINING):
                continue
            coordinator = mirror.coordination.coordinator
            if coordinator in (None, agent.peer) or mirror.training_by(agent.peer):
                continue
            open_shards = mirror.open_shards()
            if not open_shards:
                continue
            waiting = True
            if self.now - agent.last_claim.get(job_index, -math.inf) < 2 * self.cfg.claim_interval:
                continue
            agent.last_claim[job_index] = self.now
            self._publish(agent, f.job, m.ShardClaim(f.job.job_id, state.round, self.rng.choice(open_shards)))
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

    def _on_lease(self, agent: SimAgent, f: Followed, lease: m.ShardLease) -> None:
        """WorkerRole.on_lease and _train_and_report: fetch, train under the lock, commit, report."""
        if agent.lease is not None:
            return
        cfg, rng = self.cfg, self.rng
        key = (f.job.index, lease.round, lease.shard, lease.attempt)
        agent.lease = key
        start = max(self.now + cfg.fetch_seconds * rng.lognormvariate(0.0, 0.3), agent.torch_free)
        duration = cfg.shard_minutes * 60 * agent.speed * rng.lognormvariate(0.0, 0.1)
        if agent.byzantine:
            faked = frozenset(rng.sample(range(cfg.checkpoints), faked_segments(cfg.checkpoints, cfg.fake_fraction)))
            self.faked[key + (agent.peer,)] = faked  # the model's truth, fixed before any verifier draws
            duration = duration * (1 - len(faked) / cfg.checkpoints) + 60.0  # faking saves the work
        agent.torch_free = start + duration
        fails_at = math.inf
        if not agent.byzantine and cfg.worker_failure and rng.random() < cfg.worker_failure:
            fails_at = start + rng.uniform(0.0, duration)
            self._at(fails_at, self._worker_message, agent.index, agent.epoch, key, RELEASE, 0)
        for i in range(1, cfg.checkpoints + 1):
            if start + duration * i / cfg.checkpoints < fails_at:
                self._at(start + duration * i / cfg.checkpoints, self._worker_message, agent.index, agent.epoch,
                         key, CKPT, i)
        if fails_at == math.inf:
            self._at(start + duration + 5.0, self._worker_message, agent.index, agent.epoch, key, REPORT, 0)

    def _worker_message(self, index: int, epoch: int, key: tuple, kind: str, i: int) -> None:
        agent = self.agents[index]
        if agent.epoch != epoch:
            return
        job_index, rnd, shard, attempt = key
        job = self.jobs[job_index]
        if kind == CKPT:
            msg: Any = m.CheckpointCommit(job.job_id, rnd, shard, attempt, i * CHECKPOINT_EVERY, i, NO_HASH, NO_HASH,
                                          1.0, None)
        elif kind == REPORT:
            msg = m.ShardReport(job.job_id, rnd, shard, attempt, CID, CID, _chain_head(job.job_id, key, agent.peer),
                                self.cfg.checkpoints, self.cfg.checkpoints * CHECKPOINT_EVERY, 12, 1.0, {})
        else:
            msg = m.ShardRelease(job.job_id, rnd, shard, attempt, "training failed")
        self._publish(agent, job, msg)
        if kind in (REPORT, RELEASE):
            agent.lease = None
            self._wake(agent)

    # -- the coordinator (CoordinatorRole) ------------------------------------------------------

    def _on_claim(self, agent: SimAgent, f: Followed, envelope: Envelope) -> None:
        """CoordinatorRole.on_claim, _may_lease and _grant: never to a peer the job's signed history
        forbids (ourselves, a worker a verdict rejected, one training a shard of it:
        protocol.leasing.history_refusal), nor to one that is not live; the lease is the mirror's
        (``lease_for``), decided (``decide``)."""
        claim, worker, peer = envelope.msg, envelope.sender, envelope.signer
        mirror, job = f.mirror, f.job
        if not self._is_coordinator(agent, f):
            return
        state = mirror.state
        open_shards = mirror.open_shards()
        if claim.round != state.round or state.phase not in (st.JobPhase.ANNOUNCED, st.JobPhase.TRAINING) \
                or not open_shards or not self._live(agent.index, worker) \
                or history_refusal(peer, agent.peer, mirror.verdicts.values(), state.shards) is not None:
            self._ignore_claims(job, worker)
            return
        shard = claim.shard if claim.shard in open_shards else open_shards[0]
        lease = mirror.lease_for(shard, peer, self.now)
        if lease is not None and self._decide(agent, f, lease) and self.cfg.silent_holder_seconds > 0 and \
                not self.agents[self.by_peer[peer]].online:  # granted on a claim of a worker gone since (still live)
            self._at(self.now + self._silent_holder_seconds() + self.cfg.heartbeat_seconds, self._revoke_silent,
                     f.job.index)

    def _take_over(self, agent: SimAgent, f: Followed) -> None:
        """CoordinatorRole.take_over: resume what the mirror says is pending; our heartbeats carry the term."""
        job = f.job
        for worker in list(job.ignored_claimants):  # a new coordinator may grant what the old one ignored
            self._resume_claims(job, worker)
        if f.mirror.coordination.term > 1:  # a failover, not the job's first coordinator
            job.takeovers += 1
            job.late_takeovers += f.late
        self._at(self.now + self.cfg.heartbeat_seconds, self._announce_term, agent.index, agent.epoch, job.index)
        self._resume(agent, f)

    def _resume(self, agent: SimAgent, f: Followed) -> None:
        """CoordinatorRole.resume: verify each REPORTED shard (not ours), aggregate an AGGREGATING round."""
        state = f.mirror.state
        for shard in state.shards:
            if shard.phase is st.ShardPhase.REPORTED and shard.worker != agent.peer:
                self._start_verification(agent, f, (state.round, shard.index, shard.attempt))
        if state.phase is st.JobPhase.AGGREGATING:
            self._start_aggregation(agent, f, state.round)

    def _judge(self, agent: SimAgent, f: Followed, worker: str) -> bool:
        """protocol.election.judge_of, as ``agent`` sees it, for a report of the job's coordinator: the
        first live peer by rank other than the worker (the job's ranking is the whole set's)."""
        worker_index = self.by_peer[worker]
        for peer in f.job.ranking:
            if peer != worker_index and self._live(agent.index, peer):
                return peer == agent.index
        return False

    def _may_verify(self, agent: SimAgent, f: Followed, worker: str) -> bool:
        """CoordinatorRole.may_verify: we coordinate and the report is not ours, or it is the
        coordinator's own and we are its judge."""
        if worker == agent.peer:
            return False
        if worker != f.mirror.coordination.coordinator:
            return self._is_coordinator(agent, f)
        return self._past_grace(f) and self._judge(agent, f, worker)

    def _judge_reports(self, agent: SimAgent, f: Followed) -> None:
        """CoordinatorRole.judge_reports: verify the coordinator's own reports that fall to us."""
        mirror = f.mirror
        coordinator = mirror.coordination.coordinator
        if coordinator is None or coordinator == agent.peer or mirror.state.terminal:
            return
        state = mirror.state
        for shard in state.shards:
            if shard.phase is st.ShardPhase.REPORTED and shard.worker == coordinator:
                key = (state.round, shard.index, shard.attempt)
                if key in mirror.reports and self._may_verify(agent, f, coordinator):
                    self._start_verification(agent, f, key)

    def _start_verification(self, agent: SimAgent, f: Followed, key: tuple[int, int, int]) -> None:
        task = ("verify", f.job.index) + key
        if task in agent.running or key not in f.mirror.reports:
            return
        agent.running.add(task)
        cfg = self.cfg
        start = max(self.now + cfg.fetch_seconds * self.rng.lognormvariate(0.0, 0.3), agent.torch_free)
        replay = cfg.shard_minutes * 60 * agent.speed * min(cfg.verify_segments, cfg.checkpoints) / cfg.checkpoints
        agent.torch_free = start + replay
        nonce = self.rng.randbytes(16)  # drawn after the report: the worker could not know it
        report, worker = f.mirror.reports[key]  # (read when the verification starts, as _verify does)
        self._at(start + replay, self._verified, agent.index, agent.epoch, f.job.index, key, report, worker, nonce)

    def _verified(self, index: int, epoch: int, job_index: int, key: tuple[int, int, int], report: m.ShardReport,
                  worker: str, nonce: bytes) -> None:
        """The end of CoordinatorRole._verify: a verdict in our term, decided if the report is still ours to judge."""
        agent = self.agents[index]
        if agent.epoch != epoch:
            return
        agent.running.discard(("verify", job_index) + key)
        f = agent.mirrors[job_index]
        mirror = f.mirror
        if not self._may_verify(agent, f, worker):
            return
        faked = self.faked.get((job_index,) + key + (worker,), frozenset())
        segments, caught = replay_check(report.chain_head, nonce, self.cfg.checkpoints, self.cfg.verify_segments,
                                        faked)
        accepted = not caught
        reason = (f"replayed segments {list(segments)} within the proof rules" if accepted
                  else f"segment {caught[0]} does not replay")
        rnd, shard, attempt = key
        expires = mirror.state.shards[shard].expires_at
        if self.cfg.verdict_margin and expires is not None and self.now > expires - self.cfg.verdict_margin:
            self.refused["verdict withheld"] += 1  # the what-if: others' windows may already have closed
            return
        verdict = m.Verdict(f.job.job_id, rnd, shard, attempt, worker, mirror.coordination.term, accepted, reason,
                            segments)
        if not self._decide(agent, f, verdict):
            return  # too late: the verification window closed and the shard moved on
        job = f.job
        if faked and accepted:
            job.byzantine_accepted += 1
        elif faked:
            job.byzantine_rejected += 1
        else:
            job.honest_accepted += 1

    def _start_aggregation(self, agent: SimAgent, f: Followed, rnd: int) -> None:
        task = ("aggregate", f.job.index, rnd)
        if task in agent.running:
            return
        agent.running.add(task)
        cfg = self.cfg
        start = max(self.now + cfg.fetch_seconds * self.rng.lognormvariate(0.0, 0.3), agent.torch_free)
        agent.torch_free = start + cfg.aggregate_seconds * agent.speed
        self._at(agent.torch_free, self._aggregated, agent.index, agent.epoch, f.job.index, rnd)

    def _aggregated(self, index: int, epoch: int, job_index: int, rnd: int) -> None:
        """The end of CoordinatorRole._aggregate: the aggregate, decided if the round is still ours to publish."""
        agent = self.agents[index]
        if agent.epoch != epoch:
            return
        agent.running.discard(("aggregate", job_index, rnd))
        f = agent.mirrors[job_index]
        mirror, job = f.mirror, f.job
        state = mirror.state
        if not self._is_coordinator(agent, f) or state.phase is not st.JobPhase.AGGREGATING or state.round != rnd:
            return
        accepted = tuple(s.index for s in state.shards if s.phase is st.ShardPhase.ACCEPTED)
        final = mirror.ends_with(rnd, None)
        published = m.AggregatePublished(job.job_id, rnd, mirror.coordination.term, CID, job.terms.aggregation,
                                         accepted, 12 * len(accepted), final)
        if not self._decide(agent, f, published):
            return
        if final and job.published_at is None:
            job.published_at = self.now

    # -- churn ----------------------------------------------------------------------------------

    def _leave(self, index: int, epoch: int) -> None:
        agent = self.agents[index]
        if agent.epoch != epoch:
            return
        if agent.lease is not None and self.rng.random() < self.cfg.graceful_fraction:
            job_index, rnd, shard, attempt = agent.lease  # WorkerRole.release_all on a clean shutdown
            job = self.jobs[job_index]
            self._publish(agent, job, m.ShardRelease(job.job_id, rnd, shard, attempt, "the agent is shutting down"))
        elif agent.lease is not None and self.cfg.silent_holder_seconds > 0:  # crashed holding a lease
            self._at(self.now + self._silent_holder_seconds() + self.cfg.heartbeat_seconds, self._revoke_silent,
                     agent.lease[0])
        agent.online = False
        agent.left_at = self.now
        agent.online_seconds += self.now - agent.joined_at
        agent.epoch += 1
        self._left[index] = self.now
        self._liveness_changed()
        for job_index, f in agent.mirrors.items():
            job = self.jobs[job_index]
            job.subscribers.pop(index, None)
            if index in job.ignored_claimants:
                self._resume_claims(job, index)
            self._unindex(agent, f)
            self.refused.update(f.mirror.refused)
        agent.mirrors = {}
        agent.lease = None
        agent.torch_free = 0.0
        agent.running = set()
        agent.coordinating = set()
        agent.last_claim = {}
        agent.poll_pending = False
        self._at(self.now + self.cfg.silence, self._silent, index, agent.epoch)
        self._at(self.now + self.rng.expovariate(1.0 / (self.cfg.offline_minutes * 60)), self._join, index, agent.epoch)

    # -- silent holders (CoordinatorRole.revoke_silent, JobClock.tick_job) ---------------------------------

    def _silent_holder_seconds(self) -> float:
        return silent_seconds(self.cfg.silent_holder_seconds, self.cfg.silence)

    def _revoke_silent(self, job_index: int, tries: int = 0) -> None:
        """The job's coordinators (by their own view) revoke the leases of holders they no longer hear
        (protocol/leasing.silent_holders, as the agent's tick does; here from the moments a holder can fall
        silent: it crashed, or a partition cut it off, and again every ``silence`` while a holder that is gone
        still holds its lease: its coordinator may be gone too, and its successor not yet elected)."""
        job = self.jobs[job_index]
        if tries < 20 and any(shard.phase is st.ShardPhase.LEASED and shard.worker in self.by_peer
                              and not self.agents[self.by_peer[shard.worker]].online
                              for f in (self.agents[job.submitter].mirrors.get(job_index),) if f is not None
                              for shard in f.mirror.state.shards):
            self._at(self.now + self.cfg.silence, self._revoke_silent, job_index, tries + 1)
        for index in list(job.subscribers):
            agent = self.agents[index]
            f = agent.mirrors.get(job_index)
            if f is None or not self._is_coordinator(agent, f) or f.mirror.state.phase is not st.JobPhase.TRAINING:
                continue
            state = f.mirror.state
            heard = {self.agents[job.submitter].peer: self._last_heard(index, job.submitter)}
            for shard in state.shards:
                if shard.phase is st.ShardPhase.LEASED and shard.worker is not None and shard.worker in self.by_peer:
                    heard[shard.worker] = self._last_heard(index, self.by_peer[shard.worker])
            for shard_index, seconds in silent_holders(state.shards, agent.peer, heard, self.now,
                                                       state.config.lease_seconds, self._silent_holder_seconds(),
                                                       self.cfg.silence, agent.joined_at):
                shard = state.shards[shard_index]
                self._decide(agent, f, m.ShardRevoke(job.job_id, state.round, shard_index, shard.attempt,
                                                     shard.worker or "", f.mirror.coordination.term, round(seconds, 3)))
                state = f.mirror.state

    def _join(self, index: int, epoch: int) -> None:
        agent = self.agents[index]
        if agent.epoch != epoch:
            return
        agent.online = True
        agent.joined_at = self.now
        agent.epoch += 1
        self._left.pop(index, None)
        self._liveness_changed()
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


class _CountWarnings(logging.Filter):
    """Counts the warnings a logger would emit, by their text with the numbers and job IDs left out, and
    drops them (a thousand mirrors would print thousands of lines)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        self.counts[re.sub(r"%[sdrf]|%\.\d+f", "#", str(record.msg))] += 1
        return False


def _chain_head(job_id: bytes, key: tuple, worker: str) -> bytes:
    """A report's chain head (the model's: unique per attempt and worker)."""
    return hashlib.sha256(repr((job_id, key, worker)).encode()).digest()


def simulate(config: SimConfig) -> Result:
    """Run one simulation to its end and return its result."""
    return Simulation(config).run()
