"""The job and shard state machines.

Everything that affects the job/shard state machines lives here: which events each state accepts,
which state follows, which timers run and which actions a transition asks for. This file does not
know who runs it or what role we play: a submitter, a worker, a coordinator or an observer feed it
the same events and get the same answers. Carrying out the actions (gossiping a lease, starting a
verifier, aggregating adapters) is the caller's business, and so is deciding *which* worker gets a
lease; whether a lease may be granted at all is decided here.

Rules of this file:

- Pure. No I/O and no clock: time is always passed in (``now``, float seconds on one clock that
  the caller chooses). A timer fires when a step is taken with ``now >= expires_at``.
- Immutable. States are frozen dataclasses holding tuples, so they compare, hash and log as values.
- One entry point: ``step(job, event, now) -> (job', actions)``. A step first fires every timer due
  at ``now`` (job deadline, lease expiry, verification window, aggregation window), then applies
  the event through the tables below, then the job transitions that are read off its shards.
- Invalid input raises ``StateError`` and nothing else: an event the current state does not
  accept, an event from a peer that does not hold the lease, one for a stale attempt, a shard index
  out of range, a field of the wrong type. The caller keeps its old state (nothing to undo: the old
  value is untouched) and drops the event; timers that were due fire at the next step. ``Tick`` is
  never invalid, so a caller can tick every job it knows, finished or not.

Shards. Each round, every shard goes OPEN -> LEASED -> REPORTED -> ACCEPTED. A lease belongs to one
worker and one *attempt*: each lease of a shard in a round is the next attempt, numbered 1, 2, ...
up to ``max_retries + 1``. Every shard event names its round, shard and attempt, as the wire
messages do, so a late message of an earlier attempt or round never passes for the current one. An
attempt that ends badly (released, lease expired, report rejected, no verdict in time) is a
*retry*: the shard reopens while attempts are left, else it is FAILED for the round. An attempt that
ends with no verdict in time is not its worker's failure (the worker reported; the coordinator did
not decide: it died, or could not get the submitter to keep the adapter, IPIP-0006 §2.6.1): it is
*excused*, counted apart, as is a release for a cause on the worker's own machine (its disk filled,
it restarted: ``Released.excused``, the wire's ``cause: local``), and a lease the coordinator revoked because
its holder fell silent (``Revoked``, IPIP-0004 §5.3), so the retry budget (``max_retries +
1`` attempts) counts only attempts whose worker failed, and a shard may also have up to ``max_retries +
1`` excused attempts a round. Every waiting state has a timer, so no shard can be held forever by a silent worker or a silent verifier.
A checkpoint extends its attempt's lease, but an attempt takes at most ``max_checkpoints`` of them
(the number its training needs, from the terms, plus a margin): past that a lease holder's commits
are refused, so it can neither keep a lease alive forever nor make every mirror store a flood.

Late verdicts. Each mirror runs the timers on its own clock, and messages take time to travel: a
verdict the coordinator gave inside its verification window can reach another mirror just after
that mirror's window closed and reopened the shard (found by the partition-heal scenario on a
loaded machine: the submitter reopened a shard 0.1 s before the verdict accepting it arrived, then
refused the round's aggregate for good). Until the shard is leased again, an OPEN shard whose
attempt ended by the verification timer still takes that attempt's verdict: an acceptance makes it
ACCEPTED, a rejection leaves it OPEN. So every mirror follows what the coordinator decided rather
than its own timing, and nothing is decided twice: the next lease ends that chance (the coordinator's
own mirror does the same, so a verdict it gives late is published only if it leased nobody since).

Jobs. ANNOUNCED -> TRAINING (first lease) -> VERIFYING (no shard OPEN or LEASED) -> AGGREGATING
(every shard ACCEPTED or FAILED, and at least ``min_accepted_shards`` accepted) -> the aggregate is
published -> TRAINING for the next round (every shard reopens with a fresh retry budget) or DONE
(after the last round, or earlier when the aggregate is final and the job has a stop rule)
after the last. The job FAILS as soon as the acceptance rule can no longer hold, when its deadline
passes, or when a published aggregate does not appear within ``lease_seconds`` of the Aggregate
action; the submitter may CANCEL it at any time. DONE, FAILED and CANCELLED are terminal.
"Rejected" and "published" are outcomes of an event, not states a shard or job rests in.

A job with no deadline whose shards are all OPEN waits for workers indefinitely; that is the one
wait without a timer, and the job deadline is there to bound it. The document is
``ipips/0004-job-shard-lifecycle.md``; ``ipips/vectors/state-*.json`` are replayed by the tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import Enum

from protocol.errors import SpecError, StateError

MAX_SHARDS = 1024
"""Most shards a job may have, as in protocol/jobspec.py: the machine holds one record per shard."""

MAX_LIVE_JOBS_PER_SUBMITTER = 8
"""Most jobs not yet ended (not DONE, FAILED or CANCELLED) one submitter may have (IPIP-0004 §13):
a submitter announces no more, and a follower follows no more of one announcing peer's."""


# ---------------------------------------------------------------------------------------------
# States
# ---------------------------------------------------------------------------------------------


class ShardPhase(Enum):
    OPEN = "OPEN"  # waiting for a lease
    LEASED = "LEASED"  # one worker trains it until expires_at
    REPORTED = "REPORTED"  # the lease holder handed in its adapter; verification runs until expires_at
    ACCEPTED = "ACCEPTED"  # verified; part of this round's aggregate
    FAILED = "FAILED"  # no attempts left this round


class JobPhase(Enum):
    ANNOUNCED = "ANNOUNCED"
    TRAINING = "TRAINING"
    VERIFYING = "VERIFYING"
    AGGREGATING = "AGGREGATING"
    DONE = "DONE"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


TERMINAL_JOB_PHASES = frozenset({JobPhase.DONE, JobPhase.FAILED, JobPhase.CANCELLED})
SETTLED_SHARD_PHASES = frozenset({ShardPhase.ACCEPTED, ShardPhase.FAILED})


@dataclass(frozen=True)
class JobConfig:
    """The job spec's lifecycle fields (names and defaults of ``infernet.train.yml``) and an absolute deadline."""

    shards: int
    rounds: int = 1
    lease_seconds: float = 3600.0
    max_retries: int = 2
    min_accepted_fraction: float = 1.0
    deadline: float | None = None
    stop_early: bool = False  # the job has a stop rule: a final aggregate may come before the last round
    # checkpoints one attempt may commit (0: no cap); from the terms, protocol/proof.checkpoint_cap
    max_checkpoints: int = 0

    def __post_init__(self) -> None:
        _check_int("shards", self.shards, 1, MAX_SHARDS)
        _check_int("max_checkpoints", self.max_checkpoints, 0, None)
        _check_int("rounds", self.rounds, 1, None)
        _check_int("max_retries", self.max_retries, 0, None)
        _check_number("lease_seconds", self.lease_seconds)
        if self.lease_seconds <= 0:
            raise SpecError("lease_seconds", f"must be > 0, got {self.lease_seconds!r}")
        _check_number("min_accepted_fraction", self.min_accepted_fraction)
        if not 0 < self.min_accepted_fraction <= 1:
            raise SpecError("min_accepted_fraction", f"must be in (0, 1], got {self.min_accepted_fraction!r}")
        if self.deadline is not None:
            _check_number("deadline", self.deadline)

    @property
    def min_accepted_shards(self) -> int:
        """Accepted shards a round needs: ceil(min_accepted_fraction x shards), at least 1.

        The rule of JobSpec.min_accepted_shards: the product is rounded to 9 decimal places first,
        so that 0.7 x 10 is 7 and not 8 (the float product is 7.000000000000001).
        """
        return max(1, math.ceil(round(self.min_accepted_fraction * self.shards, 9)))

    @property
    def attempts_per_round(self) -> int:
        """Leases a shard may have in one round: the first one and ``max_retries`` more."""
        return self.max_retries + 1


@dataclass(frozen=True)
class ShardState:
    index: int
    phase: ShardPhase = ShardPhase.OPEN
    attempt: int = 0  # leases granted this round: the current lease's number; 0 before the first
    worker: str | None = None  # lease holder while LEASED/REPORTED; the accepted worker when ACCEPTED
    expires_at: float | None = None  # lease expiry (LEASED) or end of the verification window (REPORTED)
    late_verdict: str | None = None  # OPEN only: its verification window expired; that attempt's worker
    checkpoints: int = 0  # checkpoints seen in the current attempt (at most config.max_checkpoints)
    excused: int = 0  # attempts of this round that ended with no verdict in time or given back for the worker's
    # own machine (not a failure of the shard's work)


@dataclass(frozen=True)
class JobState:
    config: JobConfig
    shards: tuple[ShardState, ...]
    phase: JobPhase = JobPhase.ANNOUNCED
    round: int = 1  # current round, 1-based
    published: tuple[str, ...] = ()  # aggregate CID of each finished round
    expires_at: float | None = None  # end of the aggregation window while AGGREGATING
    reason: str = ""  # why a terminal job ended

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL_JOB_PHASES

    def count(self, phase: ShardPhase) -> int:
        return sum(1 for shard in self.shards if shard.phase is phase)


def new_job(config: JobConfig) -> JobState:
    """A freshly announced job: round 1, every shard OPEN."""
    return JobState(config=config, shards=tuple(ShardState(index=i) for i in range(config.shards)))


# ---------------------------------------------------------------------------------------------
# Events (what happened) and actions (what the caller should do)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LeaseGranted:
    """The coordinator leased ``shard`` to ``worker`` (a peer ID); the machine numbers the attempt."""

    round: int
    shard: int
    worker: str


@dataclass(frozen=True)
class CheckpointSeen:
    """The lease holder committed a proof-of-training checkpoint: a sign of life that extends the lease."""

    round: int
    shard: int
    worker: str
    attempt: int


@dataclass(frozen=True)
class ReportReceived:
    """The lease holder handed in its trained adapter for this attempt."""

    round: int
    shard: int
    worker: str
    attempt: int


@dataclass(frozen=True)
class Released:
    """The lease holder gave the shard back before reporting (the attempt is spent). ``excused``: for a cause on
    the worker's own machine (its disk, a restart): counted with the attempts that got no verdict in time."""

    round: int
    shard: int
    worker: str
    attempt: int
    excused: bool = False


@dataclass(frozen=True)
class Revoked:
    """The coordinator ended the lease of a holder it no longer hears (IPIP-0004 §5.3): the worker fell silent
    (its machine died, or the network between them did), not the shard's work: an excused attempt."""

    round: int
    shard: int
    worker: str
    attempt: int


@dataclass(frozen=True)
class VerdictGiven:
    """Verification of the reported attempt finished."""

    round: int
    shard: int
    attempt: int
    accepted: bool
    reason: str = ""


@dataclass(frozen=True)
class Tick:
    """Time passed; fire the timers due at ``now``."""


@dataclass(frozen=True)
class AggregatePublished:
    """The aggregate of ``round`` is published under ``cid``."""

    round: int
    cid: str
    final: bool = False  # the job ends with it; before its last round only with a stop rule


@dataclass(frozen=True)
class Cancel:
    """The submitter cancelled the job (the caller checked that the submitter signed it)."""

    reason: str = "cancelled by the submitter"


Event = LeaseGranted | CheckpointSeen | ReportReceived | Released | Revoked | VerdictGiven | Tick | AggregatePublished | \
    Cancel


@dataclass(frozen=True)
class PublishLease:
    round: int
    shard: int
    worker: str
    attempt: int
    expires_at: float


@dataclass(frozen=True)
class ExtendLease:
    round: int
    shard: int
    worker: str
    attempt: int
    expires_at: float


@dataclass(frozen=True)
class StartVerification:
    round: int
    shard: int
    worker: str
    attempt: int
    expires_at: float  # a verdict after this moment comes too late


@dataclass(frozen=True)
class ReopenShard:
    round: int
    shard: int
    reason: str


@dataclass(frozen=True)
class FailShard:
    round: int
    shard: int
    reason: str


@dataclass(frozen=True)
class Aggregate:
    round: int
    accepted_shards: tuple[int, ...]
    expires_at: float  # publish the aggregate before this moment or the job fails


@dataclass(frozen=True)
class StartRound:
    round: int


@dataclass(frozen=True)
class FailJob:
    reason: str


@dataclass(frozen=True)
class CancelJob:
    reason: str


@dataclass(frozen=True)
class Done:
    cid: str  # the last round's aggregate


Action = (
    PublishLease
    | ExtendLease
    | StartVerification
    | ReopenShard
    | FailShard
    | Aggregate
    | StartRound
    | FailJob
    | CancelJob
    | Done
)


# ---------------------------------------------------------------------------------------------
# The tables
# ---------------------------------------------------------------------------------------------


class ShardInput(Enum):
    """What can happen to one shard: the shard events, a verdict's two outcomes, and its two timers."""

    LEASE = "lease granted"
    CHECKPOINT = "checkpoint seen"
    REPORT = "report received"
    RELEASE = "released"
    RELEASE_EXCUSED = "released for a cause on the worker's machine"
    ACCEPT = "verdict accepted"
    REJECT = "verdict rejected"
    LEASE_EXPIRED = "lease expired"
    LEASE_REVOKED = "lease revoked: its holder fell silent"
    VERIFICATION_EXPIRED = "verification window expired"


RETRY = "RETRY"
"""Table target: OPEN again while the round has attempts left for this shard, else FAILED."""

SHARD_TRANSITIONS: dict[ShardPhase, dict[ShardInput, ShardPhase | str]] = {
    ShardPhase.OPEN: {
        ShardInput.LEASE: ShardPhase.LEASED,  # new attempt, lease until now + lease_seconds
        ShardInput.ACCEPT: ShardPhase.ACCEPTED,  # late verdict: only after a verification expiry, same attempt
        ShardInput.REJECT: ShardPhase.OPEN,  # late verdict, as above: it was reopened already
    },
    ShardPhase.LEASED: {
        ShardInput.CHECKPOINT: ShardPhase.LEASED,  # holder only; lease extended to now + lease_seconds
        ShardInput.REPORT: ShardPhase.REPORTED,  # holder only; verification window of lease_seconds
        ShardInput.RELEASE: RETRY,  # holder only
        ShardInput.RELEASE_EXCUSED: RETRY,  # holder only; an excused attempt
        ShardInput.LEASE_EXPIRED: RETRY,
        ShardInput.LEASE_REVOKED: RETRY,  # holder, current attempt (the coordinator's decision); an excused attempt
    },
    ShardPhase.REPORTED: {
        ShardInput.ACCEPT: ShardPhase.ACCEPTED,  # current attempt only
        ShardInput.REJECT: RETRY,  # current attempt only
        ShardInput.VERIFICATION_EXPIRED: RETRY,
    },
    ShardPhase.ACCEPTED: {},
    ShardPhase.FAILED: {},
}

EXCUSED_INPUTS = frozenset({ShardInput.VERIFICATION_EXPIRED, ShardInput.RELEASE_EXCUSED, ShardInput.LEASE_REVOKED})
"""The RETRY inputs that are not the worker's failure: counted in ``ShardState.excused``, apart from the retry budget."""

NEXT_ROUND = "NEXT_ROUND"
"""Table target: TRAINING in round + 1 with every shard reopened, or DONE after the last round."""

# Event-triggered job transitions. Shard events pass on to SHARD_TRANSITIONS for their shard. Tick
# is accepted in every phase: it only fires timers. After every step the state-triggered rules of
# _read_shards (TRAINING/VERIFYING -> TRAINING | VERIFYING | AGGREGATING | FAILED) run.
JOB_TRANSITIONS: dict[JobPhase, dict[type, JobPhase | str]] = {
    JobPhase.ANNOUNCED: {
        LeaseGranted: JobPhase.TRAINING,
        Cancel: JobPhase.CANCELLED,
    },
    JobPhase.TRAINING: {
        LeaseGranted: JobPhase.TRAINING,
        CheckpointSeen: JobPhase.TRAINING,
        ReportReceived: JobPhase.TRAINING,
        Released: JobPhase.TRAINING,
        Revoked: JobPhase.TRAINING,
        VerdictGiven: JobPhase.TRAINING,
        Cancel: JobPhase.CANCELLED,
    },
    JobPhase.VERIFYING: {
        VerdictGiven: JobPhase.VERIFYING,
        Cancel: JobPhase.CANCELLED,
    },
    JobPhase.AGGREGATING: {
        AggregatePublished: NEXT_ROUND,
        Cancel: JobPhase.CANCELLED,
    },
    JobPhase.DONE: {},
    JobPhase.FAILED: {},
    JobPhase.CANCELLED: {},
}


# ---------------------------------------------------------------------------------------------
# The machine
# ---------------------------------------------------------------------------------------------


def step(job: JobState, event: Event, now: float) -> tuple[JobState, tuple[Action, ...]]:
    """Fire the timers due at ``now``, apply ``event``, return the new state and what to do."""
    _check_number("now", now, error=StateError)
    job, timer_actions = _fire_timers(job, now)
    if isinstance(event, Tick):
        return job, timer_actions
    job, event_actions = _apply(job, event, now)
    job, shard_actions = _read_shards(job, now)
    return job, timer_actions + event_actions + shard_actions


def _fire_timers(job: JobState, now: float) -> tuple[JobState, tuple[Action, ...]]:
    if job.terminal:
        return job, ()
    deadline = job.config.deadline
    if deadline is not None and now >= deadline:
        return _end(job, JobPhase.FAILED, f"the job deadline {deadline} has passed")
    if job.phase is JobPhase.AGGREGATING and job.expires_at is not None and now >= job.expires_at:
        return _end(job, JobPhase.FAILED, f"the aggregate of round {job.round} was not published in time")
    shards = list(job.shards)
    actions: list[Action] = []
    for shard in job.shards:
        if shard.expires_at is None or now < shard.expires_at:
            continue
        timer = ShardInput.LEASE_EXPIRED if shard.phase is ShardPhase.LEASED else ShardInput.VERIFICATION_EXPIRED
        shards[shard.index], done = _shard_step(job, shard, timer, now)
        actions.extend(done)
    if not actions:
        return job, ()
    return _read_shards(replace(job, shards=tuple(shards)), now, tuple(actions))


def _apply(job: JobState, event: Event, now: float) -> tuple[JobState, tuple[Action, ...]]:
    target = JOB_TRANSITIONS[job.phase].get(type(event))
    if target is None:
        raise StateError(f"job is {job.phase.name} (round {job.round}): {type(event).__name__} is not allowed")
    if isinstance(event, Cancel):
        _check_str("reason", event.reason, allow_empty=True)
        return _end(job, JobPhase.CANCELLED, event.reason or "cancelled by the submitter")
    if isinstance(event, AggregatePublished):
        return _publish(job, event)
    shard, shard_input, worker, attempt, reason = _shard_event(job, event)
    new_shard, actions = _shard_step(job, shard, shard_input, now, worker, attempt, reason)
    shards = job.shards[: shard.index] + (new_shard,) + job.shards[shard.index + 1 :]
    return replace(job, shards=shards, phase=target), actions


def _shard_event(job: JobState, event: Event) -> tuple[ShardState, ShardInput, str | None, int | None, str]:
    """Check a shard event's fields and name its input: (shard, input, worker, attempt, reason)."""
    _check_int("round", event.round, 1, None, error=StateError)
    _check_int("shard", event.shard, 0, len(job.shards) - 1, error=StateError)
    if event.round != job.round:
        raise StateError(f"{type(event).__name__} for round {event.round}, but the job is in round {job.round}")
    worker = attempt = None
    if not isinstance(event, VerdictGiven):  # a verdict comes from the verifier, not from a worker
        worker = event.worker
        _check_str("worker", worker)
    if not isinstance(event, LeaseGranted):  # a new lease gets its number here
        attempt = event.attempt
        _check_int("attempt", attempt, 1, None, error=StateError)
    reason = ""
    if isinstance(event, LeaseGranted):
        shard_input = ShardInput.LEASE
    elif isinstance(event, CheckpointSeen):
        shard_input = ShardInput.CHECKPOINT
    elif isinstance(event, ReportReceived):
        shard_input = ShardInput.REPORT
    elif isinstance(event, Released):
        if not isinstance(event.excused, bool):
            raise StateError(f"excused must be true or false, got {event.excused!r}")
        shard_input = ShardInput.RELEASE_EXCUSED if event.excused else ShardInput.RELEASE
        reason = f"released by {worker}" + (" (its own machine)" if event.excused else "")
    elif isinstance(event, Revoked):
        shard_input = ShardInput.LEASE_REVOKED
        reason = f"lease of attempt {attempt} revoked: {worker} fell silent"
    else:  # VerdictGiven, the only other shard event in JOB_TRANSITIONS
        if not isinstance(event.accepted, bool):
            raise StateError(f"accepted must be true or false, got {event.accepted!r}")
        _check_str("reason", event.reason, allow_empty=True)
        shard_input = ShardInput.ACCEPT if event.accepted else ShardInput.REJECT
        reason = f"attempt {attempt} rejected: {event.reason or 'no reason given'}"
    return job.shards[event.shard], shard_input, worker, attempt, reason


def checkpoints_spent(job: "JobState", rnd: int, index: int, attempt: int) -> bool:
    """Has attempt ``attempt`` of shard ``index`` in round ``rnd`` (the current attempt) committed every
    checkpoint ``config.max_checkpoints`` allows? Its next commit is then refused (IPIP-0004 §5.2)."""
    if rnd != job.round or not 0 <= index < len(job.shards):
        return False
    shard = job.shards[index]
    return shard.attempt == attempt and _allowance_spent(job.config, shard)


def _allowance_spent(config: JobConfig, shard: ShardState) -> bool:
    return 0 < config.max_checkpoints <= shard.checkpoints


def _shard_step(
    job: JobState,
    shard: ShardState,
    shard_input: ShardInput,
    now: float,
    worker: str | None = None,
    attempt: int | None = None,
    reason: str = "",
) -> tuple[ShardState, tuple[Action, ...]]:
    """One row of SHARD_TRANSITIONS, with its guards (current attempt, lease holder)."""
    target = SHARD_TRANSITIONS[shard.phase].get(shard_input)
    if target is None:
        raise StateError(f"shard {shard.index} is {shard.phase.name}: {shard_input.value} is not allowed")
    if attempt is not None and attempt != shard.attempt:
        raise StateError(f"shard {shard.index}: attempt {attempt} is stale, the current attempt is {shard.attempt}")
    if shard_input is not ShardInput.LEASE and worker is not None and worker != shard.worker:
        raise StateError(f"shard {shard.index}: {worker} does not hold the lease of attempt {shard.attempt}")
    if shard.phase is ShardPhase.OPEN and shard_input is not ShardInput.LEASE:  # a late verdict
        if shard.late_verdict is None:
            raise StateError(f"shard {shard.index} is OPEN: {shard_input.value} is not allowed")
        if shard_input is ShardInput.REJECT:
            return replace(shard, late_verdict=None), ()  # it was reopened already
        shard = replace(shard, worker=shard.late_verdict, late_verdict=None)

    config, r, i = job.config, job.round, shard.index
    if shard_input is ShardInput.LEASE:
        expires = now + config.lease_seconds
        leased = replace(shard, phase=target, attempt=shard.attempt + 1, worker=worker, expires_at=expires,
                         late_verdict=None, checkpoints=0)
        return leased, (PublishLease(r, i, worker, leased.attempt, expires),)
    if shard_input is ShardInput.CHECKPOINT:
        if _allowance_spent(config, shard):
            # past what the terms' steps need: a flood, not progress (it would extend the lease forever)
            raise StateError(f"shard {i}: attempt {shard.attempt} already has {shard.checkpoints} checkpoints, "
                             f"the most the job's terms allow")
        expires = max(shard.expires_at, now + config.lease_seconds)  # a clock step back never shortens a lease
        extended = replace(shard, expires_at=expires, checkpoints=shard.checkpoints + 1)
        return extended, (ExtendLease(r, i, shard.worker, shard.attempt, expires),)
    if shard_input is ShardInput.REPORT:
        expires = now + config.lease_seconds
        verifying = replace(shard, phase=target, expires_at=expires)
        return verifying, (StartVerification(r, i, shard.worker, shard.attempt, expires),)
    if shard_input is ShardInput.ACCEPT:
        return replace(shard, phase=target, expires_at=None), ()
    # target is RETRY
    if shard_input is ShardInput.LEASE_EXPIRED:
        reason = f"lease of attempt {shard.attempt} expired"
    elif shard_input is ShardInput.VERIFICATION_EXPIRED:
        reason = f"no verdict on attempt {shard.attempt} in time"
    excused = shard.excused + (shard_input in EXCUSED_INPUTS)
    failed = shard.attempt - excused  # attempts whose worker failed (released, expired, rejected)
    if failed < config.attempts_per_round and excused <= config.attempts_per_round:
        late = shard.worker if shard_input is ShardInput.VERIFICATION_EXPIRED else None  # its verdict may follow
        reopened = replace(shard, phase=ShardPhase.OPEN, worker=None, expires_at=None, late_verdict=late,
                           excused=excused)
        return reopened, (ReopenShard(r, i, reason),)
    if excused > config.attempts_per_round:
        reason = f"{reason}; {excused} attempts were excused (no verdict in time, or given back for the worker's own " \
                 f"machine), more than {config.attempts_per_round}"
    else:
        reason = f"{reason}; no attempts left ({failed} of {config.attempts_per_round} failed)"
    return (replace(shard, phase=ShardPhase.FAILED, worker=None, expires_at=None, excused=excused),
            (FailShard(r, i, reason),))


def _read_shards(
    job: JobState, now: float, actions: tuple[Action, ...] = ()
) -> tuple[JobState, tuple[Action, ...]]:
    """State-triggered job transitions: TRAINING/VERIFYING follow from the shards of the round."""
    if job.phase not in (JobPhase.TRAINING, JobPhase.VERIFYING):
        return job, actions
    total = len(job.shards)
    failed = job.count(ShardPhase.FAILED)
    required = job.config.min_accepted_shards
    if total - failed < required:
        reason = f"round {job.round}: only {total - failed} of {total} shards can still be accepted, {required} required"
        ended, end_actions = _end(job, JobPhase.FAILED, reason)
        return ended, actions + end_actions
    if all(s.phase in SETTLED_SHARD_PHASES for s in job.shards):
        expires = now + job.config.lease_seconds
        accepted = tuple(s.index for s in job.shards if s.phase is ShardPhase.ACCEPTED)
        aggregating = replace(job, phase=JobPhase.AGGREGATING, expires_at=expires)
        return aggregating, actions + (Aggregate(job.round, accepted, expires),)
    in_training = any(s.phase in (ShardPhase.OPEN, ShardPhase.LEASED) for s in job.shards)
    return replace(job, phase=JobPhase.TRAINING if in_training else JobPhase.VERIFYING), actions


def _publish(job: JobState, event: AggregatePublished) -> tuple[JobState, tuple[Action, ...]]:
    _check_int("round", event.round, 1, None, error=StateError)
    _check_str("cid", event.cid)
    if event.round != job.round:
        raise StateError(f"aggregate for round {event.round}, but the job is aggregating round {job.round}")
    if not isinstance(event.final, bool):
        raise StateError("aggregate: final must be a boolean")
    if event.final and job.round < job.config.rounds and not job.config.stop_early:
        raise StateError(f"a final aggregate in round {job.round} of {job.config.rounds}, but the job has no stop rule")
    published = job.published + (event.cid,)
    if job.round == job.config.rounds or event.final:
        return replace(job, phase=JobPhase.DONE, published=published, expires_at=None), (Done(event.cid),)
    reopened = tuple(ShardState(index=s.index) for s in job.shards)
    next_round = job.round + 1
    return (
        replace(job, phase=JobPhase.TRAINING, round=next_round, shards=reopened, published=published, expires_at=None),
        (StartRound(next_round),),
    )


def _end(job: JobState, phase: JobPhase, reason: str) -> tuple[JobState, tuple[Action, ...]]:
    action = CancelJob(reason) if phase is JobPhase.CANCELLED else FailJob(reason)
    return replace(job, phase=phase, reason=reason, expires_at=None), (action,)


# ---------------------------------------------------------------------------------------------
# Field checks: events are built from peers' messages, so every field is checked before use.
# ---------------------------------------------------------------------------------------------


def _check_int(name: str, value: object, low: int, high: int | None, error: type = SpecError) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in {low}..{high}"
        raise _error(error, name, f"must be an integer {bound}, got {value!r}")


def _check_number(name: str, value: object, error: type = SpecError) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _error(error, name, f"must be a finite number, got {value!r}")


def _check_str(name: str, value: object, allow_empty: bool = False) -> None:
    if not isinstance(value, str) or (not value and not allow_empty):
        raise StateError(f"{name} must be a {'' if allow_empty else 'non-empty '}string, got {value!r}")


def _error(error: type, name: str, message: str) -> Exception:
    return SpecError(name, message) if error is SpecError else error(f"{name} {message}")
