"""The submitter role: turn a job spec and a dataset into an announced job, and follow it.

Rules of this file:
- A dataset named by CID (``input.dataset: bafy...`` or ``ipfs://...``) is fetched first through our
  content service (``fetch_dataset``: every block checked against the CID), then sharded like a
  local file; the terms name it (``dataset_cid``).
- The dataset is split deterministically (agent/train/data.split_dataset with the job seed): a
  validation split, then ``shards`` near-equal shards. Each part is written as ChatML JSONL, added
  to the content store (CIDv1, raw leaves) and provided in the DHT in the background (workers ask
  the submitter first; with DHT peers gone or cut off each provide waited out its 30 s, and an
  announcement took minutes in the soak); the announcement names every shard by CID with its record
  count and size, so workers can check what they fetch.
- A dataset that cannot be trained (empty, fewer training records than shards, a shard without
  assistant text) is refused before anything is written or announced (train/data.check_dataset).
- The base model's content hash is computed from our local copy; workers refuse a different one.
- At most ``MAX_LIVE_JOBS_PER_SUBMITTER`` of our jobs are not ended at once (IPIP-0004 §13: peers
  follow no more of one submitter's): a new one past it is refused (``SubmitRefused``, one line
  naming the limit) before anything is sharded or announced (``check_room``).
- The job ID is the hash of the terms (protocol/messages.py). The announcement is re-gossiped with
  a fresh envelope every ``reannounce_seconds`` until the job ends, so late joiners see it (an
  envelope is only accepted for 300 s, IPIP-0001). We keep serving the shards while the job runs.
- We keep a copy of every accepted adapter and every aggregate of our job (``accepted/<cid>.tar``),
  so no accepted work is lost with its worker: a failed copy is tried again after each of
  ``keep_retry_delays`` (given up early only if the job fails or is cancelled; again after a
  restart), and ``job show`` lists what is accepted but not held here yet (``not_held``).
- A paid job whose accepted work has spent its budget gets no more leases; once none of its leases
  is in flight we cancel it with the budget's reason (``_watch_budget``, a task of the job: it waits on
  the job's changes through ``wait_until``, re-checking at least every ``budget_check_seconds``).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from agent.bundle import AGGREGATE_FILES, bundle_size_bound
from agent.downlink import fetch_coded
from agent.market import budget_reason
from protocol import downlink, market as mk
from protocol import messages as m
from protocol import state as st
from protocol.jobspec import to_terms

if TYPE_CHECKING:
    from agent.blocks import Blocks
    from agent.evidence import Evidence
    from agent.peers import PeerTable
    from agent.roles.port import Local
    from agent.tasks import Tasks
    from agent.following import Following
    from protocol.mirror import JobMirror

log = logging.getLogger(__name__)

# How long the submitter's head-start copy of a report's adapter, from its worker, may take: a keep request for the
# same CID waits on it (one fetch of a CID at a time), then fetches what is left from the coordinator
REPORT_PREFETCH_SECONDS = 10.0


class SubmitRefused(ValueError):
    """A job we will not announce; ``str()`` is the one line to show."""


@dataclass(frozen=True)
class ShardPlan:
    """A job's dataset read, checked (train/data.check_dataset) and split (split_dataset): what announcing
    shards and what an estimate counts, made once for both (issue 23: an interactive announce read and
    split the dataset twice)."""

    records: list
    split: Any  # agent/train/data.Split


class RecentFiles:
    """What was made from a file, kept for the next request about the same file state (path, size, mtime,
    plus the caller's settings): at most ``keep`` entries, the oldest dropped first; thread-safe (plans are
    made in worker threads). ``take`` hands an entry out and forgets it."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._entries: dict[tuple, Any] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(path: str | Path, *settings: Any) -> tuple:
        state = Path(path).stat()
        return (str(Path(path).resolve()), state.st_size, state.st_mtime_ns, *settings)

    def get(self, key: tuple, *, take: bool = False) -> Any:
        with self._lock:
            return self._entries.pop(key, None) if take else self._entries.get(key)

    def put(self, key: tuple, value: Any) -> None:
        with self._lock:
            self._entries[key] = value
            while len(self._entries) > self.keep:
                del self._entries[next(iter(self._entries))]


class SubmitterRole:
    reannounce_seconds = 60.0
    keep_retry_delays: tuple[float, ...] = (2.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0)
    # the budget watch re-checks at least this often (job changes wake it at once; this is the deadline)
    budget_check_seconds = 30.0

    def __init__(self, local: "Local", peer_table: "PeerTable", tasks: "Tasks", blocks: "Blocks", evidence: "Evidence",
                 following: "Following") -> None:
        self.local, self.peer_table, self.tasks, self.blocks, self.evidence = local, peer_table, tasks, blocks, evidence
        self.following = following  # following the jobs we announce, and which of ours have not ended
        self._keeping: set[tuple[bytes, str]] = set()  # (job, cid) copies under way
        self._keep_locks: dict[tuple[bytes, str], trio.Lock] = {}  # (job, cid) fetched now, one at a time
        # (job, cid) of an announced early start -> the peers fetching it together (protocol/early.swarm), latest last
        self._swarms: dict[tuple[bytes, str], tuple[str, ...]] = {}
        # (job, aggregate CID) -> (its update, the round's start) as an `early` message named them (IPIP-0006 §2.8.1)
        self._updates: dict[tuple[bytes, str], tuple[str, str]] = {}
        # an estimate's spec and dataset plan, for the announce that follows it (the plan is taken by it)
        self._specs, self._plans = RecentFiles(), RecentFiles()

    def spec_of(self, path: str | Path) -> Any:
        """The job spec in file ``path`` (agent/specfile.load_spec: SpecError, one line, for a bad one), read
        once per file state (path, size, mtime): the estimate before an announce and the announce share it."""
        from agent.specfile import load_spec

        try:
            key = RecentFiles.key(path)
        except OSError:
            return load_spec(path)  # says what is wrong with the path
        spec = self._specs.get(key)
        if spec is None:
            spec = load_spec(path)
            self.local.counters["spec_reads"] += 1
            self._specs.put(key, spec)
        return spec

    def shard_plan(self, spec: Any, dataset: Path, *, keep: bool) -> ShardPlan:
        """The dataset's plan for ``spec`` (in a worker thread): an estimate's (``keep``) is kept for the
        announce after it, which takes it (``keep`` False), so a dataset's records stay in memory no longer
        than between the two. DataError (one line) for a dataset that cannot be trained."""
        from agent.train import split_dataset
        from agent.train.data import check_dataset

        settings = (spec.shards, spec.input.validation_split, spec.seed, spec.input.format)
        key = RecentFiles.key(dataset, *settings)
        plan = self._plans.get(key, take=not keep)
        if plan is None:
            records = check_dataset(dataset, *settings).records
            plan = ShardPlan(records, split_dataset(len(records), spec.shards, spec.input.validation_split, spec.seed))
            self.local.counters["dataset_plans"] += 1
        if keep:
            self._plans.put(key, plan)
        return plan

    async def fetch_dataset(self, cid: str) -> Path:
        """A dataset named by CID in the spec (IPIP-0007 ``input.dataset``): fetched through our content
        service, every block checked against the CID, into our work directory."""
        out = self.local.work_dir / "datasets" / f"{cid}.jsonl"
        if not out.exists():
            await self.blocks.content.fetch(cid, out, timeout=self.local.config.fetch_timeout)
        return out

    async def prepare_terms(self, spec: Any, dataset: Path, base_model_path: str, *,
                            deadline: int | None = None, created: int | None = None,
                            dataset_cid: str | None = None, max_nodes: int = 0,
                            providers: tuple[str, ...] = ()) -> m.JobTerms:
        """Shard ``dataset``, add the parts to the content store, and build the job's terms.

        ``created`` and ``deadline`` default to now and now + the spec's max runtime; the harness pins
        both so that a job's ID (the hash of its terms) depends only on its seed."""
        from agent.train import base_model_sha256
        from agent.train.data import write_chatml
        from agent.train.model import model_refusal

        # LoRA targets the base model has (or its size, for full fine-tuning), and every shard trainable: checked
        # before anything is written or sent (a bad target used to fail on every worker, issue 25)
        problem = await trio.to_thread.run_sync(model_refusal, spec.method, spec.lora.target_modules, base_model_path)
        if problem is not None:
            raise SubmitRefused(f"{problem} ({spec.base_model})")
        plan = await trio.to_thread.run_sync(partial(self.shard_plan, spec, dataset, keep=False))
        records, split = plan.records, plan.split
        out = self.local.work_dir / f"submit-{int(self.local.clock() * 1000)}"
        out.mkdir(parents=True)
        shards = []
        for index, indices in enumerate(split.shards):
            path = out / f"shard-{index}.jsonl"
            write_chatml(path, [records[i] for i in indices])
            cid = await self.blocks.content.add_file(path, provide=False)
            self.blocks.provide_soon(cid)  # in the background: workers ask us first (the terms name us)
            shards.append(m.ShardRef(index, str(cid), len(indices), path.stat().st_size))
        validation_cid = None
        if split.validation:
            path = out / "validation.jsonl"
            write_chatml(path, [records[i] for i in split.validation])
            cid = await self.blocks.content.add_file(path, provide=False)
            self.blocks.provide_soon(cid)
            validation_cid = str(cid)
        if spec.input.hf and dataset_cid is None:  # the converted file, by CID beside its Hub source in the terms
            dataset_cid = str(await self.blocks.content.add_file(dataset, provide=False))
            self.blocks.provide_soon(dataset_cid)
        model_hash = await trio.to_thread.run_sync(base_model_sha256, base_model_path)
        return to_terms(spec, submitter=self.local.peer_id, base_model_sha256=bytes.fromhex(model_hash),
                        shards=tuple(shards), validation_cid=validation_cid,
                        created=int(self.local.clock()) if created is None else created, deadline=deadline,
                        dataset_cid=dataset_cid, max_nodes=max_nodes, providers=tuple(providers))

    def check_room(self, job_id: bytes | None = None) -> None:
        """SubmitRefused while ``MAX_LIVE_JOBS_PER_SUBMITTER`` of our jobs have not ended (IPIP-0004 §13:
        followers follow no more of one submitter's, so a job past it would not run); ``job_id``, one of
        them announced again, passes."""
        unended = self.following.unended_jobs(self.local.peer_id)
        if job_id not in unended and len(unended) >= st.MAX_LIVE_JOBS_PER_SUBMITTER:
            raise SubmitRefused(f"{len(unended)} of this agent's jobs have not ended, the most a submitter may have "
                                f"(MAX_LIVE_JOBS_PER_SUBMITTER = {st.MAX_LIVE_JOBS_PER_SUBMITTER}, IPIP-0004 §13); "
                                "wait for one to end or cancel one (`infernet job list`)")

    async def announce(self, terms: m.JobTerms) -> "JobMirror":
        """Gossip the job (and keep re-announcing it until it ends); return our view of it. SubmitRefused
        (nothing announced) past ``MAX_LIVE_JOBS_PER_SUBMITTER`` jobs of ours not yet ended."""
        from agent.store import announced_data
        self.check_room(terms.job_id())
        view = await self.following.follow_job(terms, self.local.peer_id)
        self.evidence.ledger(view.job_id, "announced", announced_data(terms))
        await self.evidence.publish(m.JobAnnouncement.for_terms(terms))
        self.tasks.spawn_in_job(view.job_id, self._reannounce, view)
        self.tasks.spawn_in_job(view.job_id, self._watch_budget, view)  # a paid job ends when its budget is spent
        log.info("job %s announced: %s, %d shards x %d rounds", view.job_id.hex()[:8], terms.name,
                 len(terms.shards), terms.rounds)
        return view

    async def resume(self, view: "JobMirror") -> None:
        """After a restart: announce our unfinished job again at once, then keep re-announcing it."""
        await self.tasks.wait_until(lambda: bool(self.peer_table.peers.keys() - {self.local.peer_id}), 10)
        await self.evidence.publish(m.JobAnnouncement.for_terms(view.terms))
        for item in self.not_held(view):  # copies a restart interrupted (the agent's: kept after the job ends)
            self.tasks.spawn(self._keep, view, item["cid"], item["provider"])
        self.tasks.spawn_in_job(view.job_id, self._watch_budget, view)
        await self._reannounce(view)

    async def _reannounce(self, view: "JobMirror") -> None:
        while not view.state.terminal:
            if not await self.tasks.wait_until(lambda: view.state.terminal, self.reannounce_seconds):
                await self.evidence.publish(m.JobAnnouncement.for_terms(view.terms))

    async def _watch_budget(self, view: "JobMirror") -> None:
        """Our paid job's budget is spent: once none of its leases is in flight, cancel it with that reason."""
        if not mk.is_paid(view.terms.price_per_hour):
            return
        while not view.state.terminal:
            await self.tasks.wait_until(lambda: view.state.terminal or self.budget_cancel_reason(view) is not None,
                                        self.budget_check_seconds)
            reason = None if view.state.terminal else self.budget_cancel_reason(view)
            if reason is not None:
                log.info("job %s: %s; cancelling it", view.job_id.hex()[:8], reason)
                await self.cancel(view, reason)
                return

    @staticmethod
    def budget_cancel_reason(view: "JobMirror") -> str | None:
        """Why we cancel our job now: its budget is spent (IPIP-0004 §12), none of its shards is LEASED
        or REPORTED, and an OPEN one remains (not while it aggregates); else None."""
        if view.state.terminal or view.state.phase is st.JobPhase.AGGREGATING:
            return None
        reason = budget_reason(view)
        if reason is None:
            return None
        busy = [s for s in view.state.shards if s.phase in (st.ShardPhase.LEASED, st.ShardPhase.REPORTED)]
        return reason if not busy and view.open_shards() else None

    def on_aggregate(self, view: "JobMirror", published: m.AggregatePublished, coordinator: str) -> None:
        """Keep a copy of every aggregate of our job: the next round starts from it, whoever coordinates."""
        if view.terms.submitter == self.local.peer_id:
            self.tasks.spawn(self._keep, view, published.adapter_cid, coordinator)  # outlives the job

    def on_early_start(self, view: "JobMirror", early: m.EarlyStart, signer: str) -> None:
        """Our job's coordinator announced the next round's start before publishing it (IPIP-0006 §2.9): its
        workers fetch it now, and so do we (its keep request follows), together (IPIP-0003 §4.2)."""
        from protocol import early as early_rules

        if view.terms.submitter != self.local.peer_id or early_rules.refusal(
                early, signer, view.coordination.coordinator, view.coordination.term, view.state,
                view.terms.rounds) is not None:
            return
        self._swarms[(view.job_id, early.initial_adapter_cid)] = early_rules.swarm(early, self.local.peer_id)
        while len(self._swarms) > 16:
            self._swarms.pop(next(iter(self._swarms)))
        base = downlink.update_base(view.terms, view.aggregates, early.round - 1)  # a coded aggregate's start
        if early.update_cid is not None and base is not None:  # (IPIP-0006 §2.8.1)
            self._updates[(view.job_id, early.initial_adapter_cid)] = (early.update_cid, base)
            while len(self._updates) > 16:
                self._updates.pop(next(iter(self._updates)))

    def on_report(self, view: "JobMirror", report: m.ShardReport, worker: str) -> None:
        """Take a copy of a report's adapter from its worker as soon as it is reported, beside its verification:
        the coordinator's keep request for it (before the verdict, IPIP-0006 §2.6.1) then finds it held, and
        the copy came over the worker's link, not the coordinator's (at 80 ms and 20 Mbit/s, the copies of a
        round's adapters through the coordinator's one link were most of its verification, issue 24). One try;
        the keep request and the verdict ask again (``keep_once`` fetches a CID once at a time)."""
        if view.terms.submitter != self.local.peer_id:
            return

        async def prefetch() -> None:
            try:  # bounded, from the worker only: a keep request waiting on this copy waits at most that long
                await self.keep_once(view, report.adapter_cid, worker, timeout=REPORT_PREFETCH_SECONDS, use_dht=False)
                self.local.counters["reports_copied_ahead"] += 1
            except Exception as exc:  # noqa: BLE001 - a head start only: the keep request asks again
                log.info("job %s: report %s not copied ahead from its worker: %s", view.job_id.hex()[:8],
                         report.adapter_cid[:24], exc)

        self.tasks.spawn_in_job(view.job_id, prefetch)

    def on_verdict(self, view: "JobMirror", verdict: m.Verdict) -> None:
        """Keep a copy of every accepted adapter of our job, so no accepted work is lost with its worker."""
        if verdict.accepted and view.terms.submitter == self.local.peer_id:
            report, worker = view.reports.get(m.attempt_of(verdict), (None, None))
            if report is not None:
                self.tasks.spawn(self._keep, view, report.adapter_cid, worker)

    def kept_path(self, view: "JobMirror", cid: str) -> Path:
        """Where our copy of accepted work ``cid`` of the job lies once we hold it."""
        return self.local.work_dir / view.job_id.hex()[:16] / "accepted" / f"{cid}.tar"

    def not_held(self, view: "JobMirror") -> list[dict]:
        """Accepted adapters and aggregates of our job of which we hold no copy yet (``job show``)."""
        if view.terms.submitter != self.local.peer_id:
            return []
        out = []
        for (rnd, shard, attempt), verdict in sorted(view.verdicts.items()):
            report, worker = view.reports.get((rnd, shard, attempt), (None, None))
            if verdict.accepted and report is not None and not self.kept_path(view, report.adapter_cid).exists():
                out.append({"kind": "adapter", "round": rnd, "shard": shard, "attempt": attempt,
                            "cid": report.adapter_cid, "provider": worker})
        for rnd, published in sorted(view.aggregates.items()):
            if not self.kept_path(view, published.adapter_cid).exists():
                out.append({"kind": "aggregate", "round": rnd, "cid": published.adapter_cid,
                            "provider": None})  # its coordinator is not recorded: the DHT names providers
        return out

    async def keep_once(self, view: "JobMirror", cid: str, provider: str | None, *, timeout: float | None = None,
                        use_dht: bool = True) -> None:
        """One try to fetch accepted work ``cid`` (from ``provider`` first, then, ``use_dht``, the DHT's providers)
        into ``kept_path`` within ``timeout`` (the agent's fetch timeout), and provide it; raises why it failed.
        (A coordinator asks this of us before it publishes an aggregate: agent/roles/keep.py.)"""
        out, key = self.kept_path(view, cid), (view.job_id, cid)
        lock = self._keep_locks.setdefault(key, trio.Lock())  # one fetch of a CID at a time: the other waits
        try:
            async with lock:
                if out.exists():
                    return
                out.parent.mkdir(parents=True, exist_ok=True)
                swarm, update = self._swarms.pop((view.job_id, cid), ()), self._updates.pop((view.job_id, cid), None)
                if update is not None and provider:  # rebuilt from its update onto the round's start we keep
                    rebuilt = await fetch_coded(self.blocks.content, view.terms, cid=cid, update_cid=update[0],
                                                base_cid=update[1], out=out, providers=[provider], swarm=swarm,
                                                timeout=timeout or self.local.config.fetch_timeout,
                                                work=out.with_name(f".{out.name}.rebuild"))
                    self.local.counters["aggregates_rebuilt" if rebuilt else "aggregates_not_rebuilt"] += 1
                    if rebuilt:
                        self.blocks.provide_soon(cid)
                        return
                    swarm = ()  # the others fetch the update, not the whole
                report = await self.blocks.content.fetch(
                    cid, out, timeout=timeout or self.local.config.fetch_timeout,
                    providers=[provider] if provider else [], use_dht=use_dht,
                    max_size=bundle_size_bound(4 << 30, AGGREGATE_FILES), swarm=swarm)
                if report.swarm is not None:
                    self.local.counters["aggregates_fetched_together"] += 1
                self.blocks.provide_soon(cid)
        finally:
            if not lock.statistics().tasks_waiting:
                self._keep_locks.pop(key, None)

    async def _keep(self, view: "JobMirror", cid: str, provider: str | None) -> None:
        """Fetch accepted work ``cid`` into ``kept_path`` and provide it; tried again until held."""
        key = (view.job_id, cid)
        if key in self._keeping:
            return
        self._keeping.add(key)
        out, tries = self.kept_path(view, cid), 0
        try:
            while not out.exists():
                tries += 1
                try:
                    await self.keep_once(view, cid, provider)
                    if tries > 1:
                        log.info("job %s: kept accepted work %s (try %d)", view.job_id.hex()[:8], cid, tries)
                    return
                except Exception as exc:  # noqa: BLE001 - logged and tried again; the worker still holds it
                    ended = view.state.phase.value in ("FAILED", "CANCELLED")
                    if ended or getattr(exc, "refused", False) or tries > len(self.keep_retry_delays):
                        log.warning("job %s: could not keep accepted work %s after %d tries, giving up: %s",
                                    view.job_id.hex()[:8], cid, tries, exc)
                        return
                    delay = self.keep_retry_delays[tries - 1]
                    log.warning("job %s: could not keep accepted work %s (try %d), again in %.0f s: %s",
                                view.job_id.hex()[:8], cid, tries, delay, exc)
                    await trio.sleep(delay)
        finally:
            self._keeping.discard(key)

    async def cancel(self, view: "JobMirror", reason: str) -> None:
        await self.evidence.publish(m.JobCancel(view.job_id, reason))
        await self.evidence.commit(view, view.cancel(reason, self.local.clock()))


