"""The job mirror: one peer's copy of a job, fed by the signed messages it sees on the job's topic,
and the only door to it (issue 23). It does no I/O, like h11's ``Connection``: events in, an ``Outcome``
out, and what the outcome asks for is the caller's to carry out, in one order (agent/evidence.py ``Evidence.commit``:
store the evidence, publish what goes out, then act).

The doors, each returning an ``Outcome`` (``actions``: what the state machine asks for, None when
nothing changed; ``applied``: the messages that changed the mirror, in order, with their signers, for
the caller's reactions; ``evidence``: their envelopes, to store in that order; ``outgoing``: our own
decision's envelope, to publish once stored):

- ``receive``: a verified message of the job's topic from the network (anyone's, ours echoed back);
- ``decide``: our own decision as a coordinator (a lease, a verdict, an aggregate), applied and kept
  as evidence when we make it, before it is published: a crash after the publish loses nothing of it
  (its echo is then ignored); ``lease_for`` offers the lease the state machine would grant;
- ``replay``: a message accepted earlier (our store after a restart, the submitter's history);
- ``tick`` (timers), ``cancel`` (the submitter's cancel), ``observe_term`` (a coordinator's term heard
  in a heartbeat), ``retry`` (held messages again) and ``adopt`` (take the state of a mirror rebuilt
  from the submitter's history, keeping what live messages are still held).

Every limit of the mirror is here: ``PENDING_MAX``, ``PENDING_PER_SIGNER``, ``PENDING_SECONDS`` and the
checkpoint cap read off the terms (protocol/proof.max_checkpoints). ``agent/harness/sim.py`` drives this
class too, so the simulator's figures are about this code.

Rules of this file:
- Every peer that follows a job keeps the same mirror: the protocol state machine
  (protocol/state.py) driven by the job topic's messages, plus the messages themselves. The
  coordinator's own decisions are applied when it makes them; every other peer applies them when
  they arrive. So a successor coordinator already holds the job's state when it takes over.
- Worker messages (``ckpt``, ``report``, ``release``) are applied by everyone. Coordinator
  messages (``lease``, ``revoke``, ``verdict``, ``aggregate``) only when their signer and term pass the
  election view (protocol/election.py); echoes of our own decisions are skipped. A verdict signed
  by the worker it judges is never applied; one on the coordinator's own report is applied from
  another eligible peer in the coordinator's term (``election.may_judge``).
- A lease holder commits at most ``JobConfig.max_checkpoints`` checkpoints per attempt (read off the
  terms: protocol/proof.max_checkpoints; IPIP-0004 §5.2). The state machine refuses the ones past it; they are
  counted (``refused["checkpoint-cap"]``), never held, never stored.
- A message the state machine refuses (StateError) is never raised: it is untrusted input. It is
  held (at most ``PENDING_MAX``, for ``PENDING_SECONDS``) and tried again after every message that
  does apply, because gossip keeps no order: a lease for attempt 2 may arrive before the release
  or verdict that reopened the shard, a report before the lease it answers. Duplicates and
  forgeries simply stay refused until they expire. What is held is bounded per signer
  (``PENDING_PER_SIGNER``), and when the whole is full the held messages of peers the job does not
  know (not an eligible coordinator, not its submitter, no lease) go first: many identities each
  under the rate limit cannot push a held verdict out. No I/O here.
- Evidence. ``receive``, ``decide`` and ``replay`` take the message's envelope bytes; an outcome's
  ``evidence`` holds the envelopes of the messages that applied, in the order they applied (a held one
  when it finally does): the store holds what changed the mirror, in that order, so a replay of it (a
  restart, another peer's catch-up from us) rebuilds the same mirror, and refused junk is never
  written to disk. Our own decisions are evidence when we make them (``decide``), never from their echo.
- Earlier terms (IPIP-0006 §1.3 rule 7): a verdict of a term before the view's is applied when
  ``election.may_apply_past_verdict`` allows it (its signer held that term in our view, or our view
  skipped that term); it never moves the view. In a history our view's coordinator serves to us as
  the submitter catching up (``receive(history=True, vouched=True)``), a lease, aggregate or verdict of
  an earlier term applies under rule 9 (``election.may_apply_vouched_past``): its signer may be gone.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

from protocol import messages as m
from protocol import state as st
from protocol.election import SILENCE_SECONDS, Coordination, may_apply_past_verdict, may_apply_vouched_past, \
    may_judge, settle_replayed_term
from protocol.errors import StateError
from protocol.proof import max_checkpoints

log = logging.getLogger(__name__)

Key = m.ShardAttempt  # (round, shard, attempt)
DECISIONS = (m.ShardLease, m.ShardRevoke, m.Verdict, m.AggregatePublished)  # a coordinator's messages
PENDING_MAX = 256
PENDING_PER_SIGNER = 32  # held messages of one signer; its oldest goes first
PENDING_SECONDS = 300.0  # an envelope's acceptance window (IPIP-0001)


def job_config(terms: m.JobTerms) -> st.JobConfig:
    """The state machine's settings, read off the announced terms (deadline 0 = none)."""
    return st.JobConfig(
        shards=len(terms.shards), rounds=terms.rounds, lease_seconds=float(terms.lease_seconds),
        max_retries=terms.max_retries, min_accepted_fraction=terms.min_accepted_fraction,
        deadline=float(terms.deadline) if terms.deadline else None, stop_early=terms.stop is not None,
        max_checkpoints=max_checkpoints(terms),
    )


@dataclass(frozen=True)
class Outcome:
    """What one event did to a mirror, for its caller to carry out in this order: store ``evidence``
    (one transaction), publish ``outgoing``, then carry out ``actions`` and react to ``applied``."""

    actions: tuple[Any, ...] | None = None  # the state machine's actions; None: nothing changed
    applied: tuple[tuple[Any, str], ...] = ()  # (message, signer) that changed the mirror, in order
    evidence: tuple[bytes, ...] = ()  # the envelopes of those (where known), in the same order
    outgoing: bytes | None = None  # our own decision's envelope, to publish once the evidence is stored

    @property
    def changed(self) -> bool:
        return self.actions is not None

    @staticmethod
    def join(outcomes: "list[Outcome]") -> "Outcome":
        """Many outcomes as one, in order (linear in their size: for a history of thousands)."""
        actions: list[Any] | None = None
        applied: list[tuple[Any, str]] = []
        evidence: list[bytes] = []
        outgoing = None
        for o in outcomes:
            if o.actions is not None:
                actions = [] if actions is None else actions
                actions.extend(o.actions)
            applied.extend(o.applied)
            evidence.extend(o.evidence)
            outgoing = o.outgoing if o.outgoing is not None else outgoing
        return Outcome(None if actions is None else tuple(actions), tuple(applied), tuple(evidence), outgoing)



@dataclass
class JobMirror:
    terms: m.JobTerms
    first_seen: float
    me: str
    state: st.JobState = field(init=False)
    coordination: Coordination = field(init=False)
    leases: dict[Key, m.ShardLease] = field(default_factory=dict)
    commits: dict[Key, list[m.CheckpointCommit]] = field(default_factory=lambda: defaultdict(list))
    reports: dict[Key, tuple[m.ShardReport, str]] = field(default_factory=dict)
    verdicts: dict[Key, m.Verdict] = field(default_factory=dict)
    revocations: dict[Key, m.ShardRevoke] = field(default_factory=dict)  # leases ended: their holder fell silent
    aggregates: dict[int, m.AggregatePublished] = field(default_factory=dict)
    refused: Counter = field(default_factory=Counter)
    # (first seen, message, signer, envelope bytes or None)
    pending: list[tuple[float, Any, str, bytes | None]] = field(default_factory=list)
    resynced_at: float | None = None  # when a rebuild from history last started (the agent's resync rule)
    # catching up on the job's history (a restart, a late join): our view of the term may be behind, so
    # we do not act as its coordinator until it is done (the agent's is_coordinator)
    catching_up: bool = False
    last_applied: float = 0.0  # when a message last applied (a stalled mirror asks peers)
    # when each lease, report and aggregate applied here ("lease"/"report", key) / ("aggregate", round):
    # live, our clock; rebuilt from the store or a peer's history, the envelope's signed time
    applied_at: dict[tuple[str, Any], float] = field(default_factory=dict)
    # the latest term each peer claimed to coordinate the job in, and when we heard it (heartbeats,
    # ``observe_term``): a live coordinator that does not claim our view's term is deposed (IPIP-0006 §1.3 rule 10)
    claims: dict[str, tuple[int, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._replaying = False
        self._vouched = False  # receiving a history our view's coordinator vouches for (``receive``)
        self._applied: list[tuple[Any, str]] = []  # applied since the last outcome was collected
        self._evidence: list[bytes] = []  # envelopes of those, in the order they applied
        # (term, signer, worker judged) while our view's term was taken from a replayed verdict: its signer
        # may be the term's judge, not its coordinator (see _settle_term)
        self.term_from_verdict: tuple[int, str, str] | None = None
        self.job_id = self.terms.job_id()
        self.last_applied = self.first_seen
        self.state = st.new_job(job_config(self.terms))
        self.coordination = Coordination(self.job_id)

    # -- the state machine ---------------------------------------------------------------------

    def ends_with(self, rnd: int, validation_loss: float | None) -> bool:
        """Whether round ``rnd``'s aggregate, scored ``validation_loss``, must be the final one."""
        from protocol.schedule import is_final

        losses = [self.aggregates[r].validation_loss if r in self.aggregates else None for r in range(1, rnd)]
        stop = self.terms.stop
        return is_final(self.terms.rounds, stop.validation_loss_below if stop else 0.0,
                        stop.patience_rounds if stop else 0, losses + [validation_loss])

    def _step(self, event: Any, now: float, *, count: bool = True) -> tuple[Any, ...] | None:
        """Apply ``event``; return the actions, or None if the machine refused it."""
        try:
            self.state, actions = st.step(self.state, event, now)
        except StateError as exc:
            if count:
                self.refused[type(event).__name__] += 1
            log.debug("job %s: refused %s: %s", self.job_id.hex()[:8], event, exc)
            return None
        return actions

    def shard(self, index: int) -> st.ShardState:
        return self.state.shards[index]

    def open_shards(self) -> list[int]:
        return [s.index for s in self.state.shards if s.phase is st.ShardPhase.OPEN]

    def training_by(self, worker: str) -> list[st.ShardState]:
        """Shards ``worker`` holds a live lease on (not those it reported and awaits a verdict for)."""
        return [s for s in self.state.shards if s.worker == worker and s.phase is st.ShardPhase.LEASED]

    def held_by(self, worker: str) -> list[st.ShardState]:
        busy = (st.ShardPhase.LEASED, st.ShardPhase.REPORTED)
        return [s for s in self.state.shards if s.worker == worker and s.phase in busy]

    def current_key(self, index: int) -> Key:
        s = self.shard(index)
        return (self.state.round, index, s.attempt)

    # -- the doors: every change of the mirror goes through one of these, and returns its Outcome --------

    def _collect(self, actions: tuple[Any, ...] | None, outgoing: bytes | None = None) -> Outcome:
        """The outcome of one door: ``actions`` and what applied (and its evidence) since the last one."""
        applied, evidence = tuple(self._applied), tuple(self._evidence)
        self._applied, self._evidence = [], []
        if actions is None and applied:
            actions = ()
        return Outcome(actions, applied, evidence, outgoing)

    def receive(self, msg: Any, signer: str, now: float, eligible: frozenset[str],
                envelope: bytes | None = None, *, history: bool = False, vouched: bool = False) -> Outcome:
        """One verified job-topic message from the network (``eligible``: the job's live coordinators in
        our view); a refused one is held for a later try. The echo of our own decision is never applied
        again (``decide`` applied and kept it). ``history``: a message a peer stored, received at its
        signed time ``now`` (a submitter catching up): the held live messages are not tried at that past
        time (a held lease would start its clock then and expire early, found by the simulator); the
        caller tries them once at the real now (``retry``). ``vouched`` (with ``history``): the history is
        our view's coordinator's, so a decision of an earlier term applies under IPIP-0006 §1.3 rule 9
        (``election.may_apply_vouched_past``: its signer may be gone) instead of being stale."""
        self._vouched = history and vouched
        try:
            return self._collect(self._apply(msg, signer, now, eligible, envelope, retry=not history))
        finally:
            self._vouched = False

    def lease_for(self, shard: int, worker: str, now: float) -> m.ShardLease | None:
        """The lease the state machine would grant ``worker`` on ``shard`` now, in our term (None: none
        may be granted); nothing changes until it is ``decide``d."""
        try:
            _, actions = st.step(self.state, st.LeaseGranted(self.state.round, shard, worker), now)
        except StateError:
            return None
        grant = next((a for a in actions if isinstance(a, st.PublishLease)), None)
        if grant is None:
            return None
        initial = self.state.published[-1] if self.state.round > 1 and self.state.published else None
        return m.ShardLease(self.job_id, grant.round, grant.shard, grant.attempt, worker, self.coordination.term,
                            float(grant.expires_at), initial)

    def decide(self, msg: Any, now: float, envelope: bytes) -> Outcome:
        """Our own decision as the job's coordinator (or judge): applied now, its ``envelope`` (our signed
        copy of ``msg``) the outcome's evidence and ``outgoing``. Refused (nothing to store or publish):
        the mirror moved on meanwhile (the shard was settled, the round ended, we were deposed)."""
        actions = self._apply_decision(msg, now)
        if actions is None:
            return self._collect(None)
        self._applied.append((msg, self.me))
        self._evidence.append(envelope)
        return self._collect(actions, envelope)

    def replay(self, msg: Any, signer: str, at: float, envelope: bytes | None = None) -> Outcome:
        """A message accepted earlier (our store after a restart, the submitter's history): its signer
        is believed at its term, as it was when the message was accepted, and our own decisions are
        applied as when we made them."""
        return self._collect(self._replay(msg, signer, at, envelope))

    def retry(self, now: float, eligible: frozenset[str]) -> Outcome:
        """The held messages tried again (those past PENDING_SECONDS dropped)."""
        actions = self._retry_pending(now, eligible)
        return self._collect(actions if self._applied else None)

    def observe_term(self, signer: str, term: int, now: float, eligible: frozenset[str]) -> Outcome:
        """A coordinator's term heard outside the job's topic (its heartbeat): our election view may move
        to it, and what was held for that term may apply now -- also when our own coordinator claims a lower
        term than our view's, newly: its decisions held as stale apply in that term (IPIP-0006 §1.3 rule 11)."""
        previous = self.claims.get(signer)
        self.claims[signer] = (term, now)
        before = self.coordination
        self._check_coordinator(signer, term, eligible, now=now)
        renumbered = signer == before.coordinator and term < before.term and (previous is None or previous[0] != term)
        if self.coordination == before and not (renumbered and self.pending):
            return Outcome()
        return self.retry(now, eligible)

    def claimed_at(self, peer: str, term: int) -> float | None:
        """When ``peer`` last claimed to coordinate the job in ``term`` or a later one, or, when it is our view's
        coordinator, in any term (a lower one is its tenure counted lower, whose decisions apply: IPIP-0006 §1.3
        rule 11, so for rule 10 it acts) (None: not heard)."""
        claim = self.claims.get(peer)
        if claim is None:
            return None
        return claim[1] if claim[0] >= term or peer == self.coordination.coordinator else None

    def _claimed(self, peer: str | None, now: float) -> int | None:
        """The term ``peer`` claims to coordinate the job in, by its latest heartbeat, heard within the protocol's
        silence window before ``now`` (None: none heard then; a peer that stopped claiming claims nothing)."""
        claim = self.claims.get(peer) if peer is not None else None
        return claim[0] if claim is not None and now - claim[1] <= SILENCE_SECONDS else None

    def tick(self, now: float) -> Outcome:
        """The timers due at ``now`` (leases, windows, the deadline); held messages past their
        ``PENDING_SECONDS`` are dropped (a mirror to which nothing applies would hold them for hours)."""
        kept = [p for p in self.pending if now - p[0] <= PENDING_SECONDS]
        if len(kept) != len(self.pending):
            self.refused["pending-expired"] += len(self.pending) - len(kept)
            self.pending = kept
        return self._collect(self._step(st.Tick(), now))

    def cancel(self, reason: str, now: float) -> Outcome:
        """The submitter cancels the job."""
        return self._collect(self._step(st.Cancel(reason), now))

    def adopt(self, fresh: "JobMirror", history: Outcome, now: float, eligible: frozenset[str]) -> Outcome:
        """Take the state of ``fresh``, this job's mirror rebuilt from the submitter's history (the
        submitter's record wins even with a lower term: decisions count only on its side, IPIP-0006
        §1.3, so a higher term it never saw was ours alone); ``history``: the outcomes of ``fresh``'s
        replays, added up. Still-held live messages may apply on it, except our own and decisions of a
        term before its. The outcome's evidence is the history's, then what applied here (so the store
        holds what the rebuilt mirror holds)."""
        for name in ("state", "coordination", "term_from_verdict", "leases", "commits", "reports", "verdicts",
                     "revocations", "aggregates"):
            setattr(self, name, getattr(fresh, name))
        term = self.coordination.term
        self.pending = [p for p in self.pending if p[2] != self.me and getattr(p[1], "term", term) >= term]
        self._applied, self._evidence = [], list(history.evidence)
        actions = self._retry_pending(now, eligible)
        return self._collect(actions)

    # -- applying messages -----------------------------------------------------------------------

    def _check_coordinator(self, signer: str, term: int, eligible: frozenset[str], now: float, *, adopt: bool = True,
                          judged: str | None = None) -> bool:
        """Does a coordinator message from ``signer`` in ``term`` pass our election view? (``adopt=False``
        for live verdicts: they never move the view to a higher term, IPIP-0006 §1.3 rule 6.) ``judged``:
        the worker, when the message is a verdict (a term taken from one is provisional: ``_settle_term``)."""
        before = self.coordination
        try:
            self.coordination = before.check_message(signer, term, eligible, adopt=adopt,
                                                     claimed=self._claimed(signer, now))
        except StateError as exc:
            self.refused["coordinator"] += 1
            log.debug("job %s: ignored coordinator message: %s", self.job_id.hex()[:8], exc)
            return False
        if self.coordination.term != before.term:
            self.term_from_verdict = (term, signer, judged) if judged is not None else None
        elif self.coordination.coordinator != before.coordinator:
            log.info("job %s: %s and %s both claimed term %d; %s ranks first and coordinates it (IPIP-0006 §1.3 "
                     "rule 8)", self.job_id.hex()[:8], (before.coordinator or "?")[-8:], signer[-8:], term, signer[-8:])
        return True

    def _settle_term(self, msg: Any, signer: str, eligible: frozenset[str]) -> None:
        """Replayed history believes a verdict's higher term and takes its signer for the term's
        coordinator; but a verdict that opens its term in a history may be the term's *judge's* (its
        coordinator held a report of its own, rule 6, and had decided nothing yet). So a term taken from
        a verdict is provisional until one of the two peers of that verdict decides again in the term:
        protocol/election.settle_replayed_term (IPIP-0006 §1.3 rule 6)."""
        provisional = self.term_from_verdict
        if provisional is None or getattr(msg, "term", None) != provisional[0] or \
                self.coordination.term != provisional[0] or self.coordination.coordinator != provisional[1]:
            return
        term, first, judged = provisional
        if signer == judged and signer not in eligible:
            return
        coordinator = settle_replayed_term(self.job_id, first, judged, signer, _judged(msg))
        if coordinator is None:
            return
        self.term_from_verdict = None
        if coordinator != first:
            self.coordination = replace(self.coordination, coordinator=coordinator)
            log.info("job %s: term %d is %s's; %s judged its own report (IPIP-0006 §1.3 rule 6)",
                     self.job_id.hex()[:8], term, coordinator[-8:], first[-8:])

    def _apply(self, msg: Any, signer: str, now: float, eligible: frozenset[str],
               envelope: bytes | None = None, *, retry: bool = True) -> tuple[Any, ...] | None:
        """Apply one verified job-topic message, then any held message it unblocks; return the actions
        (None if this message was refused — it is then held for a later try). ``envelope``: its bytes,
        kept in ``evidence`` once it applies."""
        before = self.coordination
        actions = self._apply_one(msg, signer, now, eligible)
        if actions is None:
            if isinstance(msg, m.CheckpointCommit) and self._checkpoints_spent(msg):
                return None  # past the attempt's cap: it will never apply, so it is not held either
            if signer != self.me or not isinstance(msg, DECISIONS):
                self._hold(now, msg, signer, envelope, eligible)  # (echoes of our own decisions never are)
            if retry and self.coordination != before:  # it moved our view to its term: what waited may apply
                more = self._retry_pending(now, eligible)
                return more if self._applied else None
            return None
        self._applied.append((msg, signer))
        self.last_applied = max(self.last_applied, now)
        if envelope is not None:
            self._evidence.append(envelope)
        if self.pending:  # a copy held earlier (a catch-up's first pass) can never apply now: not kept
            self.pending = [p for p in self.pending if p[2] != signer or p[1] != msg]
        return actions + self._retry_pending(now, eligible) if retry else actions

    def _hold(self, now: float, msg: Any, signer: str, envelope: bytes | None, eligible: frozenset[str]) -> None:
        """Hold a refused message for a later try, within the per-signer and total bounds (once)."""
        mine = [i for i, p in enumerate(self.pending) if p[2] == signer]
        if any(self.pending[i][1] == msg for i in mine):
            return  # already held (a catch-up brought it again)
        if len(mine) >= PENDING_PER_SIGNER:
            del self.pending[mine[0]]
            self.refused["pending-signer-quota"] += 1
        self.pending.append((now, msg, signer, envelope))
        if len(self.pending) > PENDING_MAX:
            known = set(eligible) | {self.terms.submitter} | {lease.worker for lease in self.leases.values()}
            strangers = [i for i, p in enumerate(self.pending) if p[2] not in known]
            del self.pending[strangers[0] if strangers else 0]
            self.refused["pending-overflow"] += 1

    def _checkpoints_spent(self, msg: m.CheckpointCommit) -> bool:
        """Has the attempt ``msg`` names committed all the checkpoints its terms allow (protocol/state.py)?"""
        return st.checkpoints_spent(self.state, msg.round, msg.shard, msg.attempt)

    def _replay(self, msg: Any, signer: str, at: float, envelope: bytes | None = None) -> tuple[Any, ...] | None:
        """Apply a message accepted earlier (our store after a restart, the submitter's history):
        its signer is believed at its term, as it was when the message was accepted, and our own
        decisions are applied as when we made them."""
        if isinstance(msg, m.ShardClaim):
            return None  # a request to the coordinator, not a change of the job
        own = None
        if signer == self.me and isinstance(msg, DECISIONS):
            self._settle_term(msg, signer, frozenset({signer}))  # (others' decisions settle it in _apply_one)
        if isinstance(msg, m.Verdict) and signer == self.me and \
                may_judge(self.coordination, signer, msg.worker, msg.term, frozenset({signer})):
            own = self._apply_decision(msg, at)  # we judged the coordinator's own work (IPIP-0006 §1.3)
        elif isinstance(msg, DECISIONS) and signer == self.me:
            if self._check_coordinator(signer, msg.term, frozenset({signer}), at, judged=_judged(msg)):
                own = self._apply_decision(msg, at)
        else:
            # history is believed as it was accepted: here a verdict's higher term is adopted (live, it
            # is not: its signer may be the judge, rule 6; replayed, it was the term's coordinator's
            # unless a judge's verdict is the first message of its term in the history)
            self._replaying = True
            try:
                return self._apply(msg, signer, at, frozenset({signer}), envelope)
            finally:
                self._replaying = False
        if own is not None:
            self._applied.append((msg, signer))
            if envelope is not None:
                self._evidence.append(envelope)
        return own

    def _retry_pending(self, now: float, eligible: frozenset[str]) -> tuple[Any, ...]:
        """Try the held messages again until none applies; drop those past PENDING_SECONDS."""
        out: list[Any] = []
        progress = True
        while progress and self.pending:
            progress = False
            keep = []
            for held in self.pending:
                seen, msg, signer, envelope = held
                if now - seen > PENDING_SECONDS:
                    continue
                actions = self._apply_one(msg, signer, now, eligible, count=False)
                if actions is None:
                    keep.append(held)
                else:
                    out.extend(actions)
                    self._applied.append((msg, signer))
                    self.last_applied = max(self.last_applied, now)
                    if envelope is not None:
                        self._evidence.append(envelope)
                    progress = True
            self.pending = keep
        return tuple(out)

    def _apply_one(self, msg: Any, signer: str, now: float, eligible: frozenset[str], *,
                   count: bool = True) -> tuple[Any, ...] | None:
        if isinstance(msg, m.CheckpointCommit):
            if self._checkpoints_spent(msg):
                if count:
                    self.refused["checkpoint-cap"] += 1
                return None
            actions = self._step(st.CheckpointSeen(msg.round, msg.shard, signer, msg.attempt), now, count=count)
            if actions is not None:
                self.commits[m.attempt_of(msg)].append(msg)
            return actions
        if isinstance(msg, m.ShardReport):
            actions = self._step(st.ReportReceived(msg.round, msg.shard, signer, msg.attempt), now, count=count)
            if actions is not None:
                self.reports[m.attempt_of(msg)] = (msg, signer)
                self.applied_at[("report", m.attempt_of(msg))] = now
            return actions
        if isinstance(msg, m.ShardRelease):
            return self._step(st.Released(msg.round, msg.shard, signer, msg.attempt,
                                           excused=msg.cause == m.RELEASE_LOCAL), now, count=count)
        if isinstance(msg, DECISIONS):
            self._settle_term(msg, signer, eligible)
        if isinstance(msg, m.Verdict) and (signer == msg.worker or may_judge(
                self.coordination, signer, msg.worker, msg.term, eligible,
                self._claimed(self.coordination.coordinator, now))):
            # a worker never judges itself; the coordinator's own work is judged by another peer
            if signer == msg.worker and count:
                self.refused["self-judged"] += 1
            if signer == msg.worker or signer == self.me:
                return None
            return self._apply_decision(msg, now, count=count)
        if isinstance(msg, m.Verdict) and signer != self.me and isinstance(msg.term, int) and \
                msg.term < self.coordination.term:
            # an earlier term's verdict (IPIP-0006 §1.3 rule 7): never moves the view
            lease = self.leases.get(m.attempt_of(msg))
            lease_term = None if lease is None else lease.term
            if not may_apply_past_verdict(self.coordination, signer, msg.worker, msg.term, lease_term, eligible,
                                          self._claimed(signer, now)) \
                    and not (self._vouched and may_apply_vouched_past(self.coordination, signer, msg.term, msg.worker,
                                                                      lease_term)):
                if count:
                    self.refused["coordinator"] += 1
                return None
            return self._apply_decision(msg, now, count=count)
        if isinstance(msg, DECISIONS) and self._vouched and signer != self.me and isinstance(msg.term, int) and \
                msg.term < self.coordination.term:
            # a lease or aggregate of an earlier term in our coordinator's history (rule 9): never moves the view
            if not may_apply_vouched_past(self.coordination, signer, msg.term):
                if count:
                    self.refused["coordinator"] += 1
                return None
            return self._apply_decision(msg, now, count=count)
        if isinstance(msg, DECISIONS):
            if signer == self.me or not self._check_coordinator(
                    signer, msg.term, eligible, now, adopt=self._replaying or not isinstance(msg, m.Verdict),
                    judged=_judged(msg)):
                return None
            return self._apply_decision(msg, now, count=count)
        return None

    def _apply_decision(self, msg: Any, now: float, *, count: bool = True) -> tuple[Any, ...] | None:
        """Apply a coordinator's decision (ours when we make it, or a verified one from the network)."""
        if isinstance(msg, m.ShardLease):
            # the lease must be the attempt this mirror would grant: a lease whose number differs means one
            # of the two missed a lease (IPIP-0004 §5, "A lease's attempt"). Applied anyway (as this
            # mirror's number), every report of its worker named another attempt and was refused for good:
            # the simulator's job stalled to its deadline. Refused, it is held: a mirror that missed the lease rebuilds
            # from the submitter's history (a held decision asks for it), and a coordinator that missed it
            # sees its lease expire unapplied and grants the number every other mirror expects.
            try:
                state, actions = st.step(self.state, st.LeaseGranted(msg.round, msg.shard, msg.worker), now)
            except StateError as exc:
                if count:
                    self.refused["ShardLease"] += 1
                log.debug("job %s: refused %s: %s", self.job_id.hex()[:8], msg, exc)
                return None
            granted = [a for a in actions if isinstance(a, st.PublishLease)]
            if granted and granted[0].attempt != msg.attempt:
                if count:
                    self.refused["lease-attempt"] += 1
                log.debug("job %s: lease of attempt %d refused: our mirror's next attempt is %d",
                          self.job_id.hex()[:8], msg.attempt, granted[0].attempt)
                return None
            self.state = state
            self.leases[m.attempt_of(msg)] = msg
            self.applied_at[("lease", m.attempt_of(msg))] = now
            return actions
        if isinstance(msg, m.ShardRevoke):
            actions = self._step(st.Revoked(msg.round, msg.shard, msg.worker, msg.attempt), now, count=count)
            if actions is not None:
                self.revocations[m.attempt_of(msg)] = msg
            return actions
        if isinstance(msg, m.Verdict):
            actions = self._step(st.VerdictGiven(msg.round, msg.shard, msg.attempt, msg.accepted, msg.reason), now,
                                count=count)
            if actions is not None:
                self.verdicts[m.attempt_of(msg)] = msg
            return actions
        if isinstance(msg, m.AggregatePublished):
            if msg.final != self.ends_with(msg.round, msg.validation_loss):
                # the final flag must follow the job's rounds and stop rule (IPIP-0006 §2.6)
                if count:
                    self.refused["final-flag"] += 1
                return None
            actions = self._step(st.AggregatePublished(msg.round, msg.adapter_cid, msg.final), now, count=count)
            if actions is not None:
                self.aggregates[msg.round] = msg
                self.applied_at[("aggregate", msg.round)] = now
            return actions
        return None


def _judged(msg: Any) -> str | None:
    """The worker a coordinator decision judges: a verdict's; None for a lease or an aggregate."""
    return msg.worker if isinstance(msg, m.Verdict) else None
