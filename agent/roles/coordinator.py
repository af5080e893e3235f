"""The coordinator role: leases, verification, aggregation — for the jobs we are elected to.

Rules of this file:
- We act for a job only while our election view names us (agent/node.py). Every decision is a
  state-machine event (protocol/state.py) applied to our mirror first, then gossiped, signed, with
  our term; the actions the machine returns tell us what to do next.
- Which worker gets a lease is ours to decide: the shard it asked for if OPEN, else the lowest OPEN
  one; never a second live lease of this job to one worker (a shard it reported and that awaits
  its verdict does not count: it trains the next one meanwhile); never a lease to a worker whose work in
  this job was rejected, in any term (these three read off the signed history alone,
  protocol/leasing.history_refusal, so a successor refuses what its predecessor did); only to a live peer whose signed capability says it trains and fits the
  job (protocol/fit.lease_refusals: the job's runtime offered, its base model held by hash, a GPU
  with ``min_vram_gb`` total; IPIP-0004 §5.1) -- a claim from anyone else gets no lease, its reason
  logged once, so a peer cannot hoard leases it never meant or could not train; a lease to
  ourselves only when another peer would judge our report (a coordinator does not judge its own
  work: a report of ours, from a lease we granted ourselves or from one granted before we took over,
  is judged by the next eligible peer by rank: ``judge_reports``, protocol/election.judge_of), and accepted work must outlive the coordinator (the worker, the submitter and the verifier
  each hold a copy). The market's rules come on top (protocol/market.lease_refusal): no lease once a
  paid job's accepted work has spent its budget, only to its named providers, at most ``max_nodes``
  distinct workers. Claims are queued for ``claim_window`` and granted best reputation first --
  when open shards are scarce; while there are at least as many open shards as live peers that could
  claim one, a claim is granted at once (no order to keep, and the wait was a sixth of a demo round).
  A claim heard while we are not (yet) the job's coordinator -- our election tick has not named us
  yet, or a failover is under way -- is remembered (its latest per worker, at most
  ``early_claims_max`` per job) and queued when we take the job over, if the latest is at most
  ``early_claim_seconds`` old and of the current round, in the order the workers first claimed (a
  worker repeating its claim keeps its place): a worker whose grace period ended a tick before ours
  does not wait for its next claim while a faster one takes every shard.
- A report is accepted only if: the adapter and proof bundles fetch and hash-check by CID; the proof
  is about this job, round, shard, attempt, worker, base model and seed; its chain ends in the
  reported head and passes through every head the worker gossiped; its step-0 checkpoint is the
  start the round had to have (the LoRA seeded from the job in round 1, the previous round's
  aggregate after); the adapter's tensors are finite,
  have the job's rank and target modules, and hash to the chain's last adapter hash; and the
  ``proof.verify_segments`` segments chosen from randomness drawn *after* the report arrived
  replay within the proof rules (protocol/proof.py, agent/train/replay.py).
- The aggregate of a round is the job's method over the accepted adapters weighted by samples
  (agent/train/aggregate.py), then, if the job has one, the outer optimizer's step from the round's
  start (the seeded init in round 1, the previous aggregate after) with the outer state the previous
  aggregate's bundle carries (IPIP-0006 §2.4); published as an HF-layout adapter bundle by CID, with
  ``outer_state.safetensors`` beside the adapter so a successor continues with the same state. When
  the job has a validation split, the aggregate is scored on it (and the base model in round 1) and
  the losses go into the signed aggregate message (IPIP-0006 §2.6).
- Early start (IPIP-0006 §2.9, ``early_start``): once every shard of a round is reported and each report's
  adapter has passed the checks before the replays, the round's aggregate is computed (and scored, and
  kept by the submitter) while the replays run, and announced in an ``early`` message with the next
  round's shard for each of the round's workers; a worker that takes it claims that shard at once. If the
  round's accepted reports are the ones combined, that aggregate is published as is, and the announced
  leases go to the workers that claimed them before any other claim is granted.
- A verification fetches only what its replays read (IPIP-0005 §8 "What a verifier fetches"): no step-0
  checkpoint when the proof commits to the start we hold, and a segment's end only when its replay may
  not be bit-exact.
- On taking a job over (failover) we resume what the mirror says is pending: verifications of
  REPORTED shards and the aggregation of an AGGREGATING round.
- A verdict judges the worker, never us. The worker's fault is a rejection (and a ban): a proof or
  adapter that fails a rule (``Rejection``), a bundle of its that does not unpack, content of its
  whose blocks do not verify. Our own inability (a fetch that times out, a base model we do not
  hold, our own crash) is no verdict: we try again after each of ``retry_delays`` while the
  verification window lasts, then give up with a log line and leave the shard REPORTED; its window
  then expires and the shard reopens for another attempt with nobody banned (protocol/state.py),
  or a coordinator that takes over meanwhile verifies it. A failed aggregation is retried the same
  way within the aggregation window.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import trio

from agent.bundle import (
    AGGREGATE_FILES, CHECKPOINT_FILES, REPORT_FILES, BundleError, bundle_size_bound, pack_dir_off_loop, unpack_off_loop,
)
from agent.content.errors import FetchError
from agent.combine import Rejection, compute_aggregate, materialize_report, reads_start
from agent.downlink import read_start
from agent.roles.keep import KeepRefused, keep_before_publishing, keep_within
from agent.train.recorder import write_checkpoint
from agent.train.runner import run_torch, train_config
from agent.sealing import must_seal, seal_dir
from protocol import downlink, messages as m
from protocol.early import assignment as early_assignment, ready as early_ready
from protocol import state as st
from protocol.election import judge_of
from protocol.acceptance import HEADER_FIELDS, TensorFacts, adapter_refusal, chain_refusal, header_refusal
from protocol.cid import parse_cid
from protocol.fit import lease_refusals
from protocol.leasing import history_refusal, silent_holders, silent_seconds
from protocol.mirror import JobMirror

if TYPE_CHECKING:
    from agent.blocks import Blocks
    from agent.evidence import Evidence
    from agent.peers import PeerTable
    from agent.roles.port import Local
    from agent.tasks import Tasks
    from agent.net.stack import Network

log = logging.getLogger(__name__)

PROOF_FILES = frozenset({"proof.json", "checkpoints.json"})


@dataclass
class _Provisional:
    """A round's aggregate computed before its last verdicts, and the early start announced with it (§2.9)."""

    shards: tuple[tuple[int, int], ...]  # (shard, attempt) of every report it combines
    out: Path
    score: Any
    base_score: Any
    samples: int
    cid: str
    update_cid: str | None  # the coded aggregate's update (IPIP-0006 §2.8.1), None when it travels whole
    leases: tuple[tuple[int, str], ...]  # (shard, worker) of the next round, as announced
    scored: bool = True  # score and base_score computed (else: after the announcement, beside the training)
    taken: set[str] = field(default_factory=set)  # the workers whose claim said they started it


@dataclass
class _VerifyCosts:
    """What a job's verifications took here, to choose between fetching a segment's start checkpoint and replaying
    to it from the round's start (IPIP-0005 §8 "What a verifier fetches"): each a running mean, None until seen."""

    fetch: float | None = None  # seconds a checkpoint fetch took (from its start, beside the report's other fetches)
    step: float | None = None  # seconds a replayed step took

    def fetched(self, seconds: float) -> None:
        self.fetch = seconds if self.fetch is None else (self.fetch + seconds) / 2

    def replayed(self, seconds: float, steps: int) -> None:
        if steps > 0:
            self.step = seconds / steps if self.step is None else (self.step + seconds / steps) / 2

    def replay_cheaper(self, steps: int) -> bool:
        """Would replaying ``steps`` steps take less than the last checkpoint fetches did?"""
        return steps > 0 and self.fetch is not None and self.step is not None and steps * self.step < self.fetch


class CoordinatorRole:
    # after a failure of our own, wait this long before the next try of a verification or
    # aggregation (one try more than there are delays); never past the window it must finish in
    retry_delays: tuple[float, ...] = (2.0, 5.0, 15.0, 30.0, 60.0)
    # claims arriving within this many seconds of the first are granted together, best reputation first
    claim_window: float = 0.25
    # claims heard before we coordinate a job: kept this long, this many workers per job at most
    early_claim_seconds: float = 5.0
    early_claims_max: int = 256
    # claims from a peer we have not heard yet (no heartbeat or no signed capability: we just restarted or
    # took over, and peers tell theirs on hearing us back, at most every CAPABILITY_TELL_GAP, else every 30 s):
    # kept this long and granted once we hear it (a restarted coordinator refused an early start's claim and the
    # worker dropped that work 20 s later, unleased: tests/roles/test_resume.py)
    unheard_claim_seconds: float = 30.0

    def __init__(self, local: "Local", peer_table: "PeerTable", tasks: "Tasks", blocks: "Blocks", evidence: "Evidence",
                 net: Callable[[], "Network"]) -> None:
        self.local, self.peer_table, self.tasks, self.blocks, self.evidence = local, peer_table, tasks, blocks, evidence
        self.net = net  # a getter: the network exists once the agent runs (asking the submitter to keep a copy)
        self._running: set[tuple] = set()
        self.accepted_adapters: dict[tuple[bytes, int, int], tuple[Path, int]] = {}
        # (job, round) -> the adapter training starts from, and the outer state it carries
        self._initial: dict[tuple[bytes, int], tuple[dict, dict, dict]] = {}
        # (job, round) -> the hashes of that start's adapter and AdamW state (a header naming them needs no step 0)
        self._start_hashes: dict[tuple[bytes, int], tuple[bytes, bytes, Path | None]] = {}  # + where it is written
        self._start_lock = trio.Lock()
        self._replay_device_class: str | None = None
        # early start (IPIP-0006 §2.9): (job, round, shard, attempt) -> a report's adapter directory and samples once
        # its adapter checks out (before its replays); (job, round) -> the aggregate computed from them, announced
        self._checked: dict[tuple[bytes, int, int, int], tuple[Path, int]] = {}
        self._provisional: dict[tuple[bytes, int], _Provisional] = {}
        self._verify_costs: dict[bytes, _VerifyCosts] = {}  # job -> what its checkpoint fetches and replays took here
        self._computing_early: dict[tuple[bytes, int], trio.Event] = {}
        self._validation: dict[bytes, Path] = {}  # job -> its validation split, fetched
        self._claims: dict[bytes, list[tuple[str, int, int]]] = {}  # job -> (worker, round, shard) in arrival order
        self.hash_limiter = trio.CapacityLimiter(2)  # tensor hashing off the event loop, at most two at once
        self._refused: dict[tuple[bytes, str], str] = {}  # (job, worker) -> why its claims get no lease
        # job -> worker -> (first heard, last heard, round, shard): claims heard while we did not
        # coordinate the job; granted in order of first hearing (a worker repeating its claim keeps its
        # place), if the last is fresh
        self._early: dict[bytes, dict[str, tuple[float, float, int, int]]] = {}
        # job -> worker -> (first heard, round, shard): claims refused only because we have not heard that peer yet
        self._unheard: dict[bytes, dict[str, tuple[float, int, int]]] = {}

    # -- leases -----------------------------------------------------------------------------------

    async def on_claim(self, view: JobMirror, claim: m.ShardClaim, worker: str) -> None:
        """Queue a claim that may be granted; the claims of one ``claim_window`` are granted in order
        of the claimants' reputation (protocol/market.order_claims, IPIP-0004 §12)."""
        if not self.peer_table.is_coordinator(view):
            self._remember_early(view, claim, worker)
            return
        if claim.round == view.state.round + 1:  # a worker took the early start we announced it (IPIP-0006 §2.9)
            early = self._provisional.get((view.job_id, view.state.round))
            if early is not None and (claim.shard, worker) in early.leases:
                early.taken.add(worker)
            return
        self._queue(view, worker, claim.round, claim.shard)

    def _queue(self, view: JobMirror, worker: str, rnd: int, shard: int) -> None:
        if not self._may_lease(view, rnd, worker):
            if self._unheard_claimant(view, worker, rnd):
                waiting = self._unheard.setdefault(view.job_id, {})
                if worker in waiting or len(waiting) < self.early_claims_max:
                    first = waiting[worker][0] if worker in waiting else self.local.clock()
                    waiting[worker] = (first, rnd, shard)
            return
        queue = self._claims.setdefault(view.job_id, [])
        if any(w == worker for w, _, _ in queue):
            return
        queue.append((worker, rnd, shard))
        if len(queue) == 1 and not self.tasks.spawn_in_job(view.job_id, self._grant_claims, view):
            self._claims.pop(view.job_id, None)  # the job ended

    def _unheard_claimant(self, view: JobMirror, worker: str, rnd: int) -> bool:
        """Was a claim refused only because we have not heard its worker yet (its heartbeat or its capability)?"""
        return worker != self.local.peer_id and self._claim_in_order(view, rnd, worker) and \
            (worker not in self.peer_table.live_peers() or self.peer_table.capability_of(worker) is None)

    def grant_heard(self, view: JobMirror, now: float) -> None:
        """At each tick: the claims kept for a peer we had not heard (``_queue``) are queued again once we hear
        it, dropped ``unheard_claim_seconds`` after the first, or when their round is over."""
        waiting = self._unheard.get(view.job_id)
        if not waiting:
            return
        if not self.peer_table.is_coordinator(view) or view.state.terminal:
            del self._unheard[view.job_id]
            return
        live = self.peer_table.live_peers()
        for worker, (first, rnd, shard) in list(waiting.items()):
            if now - first > self.unheard_claim_seconds or rnd != view.state.round:
                del waiting[worker]
            elif worker in live and self.peer_table.capability_of(worker) is not None:
                del waiting[worker]
                log.info("job %s: heard %s now: its claim of round %d shard %d is queued again", view.job_id.hex()[:8],
                         worker[-8:], rnd, shard)
                self._refused.pop((view.job_id, worker), None)
                self._queue(view, worker, rnd, shard)

    def _remember_early(self, view: JobMirror, claim: m.ShardClaim, worker: str) -> None:
        """A claim we cannot grant because we do not coordinate the job (yet): kept for ``take_over``."""
        if claim.round != view.state.round or view.state.terminal or worker == self.local.peer_id:
            return
        if view.job_id not in self._early and len(self._early) >= 64:
            del self._early[next(iter(self._early))]  # the job we heard of longest ago
        early = self._early.setdefault(view.job_id, {})
        now = self.local.clock()
        if worker not in early and len(early) >= self.early_claims_max:
            for w in [w for w, (_, last, _, _) in early.items() if now - last > self.early_claim_seconds]:
                del early[w]
            if len(early) >= self.early_claims_max:
                return
        first = early[worker][0] if worker in early and early[worker][2] == claim.round else now
        early[worker] = (first, now, claim.round, claim.shard)

    def _claim_in_order(self, view: JobMirror, rnd: int, worker: str) -> bool:
        """What a claim must pass whatever we know of its worker: we coordinate the job, in its current round and a
        phase that leases, and the worker may train it by the job's history (or, for ourselves, ``_we_train``)."""
        if not self.peer_table.is_coordinator(view) or rnd != view.state.round:
            return False
        if view.state.phase not in (st.JobPhase.ANNOUNCED, st.JobPhase.TRAINING):
            return False
        if worker == self.local.peer_id:  # (with the history rule, our judge included: protocol/leasing.py)
            return self._we_train(view)  # we coordinate only, or hold a shard of this round already, or nobody would judge us
        # a worker rejected in any term, or one training a shard of it (protocol/leasing.py)
        return history_refusal(worker, self.local.peer_id, view.verdicts.values(), view.state.shards) is None

    def _may_lease(self, view: JobMirror, rnd: int, worker: str, *, count: bool = True) -> bool:
        from agent.market import lease_refusal as market_lease_refusal
        if not self._claim_in_order(view, rnd, worker):
            return False
        if worker != self.local.peer_id and worker not in self.peer_table.live_peers():
            return False
        # its signed capability fits the job (protocol/fit.py), then the market's rules (protocol/market.py:
        # budget, named providers, max_nodes)
        refusal = self.lease_refusal(view, worker) or market_lease_refusal(view, worker)
        if refusal is not None:
            if count:  # a claim is checked when queued, then again when granted: counted once
                self.local.counters["leases_refused"] += 1
            if self._refused.get((view.job_id, worker)) != refusal:  # claims repeat: say each reason once
                log.info("job %s: no lease for %s: %s", view.job_id.hex()[:8], worker, refusal)
            self._refused[(view.job_id, worker)] = refusal
            return False
        return True

    async def _grant_claims(self, view: JobMirror) -> None:
        from protocol.market import order_claims

        if self._shards_scarce(view):
            await trio.sleep(self.claim_window)
        claims = self._claims.pop(view.job_id, [])
        reputations = self.peer_table.reputations()
        ordered = order_claims([(w, i) for i, (w, _, _) in enumerate(claims)], reputations)
        # our own claim (we coordinate and train: leasing rule 1) comes after every other claimant's: a
        # coordinator takes a shard nobody else claimed, never one from a worker (in a paid job, from its pay)
        ordered = sorted(ordered, key=lambda claim: claim[0] == self.local.peer_id)  # (stable: the others keep their order)
        for worker, i in ordered:
            try:
                await self._grant(view, worker, claims[i][1], claims[i][2])
            except Exception as exc:  # noqa: BLE001 - one failed grant must not stop the agent
                log.warning("job %s: lease for %s failed: %s", view.job_id.hex()[:8], worker[-8:], exc)

    def _shards_scarce(self, view: JobMirror) -> bool:
        """Could a claim granted now take the last open shard from a better-reputed claimant that is
        still to come? Only then is there a ``claim_window`` to wait: when the open shards are at least
        as many as the live peers that could claim one (they train, fit the job, hold no live lease of it,
        are not banned; ourselves too, when we may train it), every claimant gets a lease whatever the
        order, and waiting only slows a round."""
        open_shards = len(view.open_shards())
        live = self.peer_table.live_peers()
        ours = 1 if self._we_train(view) else 0  # we claim too (after the others: _grant_claims)
        if open_shards >= len(live) + ours:
            return False
        if len(live) > 256:  # too many to check one by one on every claim: assume they compete
            return True
        could_claim = ours
        for peer in live:
            if history_refusal(peer, self.local.peer_id, view.verdicts.values(), view.state.shards) is not None:
                continue  # ourselves, rejected in any term, or training a shard of it (protocol/leasing.py)
            info = self.peer_table.peers.get(peer)
            if info is None or lease_refusals(info.capability, view.terms):
                continue
            could_claim += 1
            if could_claim > open_shards:
                return True
        return False

    async def _grant(self, view: JobMirror, worker: str, rnd: int, wanted: int) -> None:
        if not self._may_lease(view, rnd, worker):
            return
        open_shards = view.open_shards()
        if not open_shards:
            return
        shard = wanted if wanted in open_shards else open_shards[0]
        lease = view.lease_for(shard, worker, self.local.clock())
        if lease is None or not await self.evidence.decide(view, lease):
            return
        self.evidence.ledger(view.job_id, "lease", {"round": lease.round, "shard": lease.shard, "attempt": lease.attempt,
                                            "worker": worker, "expires_at": lease.expires_at})

    async def revoke_silent(self, view: JobMirror, now: float) -> None:
        """End the leases whose holder we no longer hear (protocol/leasing.silent_holders, IPIP-0004 §5.3): the
        shard reopens now, not ``lease_seconds`` later (an hour by default). A worker SIGKILLed after its claim
        was granted held a demo round for the whole lease (issue 24, early-member-killed)."""
        if not self.peer_table.is_coordinator(view) or view.state.phase is not st.JobPhase.TRAINING:
            return
        table = self.peer_table
        silent = silent_seconds(self.local.config.silent_holder_seconds, table.silence)
        heard = {p: i.last_heartbeat for p, i in table.peers.items() if p != self.local.peer_id}
        for index, seconds in silent_holders(view.state.shards, self.local.peer_id, heard, now,
                                             view.state.config.lease_seconds, silent, table.silence,
                                             table.beating_since):
            shard = view.shard(index)
            revoke = m.ShardRevoke(view.job_id, view.state.round, index, shard.attempt, shard.worker or "",
                                   view.coordination.term, round(seconds, 3))
            if await self.evidence.decide(view, revoke):
                self.local.counters["leases_revoked"] += 1
                log.warning("job %s round %d shard %d: lease of attempt %d revoked: %s silent for %.0f s",
                            view.job_id.hex()[:8], revoke.round, index, revoke.attempt, revoke.worker[-8:], seconds)

    def lease_refusal(self, view: JobMirror, worker: str) -> str | None:
        """Why we grant ``worker`` no lease of this job, read off its latest signed capability (ours: the
        one we last published) (protocol/fit.lease_refusals: it trains, offers the runtime, holds the model,
        a large enough GPU); None if it fits."""
        if worker == self.local.peer_id:
            capability = self.local.capabilities.published
        else:
            info = self.peer_table.peers.get(worker)
            capability = info.capability if info is not None else None
        reasons = lease_refusals(capability, view.terms)
        return "; ".join(reasons) if reasons else None

    def _we_train(self, view: JobMirror) -> bool:
        """Could we, the coordinator, be leased a shard of this job now? We train it (``coordinator_trains``),
        another peer would judge our report, we hold no shard of this round yet (one a round: a coordinator
        does not crowd out a worker that joins late or comes back), and our capability fits."""
        config, me = self.local.config, self.local.peer_id
        return config.accept_training and config.coordinator_trains and \
            not any(shard.worker == me for shard in view.state.shards) and \
            history_refusal(me, me, view.verdicts.values(), view.state.shards, self._judge_of_ours(view)) is None and \
            self.lease_refusal(view, me) is None

    def _judge_of_ours(self, view: JobMirror) -> str | None:
        """Who would judge a report of ours in this job (protocol/election.judge_of): the first eligible peer
        by rank after us; None when there is no other (then we lease ourselves nothing: leasing rule 1)."""
        judge = judge_of(view.job_id, self.local.peer_id, self.local.peer_id,
                         self.peer_table.eligible_coordinators(view.terms))
        return None if judge == self.local.peer_id else judge

    # -- reacting to the state machine -------------------------------------------------------------

    def on_actions(self, view: JobMirror, actions: tuple[Any, ...]) -> None:
        if not self.peer_table.is_coordinator(view):
            return
        for action in actions:
            if isinstance(action, st.StartVerification):
                if view.shard(action.shard).worker == self.local.peer_id:
                    continue  # our own report: another peer judges it (judge_reports)
                self._start(("verify", view.job_id, action.round, action.shard, action.attempt),
                            self._verify, view, action.round, action.shard, action.attempt)
            elif isinstance(action, st.Aggregate):
                self._start(("aggregate", view.job_id, action.round), self._aggregate_retrying, view, action)

    def forget(self, job_id: bytes) -> None:
        """The agent stopped following the job (agent/node.py ``forget_job``): drop what we kept for it
        (its tasks were cancelled with the job's nursery)."""
        for per_job in (self._validation, self._claims, self._early, self._unheard, self._verify_costs):
            per_job.pop(job_id, None)
        for keyed in (self.accepted_adapters, self._initial, self._start_hashes, self._refused, self._checked,
                      self._provisional):
            for key in [k for k in keyed if k[0] == job_id]:
                del keyed[key]

    def take_over(self, view: JobMirror) -> None:
        """We just became this job's coordinator: resume what is pending."""
        state = view.state
        log.info("job %s: coordinating (term %d)", view.job_id.hex()[:8], view.coordination.term)
        now = self.local.clock()
        for worker, (_, last, rnd, shard) in sorted(self._early.pop(view.job_id, {}).items(), key=lambda kv: kv[1][0]):
            if now - last <= self.early_claim_seconds and rnd == state.round:
                self._queue(view, worker, rnd, shard)  # claims heard just before we were elected
        self.tasks.spawn_in_job(view.job_id, self._prefetch_validation, view)
        self.tasks.spawn_in_job(view.job_id, self._warm, view)
        self.resume(view)

    def resume(self, view: JobMirror) -> None:
        """Start what our mirror says is pending: the verification of each REPORTED shard (not ours) and
        the aggregation of an AGGREGATING round (after a take-over, or a mirror rebuilt from the
        submitter's history: agent/roles/sync.resync). Work already running is not started twice."""
        state = view.state
        for shard in state.shards:
            if shard.phase is st.ShardPhase.REPORTED and shard.worker != self.local.peer_id:
                self._start(("verify", view.job_id, state.round, shard.index, shard.attempt),
                            self._verify, view, state.round, shard.index, shard.attempt)
        if state.phase is st.JobPhase.AGGREGATING:
            accepted = tuple(s.index for s in state.shards if s.phase is st.ShardPhase.ACCEPTED)
            action = st.Aggregate(state.round, accepted, state.expires_at or math.inf)
            self._start(("aggregate", view.job_id, state.round), self._aggregate_retrying, view, action)

    def judge_reports(self, view: JobMirror) -> None:
        """Verify the reports of the job's coordinator that fall to us (IPIP-0006 §1.3: a coordinator
        never judges its own work; the first eligible peer by rank after it does). Called every tick."""
        coordinator = view.coordination.coordinator
        if coordinator is None or coordinator == self.local.peer_id or view.state.terminal:
            return
        for shard in view.state.shards:
            if shard.phase is st.ShardPhase.REPORTED and shard.worker == coordinator and \
                    self.may_verify(view, coordinator) and \
                    (view.state.round, shard.index, shard.attempt) in view.reports:
                self._start(("verify", view.job_id, view.state.round, shard.index, shard.attempt),
                            self._verify, view, view.state.round, shard.index, shard.attempt)

    def may_verify(self, view: JobMirror, worker: str) -> bool:
        """Is it ours to judge ``worker``'s report now: we coordinate and it is not ours, or it is
        the coordinator's own and we are its judge (protocol/election.judge_of)?"""
        if worker == self.local.peer_id:
            return False
        if worker != view.coordination.coordinator:
            return self.peer_table.is_coordinator(view)
        judge = judge_of(view.job_id, view.coordination.coordinator, worker, self.peer_table.eligible_coordinators(view.terms))
        return judge == self.local.peer_id and self.local.clock() - view.first_seen >= self.local.config.grace_seconds and \
            self.peer_table.hears_submitter(view)

    def _start(self, key: tuple, fn: Any, *args: Any) -> None:
        if key in self._running:
            return
        self._running.add(key)

        async def run() -> None:
            try:
                await fn(*args)
            except Exception as exc:  # noqa: BLE001 - one job's failure must not stop the agent
                log.warning("job %s: %s failed: %s", args[0].job_id.hex()[:8], key[0], exc)
            finally:
                self._running.discard(key)

        if not self.tasks.spawn_in_job(args[0].job_id, run):
            self._running.discard(key)  # the job ended

    # -- verification -------------------------------------------------------------------------------

    def _retry_delay(self, tries: int, window_end: float | None) -> float | None:
        """Seconds to wait before try ``tries + 1`` after a failure of our own, or None: give up (no
        delay left, or the next try would start after ``window_end`` on the agent's clock)."""
        if tries > len(self.retry_delays):
            return None
        delay = self.retry_delays[tries - 1]
        if window_end is not None and self.local.clock() + delay >= window_end:
            return None
        return delay

    async def _verify(self, view: JobMirror, rnd: int, shard: int, attempt: int) -> None:
        report, worker = view.reports[(rnd, shard, attempt)]
        work = self.local.work_dir / view.job_id.hex()[:16] / f"verify-r{rnd}-s{shard}-a{attempt}"
        segments: tuple[int, ...] = ()
        tries = 0
        # the submitter's copy of the adapter (durable before announced, IPIP-0006 §2.6.1) is asked for once the
        # adapter checks out, while the segments replay, rather than after: on a WAN it is round trips (issue 24);
        # a rejection cancels it (the copy of an adapter that is then rejected costs the submitter its bytes only)
        async with _prefetching() as keeping:
            def keep_soon(adapter_dir: Path | None = None) -> None:
                if "keep" not in keeping.done:
                    keeping.start("keep", self._keep_accepted, view, rnd, shard, attempt, report.adapter_cid)
                if adapter_dir is not None:  # checked, not replayed yet: enough to aggregate early (§2.9)
                    self._checked[(view.job_id, rnd, shard, attempt)] = (adapter_dir, report.samples)
                    self._maybe_start_early(view, rnd)

            while True:
                tries += 1
                shutil.rmtree(work, ignore_errors=True)
                work.mkdir(parents=True)
                try:
                    segments, adapter_dir = await self._check_report(view, report, worker, work, keep_soon)
                    accepted, reason = True, f"replayed segments {list(segments)} within the proof rules"
                    break
                except Rejection as exc:  # the worker's fault: a verdict against it
                    accepted, reason = False, str(exc)[:1000]
                    break
                except Exception as exc:  # noqa: BLE001 - our own failure: never a verdict against the worker
                    current = view.shard(shard)
                    if current.phase is not st.ShardPhase.REPORTED or current.attempt != attempt or \
                            view.state.round != rnd or not self.may_verify(view, worker):
                        keeping.nursery.cancel_scope.cancel()
                        return  # settled or no longer ours meanwhile
                    delay = self._retry_delay(tries, current.expires_at)
                    problem = f"{type(exc).__name__}: {str(exc)[:300]}"
                    if delay is None:
                        self.local.counters["verifications_given_up"] += 1
                        log.warning("job %s shard %d attempt %d: cannot verify after %d tries, no verdict (the "
                                    "shard stays REPORTED until its window ends; the worker is not blamed): %s",
                                    view.job_id.hex()[:8], shard, attempt, tries, problem)
                        keeping.nursery.cancel_scope.cancel()
                        return
                    self.local.counters["verifications_retried"] += 1
                    log.warning("job %s shard %d attempt %d: cannot verify (try %d), again in %.0f s: %s",
                                view.job_id.hex()[:8], shard, attempt, tries, delay, problem)
                    await trio.sleep(delay)
            if not accepted or not self.may_verify(view, worker):
                keeping.nursery.cancel_scope.cancel()
            else:
                keep_soon()  # started already, unless the adapter check never called it
                kept = await keeping.get("keep")
        if not self.may_verify(view, worker):
            return
        if accepted and not kept:
            return
        if accepted:
            self.accepted_adapters[(view.job_id, rnd, shard)] = (adapter_dir, report.samples)
        else:
            self._checked.pop((view.job_id, rnd, shard, attempt), None)
        log.info("job %s shard %d attempt %d: %s — %s", view.job_id.hex()[:8], shard, attempt,
                 "accepted" if accepted else "REJECTED", reason)
        verdict = m.Verdict(view.job_id, rnd, shard, attempt, worker, view.coordination.term, accepted,
                            reason, segments)
        if not await self.evidence.decide(view, verdict):
            return
        self.local.counters["verdicts_accepted" if accepted else "verdicts_rejected"] += 1
        self.evidence.ledger(view.job_id, "verdict", {"round": rnd, "shard": shard, "attempt": attempt, "worker": worker,
                                              "accepted": accepted, "reason": reason})

    # -- early start (IPIP-0006 §2.9) ------------------------------------------------------------------

    def _maybe_start_early(self, view: JobMirror, rnd: int) -> None:
        """Once every shard of round ``rnd`` is reported and each report's adapter checked out (before its
        replays end), compute the round's aggregate and announce it as the next round's start."""
        if not self.local.config.early_start or not self.peer_table.is_coordinator(view) or view.state.round != rnd or \
                (view.job_id, rnd) in self._provisional or not self._early_inputs_in(view):
            return
        self._start(("early", view.job_id, rnd), self._start_early, view, rnd)

    def _early_inputs_in(self, view: JobMirror) -> bool:
        """The round may be announced (protocol/early.ready) and every report of it checked out here."""
        state = view.state
        return early_ready(state, view.terms.rounds) and \
            all((view.job_id, state.round, s.index, s.attempt) in self._checked for s in state.shards)

    async def _start_early(self, view: JobMirror, rnd: int) -> None:
        done = self._computing_early[(view.job_id, rnd)] = trio.Event()
        try:
            await self._compute_early(view, rnd)
        finally:
            done.set()
            self._computing_early.pop((view.job_id, rnd), None)

    async def _compute_early(self, view: JobMirror, rnd: int) -> None:
        shards = tuple((s.index, s.attempt) for s in view.state.shards)
        workers = {s.index: s.worker for s in view.state.shards}
        inputs = [self._checked[(view.job_id, rnd, index, attempt)] for index, attempt in shards]
        work = self.local.work_dir / view.job_id.hex()[:16] / f"early-r{rnd}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        started = trio.current_time()
        config = self._train_config(view, rnd)
        # The score is informative and the next round does not start from it: unless the job has a stop rule
        # (every one reads the score: StopTerms holds no rule without a condition), it is computed after the
        # announcement, beside the next round's training (a real job's validation split takes the coordinator's
        # device for seconds to minutes).
        score_first = view.terms.stop is not None
        out, score, base_score = await self._combine(view, rnd, config, inputs, work, scored=score_first,
                                                     beside_replays=True)
        if view.ends_with(rnd, score.loss if score is not None else None):
            return  # the stop rule ends the job here: no next round to start
        combined = trio.current_time()
        cid = str(await self.blocks.content.add_file(await pack_dir_off_loop(out, work / "adapter.tar"), provide=False))
        self.blocks.hold(view.job_id, rnd, cid)
        update_cid = await self._add_update(view, rnd, work)
        if view.state.round != rnd or tuple((s.index, s.attempt) for s in view.state.shards) != shards or \
                not self.peer_table.is_coordinator(view) or not self._early_inputs_in(view):
            return  # a report was rejected (its shard reopened), the round moved on, or we no longer coordinate it
        leases = early_assignment(tuple(workers.items()), self.local.peer_id, view.verdicts.values())
        provisional = self._provisional[(view.job_id, rnd)] = _Provisional(
            shards, out, score, base_score, sum(n for _, n in inputs), cid, update_cid, leases, scored=score_first)
        if leases:
            await self.evidence.publish(m.EarlyStart(view.job_id, rnd + 1, view.coordination.term, cid,
                                                     tuple(i for i, _ in leases), tuple(w for _, w in leases),
                                                     update_cid=update_cid))
        announced = trio.current_time()
        self.local.counters["early_starts_announced"] += 1

        async def keep() -> None:
            # the submitter's copy (durable before announced, §2.6.1) asked for now too: at the aggregate's
            # publication it is then one round trip; a refusal here costs nothing (asked again then)
            with trio.move_on_after(self.local.config.fetch_timeout):
                try:
                    await keep_before_publishing(self.local, self.net(), view, rnd, cid)
                except KeepRefused as exc:
                    log.info("job %s: round %d early aggregate not kept yet: %s", view.job_id.hex()[:8], rnd, exc)

        async def score_it() -> None:
            provisional.score, provisional.base_score = await self._scores(view, rnd, config, out, work)
            provisional.scored = True

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(keep)
                if not provisional.scored:
                    nursery.start_soon(score_it)
        except BaseExceptionGroup as group:  # the one error, as the sequential code raised it
            from agent.content.exchange import first_error

            raise first_error(group) from None
        log.info("job %s: round %d aggregate %s… computed early (%.2f s: %.2f s combining, announced after %.2f s), "
                 "before %d of %d verdicts; round %d announced to %d workers", view.job_id.hex()[:8], rnd, cid[:24],
                 trio.current_time() - started, combined - started, announced - started,
                 sum(1 for s in view.state.shards if s.phase is st.ShardPhase.REPORTED), len(shards), rnd + 1,
                 len(leases))

    async def _keep_accepted(self, view: JobMirror, rnd: int, shard: int, attempt: int, cid: str) -> bool:
        """Durable before announced, for accepted work too (IPIP-0006 §2.6.1): the submitter holds the
        adapter (fetched from us: we hold it since we verified it) before the verdict accepting it is
        published, asked again while the shard is ours to judge and its verification window lasts; False
        (no verdict; the window's end reopens the shard, nobody blamed) otherwise. (The soak: a worker and
        its verifier killed soon after the verdict, the submitter down meanwhile: the round's accepted
        adapter was held by nobody alive, and the round could not be aggregated.)"""
        def still_ours() -> bool:
            current = view.shard(shard)
            return current.phase is st.ShardPhase.REPORTED and current.attempt == attempt and \
                view.state.round == rnd and self.may_verify(view, current.worker or "")

        try:
            await keep_within(self.local, self.net, view, rnd, cid, still_ours=still_ours,
                              window_end=view.shard(shard).expires_at)
            return True
        except KeepRefused as exc:
            log.warning("job %s shard %d attempt %d: accepted, but the submitter holds no copy and the window is "
                        "over: no verdict (%s)", view.job_id.hex()[:8], shard, attempt, exc)
            return False

    async def _check_report(self, view: JobMirror, report: m.ShardReport, worker: str, work: Path,
                            on_adapter_checked: Any = None) -> tuple[tuple[int, ...], Path]:
        """The checks of IPIP-0005 §8 on a report: (the replayed segments, the adapter's directory), or
        Rejection. ``on_adapter_checked(adapter_dir)`` is called once the adapter is the one the chain commits to,
        before the replays (``_verify`` starts the submitter's copy of it then)."""
        from agent.train import base_model_sha256
        from agent.train.replay import check_initial_adapter, replay_runtime, verify_segment
        from protocol.proof import Commitment, ProofError, chain_heads, segment_selection_seed, select_segments

        terms = view.terms
        providers = [worker]
        shard_path = work / "shard.jsonl"
        began, marks = trio.current_time(), {}
        # Everything the checks read is fetched at once: the adapter and the shard (their CIDs are in the report
        # and the terms) with the proof, then the checkpoints the proof names. On a WAN each fetch is round trips,
        # and one after the other they were most of a round's verification (issue 24). The checks still run, and
        # reject, in IPIP-0005 §8's order; a rejection cancels the fetches still running.
        async with _prefetching() as fetched:
            # every worker-chosen CID is bounded by what we would unpack of it (IPIP-0003 "Size bounds")
            fetched.start("adapter", _fetch_worker_content, self.blocks, self.local, report.adapter_cid, work / "adapter.tar", worker,
                          providers, max_size=bundle_size_bound(1 << 30, REPORT_FILES))
            fetched.start("shard", partial(_fetch_worker_content, named_by_worker=False,
                                           exact_size=terms.shards[report.shard].size),
                          self.blocks, self.local, terms.shards[report.shard].cid, shard_path, worker, [terms.submitter, worker])
            await _fetch_worker_content(self.blocks, self.local, report.proof_cid, work / "proof.tar", worker, providers,
                                        max_size=bundle_size_bound(16 << 20, PROOF_FILES))
            proof_dir = await _unpack_worker_bundle(work / "proof.tar", work / "proof", allowed=PROOF_FILES,
                                                    max_bytes=16 << 20)
            try:
                commitment = Commitment.from_json(json.loads((proof_dir / "proof.json").read_text()))
                commitment.check(report.chain_head)
            except (ProofError, ValueError) as exc:
                raise Rejection(f"proof: {exc}") from None
            header = commitment.header
            expected = {"job_id": view.job_id, "round": report.round, "shard": report.shard,
                        "attempt": report.attempt, "worker": worker, "seed": terms.seed,
                        "checkpoint_every": terms.proof.checkpoint_every,
                        "base_model_sha256": terms.base_model_sha256.hex()}
            problem = header_refusal({name: getattr(header, name) for name in HEADER_FIELDS}, expected)  # R2
            if problem is None:  # R3
                heads = chain_heads(header.genesis(), commitment.links)
                gossiped = view.commits.get(m.attempt_of(report), [])
                problem = chain_refusal(report.checkpoints, len(commitment.links), heads,
                                        [(c.index, c.chain_head) for c in gossiped])
            if problem is not None:
                raise Rejection(problem)
            try:
                checkpoints = {int(k): v for k, v in json.loads((proof_dir / "checkpoints.json").read_text()).items()}
            except (ValueError, AttributeError) as exc:
                raise Rejection(f"checkpoints.json: {exc}") from None
            # the segments to replay, from randomness drawn after the report arrived
            seed = segment_selection_seed(report.chain_head, os.urandom(16))
            segments = select_segments(seed, len(commitment.links), terms.proof.verify_segments)
            model_path = self.local.capabilities.local_model(terms)
            if model_path is None or await trio.to_thread.run_sync(base_model_sha256, model_path) != terms.base_model_sha256.hex():
                raise RuntimeError(f"this coordinator does not hold base model {terms.base_model!r}")
            config = train_config(terms, model_path, round=report.round, threads=self.local.config.threads)
            expected, _, expected_optimizer = await self._round_start(view, report.round, config, work)
            # Only the checkpoints a replay reads are fetched, at once (issue 24: at 80 ms and 20 Mbit/s, three
            # checkpoints and the adapter of every report, all into the coordinator, were most of a round):
            # - step 0 not at all when the header commits to the round's start we hold (the usual case: the
            #   hashes bind the tensors, so the worker's copy would be the same bytes): written here instead;
            # - a segment's end only where its replay may not be bit-exact (another device class); elsewhere an
            #   exact replay never reads it, and one that is not exact fetches it then (``_replay_segment``).
            known = await self._known_start(view, report.round, commitment.header, expected, expected_optimizer)
            if known is not None:  # read where it is (``_checkpoint`` finds it under its own name)
                (work / "ckpt-0").symlink_to(known, target_is_directory=True)
            worker_env = commitment.header.environment
            parallel = worker_env.get("data_parallel", 1)
            ends_needed = worker_env.get("device_class") != await self._device_class(config) or \
                (isinstance(parallel, int) and parallel > 1)  # a data-parallel proof never replays bit for bit (§6.1)
            # - a segment's start not at all when replaying to it from the round's start we hold is bit for bit
            #   here and took less, on this job so far, than fetching a checkpoint did (a home uplink: a 7B
            #   adapter's checkpoint with its AdamW state is hundreds of MB, its replay seconds on a GPU)
            costs = self._verify_costs.setdefault(view.job_id, _VerifyCosts())
            from_start = set()
            if known is not None and not ends_needed and replay_runtime(worker_env) == "peft":
                from_start = {index for index in segments if costs.replay_cheaper(commitment.segment_start(index)[0])}
            steps = {0} | {commitment.segment_start(index)[0] for index in segments if index not in from_start}
            if ends_needed:
                steps |= {commitment.links[index].step for index in segments}

            async def checkpoint(step: int) -> Path:
                began_fetch = trio.current_time()
                path = await self._checkpoint(checkpoints, step, work, providers)
                if step != 0 or known is None:  # (step 0 we hold: written here, not fetched)
                    costs.fetched(trio.current_time() - began_fetch)
                return path

            for step in sorted(steps):
                fetched.start(step, checkpoint, step)

            await fetched.get("adapter")
            marks["adapter in"] = trio.current_time()
            adapter_dir = await _unpack_worker_bundle(work / "adapter.tar", work / "adapter", allowed=REPORT_FILES,
                                                      max_bytes=1 << 30)
            # (beside a replay of another report, not after it: these load no model and change no process-wide
            # torch setting, and an early start waits for them, not for the replays, IPIP-0006 §2.9)
            await trio.to_thread.run_sync(materialize_report, adapter_dir, terms, expected, expected_optimizer)
            adapter = await trio.to_thread.run_sync(_check_adapter, adapter_dir, terms)
            if await tensors_hash_off_loop(adapter, self.hash_limiter) != commitment.links[-1].adapter_hash:
                raise Rejection("the adapter does not hash to the last committed checkpoint")
            if terms.training.optimizer_state == "carried":  # it becomes part of the next round's start
                problem = await trio.to_thread.run_sync(_check_final_optimizer, adapter_dir, commitment.links[-1].optimizer_hash)
                if problem is not None:
                    raise Rejection(problem)
            if on_adapter_checked is not None:
                on_adapter_checked(adapter_dir)
            marks["adapter checked"] = trio.current_time()

            await fetched.get("shard")
            # training started where it had to: the seeded init in round 1, the last aggregate after
            genesis = await fetched.get(0)
            problem = await trio.to_thread.run_sync(run_torch, check_initial_adapter, genesis, commitment, expected,
                                                    expected_optimizer)
            if problem is not None:
                raise Rejection(problem)
            marks["start checked"] = trio.current_time()
            for index in segments:
                first_step = commitment.segment_start(index)[0]
                verdict = None
                if index in from_start:  # replayed to from the round's start (bit for bit, or its checkpoint decides)
                    replayed_at = trio.current_time()
                    verdict = await trio.to_thread.run_sync(run_torch, partial(
                        verify_segment, commitment, index, start=genesis, shard=shard_path, config=config,
                        claimed_head=report.chain_head, round_start=genesis, from_round_start=True),
                        abandon_on_cancel=True)
                    if verdict is not None and not verdict.needs_end:
                        self.local.counters["replays_from_round_start"] += 1
                        costs.replayed(trio.current_time() - replayed_at, commitment.links[index].step)
                        marks[f"segment {index} replayed from the round's start"] = trio.current_time()
                        if not verdict.accepted:
                            raise Rejection(f"segment {index} does not replay: {verdict.reason}")
                        continue
                    self.local.counters["replays_from_round_start_missed"] += 1
                start = await (fetched.get(first_step) if first_step in steps else checkpoint(first_step))
                end = await fetched.get(commitment.links[index].step) if ends_needed else None
                marks[f"checkpoints of segment {index} in"] = trio.current_time()
                replay = partial(verify_segment, commitment, index, start=start, shard=shard_path, config=config,
                                 claimed_head=report.chain_head, round_start=genesis)
                # abandoned on cancellation (the agent stops, the job ends): a replay has no side effect, and
                # waiting for it held SIGTERM up for tens of seconds on a busy machine (the soak)
                replayed_at = trio.current_time()
                verdict = await trio.to_thread.run_sync(run_torch, partial(replay, end=end), abandon_on_cancel=True)
                costs.replayed(trio.current_time() - replayed_at, commitment.links[index].step - first_step)
                if verdict.needs_end:  # not bit-exact here after all: measured against the worker's end checkpoint
                    self.local.counters["replays_needing_end"] += 1
                    end = await self._checkpoint(checkpoints, commitment.links[index].step, work, providers)
                    verdict = await trio.to_thread.run_sync(run_torch, partial(replay, end=end), abandon_on_cancel=True)
                if not verdict.accepted:
                    raise Rejection(f"segment {index} does not replay: {verdict.reason}")
                marks[f"segment {index} replayed"] = trio.current_time()
        log.info("job %s round %d shard %d attempt %d: checked in %.2f s (%s)", view.job_id.hex()[:8], report.round,
                 report.shard, report.attempt, trio.current_time() - began,
                 ", ".join(f"{name} at {t - began:.2f} s" for name, t in marks.items()))
        return segments, adapter_dir

    async def _round_start(self, view: JobMirror, rnd: int, config: Any, work: Path) -> tuple[dict, dict, dict]:
        """Round ``rnd``'s start (cached): the adapter its training starts from, the outer optimizer
        state and the AdamW state carried with it: the seeded init and no state in round 1, the
        previous aggregate's after (its AdamW state only if the job carries it, IPIP-0006 §2.3)."""
        from agent.train.replay import expected_initial_adapter

        key = (view.job_id, rnd)
        if key not in self._initial:
            directory = None
            if rnd > 1:
                previous = view.aggregates.get(rnd - 1)
                if previous is None:
                    raise RuntimeError(f"round {rnd - 1}'s aggregate is not known here yet")
                bundle = work / f"initial-r{rnd}.tar"
                providers = [p for p in (view.terms.submitter,) if p != self.local.peer_id]
                await self.blocks.content.fetch(previous.adapter_cid, bundle, timeout=self.local.config.fetch_timeout,
                                               providers=providers, max_size=bundle_size_bound(1 << 30, AGGREGATE_FILES))
                directory = await unpack_off_loop(bundle, work / f"initial-r{rnd}", allowed=AGGREGATE_FILES, max_bytes=1 << 30)
            if len(self._initial) > 64:
                self._initial.clear()
            if directory is None:  # round 1: the seeded adapter, from the pool's model (under the torch lock)
                self._initial[key] = (await trio.to_thread.run_sync(run_torch, expected_initial_adapter, config), {}, {})
            else:
                try:
                    self._initial[key] = await trio.to_thread.run_sync(read_start, view.terms, directory)
                except ValueError as exc:
                    raise RuntimeError(f"round {rnd - 1}'s aggregate: {exc}") from None
        return self._initial[key]

    async def _known_start(self, view: JobMirror, rnd: int, header: Any, expected: dict,
                           expected_optimizer: dict) -> Path | None:
        """Round ``rnd``'s step-0 checkpoint from the start we hold, when the proof's header commits to exactly it
        (its tensors and AdamW state hash to the header's initial hashes), so it is not fetched from the worker;
        written once a round, for every report that names it. None otherwise (a worker in bf16 starts from a
        cast of it: fetched, and checked by ``check_initial_adapter`` as before). A replay reads only the
        tensors of a checkpoint."""
        key = (view.job_id, rnd)
        async with self._start_lock:
            if key not in self._start_hashes:
                if len(self._start_hashes) > 64:
                    self._start_hashes.clear()
                hashes = (await tensors_hash_off_loop(expected, self.hash_limiter),
                          await tensors_hash_off_loop(expected_optimizer or {}, self.hash_limiter))
                self._start_hashes[key] = (*hashes, None)
            adapter_hash, optimizer_hash, path = self._start_hashes[key]
            if (adapter_hash, optimizer_hash) != (header.initial_adapter_hash, header.initial_optimizer_hash):
                return None
            if path is None or not path.exists():
                path = self.local.work_dir / view.job_id.hex()[:16] / f"start-r{rnd}"
                await trio.to_thread.run_sync(run_torch, partial(
                    write_checkpoint, path, None, expected, expected_optimizer or {}, {"step": 0, "written_by": "verifier"}))
                self._start_hashes[key] = (adapter_hash, optimizer_hash, path)
        self.local.counters["verify_starts_known"] += 1
        return path

    async def _device_class(self, config: Any) -> str:
        """The device class our replays run on (agent/train/env.device_class)."""
        if self._replay_device_class is None:
            self._replay_device_class = await trio.to_thread.run_sync(run_torch, _device_class_of, config.device)
        return self._replay_device_class

    async def _checkpoint(self, checkpoints: dict[int, str], step: int, work: Path, providers: list[str]) -> Path:
        if step not in checkpoints:
            raise Rejection(f"the proof lists no checkpoint for step {step}")
        target = work / f"ckpt-{step}"
        if not target.exists():
            self.local.counters["verify_checkpoints_fetched"] += 1
            bundle = work / f"ckpt-{step}.tar"
            await _fetch_worker_content(self.blocks, self.local, checkpoints[step], bundle, providers[0], providers,
                                        max_size=bundle_size_bound(1 << 30, CHECKPOINT_FILES))
            await _unpack_worker_bundle(bundle, target, allowed=CHECKPOINT_FILES, max_bytes=1 << 30)
        return target

    # -- aggregation ------------------------------------------------------------------------------

    async def _aggregate_retrying(self, view: JobMirror, action: st.Aggregate) -> None:
        """``_aggregate``, tried again after a failure (a fetch that timed out, ...) while the round is
        still ours to aggregate and its window lasts; then given up with one log line."""
        tries = 0
        while True:
            tries += 1
            try:
                await self._aggregate(view, action)
                return
            except Exception as exc:  # noqa: BLE001 - logged; the window's end fails the job, not us
                if view.state.phase is not st.JobPhase.AGGREGATING or view.state.round != action.round or \
                        not self.peer_table.is_coordinator(view):
                    return
                delay = self._retry_delay(tries, action.expires_at)
                problem = f"{type(exc).__name__}: {str(exc)[:300]}"
                if delay is None:
                    self.local.counters["aggregations_given_up"] += 1
                    log.warning("job %s: round %d aggregation failed %d times, giving up (the job fails when the "
                                "aggregation window ends): %s", view.job_id.hex()[:8], action.round, tries, problem)
                    return
                self.local.counters["aggregations_retried"] += 1
                log.warning("job %s: round %d aggregation failed (try %d), again in %.0f s: %s",
                            view.job_id.hex()[:8], action.round, tries, delay, problem)
                await trio.sleep(delay)

    def _train_config(self, view: JobMirror, rnd: int) -> Any:
        """The round's train config where aggregating needs it (a coded report, the outer step, the score), else None."""
        terms = view.terms
        if terms.outer is None and not terms.validation_cid and terms.training.report_codec == "none":
            return None
        model_path = self.local.capabilities.local_model(terms)
        if model_path is None:
            raise RuntimeError(f"this coordinator does not hold base model {terms.base_model!r}")
        return train_config(terms, model_path, round=rnd, threads=self.local.config.threads)

    async def _combine(self, view: JobMirror, rnd: int, config: Any, inputs: list[tuple[Path, int]],
                       work: Path, scored: bool = True, beside_replays: bool = False) -> tuple[Path, Any, Any]:
        """Round ``rnd``'s aggregate of ``inputs`` (adapter directories and their samples) in ``work``/adapter,
        and (``scored``) its score and the base model's (round 1) on the validation split, each None when not
        scored. ``beside_replays``: computed beside the round's replays, not after the one running (an early
        start waits for it): without the torch lock, and so changing no process-wide torch setting."""
        terms = view.terms
        out = work / "adapter"
        start = await self._round_start(view, rnd, config, work) if reads_start(terms, rnd) else None
        computed = partial(compute_aggregate, terms, inputs, out, work / "update", rnd, start, parallel=not beside_replays)
        await (trio.to_thread.run_sync(computed) if beside_replays else trio.to_thread.run_sync(run_torch, computed))
        score, base_score = await self._scores(view, rnd, config, out, work) if scored else (None, None)
        return out, score, base_score

    async def _add_update(self, view: JobMirror, rnd: int, work: Path) -> str | None:
        """A coded round's update (``work``/update, written by ``_combine``) added and held beside its aggregate; its
        CID, or None when the round's aggregate travels whole (IPIP-0006 §2.8.1)."""
        if not downlink.coded(view.terms, rnd) or not (work / "update").is_dir():
            return None
        cid = str(await self.blocks.content.add_file(await pack_dir_off_loop(work / "update", work / "update.tar"),
                                                     provide=False))
        self.blocks.hold(view.job_id, rnd, cid)
        return cid

    async def _scores(self, view: JobMirror, rnd: int, config: Any, out: Path, work: Path) -> tuple[Any, Any]:
        """The aggregate in ``out`` scored on the validation split, and the base model (round 1); (None, None)
        when the job has no validation split or the scoring failed."""
        if not view.terms.validation_cid:
            return None, None
        try:  # informative, not essential: a failed score never holds the round back
            return await self._score(view, config, out, work, with_base=rnd == 1)
        except Exception as exc:  # noqa: BLE001 - logged; the aggregate is published without a score
            log.warning("job %s: round %d not scored on the validation split: %s", view.job_id.hex()[:8], rnd, exc)
            return None, None

    async def _aggregate(self, view: JobMirror, action: st.Aggregate) -> None:
        terms = view.terms
        work = self.local.work_dir / view.job_id.hex()[:16] / f"aggregate-r{action.round}"
        running = self._computing_early.get((view.job_id, action.round))
        if running is not None:  # computing it already: the same work, done once
            with trio.move_on_after(max(0.0, action.expires_at - self.local.clock()) / 2):
                await running.wait()
        announced = early = self._provisional.get((view.job_id, action.round))
        if early is not None and early.shards == tuple(
                (s, view.shard(s).attempt) for s in action.accepted_shards) and early.out.exists():
            # computed while the round's last replays ran (IPIP-0006 §2.9), from the adapters now accepted
            out, score, base_score, samples, cid = early.out, early.score, early.base_score, early.samples, early.cid
            update_cid = early.update_cid
            if not early.scored:  # its scoring did not end while we waited: scored here, as without early start
                score, base_score = await self._scores(view, action.round, self._train_config(view, action.round),
                                                       out, out.parent)
            self.local.counters["aggregates_computed_early"] += 1
        else:
            early = None
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            config = self._train_config(view, action.round)
            inputs = []
            for shard in action.accepted_shards:
                entry = self.accepted_adapters.get((view.job_id, action.round, shard))
                if entry is None:  # verified by a coordinator before us: fetch the accepted adapter
                    attempt = view.shard(shard).attempt
                    report, worker = view.reports[(action.round, shard, attempt)]
                    bundle = work / f"adapter-{shard}.tar"
                    await self.blocks.content.fetch(report.adapter_cid, bundle, timeout=self.local.config.fetch_timeout,
                                                    providers=[terms.submitter, worker],
                                                    max_size=bundle_size_bound(1 << 30, REPORT_FILES))
                    directory = await unpack_off_loop(bundle, work / f"adapter-{shard}", allowed=REPORT_FILES,
                                                      max_bytes=1 << 30)
                    if terms.training.report_codec != "none":  # verified already: decode it onto the round's start
                        start_adapter, _, start_optimizer = await self._round_start(view, action.round, config, work)
                        await trio.to_thread.run_sync(materialize_report, directory, terms, start_adapter,
                                                      start_optimizer)
                    entry = (directory, report.samples)
                inputs.append(entry)
            out, score, base_score = await self._combine(view, action.round, config, inputs, work)
            samples, cid, update_cid = sum(n for _, n in inputs), None, None
        loss = score.loss if score is not None else None
        base_loss = base_score.loss if base_score is not None else None
        final = view.ends_with(action.round, loss)  # the last round, or the job's stop rule holds
        sealed = must_seal(terms, final)
        if sealed:  # a private job's final aggregate: only its submitter can open it (ipips/0010)
            work.mkdir(parents=True, exist_ok=True)
            out = await trio.to_thread.run_sync(seal_dir, out, work / "sealed", terms.submitter)
            cid = None
        if cid is None:
            cid = await self.blocks.content.add_file(await pack_dir_off_loop(out, out.parent / "adapter.tar"),
                                                     provide=False)
            if not final:  # (a final aggregate, the job's result, has no update: nobody starts from it)
                update_cid = await self._add_update(view, action.round, out.parent)
        if final:
            update_cid = None
        self.blocks.hold(view.job_id, action.round, cid)
        self.blocks.provide_soon(cid)  # in the background: a slow DHT peer must not delay the aggregate
        if not self.peer_table.is_coordinator(view):
            return
        # durable before announced (IPIP-0006 §2.6.1): the submitter holds a copy before anyone hears of it,
        # so a crash of ours from here on loses nothing; asked again while the round is ours to publish and
        # its window lasts (the aggregate is not computed again); the last refusal goes to the retry loop
        def still_ours() -> bool:
            return self.peer_table.is_coordinator(view) and view.state.phase is st.JobPhase.AGGREGATING and \
                view.state.round == action.round

        await keep_within(self.local, self.net, view, action.round, str(cid), still_ours=still_ours, window_end=action.expires_at)
        if not still_ours():
            return
        published = m.AggregatePublished(view.job_id, action.round, view.coordination.term, str(cid),
                                         terms.aggregation, tuple(action.accepted_shards),
                                         samples, final, loss, base_loss,
                                         score.reward_accuracy if score is not None else None,
                                         score.reward_margin if score is not None else None, update_cid=update_cid)
        if not await self.evidence.decide(view, published):
            return
        self.local.counters["aggregates_published"] += 1
        if announced is not None and str(cid) == announced.cid and not final:
            # the leases announced with it, to the workers that took them (their claim came with the early start),
            # granted before any claim of the new round is (IPIP-0006 §2.9)
            for shard, worker in announced.leases:
                if worker in announced.taken:
                    try:
                        await self._grant(view, worker, action.round + 1, shard)
                    except Exception as exc:  # noqa: BLE001 - one failed grant must not stop the others
                        log.warning("job %s: announced lease for %s failed: %s", view.job_id.hex()[:8], worker[-8:], exc)
        entry = {"round": action.round, "adapter_cid": str(cid), "method": terms.aggregation,
                 "shards": list(action.accepted_shards)}
        if terms.outer is not None:
            entry["outer"] = terms.outer.optimizer
        if update_cid is not None:
            entry["update_cid"] = update_cid
        if sealed:
            entry["sealed_to"] = terms.submitter
        if loss is not None:
            entry["validation_loss"] = loss
        if base_loss is not None:
            entry["base_validation_loss"] = base_loss
        if published.reward_accuracy is not None:
            entry["reward_accuracy"] = published.reward_accuracy
            entry["reward_margin"] = published.reward_margin
        self.evidence.ledger(view.job_id, "aggregate", entry)
        log.info("job %s: round %d aggregate %s (%s%s over shards %s)%s%s", view.job_id.hex()[:8], action.round, cid,
                 terms.aggregation, f" + {terms.outer.optimizer}" if terms.outer else "",
                 list(action.accepted_shards), (f", validation loss {loss:.4f}" if loss is not None else "") +
                 (f", reward accuracy {published.reward_accuracy:.2f}" if published.reward_accuracy is not None else ""),
                 f"; the stop rule holds: the job ends after round {action.round} of {terms.rounds}"
                 if final and action.round < terms.rounds else "")

    async def _validation_split(self, view: JobMirror, directory: Path) -> Path:
        """The job's validation split (in ``directory``, the job's work directory), fetched once
        (``take_over`` fetches it at once, so a round's score never waits on it). Its provider is the
        submitter: with the split not held here and the submitter heard before but silent now,
        RuntimeError at once, saying so, instead of a fetch that waits out its timeout (issue 21 §5: a
        coordinator idled 63 s after the submitter was killed, then published the round unscored)."""
        path = self._validation.get(view.job_id)
        if path is not None and path.exists():
            return path
        path = directory / "validation.jsonl"
        submitter = view.terms.submitter
        if submitter != self.local.peer_id and submitter in self.peer_table.peers and submitter not in self.peer_table.live_peers() and \
                not self.blocks.content.store.has(parse_cid(view.terms.validation_cid)):
            raise RuntimeError(f"the validation split {view.terms.validation_cid[:24]}… is not held here and its "
                               f"provider, the submitter {submitter[-8:]}, is not live")
        providers = [p for p in (submitter,) if p != self.local.peer_id]
        path.parent.mkdir(parents=True, exist_ok=True)
        # bounded by the training shards' bytes (IPIP-0003 §3): the submitter chose this CID
        await self.blocks.content.fetch(view.terms.validation_cid, path, timeout=self.local.config.fetch_timeout,
                                  providers=providers, max_size=view.terms.validation_size_bound())
        self._validation[view.job_id] = path
        return path

    async def _prefetch_validation(self, view: JobMirror) -> None:
        """On taking a job over: hold its validation split before the first round needs a score."""
        if not view.terms.validation_cid:
            return
        try:
            await self._validation_split(view, self.local.work_dir / view.job_id.hex()[:16])
        except Exception as exc:  # noqa: BLE001 - tried again when a round is scored
            log.info("job %s: validation split not fetched yet: %s", view.job_id.hex()[:8], exc)

    async def _warm(self, view: JobMirror) -> None:
        """On taking a job over: load what the first report's checks would load then (the base model's hash, the
        ML libraries, the model into the pool, the round's start, our device class), while the round trains.
        Round 1's first check waited for it (issue 24: 5-6 s here, with a barrier behind it; on a GPU the model's
        load). Our own failure here is only a cold first check: the checks load it again, and say why."""
        from agent.train import base_model_sha256
        from agent.train.run import warm_model

        terms, rnd = view.terms, view.state.round
        model_path = self.local.capabilities.local_model(terms)
        if model_path is None or view.state.terminal:
            return
        began = trio.current_time()
        try:
            if await trio.to_thread.run_sync(base_model_sha256, model_path) != terms.base_model_sha256.hex():
                return
            config = train_config(terms, model_path, round=rnd, threads=self.local.config.threads)
            await trio.to_thread.run_sync(run_torch, warm_model, config)
            await self._device_class(config)
            work = self.local.work_dir / view.job_id.hex()[:16] / f"warm-r{rnd}"
            work.mkdir(parents=True, exist_ok=True)
            await self._round_start(view, rnd, config, work)
        except Exception as exc:  # noqa: BLE001 - see above
            log.info("job %s: verification not prepared ahead: %s", view.job_id.hex()[:8], exc)
            return
        self.local.counters["verifications_prepared"] += 1
        log.info("job %s: ready to verify round %d in %.2f s", view.job_id.hex()[:8], rnd, trio.current_time() - began)

    async def _score(self, view: JobMirror, config: Any, adapter_dir: Path, work: Path,
                     with_base: bool) -> tuple[Any, Any]:
        """The score (train.loop.Evaluation) of the aggregate in ``adapter_dir`` (and of the base model) on
        the job's validation split."""
        from agent.train.run import validation_scores

        path = await self._validation_split(view, work.parent)
        adapters = [adapter_dir / "adapter_model.safetensors"]
        if with_base:
            adapters.append(None)  # the seeded initial adapter: B = 0, so exactly the base model
        scores = await trio.to_thread.run_sync(run_torch, validation_scores, config, path, adapters,
                                               abandon_on_cancel=True)  # no side effect (see the replay)
        return scores[0], scores[1] if with_base else None


class _Prefetch:
    """Fetches started together in ``nursery`` (their owner), each awaited later by name: ``get`` returns its
    value or raises its exception then, at the point the sequential code would have met it."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.done: dict[Any, trio.Event] = {}
        self.results: dict[Any, Any] = {}

    def start(self, name: Any, fn: Any, *args: Any, **kwargs: Any) -> None:
        done = self.done[name] = trio.Event()

        async def run() -> None:
            try:
                self.results[name] = (True, await fn(*args, **kwargs))
            except Exception as exc:  # kept for ``get``; a cancellation is the nursery's
                self.results[name] = (False, exc)
            done.set()

        self.nursery.start_soon(run)

    async def get(self, name: Any) -> Any:
        """The fetch's value (as often as asked), or its exception raised."""
        await self.done[name].wait()
        ok, value = self.results[name]
        if not ok:
            raise value
        return value


@asynccontextmanager
async def _prefetching() -> AsyncIterator[_Prefetch]:
    """A ``_Prefetch`` whose fetches end with the block; the block's own exception comes out as itself (trio
    would wrap it in a group: callers tell a Rejection from our own failure by its type)."""
    from agent.content.exchange import first_error

    try:
        async with trio.open_nursery() as nursery:
            yield _Prefetch(nursery)
    except BaseExceptionGroup as group:
        raise first_error(group) from None


async def _fetch_worker_content(blocks: "Blocks", local: "Local", cid: str, out: Path, worker: str, providers: list[str], *,
                                named_by_worker: bool = True, **bounds: int) -> None:
    """Fetch for a verification, within ``bounds`` (max_size / exact_size, IPIP-0003 §3); Rejection if
    the failure is the worker's: it sent blocks that do not verify, or (content it named) the CID names
    no valid file or a file over the bound. Any other failure is ours (FetchError)."""
    try:
        await blocks.content.fetch(cid, out, timeout=local.config.fetch_timeout, providers=providers, **bounds)
    except FetchError as exc:
        if worker in exc.corrupt or named_by_worker and (exc.invalid or exc.refused):
            raise Rejection(f"content {cid[:24]}…: {str(exc)[:600]}") from None
        raise


async def _unpack_worker_bundle(bundle: Path, out: Path, **limits: Any) -> Path:
    """``unpack`` (in a worker thread) of a bundle the worker made (its bytes verified by CID): one that
    does not unpack is its fault."""
    try:
        return await unpack_off_loop(bundle, out, **limits)
    except BundleError as exc:
        raise Rejection(f"bundle: {exc}") from None


def _device_class_of(requested: str) -> str:
    from agent.train.env import device_class
    from agent.train.model import pick_device

    return device_class(pick_device(requested))


def _check_adapter(adapter_dir: Path, terms: m.JobTerms) -> dict:
    """Load an untrusted adapter (safetensors only) and check it fits the job; Rejection if not."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        config = json.loads((adapter_dir / "adapter_config.json").read_text())
        tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    except (OSError, ValueError, SafetensorError) as exc:
        raise Rejection(f"adapter does not load: {exc}") from None
    if not isinstance(config, dict):
        raise Rejection("adapter does not load: adapter_config.json is not a JSON object")
    facts = []
    for name, tensor in tensors.items():
        values = tensor.float()
        finite = bool(torch.isfinite(values).all())
        facts.append(TensorFacts(name, tuple(tensor.shape), finite,
                                 float(values.abs().max()) if finite and values.numel() else 0.0))
    problem = adapter_refusal(config, facts, terms.lora.rank, terms.lora.target_modules, terms.method)  # R4 (IPIP-0005 §8)
    if problem is not None:
        raise Rejection(problem)
    return tensors


def _check_final_optimizer(adapter_dir: Path, committed: bytes) -> str | None:
    """Why the report's AdamW state is not the one its last checkpoint committed, or None."""
    from safetensors import SafetensorError

    from agent.train.aggregate import OPTIMIZER_FILE
    from agent.train.model import tensors_hash

    path = adapter_dir / OPTIMIZER_FILE
    if not path.exists():
        return f"the job carries the optimizer state across rounds; the adapter bundle has no {OPTIMIZER_FILE}"
    try:
        tensors = _load_tensors(path)
    except (OSError, SafetensorError) as exc:
        return f"{OPTIMIZER_FILE} does not load: {exc}"
    if tensors_hash(tensors) != committed:
        return f"{OPTIMIZER_FILE} does not hash to the last committed checkpoint's optimizer state"
    return None


async def tensors_hash_off_loop(tensors: Any, limiter: trio.CapacityLimiter) -> bytes:
    """agent.train.model.tensors_hash in a worker thread (hashing a large adapter takes long enough to
    stall heartbeats and gossip if it ran on the event loop); ``limiter`` bounds how many run at once."""
    from agent.train.model import tensors_hash

    return await trio.to_thread.run_sync(tensors_hash, tensors, limiter=limiter)


def _load_tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))
