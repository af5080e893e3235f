"""The clock of the jobs we follow: elections, the state machines' timers, rebuilds, taking a job over.

Rules of this file:
- Twice a second every followed job gets one ``tick``: its election view moves (``update_election``),
  what its mirror held for a term is tried again when the view moved, the state machine's clock runs
  (``JobMirror.tick``: leases expire, rounds time out), a job we coordinate ends the leases of holders we no
  longer hear (``CoordinatorRole.revoke_silent``), and what that caused is committed through the
  agent's one ``commit`` (agent/node.py).
- Election view: a job's coordinator is elected once the job has been known for ``grace_seconds`` (so
  that peers whose views converged agree on term 1), and stays until it falls silent; then the next
  peer by rendezvous takes the job with term + 1 (protocol/election.keep_or_elect). The view moves only
  while we hear the job's submitter (in a partition the submitter's side decides), and the first one
  waits up to ``FIRST_VIEW_WAIT`` s more for the capability of every live peer.
- We act as a job's coordinator only while our own view says so (``is_coordinator``); the tick that
  first finds us so hands the job to the coordinator role (``take_over``), and the role judges the
  coordinator's own reports when we are their judge.
- A mirror that diverged or stalled (protocol/resync.py ``needs_resync``, ``stalled``) is rebuilt from
  its submitter's history; the submitter asks its live peers what it missed instead. A mirror that holds
  worker messages it cannot apply (``repair_sources``) asks their signers for their history
  (agent/roles/sync.py ``repair``), when the operator turned that on (``repair_from_senders``). At most
  one of these per job per ``RESYNC_INTERVAL``, one at a time.
  A rebuild that leaves us coordinator resumes the pending work (``CoordinatorRole.resume``); one that holds a
  live lease to us has our worker train it (``WorkerRole.take_leases``): it came in the history, not as a live
  message, so nothing else would start it before it ran out.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Awaitable, Callable, Mapping

import trio

from agent.store import StoreFullError
from protocol import messages as m
from protocol.election import UNCLAIMED_FACTOR, depose_unclaimed, keep_or_elect
from protocol.resync import RESYNC_INTERVAL, needs_resync, repair_sources, stalled

if TYPE_CHECKING:
    from agent.peers import PeerTable
    from agent.roles.sync import JobSync
    from agent.roles.coordinator import CoordinatorRole
    from agent.tasks import Tasks
    from protocol.mirror import JobMirror, Outcome

log = logging.getLogger(__name__)

FIRST_VIEW_WAIT = 5.0  # seconds past the grace a job's first election view waits for live peers' capabilities
TICK = 0.5  # seconds between two ticks of every job


class JobClock:
    """Elections, ticks and rebuilds of the jobs in ``jobs`` (our live mirrors, agent/jobbook.py)."""

    def __init__(self, peer_id: str, clock: Callable[[], float], peers: "PeerTable",
                 jobs: Mapping[bytes, "JobMirror"], tasks: "Tasks", coordinator: "CoordinatorRole", sync: "JobSync", *,
                 commit: Callable[["JobMirror", "Outcome"], Awaitable[bool]],
                 ledger: Callable[[bytes, str, dict], None], refuse_work: Callable[[Exception], None],
                 repair: bool = False, rebuilt: Callable[["JobMirror"], None] = lambda view: None) -> None:
        self.peer_id, self.clock = peer_id, clock
        self.peers, self.jobs, self.tasks, self.coordinator, self.sync = peers, jobs, tasks, coordinator, sync
        self.commit, self.ledger, self.refuse_work = commit, ledger, refuse_work
        self.repair = repair  # the operator's repair_from_senders (IPIP-0004 §11.1)
        self.rebuilt = rebuilt  # a mirror changed by a rebuild or repair: our worker takes a lease to us it brought
        self.coordinating: set[bytes] = set()  # jobs whose pending work we took over as coordinator
        self.resyncing: set[bytes] = set()  # jobs whose mirror is being rebuilt
        self.last_resync: dict[bytes, float] = {}
        # per job: the (term, coordinator) our view named at the last tick, and since when (rule 10's clock)
        self.named: dict[bytes, tuple[tuple[int, str | None], float]] = {}

    def forget(self, job_id: bytes) -> None:
        self.last_resync.pop(job_id, None)
        self.named.pop(job_id, None)
        self.coordinating.discard(job_id)

    # -- the election ------------------------------------------------------------------------------

    def update_election(self, view: "JobMirror", now: float) -> None:
        """Elect after the grace period; replace a coordinator that fell silent (term + 1). The first view
        also waits (at most ``FIRST_VIEW_WAIT`` s more) for the capability of every live peer: a peer whose
        capability we lack is not eligible in our view, and two peers that each lacked the other's both
        elected themselves in term 1 (the CLI job test under load; IPIP-0006 §1.3 rule 8 resolves it)."""
        if now - view.first_seen < self.grace_seconds or view.state.terminal:
            return
        if view.coordination.term == 0 and now - view.first_seen < self.grace_seconds + FIRST_VIEW_WAIT and \
                any(self.peers.capability_of(p) is None for p in self.peers.live_peers()):
            return
        if not self.peers.hears_submitter(view, settled=True):
            return  # cut off from the submitter (or just back): its side decides; we wait
        before = view.coordination
        eligible = self.peers.eligible_coordinators(view.terms)
        view.coordination = keep_or_elect(before, eligible)
        named, named_at = self.named.get(view.job_id, (None, now))
        if named != (before.term, before.coordinator):  # (our view named it just now, or another way: a message)
            named_at = now
        if view.coordination == before:  # live and eligible, but does it act? (IPIP-0006 §1.3 rule 10)
            view.coordination = depose_unclaimed(before, eligible, self.peer_id, named_at,
                                                 view.claimed_at(before.coordinator, before.term) if before.coordinator
                                                 else None, now,
                                                 UNCLAIMED_FACTOR * self.peers.silence)
            if view.coordination != before:
                log.warning("job %s: coordinator %s is live but has not claimed term %d for %.0f s; %s takes over "
                            "in term %d", view.job_id.hex()[:8], (before.coordinator or "")[-8:], before.term,
                            now - named_at, (view.coordination.coordinator or "none")[-8:], view.coordination.term)
        elif before.coordinator is not None and view.coordination.coordinator != before.coordinator:
            log.info("job %s: coordinator %s went silent; %s takes over in term %d",
                     view.job_id.hex()[:8], before.coordinator[-8:], (view.coordination.coordinator or "none")[-8:],
                     view.coordination.term)
        self.named[view.job_id] = ((view.coordination.term, view.coordination.coordinator),
                                   named_at if view.coordination == before else now)
        if view.coordination != before and before.coordinator is not None:
            self.ledger(view.job_id, "coordinator", {"term": view.coordination.term,
                                                     "coordinator": view.coordination.coordinator or ""})

    @property
    def grace_seconds(self) -> float:
        """How long a job is known before its election view moves: the peer table's (one copy of the setting)."""
        return self.peers.grace_seconds

    def is_coordinator(self, view: "JobMirror") -> bool:
        """Do we act as the job's coordinator now? (agent/peers.py ``PeerTable.is_coordinator``)"""
        return self.peers.is_coordinator(view)

    def coordinating_terms(self) -> list[m.CoordinatorTerm]:
        """The jobs we coordinate now, for our heartbeats."""
        return [m.CoordinatorTerm(v.job_id, v.coordination.term) for v in self.jobs.values()
                if self.is_coordinator(v) and not v.state.terminal]

    # -- the ticks -----------------------------------------------------------------------------------

    async def run(self, each_round: Callable[[], None] = lambda: None) -> None:
        """Tick every followed job every ``TICK`` seconds; ``each_round`` after each pass."""
        while True:
            now = self.clock()
            for view in list(self.jobs.values()):
                await self.tick_job(view, now)
            each_round()
            await trio.sleep(TICK)

    async def tick_job(self, view: "JobMirror", now: float) -> None:
        """One tick of a job: the election, the state machine's clock, a rebuild if the mirror diverged,
        taking the job over when we were just elected, judging the coordinator's own reports."""
        before = view.coordination
        self.update_election(view, now)
        if view.coordination != before:
            await self._retry_held(view, now)
        await self.commit(view, view.tick(now))
        if view.job_id not in self.resyncing and now - self.last_resync.get(view.job_id, 0.0) > RESYNC_INTERVAL:
            sources: tuple[str, ...] | None = None
            if needs_resync(view, self.peers.eligible_coordinators(view.terms), now) or stalled(view, self.peer_id, now):
                sources = ()  # the submitter's history (or, for the submitter, its live peers')
            elif self.repair:
                sources = repair_sources(view, now) or None  # held worker messages: their signers'
            if sources is not None:
                self.last_resync[view.job_id] = now
                view.resynced_at = now  # (protocol/resync.py: only what is held after this counts)
                self.resyncing.add(view.job_id)
                self.tasks.one_shot(f"job {view.job_id.hex()[:8]}: {'repair' if sources else 'resync'}",
                                    self._fetch_history, view, sources)
        if not self.is_coordinator(view):
            self.coordinating.discard(view.job_id)
        elif view.job_id not in self.coordinating:  # newly elected, or resumed after a restart
            self.coordinating.add(view.job_id)
            self.coordinator.take_over(view)
        self.coordinator.judge_reports(view)  # the coordinator's own reports, if we are their judge
        self.coordinator.grant_heard(view, now)  # claims from peers we had not heard yet, heard now
        await self.coordinator.revoke_silent(view, now)  # leases whose holder fell silent (IPIP-0004 §5.3)

    async def _retry_held(self, view: "JobMirror", now: float) -> None:
        """Our view of the job's term moved (an election tick, a coordinator's heartbeat): the messages
        held for that term may apply now -- e.g. the judge's verdict on our own report, which reached us
        before our own tick made us the coordinator (IPIP-0006 §1.3 rule 6); held until another message
        applied, it left our mirror a round behind the submitter's and the round never aggregated."""
        if view.pending:
            await self.commit(view, view.retry(now, self.peers.eligible_coordinators(view.terms)))

    # -- rebuilds ------------------------------------------------------------------------------------

    async def _fetch_history(self, view: "JobMirror", sources: tuple[str, ...]) -> None:
        """Rebuild the mirror from the submitter's history (no ``sources``; the submitter itself asks its live
        peers), or repair it from ``sources``' (agent/roles/sync.py). If that changed it and we coordinate the
        job, the pending work (whose actions the history's replay gave nobody) is resumed: verify, aggregate."""
        try:
            if sources:
                changed = bool(await self.sync.repair(view, sources))
            elif view.terms.submitter == self.peer_id:  # our history is the reference: ask peers what we missed
                await self.sync.submitter_catch_up(view)
                changed = False
            else:  # (held live messages that apply on the rebuilt mirror are committed)
                changed = await self.sync.resync(view)
            if changed and self.is_coordinator(view) and view.job_id in self.coordinating:
                self.coordinator.resume(view)
            if changed:
                self.rebuilt(view)
        except StoreFullError as exc:
            self.refuse_work(exc)
        finally:
            self.resyncing.discard(view.job_id)
