"""The worker role: take shards of jobs we opted into, train them, prove it, hand the adapter in.

Rules of this file:
- Only an agent that opted in (``accept_training``) has this role. A job is taken only if its base
  model is one we hold locally (``models``) and allow (``allowed_base_models``), its price is at
  least our minimum, and our measured capability fits it (protocol/fit.training_refusals: we offer
  its runtime, hold its base model by hash, and one GPU has ``min_vram_gb`` free). Each unmet
  requirement is its own reason in the log.
- Training goes through the job's runtime (agent/train/backends.select_backend): peft in a thread
  here, unsloth in its child process; both record the same proof. On a GPU the micro-batch is
  chosen from the device's free VRAM, the job's effective batch kept (agent/train/presets.py). The
  ledger's report records the device, its VRAM, the dtype, the runtime and the processes the proof names.
- One worker, several GPUs: a peft shard is trained data-parallel by ``train_processes`` processes
  (0: one per CUDA device we measured; agent/train/parallel.py): NCCL on the GPUs, gloo on the CPU,
  each rank given at least one micro-batch; rank 0 records the proof, which a verifier replays in one
  process within the tolerance (IPIP-0005 §6.1). On a CUDA machine, more processes than GPUs is a
  refusal of every peft job (one process per GPU), said once per job, not a shard given back each time.
- We claim an OPEN shard while we hold fewer than ``max_concurrent_shards`` leases; the coordinator
  decides. On a lease for us: fetch the shard by CID (every block hash-checked by the content
  room), check the local base model's content hash against the job's, and only then train. A
  mismatch gives the shard back with the reason (``release``).
- Training runs in a worker thread (agent/train knows nothing of the network); each checkpoint
  is packed, added to the content store and gossiped as a ``ckpt`` commitment as it happens, which
  also extends our lease. The final adapter and the proof bundle go into the content store and
  the ``report`` names their CIDs.
- Early start (IPIP-0006 §2.9, ``early_start``): when the job's coordinator announces the next round's start
  and names us a shard of it, we train it at once (and claim it, saying so), but announce nothing of it
  (no checkpoint, no report) until the lease is ours and that start is the aggregate published; otherwise
  the work is dropped unannounced, with nothing to give back.
- ``training`` (agent/hooks.py) is where the test harness makes a worker Byzantine on purpose
  (agent/harness/byzantine.py); the default trains honestly.
"""

from __future__ import annotations

import hashlib
import json
import math
import logging
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from agent.combine import COMBINE_TIMEOUT, MAX_REPORT_BYTES, combine_ahead, combine_here, combines_here, start_here
from agent.hooks import HonestTraining
from agent.bundle import AGGREGATE_FILES, DEFAULT_MAX_BYTES, REPORT_FILES, bundle_size_bound, pack_dir_off_loop, \
    unpack_off_loop
from agent.downlink import fetch_coded
from agent.store import disk_is_full, full_disk
from protocol.mirror import JobMirror
from agent.train.runner import run_torch, train_config
from protocol import downlink, early as early_rules
from protocol import messages as m
from protocol import state as st
from protocol.fit import training_refusals

if TYPE_CHECKING:
    from agent.blocks import Blocks
    from agent.evidence import Evidence
    from agent.peers import PeerTable
    from agent.roles.port import Local
    from agent.tasks import Tasks
    from agent.jobbook import JobBook

log = logging.getLogger(__name__)

PROOF_FILE = "proof.json"
CHECKPOINTS_FILE = "checkpoints.json"


class EarlyStartVoid(Exception):
    """An early start (IPIP-0006 §2.9) that will not be leased to us: its work is dropped, unannounced."""


class _Ahead:
    """A round's aggregate being computed ahead of its announcement (WorkerRole._combine_ahead)."""

    def __init__(self, reports: tuple[tuple[str, str, int], ...]) -> None:
        self.reports = reports  # the inputs: (adapter CID, worker, samples) per shard
        self.done = trio.Event()
        self.cid: str | None = None  # the result's CID; None until done, or if it could not be computed


class WorkerRole:
    def __init__(self, local: "Local", peer_table: "PeerTable", tasks: "Tasks", blocks: "Blocks", evidence: "Evidence",
                 book: "JobBook", training: HonestTraining | None = None) -> None:
        self.local, self.peer_table, self.tasks, self.blocks, self.evidence = local, peer_table, tasks, blocks, evidence
        self.book = book  # our live mirror of each job we follow (a rebuild replaces it)
        self.training = training or HonestTraining()  # the harness's faults (agent/hooks.py), if any
        self.candidates: dict[bytes, JobMirror] = {}
        self.active: dict[tuple[bytes, int, int, int], m.ShardLease] = {}
        self._scopes: dict[tuple[bytes, int, int, int], trio.CancelScope] = {}  # each active shard's training
        # active shards started early (IPIP-0006 §2.9), not leased yet -> when our mirror first saw their round
        # open (None before)
        self._early: dict[tuple[bytes, int, int, int], float | None] = {}
        # job -> (when, round, whether we held a shard since) of our last claim
        self._last_claim: dict[bytes, tuple[float, int, bool]] = {}
        self._wake = trio.Event()
        self._market_logged: dict[bytes, str] = {}
        # (job, round, start CID) -> the update an `early` message named for that start (IPIP-0006 §2.8.1)
        self._updates: dict[tuple[bytes, int, str], str] = {}
        self._warmed: set[bytes] = set()  # jobs whose first shard we prepared for (``_warm``)
        # (early start, term): early starts we claimed again, once per coordination term (early.reclaim)
        self._reclaimed: set[tuple[tuple[bytes, int, int, int], int]] = set()
        self._ahead: dict[tuple[bytes, int], _Ahead] = {}  # (job, round) -> its aggregate computed ahead (on_report)
        # (job, round) -> the `early` message we were named in, and the shards of that round we train after our
        # announced one, not started yet (protocol/early.queued)
        self._queued: dict[tuple[bytes, int], tuple[m.EarlyStart, list[int]]] = {}
        # job -> (round, the shards of it we claim last: another announced worker's, protocol/early.reserved)
        self._reserved: dict[bytes, tuple[int, frozenset[int]]] = {}

    # -- choosing jobs ----------------------------------------------------------------------------

    def refusal(self, terms: m.JobTerms) -> str | None:
        """Why we won't take this job, or None if we will."""
        config = self.local.config
        if config.allowed_base_models and terms.base_model not in config.allowed_base_models:
            return f"base model {terms.base_model!r} is not in allowed_base_models"
        if self.local.capabilities.local_model(terms) is None:
            return f"base model {terms.base_model!r} is not available locally"
        if terms.price_per_hour < config.min_price_per_hour:
            return f"price {terms.price_per_hour}/h is below our minimum {config.min_price_per_hour}/h"
        from agent.market import worker_refusal

        market = worker_refusal(self.local, terms)  # our price, its budget, its named providers (IPIP-0004 §12)
        if market is not None:
            return market
        machine = self.local.capabilities.machine
        if terms.runtime == "peft" and machine is not None and machine.cuda and \
                config.train_processes > len(machine.cuda):
            return (f"train_processes = {config.train_processes}, but this machine has {len(machine.cuda)} "
                    "CUDA device(s): one training process per GPU")
        reasons = training_refusals(self.local.capabilities.capability(), terms)
        return "; ".join(reasons) if reasons else None

    def consider(self, view: JobMirror) -> None:
        reason = self.refusal(view.terms)
        if reason is None:
            self.candidates[view.job_id] = view
            log.info("job %s: will train (%s)", view.job_id.hex()[:8], view.terms.name)
            if view.job_id not in self._warmed:
                self._warmed.add(view.job_id)
                self.tasks.spawn_in_job(view.job_id, self._warm, view)
        else:
            log.info("job %s: not taking it: %s", view.job_id.hex()[:8], reason)

    async def _warm(self, view: JobMirror) -> None:
        """A job we will train: while its coordinator is elected and its first leases are granted, load what our
        first shard would load then (the base model's hash, the ML libraries, the model with its LoRA into the
        pool: agent/train/run.warm_model), so it starts training at once. Round 1 waited for it (issue 24: 5-7 s
        of imports here; on a GPU, the model's load)."""
        from agent.train.run import warm_model

        terms = view.terms
        model_path = self.local.capabilities.local_model(terms)
        if model_path is None or terms.runtime != "peft" or self.train_processes(terms) > 1:
            return  # (another runtime, or several processes: each rank builds its own model)
        if type(self.training) is not HonestTraining:
            return  # a harness fault (agent/hooks.py) may train another model, or stall where a shard would
        if await self.local.capabilities.base_model_hash(model_path) != terms.base_model_sha256.hex():
            return  # refused when a shard comes, with the reason
        began = trio.current_time()
        config = train_config(terms, model_path, threads=self.local.config.threads)
        try:
            built = await trio.to_thread.run_sync(run_torch, warm_model, config)
        except Exception as exc:  # noqa: BLE001 - the shard loads it again, and says why if it fails then
            log.info("job %s: not prepared ahead: %s", view.job_id.hex()[:8], exc)
            return
        self.local.counters["jobs_prepared"] += 1
        log.info("job %s: ready to train in %.2f s%s", view.job_id.hex()[:8], trio.current_time() - began,
                 "" if built else " (its model was loaded already)")

    def forget(self, job_id: bytes) -> None:
        """The agent stopped following the job (an ended job, agent/node.py ``forget_job``): drop what we
        kept for it."""
        self.candidates.pop(job_id, None)
        self._warmed.discard(job_id)
        self._reclaimed = {k for k in self._reclaimed if k[0][0] != job_id}
        self._last_claim.pop(job_id, None)
        self._market_logged.pop(job_id, None)
        for key in [k for k in self._updates if k[0] == job_id]:
            del self._updates[key]
        for key in [k for k in self._ahead if k[0] == job_id]:
            del self._ahead[key]
        for key in [k for k in self._queued if k[0] == job_id]:
            del self._queued[key]
        self._reserved.pop(job_id, None)

    # -- claiming ---------------------------------------------------------------------------------

    def wake(self) -> None:
        """Something changed (a job's state, one of our shards ended): look for a shard to claim now."""
        self._wake.set()

    async def claim_loop(self) -> None:
        """Claim an open shard whenever we have room: at once when woken (a new round, a shard
        reopened, our last shard done), else every ``claim_interval``. A claim that got no lease is
        not repeated within 2 x ``claim_interval`` in the same round, unless one of our shards ended."""
        while True:
            with trio.move_on_after(self.local.config.claim_interval):
                await self._wake.wait()
            self._wake = trio.Event()
            self.drop_stale()
            if len(self.active) >= self.local.config.max_concurrent_shards:
                continue
            if self.evidence.store_full is not None and not await self.evidence.can_take_work():
                continue  # the disk is full: we could not keep the evidence of new work (agent/writer.py refuse_work)
            now = self.local.clock()
            for view in list(self.candidates.values()):
                if view.state.terminal:
                    self.candidates.pop(view.job_id, None)
                    continue
                if view.state.phase not in (st.JobPhase.ANNOUNCED, st.JobPhase.TRAINING):
                    continue
                if view.coordination.coordinator is None:
                    continue  # no coordinator yet
                if view.coordination.coordinator == self.local.peer_id and (
                        not self.local.config.coordinator_trains
                        or any(shard.worker == self.local.peer_id for shard in view.state.shards)):
                    continue  # we coordinate it: we train none of it, or one shard a round (coordinator_trains)
                if view.training_by(self.local.peer_id):  # a live lease of this job: one at a time
                    if view.job_id in self._last_claim:
                        self._last_claim[view.job_id] = (*self._last_claim[view.job_id][:2], True)
                    continue
                if any(k[0] == view.job_id for k in self.active):
                    continue
                open_shards = view.open_shards()
                reserved = self._reserved.get(view.job_id)
                if reserved is not None and reserved[0] == view.state.round:  # another announced worker's last
                    open_shards = early_rules.claimable(open_shards, reserved[1])
                if open_shards and self._market_refusal(view):
                    continue
                # a claim made while we still had a live lease of this job (its report not yet in) was
                # ignored by the coordinator: it does not hold back the next one
                last_time, last_round, was_holding = self._last_claim.get(view.job_id, (0.0, 0, False))
                if not open_shards or (last_round == view.state.round and not was_holding and
                                       now - last_time < 2 * self.local.config.claim_interval):
                    continue
                self._last_claim[view.job_id] = (now, view.state.round, False)
                if not await self.evidence.can_take_work():
                    break
                await self.evidence.publish(m.ShardClaim(view.job_id, view.state.round, random.choice(open_shards)))
                break

    def _market_refusal(self, view: JobMirror) -> str | None:
        """The job can no longer pay us (its budget is spent) or would not lease us: no claim (logged once)."""
        from agent.market import lease_refusal, worker_refusal

        reason = worker_refusal(self.local, view) or lease_refusal(view, self.local.peer_id)
        if reason is not None and self._market_logged.get(view.job_id) != reason:
            self._market_logged[view.job_id] = reason
            log.info("job %s: not claiming: %s", view.job_id.hex()[:8], reason)
        return reason

    def on_lease(self, view: JobMirror, lease: m.ShardLease) -> None:
        key = (view.job_id, lease.round, lease.shard, lease.attempt)
        if key in self._early and self.active[key].initial_adapter_cid != lease.initial_adapter_cid:
            self.drop_stale()  # started early from another start than the round's: dropped, this lease trained
        if key in self.active:
            return  # (an early start of this lease goes on: _until_ours finds it ours)
        if len(self.active) >= self.local.config.max_concurrent_shards:
            self.drop_stale()  # a lease of ours that ran out may hold the slot this new one needs
        if len(self.active) >= self.local.config.max_concurrent_shards:
            # no room (an early start we claimed was dropped, and we took other work meanwhile): given back now,
            # not held unused until it runs out
            log.info("job %s round %d shard %d: leased while busy; giving it back", view.job_id.hex()[:8],
                     lease.round, lease.shard)
            self.tasks.spawn_in_job(view.job_id, self.evidence.publish, m.ShardRelease(
                view.job_id, lease.round, lease.shard, lease.attempt, "the worker has no room for it now",
                cause=m.RELEASE_LOCAL))
            return
        self.active[key] = lease
        if not self.tasks.spawn_in_job(view.job_id, self._run_shard, view, lease, key):
            self.active.pop(key, None)  # the job ended

    def take_leases(self, view: JobMirror) -> None:
        """Our mirror was just rebuilt from a peer's history (agent/jobclock.py): a live lease to us it holds came in
        that history, not as a live message, so ``on_lease`` never saw it. Trained now; else it was held unused until
        it ran out, an hour by default (the scenario successor-same-term: 30 s of its 30 s lease, the round waiting)."""
        if view.job_id not in self.candidates or view.state.terminal:
            return
        now = self.local.clock()
        for shard in view.training_by(self.local.peer_id):
            lease = view.leases.get(m.ShardAttempt(view.state.round, shard.index, shard.attempt))
            key = (view.job_id, view.state.round, shard.index, shard.attempt)
            if lease is None or key in self.active or (shard.expires_at is not None and shard.expires_at <= now):
                continue
            log.info("job %s round %d shard %d attempt %d: leased to us in the history our mirror was rebuilt from; "
                     "training it", view.job_id.hex()[:8], lease.round, lease.shard, lease.attempt)
            self.on_lease(view, lease)

    def on_early_start(self, view: JobMirror, early: m.EarlyStart, signer: str) -> None:
        """The job's coordinator says what round ``early.round`` will start from and which shard of it we would
        be leased (IPIP-0006 §2.9): when we have room and take the job, train it now, from that start; what it
        commits is announced once the lease is ours (``_until_ours``), and dropped if it never is."""
        me = self.local.peer_id
        if not self.local.config.early_start or view.job_id not in self.candidates:
            return
        if early_rules.refusal(early, signer, view.coordination.coordinator, view.coordination.term, view.state,
                               view.terms.rounds) is not None:
            return
        trained = tuple((s.index, s.worker) for s in view.state.shards)
        self._reserved[view.job_id] = (early.round, early_rules.reserved(trained, early, me))
        if me not in early.workers:
            return
        if any(k[0] == view.job_id for k in self.active) or len(self.active) >= self.local.config.max_concurrent_shards:
            return
        queued = early_rules.queued(trained, early, me)
        if queued:
            self._queued[(view.job_id, early.round)] = (early, list(queued))
            for old in [k for k in self._queued if k[0] == view.job_id and k[1] < early.round]:
                del self._queued[old]
        shard = early.shards[early.workers.index(me)]
        # the lease we would get: the round's first attempt of the shard, from that start
        lease = m.ShardLease(view.job_id, early.round, shard, 1, me, early.term,
                             self.local.clock() + view.terms.lease_seconds, early.initial_adapter_cid)
        key = (view.job_id, early.round, shard, 1)
        self.active[key] = lease
        self._early[key] = None
        if early.update_cid is not None:
            self._updates[(view.job_id, early.round, early.initial_adapter_cid)] = early.update_cid
            while len(self._updates) > 64:
                self._updates.pop(next(iter(self._updates)))
        # the round's announced workers and the submitter fetch its start together, each taking part of it from
        # the coordinator and the rest from the others (IPIP-0003 §4.2), not the whole of it each over one uplink
        swarm = early_rules.swarm(early, view.terms.submitter)
        if not self.tasks.spawn_in_job(view.job_id, self._start_early, view, lease, key, swarm):
            self.active.pop(key, None)  # the job ended
            self._early.pop(key, None)

    def _start_queued(self, view: JobMirror, rnd: int) -> None:
        """An early start's training ended: the next shard of that round we trained in the round before, if any
        (protocol/early.queued), trained now from the same start, while the round before is still verified. Its claim
        goes out once the shard before it is reported (``_claim_queued``): we hold one lease of a job at a time."""
        entry = self._queued.get((view.job_id, rnd))
        if entry is None:
            return
        early, shards = entry
        while shards:
            shard = shards.pop(0)
            key = (view.job_id, rnd, shard, 1)
            lease = m.ShardLease(view.job_id, rnd, shard, 1, self.local.peer_id, early.term,
                                 self.local.clock() + view.terms.lease_seconds, early.initial_adapter_cid)
            if key in self.active or self._early_outcome(view, lease) not in (early_rules.WAIT, early_rules.OURS):
                continue  # (another lease took it, or the round or its start is not the announced one: not trained)
            self.active[key] = lease
            self._early[key] = None
            if not self.tasks.spawn_in_job(view.job_id, self._start_early, view, lease, key, (), True):
                self.active.pop(key, None)  # the job ended
                self._early.pop(key, None)
            return
        self._queued.pop((view.job_id, rnd), None)

    async def _claim_queued(self, view: JobMirror, rnd: int) -> None:
        """One of our shards of round ``rnd`` is reported: claim the next shard of it we started early after our
        announced one (``_start_queued``), which waits for its lease."""
        for key in sorted(k for k in self._early if k[:2] == (view.job_id, rnd)):
            if view.shard(key[2]).phase is st.ShardPhase.OPEN:
                await self.evidence.publish(m.ShardClaim(view.job_id, rnd, key[2]))
                return

    async def _start_early(self, view: JobMirror, lease: m.ShardLease, key: tuple, swarm: tuple[str, ...] = (),
                           queued: bool = False) -> None:
        """An early start, if we would claim the shard now (the disk can keep the evidence, the market lets us),
        then our claim of it, which tells the coordinator we took it: only then does it lease it to us at once. A
        ``queued`` one (protocol/early.queued) is claimed once the shard before it is reported (``_claim_queued``)."""
        refusal = self._market_refusal(view)
        if refusal is None and not await self.evidence.can_take_work():
            refusal = "the disk cannot keep the evidence of new work"
        if refusal is not None or self.active.get(key) is not lease:
            if self.active.get(key) is lease:
                self.active.pop(key, None)
                self._early.pop(key, None)
            return
        self.local.counters["early_starts"] += 1
        if queued:
            self.local.counters["early_starts_queued"] += 1
        log.info("job %s: round %d shard %d: starting early%s, from %s… (not leased yet)", view.job_id.hex()[:8],
                 lease.round, lease.shard, " after our announced shard" if queued else "",
                 (lease.initial_adapter_cid or "")[:24])
        if not queued:
            await self.evidence.publish(m.ShardClaim(view.job_id, lease.round, lease.shard))
        await self._run_shard(view, lease, key, early=True, swarm=swarm)

    def _early_outcome(self, view: JobMirror, lease: m.ShardLease) -> str:
        """Where an early start stands (protocol/early.standing): OURS, WAIT, or why it never will be ours; a
        round begun without its lease waits EARLY_LEASE_WAIT seconds from when we first saw it begin."""
        published = view.aggregates.get(lease.round - 1)
        outcome = early_rules.standing(view.state, published.adapter_cid if published is not None else None,
                                       lease.round, lease.shard, lease.attempt, self.local.peer_id,
                                       lease.initial_adapter_cid)
        if outcome != early_rules.OPEN:
            return outcome
        key = (view.job_id, lease.round, lease.shard, lease.attempt)
        opened = self._early.get(key)
        if opened is None:
            opened = self.local.clock()
            if key in self._early:
                self._early[key] = opened
        if self.local.clock() - opened <= early_rules.EARLY_LEASE_WAIT:
            return early_rules.WAIT
        return f"no lease {early_rules.EARLY_LEASE_WAIT:.0f} s after the round began"

    async def _until_ours(self, view: JobMirror, lease: m.ShardLease) -> None:
        """Return once the lease of an early start is ours (at once for a leased shard); EarlyStartVoid when it
        will not be. Bounded by the job's lease time."""
        key = (view.job_id, lease.round, lease.shard, lease.attempt)
        if self.active.get(key) is not lease:
            raise EarlyStartVoid("dropped")  # an early start dropped meanwhile (its lease may train afresh)
        if key not in self._early:
            return
        deadline = self.local.clock() + view.terms.lease_seconds
        while (outcome := self._early_outcome(view, lease)) == early_rules.WAIT and self.local.clock() < deadline:
            opened = self._early.get(key)  # (when we first saw its round begin with the shard still open)
            if opened is not None and (key, view.coordination.term) not in self._reclaimed and \
                    early_rules.reclaim(self.local.clock() - opened, lease.term, view.coordination.term,
                                        holding=bool(view.training_by(self.local.peer_id))):
                # our claim went to the round before, and a coordinator elected since never kept it (the scenario
                # coded-coordinator-killed: the early work was dropped 20 s later, the shards trained again)
                self._reclaimed.add((key, view.coordination.term))
                self.local.counters["early_starts_claimed_again"] += 1
                log.info("job %s: round %d shard %d: begun, not leased yet (term %d, announced in %d): claiming it "
                         "again", view.job_id.hex()[:8], lease.round, lease.shard, view.coordination.term, lease.term)
                await self.evidence.publish(m.ShardClaim(view.job_id, lease.round, lease.shard))
            await self.tasks.wait_until(lambda: self._early_outcome(view, lease) != early_rules.WAIT, 1.0)
        if outcome != early_rules.OURS or self.active.get(key) is not lease:
            if self.active.get(key) is lease:  # its slot free now: a lease arriving meanwhile trains afresh
                self.active.pop(key, None)
                self._early.pop(key, None)
            raise EarlyStartVoid("no lease within the job's lease time" if outcome == early_rules.WAIT else
                                 "dropped" if outcome == early_rules.OURS else outcome)
        if key in self._early:
            del self._early[key]
            self.local.counters["early_starts_leased"] += 1
            log.info("job %s: round %d shard %d: leased as announced; the early start counts", view.job_id.hex()[:8],
                     lease.round, lease.shard)

    def drop_stale(self) -> None:
        """Stop training the shards whose attempt is no longer ours: its lease ran out (or the round or
        the job moved on) while we trained, so no report of it can be accepted. Issue 25: after a full
        disk a worker trained its expired attempt 2 to the end (the report silently refused) and ignored
        the attempt-3 lease the coordinator gave it meanwhile; the shard's retries ran out."""
        for key in list(self.active):
            job_id, rnd, index, attempt = key
            view = self.book.followed(job_id)
            if view is None:
                continue
            if key in self._early:  # started early: ours while its lease may still come (_until_ours says the rest)
                outcome = self._early_outcome(view, self.active[key])
                if outcome in (early_rules.WAIT, early_rules.OURS):
                    continue
                scope = self._scopes.get(key)
                if scope is not None and not scope.cancel_called:
                    log.info("job %s round %d shard %d: early start dropped: %s", job_id.hex()[:8], rnd, index, outcome)
                    self.local.counters["early_starts_dropped"] += 1
                    scope.cancel()
                self.active.pop(key, None)
                self._early.pop(key, None)
                continue
            shard = view.shard(index) if index < len(view.state.shards) else None
            ours = (not view.state.terminal and view.state.round == rnd and shard is not None
                    and shard.attempt == attempt and shard.worker == self.local.peer_id
                    and shard.phase in (st.ShardPhase.LEASED, st.ShardPhase.REPORTED))
            if ours:
                continue
            scope = self._scopes.get(key)
            if scope is not None and not scope.cancel_called:
                log.warning("job %s shard %d attempt %d: no longer ours (%s); training stopped",
                            job_id.hex()[:8], index, attempt,
                            view.state.phase.value if view.state.terminal or view.state.round != rnd else
                            f"now attempt {shard.attempt} {shard.phase.value}" if shard else "unknown shard")
                scope.cancel()
            self.active.pop(key, None)

    async def release_stale(self, view: JobMirror) -> None:
        """After a restart: give back the shards our mirror says we hold but no longer train, so
        they are reassigned now rather than when the lease runs out. Waits (bounded) for a peer to hear it."""
        await self.tasks.wait_until(lambda: bool(self.peer_table.peers.keys() - {self.local.peer_id}), 10)
        for shard in view.held_by(self.local.peer_id):
            if shard.phase is st.ShardPhase.LEASED and \
                    (view.job_id, view.state.round, shard.index, shard.attempt) not in self.active:
                log.info("job %s shard %d attempt %d: released (this agent restarted)", view.job_id.hex()[:8],
                         shard.index, shard.attempt)
                with trio.move_on_after(5):
                    await self.evidence.publish(m.ShardRelease(view.job_id, view.state.round, shard.index, shard.attempt,
                                                       "the worker restarted", cause=m.RELEASE_LOCAL))

    async def release_all(self, reason: str) -> None:
        for (job_id, rnd, shard, attempt) in list(self.active):
            with trio.move_on_after(2):
                await self.evidence.publish(m.ShardRelease(job_id, rnd, shard, attempt, reason, cause=m.RELEASE_LOCAL))

    # -- one shard --------------------------------------------------------------------------------

    def train_processes(self, terms: m.JobTerms) -> int:
        """Processes that train a shard of this job: ``train_processes``, else one per CUDA device we
        measured (agent/train/parallel.plan_processes); unsloth trains on one GPU."""
        from agent.train.parallel import plan_processes

        machine = self.local.capabilities.machine
        processes = plan_processes(self.local.config.train_processes, len(machine.cuda) if machine else 0)
        return 1 if terms.runtime != "peft" else processes

    def _fit_to_device(self, config: Any, model_path: str, processes: int = 1) -> Any:
        """On a CUDA GPU: the micro-batch from its free VRAM (the least free of the GPUs the ranks use),
        the job's effective batch kept. On a CPU the job's own split (CPU runs replay bit for bit), the
        threads shared among the ranks. With several processes each rank gets a micro-batch (parallel.split_for)."""
        import torch

        from agent.train.parallel import split_for
        from agent.train.presets import auto_micro_batch

        machine = self.local.capabilities.machine
        if machine is None or not machine.cuda:
            if processes > 1 and not torch.cuda.is_available():
                config = config.with_(threads=max(1, config.threads // processes))
            return split_for(config, processes)
        machine = self.local.capabilities.refresh_machine()
        free = min(d.vram_free_gb for d in machine.cuda[:processes]) if processes > 1 else machine.best_free_vram_gb()
        plan = auto_micro_batch(config, free, model_path)
        if not plan.fits:
            log.warning("the model may not fit in %.1f GB free VRAM (estimated %.1f GB); trying one sample at a time",
                        free, plan.estimate_gb)
        return split_for(config.with_(micro_batch_size=plan.micro_batch), processes)

    def _hardware_record(self, environment: dict) -> dict:
        """What the ledger says a report ran on: the device, its VRAM, dtype and runtime the proof names."""
        device = str(environment.get("device", "cpu"))
        return {"hardware": device, "device_class": str(environment.get("device_class", "cpu")),
                "vram_gb": _device_vram_gb(self.local.capabilities.machine, device), "dtype": str(environment.get("dtype", "")),
                "runtime": str(environment.get("backend", "")), "micro_batch": int(environment.get("micro_batch", 0)),
                "processes": int(environment.get("data_parallel", 1))}

    async def _run_shard(self, view: JobMirror, lease: m.ShardLease, key: tuple, early: bool = False,
                         swarm: tuple[str, ...] = ()) -> None:
        scope = self._scopes[key] = trio.CancelScope()
        try:
            with scope:
                await self._train_and_report(view, lease, early, swarm)
        except EarlyStartVoid as exc:  # never leased to us: nothing to give back
            self.local.counters["early_starts_dropped"] += 1
            log.info("job %s round %d shard %d: early start dropped: %s", view.job_id.hex()[:8], lease.round,
                     lease.shard, exc)
        except Exception as exc:  # noqa: BLE001 - a failed shard must not stop the agent
            if key in self._early or self.active.get(key) is not lease:  # not (or no longer) ours: nothing to give back
                log.warning("job %s shard %d: early start failed: %s", view.job_id.hex()[:8], lease.shard, exc)
                return
            # our own full disk is not the shard's failure: the attempt is excused (IPIP-0004 §5 RETRY; issue 24: a
            # worker whose disk filled spent the shard's attempts, and the demo failed a round)
            # (torch.save on a full disk says only "unexpected pos …": a disk full now counts too)
            local = full_disk(exc) or self.evidence.store_full is not None or disk_is_full(self.local.work_dir)
            log.warning("job %s shard %d: giving it back%s: %s", view.job_id.hex()[:8], lease.shard,
                        " (our disk is full)" if local else "", exc)
            with trio.move_on_after(5):
                await self.evidence.publish(m.ShardRelease(view.job_id, lease.round, lease.shard, lease.attempt,
                                                   str(exc)[:1000] or type(exc).__name__,
                                                   cause=m.RELEASE_LOCAL if local else None))
        finally:
            if self.active.get(key) is lease:  # (a dropped early start's lease may have been replaced by the real one)
                self.active.pop(key, None)
                self._early.pop(key, None)
            if self._scopes.get(key) is scope:
                self._scopes.pop(key, None)
            self._last_claim.pop(view.job_id, None)
            self.wake()

    async def _combine_start(self, view: JobMirror, lease: m.ShardLease, model_path: str, bundle: Path,
                             run_dir: Path) -> bool:
        """An early start's aggregate computed here from the reports of the round we trained in, and the round's start
        we hold (agent/combine.py, IPIP-0006 §2.9.1): True once it is ``lease.initial_adapter_cid``, in ``bundle``.
        Computed ahead already (``_combine_ahead``): its result, once it is in."""
        rnd = lease.round - 1
        reports = self._round_reports(view, rnd)
        if reports is None:
            return False
        ahead = self._ahead.get((view.job_id, rnd))
        if ahead is not None and ahead.reports == reports:
            with trio.move_on_after(COMBINE_TIMEOUT):
                await ahead.done.wait()
            if ahead.cid is not None and ahead.cid != lease.initial_adapter_cid:
                log.warning("job %s round %d: the round's reports combined here to %s…, but %s… was announced; "
                            "fetching it", view.job_id.hex()[:8], rnd, ahead.cid[:24], lease.initial_adapter_cid[:24])
                self.local.counters["starts_not_combined_here"] += 1
                return False
        start = await self._round_start(view, rnd, model_path, run_dir / "combine-start")
        combined = start is not None and await combine_here(
            self.blocks.content, view.terms, rnd=rnd, cid=lease.initial_adapter_cid, start=start, out=bundle,
            reports=list(reports), work=run_dir / "combine", coordinator=view.coordination.coordinator,
            timeout=min(self.local.config.fetch_timeout, COMBINE_TIMEOUT))
        self.local.counters["starts_combined_here" if combined else "starts_not_combined_here"] += 1
        if combined and ahead is not None and ahead.cid == lease.initial_adapter_cid:
            self.local.counters["starts_combined_ahead"] += 1
        return combined

    @staticmethod
    def _round_reports(view: JobMirror, rnd: int) -> tuple[tuple[str, str, int], ...] | None:
        """(adapter CID, worker, samples) of each shard's report of round ``rnd``, in shard order, while it is the
        mirror's round and every shard has a report of its current attempt; else None."""
        state = view.state
        reports = [view.reports.get((rnd, s.index, s.attempt)) for s in state.shards]
        if state.round != rnd or any(r is None for r in reports):
            return None
        return tuple((report.adapter_cid, worker, report.samples) for report, worker in reports)

    async def _round_start(self, view: JobMirror, rnd: int, model_path: str | None,
                           work: Path) -> tuple[dict, dict, dict] | None:
        """Round ``rnd``'s start as the coordinator reads it, from what we hold (agent/combine.start_here)."""
        if model_path is None:
            return None
        previous = view.aggregates.get(rnd - 1)
        return await start_here(self.blocks.content, view.terms, rnd, previous.adapter_cid if previous else None,
                                train_config(view.terms, model_path, round=rnd, threads=self.local.config.threads),
                                work)

    def _combine_ahead(self, view: JobMirror, rnd: int) -> None:
        """Every shard of round ``rnd`` (one we trained in) is reported: compute the round's aggregate now, while the
        coordinator checks the last report, instead of at its `early` message (issue 24: at 12-step rounds that
        computation, 0.25 s here, was each early start's wait). The announced CID still decides (combine_here)."""
        reports = self._round_reports(view, rnd)
        key = (view.job_id, rnd)
        if reports is None or (key in self._ahead and self._ahead[key].reports == reports):
            return
        for old in [k for k in self._ahead if k[0] == view.job_id and k[1] < rnd]:
            del self._ahead[old]
        ahead = self._ahead[key] = _Ahead(reports)
        model_path = self.local.capabilities.local_model(view.terms)

        async def compute() -> None:
            work = self.local.work_dir / view.job_id.hex()[:16] / f"ahead-r{rnd}"
            try:
                start = await self._round_start(view, rnd, model_path, work / "start")
                if start is not None:
                    ahead.cid = await combine_ahead(
                        self.blocks.content, view.terms, rnd=rnd, reports=reports, start=start, work=work / "combine",
                        coordinator=view.coordination.coordinator,
                        timeout=min(self.local.config.fetch_timeout, COMBINE_TIMEOUT))
                if ahead.cid is not None:
                    self.blocks.hold(view.job_id, rnd + 1, ahead.cid)
            finally:
                shutil.rmtree(work, ignore_errors=True)
                ahead.done.set()

        if not self.tasks.spawn_in_job(view.job_id, compute):
            ahead.done.set()

    def on_report(self, view: JobMirror, report: m.ShardReport, worker: str) -> None:
        """Another worker's report of a round we trained in, of a job whose next round's start we compute here when
        it is announced early (agent/combine.py): its adapter fetched from its worker now, beside our training, so
        only the round's last report is fetched at the round's end. One try; ``combine_here`` asks again. The round's
        last report (ours or another's) starts the aggregate's computation (``_combine_ahead``)."""
        me = self.local.peer_id
        if not self.local.config.early_start or view.job_id not in self.candidates or \
                not combines_here(view.terms) or report.round != view.state.round or \
                report.round >= view.terms.rounds or not any(s.worker == me for s in view.state.shards):
            return
        self._combine_ahead(view, report.round)
        if worker == me:
            return

        async def prefetch() -> None:
            out = self.local.work_dir / view.job_id.hex()[:16] / "reports-ahead" / f"{report.adapter_cid}.tar"
            try:
                await self.blocks.content.fetch(report.adapter_cid, out, timeout=self.local.config.fetch_timeout,
                                                providers=[worker],
                                                max_size=bundle_size_bound(MAX_REPORT_BYTES, REPORT_FILES))
                self.blocks.hold(view.job_id, report.round, report.adapter_cid)
                self.local.counters["reports_fetched_ahead"] += 1
            except Exception as exc:  # noqa: BLE001 - a head start only
                log.info("job %s: report %s… not fetched ahead: %s", view.job_id.hex()[:8], report.adapter_cid[:24], exc)
            finally:
                out.unlink(missing_ok=True)

        self.tasks.spawn_in_job(view.job_id, prefetch)

    async def _add_packed(self, directory: Path, tar: Path) -> Any:
        """``directory`` packed into ``tar`` and added to the store (not provided), the CID returned; the tar is
        removed then: its blocks are the copy kept and served. A tar beside its blocks was a second copy of every
        checkpoint, report and proof (issue 24: the demo filled a 600 MB disk by round 5)."""
        path = await pack_dir_off_loop(directory, tar)
        try:
            return await self.blocks.content.add_file(path, provide=False)
        finally:
            path.unlink(missing_ok=True)

    def _start_update(self, view: JobMirror, lease: m.ShardLease) -> tuple[str, str] | None:
        """(update CID, the CID of the start it decodes onto) of the lease's start when that is a coded aggregate
        (IPIP-0006 §2.8.1): named by the published aggregate, or by the `early` message that announced it."""
        base = downlink.update_base(view.terms, view.aggregates, lease.round - 1)
        if base is None or not lease.initial_adapter_cid:
            return None
        published = view.aggregates.get(lease.round - 1)
        if published is not None and published.adapter_cid == lease.initial_adapter_cid:
            update = published.update_cid
        else:
            update = self._updates.get((view.job_id, lease.round, lease.initial_adapter_cid))
        return (update, base) if update is not None else None

    async def _fetch(self, view: JobMirror, lease: m.ShardLease, cid: str, out: Path, providers: list[str],
                     tries: int = 3, swarm: tuple[str, ...] = (), **bound: int) -> Any:
        """Fetch ``cid``, trying again (resuming from the blocks we got) while our lease holds:
        one slow or unreachable provider must not cost the job an attempt. ``swarm``: the first try
        fetches together with those peers (ContentService.fetch); a try again is a plain fetch."""
        from agent.content.errors import FetchError

        for attempt in range(1, tries + 1):
            try:
                return await self.blocks.content.fetch(cid, out, timeout=self.local.config.fetch_timeout,
                                                       providers=providers, swarm=swarm if attempt == 1 else (), **bound)
            except FetchError as exc:
                if exc.refused:  # the file's size is wrong: no retry can help
                    raise
                shard = view.shard(lease.shard)
                key = (view.job_id, lease.round, lease.shard, lease.attempt)
                still_ours = (view.state.round, shard.attempt, shard.worker) == (lease.round, lease.attempt,
                                                                                  self.local.peer_id) or \
                    (key in self._early and self._early_outcome(view, lease) == early_rules.WAIT)
                if attempt == tries or not still_ours:
                    raise
                log.info("job %s shard %d: fetch failed (%s); trying again", view.job_id.hex()[:8], lease.shard, exc)
                await trio.sleep(attempt)

    async def _train_and_report(self, view: JobMirror, lease: m.ShardLease, early: bool = False,
                                swarm: tuple[str, ...] = ()) -> None:
        from agent.content.exchange import first_error
        from agent.train.backends import select_backend
        from agent.train.run import TrainRequest

        terms = view.terms
        ref = terms.shards[lease.shard]
        run_dir = self.local.work_dir / view.job_id.hex()[:16] / \
            f"r{lease.round}-s{lease.shard}-a{lease.attempt}{'-early' if early else ''}"
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        shard_path = run_dir / "shard.jsonl"
        began = trio.current_time()
        log.info("job %s shard %d attempt %d: fetching %s", view.job_id.hex()[:8], lease.shard, lease.attempt, ref.cid)
        await self._fetch(view, lease, ref.cid, shard_path, [terms.submitter], exact_size=ref.size)
        self.blocks.provide_soon(ref.cid)  # every block was checked on arrival: serve it too (IPIP-0003 §4.1)
        self.training.before_training()
        model_path = self.local.capabilities.local_model(terms)
        substitute = await self.training.base_model(self.local.config.home)
        if substitute is not None:
            model_path = substitute
        else:
            have = await self.local.capabilities.base_model_hash(model_path)
            if have != terms.base_model_sha256.hex():
                raise RuntimeError(f"base model hash mismatch: local {terms.base_model!r} is {have[:16]}…, "
                                   f"the job names {terms.base_model_sha256.hex()[:16]}…")
        initial = None
        if lease.initial_adapter_cid and self.training.use_initial_adapter():
            bundle = run_dir / "initial.tar"
            holders = [p for p in (view.coordination.coordinator, terms.submitter) if p and p != self.local.peer_id]
            # an early start's: the coordinator first (the submitter is taking its copy meanwhile)
            order = holders if early else spread(holders, self.local.peer_id, self.peer_table.live_peers())
            update = self._start_update(view, lease)
            rebuilt = early and combines_here(terms) and await self._combine_start(view, lease, model_path, bundle,
                                                                                    run_dir)
            if update is not None and not rebuilt:  # a coded aggregate: its update rebuilt onto the start we hold (IPIP-0006 §2.8.1)
                rebuilt = await fetch_coded(self.blocks.content, terms, cid=lease.initial_adapter_cid,
                                            update_cid=update[0], base_cid=update[1], out=bundle, providers=order,
                                            swarm=swarm if early else (), timeout=self.local.config.fetch_timeout,
                                            work=run_dir / "rebuild")
                self.local.counters["starts_rebuilt" if rebuilt else "starts_not_rebuilt"] += 1
            if not rebuilt:  # (whole; fetched together only when the announced workers all fetch it whole)
                fetched_start = await self._fetch(view, lease, lease.initial_adapter_cid, bundle, order,
                                                  swarm=swarm if early and update is None else (),
                                                  max_size=bundle_size_bound(DEFAULT_MAX_BYTES, AGGREGATE_FILES))
                if fetched_start.swarm is not None:
                    self.local.counters["starts_fetched_together"] += 1
                    self.local.counters["start_blocks_from_members"] += sum(fetched_start.swarm.from_members.values())
            initial = await unpack_off_loop(bundle, run_dir / "initial", allowed=AGGREGATE_FILES)
            bundle.unlink(missing_ok=True)  # its blocks are in the store: the copy kept and served
        config = train_config(terms, model_path, round=lease.round, threads=self.local.config.threads, log_every=5)
        processes = self.train_processes(terms)
        config = await trio.to_thread.run_sync(self._fit_to_device, config, model_path, processes)
        backend = select_backend(terms.runtime, processes)  # TrainError (one line) if this machine cannot run it
        config = self.training.adjust_config(config)
        request = TrainRequest(config, shard_path, run_dir / "run", initial_adapter=initial, job_id=view.job_id,
                               round=lease.round, shard_index=lease.shard, attempt=lease.attempt,
                               worker=self.local.peer_id)
        checkpoint_cids: dict[int, str] = {}
        committing = 0.0  # seconds spent packing, adding and announcing checkpoints (beside the training)

        async def commit(event: Any) -> None:
            nonlocal committing
            await self._until_ours(view, lease)  # an early start announces nothing before its lease
            started = trio.current_time()
            cid = await self._add_packed(event.path, event.path.with_suffix(".tar"))
            self.blocks.hold(view.job_id, lease.round, cid)
            checkpoint_cids[event.step] = str(cid)
            await self.evidence.publish(m.CheckpointCommit(
                view.job_id, lease.round, lease.shard, lease.attempt, event.step, event.index, event.head,
                event.link.adapter_hash, float(event.link.loss), str(cid)))
            self.evidence.ledger(view.job_id, "checkpoint", {  # IPIP-0008 §2: what the worker committed, when
                "round": lease.round, "shard": lease.shard, "attempt": lease.attempt, "step": event.step,
                "loss": float(event.link.loss), "checkpoint_cid": str(cid), "head": bytes(event.head).hex()})
            committing += trio.current_time() - started

        # A checkpoint is announced beside the training, not in its way: the training thread hands each
        # event (its bytes already on disk) to one task that packs, adds and announces them in order, and
        # goes on with the next step. Before, the thread waited for each (issue 24: the device idled
        # while a checkpoint was tarred, hashed into blocks and gossiped). The report waits for all.
        send, receive = trio.open_memory_channel[Any](math.inf)

        async def announce_checkpoints() -> None:
            async with receive:
                async for event in receive:
                    await commit(event)

        def on_checkpoint(event: Any) -> None:
            trio.from_thread.run_sync(send.send_nowait, event)

        log.info("job %s shard %d attempt %d: training", view.job_id.hex()[:8], lease.shard, lease.attempt)
        fetched = trio.current_time()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(announce_checkpoints)
                async with send:
                    result = await trio.to_thread.run_sync(run_torch, backend.train, request, on_checkpoint)
        except BaseExceptionGroup as group:  # a failed announcement (the training then stops at its next checkpoint)
            raise first_error(group) from None
        trained = trio.current_time()
        if early:
            self._start_queued(view, lease.round)  # the next shard we trained in the round before, from this start
        await self._until_ours(view, lease)
        genesis = request.run_dir / "checkpoints" / "step-000000"
        checkpoint_cids[0] = str(await self._add_packed(genesis, genesis.with_suffix(".tar")))
        self.blocks.hold(view.job_id, lease.round, checkpoint_cids[0])  # named only inside the proof
        head = self.training.after_training(result.adapter_dir, request.run_dir / PROOF_FILE, result.head)
        # provided in the background: the report names us, and a slow DHT peer must not delay it (issue 17)
        adapter_cid = await self._add_packed(report_dir(result, request.run_dir, terms), run_dir / "adapter.tar")
        self.blocks.hold(view.job_id, lease.round, adapter_cid)
        self.blocks.provide_soon(adapter_cid)
        proof_dir = run_dir / "proof"
        proof_dir.mkdir()
        shutil.copy(request.run_dir / PROOF_FILE, proof_dir / PROOF_FILE)
        (proof_dir / CHECKPOINTS_FILE).write_text(json.dumps({str(k): v for k, v in sorted(checkpoint_cids.items())}))
        proof_cid = await self._add_packed(proof_dir, run_dir / "proof.tar")
        self.blocks.hold(view.job_id, lease.round, proof_cid)
        self.blocks.provide_soon(proof_cid)
        metrics = {"train_seconds": float(result.train_seconds), "tokens_per_s": float(result.tokens_per_second)}
        if result.validation_loss is not None:
            metrics["validation_loss"] = float(result.validation_loss)
        await self.evidence.publish(m.ShardReport(
            view.job_id, lease.round, lease.shard, lease.attempt, str(adapter_cid), str(proof_cid), head,
            result.checkpoints, result.steps, result.samples, float(result.final_loss), metrics))
        log.info("job %s round %d shard %d: reported; %.2f s fetching, %.2f s loading, %.2f s training (%.2f s of it "
                 "announcing checkpoints beside it), %.2f s packing and publishing", view.job_id.hex()[:8], lease.round,
                 lease.shard, fetched - began, float(result.load_seconds), trained - fetched - float(result.load_seconds),
                 committing, trio.current_time() - trained)
        self.evidence.ledger(view.job_id, "report", {
            "round": lease.round, "shard": lease.shard, "attempt": lease.attempt, "worker": self.local.peer_id,
            "adapter_cid": str(adapter_cid), "duration": float(result.train_seconds), "samples": result.samples,
            "price_per_hour": terms.price_per_hour, "ask_per_hour": self.local.config.price_per_hour,
            **self._hardware_record(result.environment)})
        from agent.market import record_shard_speed

        record_shard_speed(self.local.capabilities, terms, float(result.tokens_per_second))
        self.local.counters["shards_trained"] += 1
        await self._claim_queued(view, lease.round)
        log.info("job %s shard %d: reported (loss %.3f, %d steps)", view.job_id.hex()[:8], lease.shard,
                 result.final_loss, result.steps)


def _device_vram_gb(machine: Any, device: str) -> float:
    """Total VRAM of the device a proof names (``cuda:<name>``), from what we measured at start."""
    if machine is None or not device.startswith("cuda:"):
        return 0.0
    named = [d for d in machine.cuda if d.name == device[5:]]
    return max((d.vram_total_gb for d in named or machine.cuda), default=0.0)


def report_dir(result: Any, train_dir: Path, terms: Any) -> Path:
    """The directory the report's bundle packs: the trained adapter (and AdamW state), or with
    a ``report_codec`` (int8, int4, int4-log, int4-fresh) its config and the coded payload only (IPIP-0006 §2.8)."""
    if terms.training.report_codec == "none":
        return result.adapter_dir
    from agent.train.codec import PAYLOAD_FILE

    directory = train_dir / "report"
    directory.mkdir(exist_ok=True)
    shutil.copy(result.adapter_dir / "adapter_config.json", directory / "adapter_config.json")
    shutil.copy(train_dir / PAYLOAD_FILE, directory / PAYLOAD_FILE)
    return directory


def spread(holders: list[str], worker: str, live: frozenset[str] | set[str]) -> list[str]:
    """The holders of a round's start in the order ``worker`` asks them: those whose heartbeats arrive
    (``live``) first, each group in an order of its own (by a hash of the worker's and the holder's IDs), so a
    round's workers do not all fetch it from the first one. The
    coordinator and the submitter both hold the aggregate before it is announced (IPIP-0006 §2.6.1); asked in
    one order, every worker's fetch went through the coordinator's uplink (issue 24: at 20 Mbit/s, a second
    a round per worker)."""
    distinct = list(dict.fromkeys(holders))
    return sorted(distinct, key=lambda holder: (holder not in live,
                                                hashlib.sha256(f"{worker} {holder}".encode()).digest()))
