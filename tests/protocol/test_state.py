"""Job and shard state machines: one example per transition, the IPIP vectors, and properties over
random runs (a rule-based machine of workers, verifiers, the submitter, time passing, and arbitrary
mostly malformed events), checked after every step."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import event as event_note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from protocol.errors import SpecError, StateError
from protocol.state import (
    Aggregate,
    AggregatePublished,
    Cancel,
    CancelJob,
    CheckpointSeen,
    Done,
    ExtendLease,
    FailJob,
    FailShard,
    JobConfig,
    JobPhase,
    JobState,
    LeaseGranted,
    PublishLease,
    Released,
    ReopenShard,
    ReportReceived,
    Revoked,
    ShardPhase,
    ShardState,
    StartRound,
    StartVerification,
    Tick,
    VerdictGiven,
    new_job,
    step,
)

VECTORS = Path(__file__).resolve().parents[2] / "ipips" / "vectors"
EVENT_TYPES = {
    cls.__name__: cls
    for cls in (LeaseGranted, CheckpointSeen, ReportReceived, Released, Revoked, VerdictGiven, Tick, AggregatePublished,
                Cancel)
}

OPEN, LEASED, REPORTED, ACCEPTED, SHARD_FAILED = (
    ShardPhase.OPEN,
    ShardPhase.LEASED,
    ShardPhase.REPORTED,
    ShardPhase.ACCEPTED,
    ShardPhase.FAILED,
)


def phases(job: JobState) -> list[ShardPhase]:
    return [shard.phase for shard in job.shards]


def run(job: JobState, *timed_events: tuple[float, object]) -> tuple[JobState, tuple]:
    """Apply (now, event) pairs in order; return the final state and the last step's actions."""
    actions: tuple = ()
    for now, event in timed_events:
        job, actions = step(job, event, now)
    return job, actions


def leased(config: JobConfig, worker: str = "w1", now: float = 0.0) -> JobState:
    """A job whose shard 0 is leased (attempt 1) to ``worker`` at ``now``."""
    job, _ = step(new_job(config), LeaseGranted(1, 0, worker), now)
    return job


# ---------------------------------------------------------------------------------------------
# Examples, one per transition
# ---------------------------------------------------------------------------------------------


def test_new_job_is_announced_with_every_shard_open():
    job = new_job(JobConfig(shards=3))
    assert job.phase is JobPhase.ANNOUNCED and job.round == 1
    assert phases(job) == [OPEN, OPEN, OPEN]


def test_first_lease_starts_training_and_numbers_the_attempt():
    job, actions = step(new_job(JobConfig(shards=2, lease_seconds=60)), LeaseGranted(1, 1, "w1"), 100.0)
    assert job.phase is JobPhase.TRAINING
    assert phases(job) == [OPEN, LEASED]
    shard = job.shards[1]
    assert (shard.worker, shard.attempt, shard.expires_at) == ("w1", 1, 160.0)
    assert actions == (PublishLease(1, 1, "w1", 1, 160.0),)


def test_a_leased_shard_cannot_be_leased_again():
    job = leased(JobConfig(shards=1))
    with pytest.raises(StateError, match="shard 0 is LEASED"):
        step(job, LeaseGranted(1, 0, "w2"), 1.0)


def test_checkpoint_from_the_holder_extends_the_lease():
    job = leased(JobConfig(shards=1, lease_seconds=60))
    job, actions = step(job, CheckpointSeen(1, 0, "w1", 1), 50.0)
    assert job.shards[0].expires_at == 110.0
    assert actions == (ExtendLease(1, 0, "w1", 1, 110.0),)
    job, _ = step(job, Tick(), 100.0)  # past the first expiry, before the extended one
    assert job.shards[0].phase is LEASED


def test_checkpoint_from_another_worker_is_rejected():
    job = leased(JobConfig(shards=1))
    with pytest.raises(StateError, match="w2 does not hold the lease"):
        step(job, CheckpointSeen(1, 0, "w2", 1), 1.0)


def test_report_from_the_holder_starts_verification():
    job = leased(JobConfig(shards=2, lease_seconds=60))
    job, actions = step(job, ReportReceived(1, 0, "w1", 1), 10.0)
    assert phases(job) == [REPORTED, OPEN]
    assert job.phase is JobPhase.TRAINING  # shard 1 still waits for a worker
    assert actions == (StartVerification(1, 0, "w1", 1, 70.0),)


def test_job_verifies_once_no_shard_is_open_or_leased():
    job = leased(JobConfig(shards=1))
    job, _ = step(job, ReportReceived(1, 0, "w1", 1), 10.0)
    assert job.phase is JobPhase.VERIFYING


def test_accepting_every_shard_starts_aggregation():
    job = leased(JobConfig(shards=1, lease_seconds=60))
    job, actions = run(job, (10.0, ReportReceived(1, 0, "w1", 1)), (20.0, VerdictGiven(1, 0, 1, True)))
    assert job.phase is JobPhase.AGGREGATING
    assert job.shards[0].phase is ACCEPTED and job.shards[0].worker == "w1"
    assert actions == (Aggregate(1, (0,), 80.0),)


def test_rejected_report_reopens_while_attempts_remain():
    job = leased(JobConfig(shards=1, max_retries=1))
    job, actions = run(job, (10.0, ReportReceived(1, 0, "w1", 1)), (20.0, VerdictGiven(1, 0, 1, False, "loss mismatch")))
    assert job.shards[0].phase is OPEN and job.shards[0].worker is None
    assert job.phase is JobPhase.TRAINING
    assert actions == (ReopenShard(1, 0, "attempt 1 rejected: loss mismatch"),)


def test_rejected_report_fails_the_shard_when_no_attempt_is_left():
    job = leased(JobConfig(shards=2, max_retries=0, min_accepted_fraction=0.5))
    job, actions = run(job, (10.0, ReportReceived(1, 0, "w1", 1)), (20.0, VerdictGiven(1, 0, 1, False)))
    assert phases(job) == [SHARD_FAILED, OPEN]
    assert job.phase is JobPhase.TRAINING  # one shard of two still suffices
    assert [type(a) for a in actions] == [FailShard]


def test_lease_expiry_reopens_the_shard_at_exactly_the_expiry_time():
    job = leased(JobConfig(shards=1, lease_seconds=60, max_retries=1))
    job, actions = step(job, Tick(), 59.999)
    assert job.shards[0].phase is LEASED and actions == ()
    job, actions = step(job, Tick(), 60.0)
    assert job.shards[0].phase is OPEN
    assert actions == (ReopenShard(1, 0, "lease of attempt 1 expired"),)


def test_lease_expiry_without_attempts_left_fails_the_shard_and_the_job():
    job = leased(JobConfig(shards=1, lease_seconds=60, max_retries=0))
    job, actions = step(job, Tick(), 60.0)
    assert job.shards[0].phase is SHARD_FAILED
    assert job.phase is JobPhase.FAILED
    assert [type(a) for a in actions] == [FailShard, FailJob]


def test_an_event_after_the_expiry_meets_the_reopened_shard():
    job = leased(JobConfig(shards=1, lease_seconds=60, max_retries=1))
    with pytest.raises(StateError, match="shard 0 is OPEN"):
        step(job, ReportReceived(1, 0, "w1", 1), 61.0)


def test_release_reopens_and_spends_the_attempt():
    job = leased(JobConfig(shards=1, max_retries=1))
    job, actions = step(job, Released(1, 0, "w1", 1), 5.0)
    assert job.shards[0].phase is OPEN and job.shards[0].attempt == 1
    assert actions == (ReopenShard(1, 0, "released by w1"),)
    job, _ = run(job, (6.0, LeaseGranted(1, 0, "w2")), (7.0, Released(1, 0, "w2", 2)))
    assert job.shards[0].phase is SHARD_FAILED and job.phase is JobPhase.FAILED


def test_release_by_someone_else_is_rejected():
    job = leased(JobConfig(shards=1))
    with pytest.raises(StateError, match="w2 does not hold the lease"):
        step(job, Released(1, 0, "w2", 1), 5.0)


def test_verification_window_expiry_counts_as_a_failed_attempt():
    job = leased(JobConfig(shards=1, lease_seconds=60, max_retries=1))
    job, _ = step(job, ReportReceived(1, 0, "w1", 1), 10.0)
    job, actions = step(job, Tick(), 70.0)
    assert job.shards[0].phase is OPEN and job.phase is JobPhase.TRAINING
    assert actions == (ReopenShard(1, 0, "no verdict on attempt 1 in time"),)


def test_stale_attempt_is_rejected_after_a_new_lease():
    job = leased(JobConfig(shards=1, lease_seconds=60, max_retries=2))
    job, _ = run(job, (60.0, Tick()), (61.0, LeaseGranted(1, 0, "w1")))
    assert job.shards[0].attempt == 2
    with pytest.raises(StateError, match="attempt 1 is stale, the current attempt is 2"):
        step(job, ReportReceived(1, 0, "w1", 1), 62.0)
    job, _ = step(job, ReportReceived(1, 0, "w1", 2), 62.0)
    with pytest.raises(StateError, match="attempt 1 is stale"):
        step(job, VerdictGiven(1, 0, 1, True), 63.0)


def test_acceptance_rule_aggregates_the_accepted_shards_only():
    config = JobConfig(shards=4, lease_seconds=600, max_retries=0, min_accepted_fraction=0.5)  # 2 of 4 required
    job = new_job(config)
    for i in range(4):
        job, _ = step(job, LeaseGranted(1, i, f"w{i}"), 0.0)
        job, _ = step(job, ReportReceived(1, i, f"w{i}", 1), 1.0)
    job, _ = run(job, (2.0, VerdictGiven(1, 0, 1, False)), (2.0, VerdictGiven(1, 1, 1, True)), (2.0, VerdictGiven(1, 2, 1, False)))
    assert job.phase is JobPhase.VERIFYING
    job, actions = step(job, VerdictGiven(1, 3, 1, True), 3.0)
    assert job.phase is JobPhase.AGGREGATING
    assert actions == (Aggregate(1, (1, 3), 603.0),)


def test_job_fails_as_soon_as_the_acceptance_rule_cannot_hold():
    config = JobConfig(shards=4, max_retries=0, min_accepted_fraction=0.75)  # 3 of 4 required
    job = new_job(config)
    for i in range(2):
        job, _ = step(job, LeaseGranted(1, i, f"w{i}"), 0.0)
        job, _ = step(job, Released(1, i, f"w{i}", 1), 0.0)
    assert job.phase is JobPhase.FAILED
    assert "only 2 of 4 shards can still be accepted, 3 required" in job.reason


@pytest.mark.parametrize(
    ("fraction", "shards", "required"),
    [(0.7, 10, 7), (1.0, 3, 3), (0.5, 3, 2), (0.34, 3, 2), (0.01, 3, 1), (0.1, 30, 3), (1e-12, 1, 1)],
)
def test_min_accepted_shards_is_the_ceiling_of_fraction_times_shards(fraction, shards, required):
    assert JobConfig(shards=shards, min_accepted_fraction=fraction).min_accepted_shards == required


def complete_round(job: JobState, now: float) -> JobState:
    """Lease, report and accept every shard of the current round."""
    for shard in job.shards:
        job, _ = step(job, LeaseGranted(job.round, shard.index, "w"), now)
        attempt = job.shards[shard.index].attempt
        job, _ = step(job, ReportReceived(job.round, shard.index, "w", attempt), now)
        job, _ = step(job, VerdictGiven(job.round, shard.index, attempt, True), now)
    return job


def test_publishing_a_round_reopens_every_shard_for_the_next():
    job = complete_round(new_job(JobConfig(shards=2, rounds=2, max_retries=0)), 0.0)
    job, actions = step(job, AggregatePublished(1, "bafy-round-1"), 1.0)
    assert actions == (StartRound(2),)
    assert job.phase is JobPhase.TRAINING and job.round == 2
    assert phases(job) == [OPEN, OPEN]
    assert [s.attempt for s in job.shards] == [0, 0]  # attempts are counted per round
    assert job.published == ("bafy-round-1",)
    job = complete_round(job, 2.0)
    job, actions = step(job, AggregatePublished(2, "bafy-round-2"), 3.0)
    assert job.phase is JobPhase.DONE and actions == (Done("bafy-round-2"),)
    assert job.published == ("bafy-round-1", "bafy-round-2")


def test_an_event_of_an_earlier_round_is_rejected():
    job = complete_round(new_job(JobConfig(shards=1, rounds=2)), 0.0)
    job, _ = run(job, (1.0, AggregatePublished(1, "c1")), (2.0, LeaseGranted(2, 0, "w")))
    with pytest.raises(StateError, match="ReportReceived for round 1, but the job is in round 2"):
        step(job, ReportReceived(1, 0, "w", 1), 3.0)
    job, _ = step(job, ReportReceived(2, 0, "w", 1), 3.0)
    assert job.shards[0].phase is REPORTED


def test_aggregate_for_another_round_is_rejected():
    job = complete_round(new_job(JobConfig(shards=1, rounds=2)), 0.0)
    with pytest.raises(StateError, match="aggregate for round 2, but the job is aggregating round 1"):
        step(job, AggregatePublished(2, "c"), 1.0)


def test_aggregation_window_expiry_fails_the_job():
    job = complete_round(new_job(JobConfig(shards=1, lease_seconds=60)), 0.0)
    job, actions = step(job, Tick(), 60.0)
    assert job.phase is JobPhase.FAILED and [type(a) for a in actions] == [FailJob]


def test_deadline_fails_the_job_whatever_its_phase():
    job = leased(JobConfig(shards=2, lease_seconds=60, deadline=30.0))
    job, actions = step(job, Tick(), 29.0)
    assert job.phase is JobPhase.TRAINING
    job, actions = step(job, Tick(), 30.0)
    assert job.phase is JobPhase.FAILED and actions == (FailJob("the job deadline 30.0 has passed"),)


def test_deadline_passed_before_an_event_rejects_the_event():
    job = new_job(JobConfig(shards=1, deadline=30.0))
    with pytest.raises(StateError, match="job is FAILED"):
        step(job, LeaseGranted(1, 0, "w1"), 31.0)


@pytest.mark.parametrize("phase_steps", [0, 1, 2, 3])
def test_cancel_ends_a_live_job_in_any_phase(phase_steps):
    job = new_job(JobConfig(shards=1))
    moves = [LeaseGranted(1, 0, "w"), ReportReceived(1, 0, "w", 1), VerdictGiven(1, 0, 1, True)]
    for event in moves[:phase_steps]:
        job, _ = step(job, event, 1.0)
    job, actions = step(job, Cancel(), 2.0)
    assert job.phase is JobPhase.CANCELLED
    assert actions == (CancelJob("cancelled by the submitter"),)


def test_terminal_jobs_accept_ticks_and_reject_everything_else():
    job, _ = step(new_job(JobConfig(shards=1)), Cancel("changed my mind"), 0.0)
    assert step(job, Tick(), 1e12) == (job, ())
    for event in (Cancel(), LeaseGranted(1, 0, "w"), AggregatePublished(1, "c")):
        with pytest.raises(StateError, match="job is CANCELLED"):
            step(job, event, 1.0)


@pytest.mark.parametrize(
    "event",
    [
        LeaseGranted(1, 1, "w"),
        LeaseGranted(1, -1, "w"),
        LeaseGranted(1, True, "w"),
        LeaseGranted(1, "0", "w"),
        LeaseGranted(2, 0, "w"),
        LeaseGranted(0, 0, "w"),
        LeaseGranted(None, 0, "w"),
        LeaseGranted(1, 0, ""),
        LeaseGranted(1, 0, None),
        CheckpointSeen(1, 0, "w1", 0),
        CheckpointSeen(1, 0, "w1", "1"),
        VerdictGiven(1, 0, 1, "yes"),
        VerdictGiven(1, 0, 1, True, None),
        "not an event",
        None,
    ],
)
def test_malformed_events_raise_state_error(event):
    job = leased(JobConfig(shards=1))
    with pytest.raises(StateError):
        step(job, event, 1.0)


@pytest.mark.parametrize("now", [math.nan, math.inf, "1.0", None, True])
def test_malformed_time_raises_state_error(now):
    with pytest.raises(StateError, match="now must be a finite number"):
        step(new_job(JobConfig(shards=1)), Tick(), now)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("shards", 0),
        ("shards", 65_537),
        ("shards", 2.0),
        ("rounds", 0),
        ("max_retries", -1),
        ("lease_seconds", 0),
        ("lease_seconds", math.inf),
        ("min_accepted_fraction", 0.0),
        ("min_accepted_fraction", 1.5),
        ("deadline", math.nan),
        ("max_checkpoints", -1),
    ],
)
def test_config_errors_name_the_field(field, value):
    fields = {"shards": 2, field: value}
    with pytest.raises(SpecError) as excinfo:
        JobConfig(**fields)
    assert excinfo.value.path == field


# ---------------------------------------------------------------------------------------------
# Vectors
# ---------------------------------------------------------------------------------------------


def action_to_json(action) -> dict:
    """An action as the vectors write it: its type and fields, without the human-readable reason."""
    fields = {k: v for k, v in dataclasses.asdict(action).items() if k != "reason"}
    if "accepted_shards" in fields:
        fields["accepted_shards"] = list(fields["accepted_shards"])
    return {"type": type(action).__name__, **fields}


def event_from_json(data: dict):
    fields = dict(data)
    return EVENT_TYPES[fields.pop("type")](**fields)


STATE_VECTORS = sorted(VECTORS.glob("state-*.json"))


def test_state_vectors_exist():
    assert len(STATE_VECTORS) >= 4


@pytest.mark.parametrize("path", STATE_VECTORS, ids=lambda p: p.name)
def test_state_vector(path):
    vector = json.loads(path.read_text())
    job = new_job(JobConfig(**vector["config"]))
    for number, item in enumerate(vector["steps"], start=1):
        where = f"{path.name} step {number}"
        event = event_from_json(item["event"])
        if item.get("error"):
            with pytest.raises(StateError):
                step(job, event, item["now"])
        else:
            job, actions = step(job, event, item["now"])
            assert [action_to_json(a) for a in actions] == item["actions"], where
        assert job.phase.name == item["job"], where
        assert job.round == item["round"], where
        assert [s.phase.name for s in job.shards] == item["shards"], where


# ---------------------------------------------------------------------------------------------
# Properties over random event sequences
# ---------------------------------------------------------------------------------------------

WORKERS = ("w1", "w2", "w3")
MAX_SHARDS_DRAWN = 5

configs = st.builds(
    JobConfig,
    shards=st.integers(1, MAX_SHARDS_DRAWN),
    rounds=st.integers(1, 3),
    lease_seconds=st.sampled_from([10.0, 60.0]),
    max_retries=st.integers(0, 2),
    min_accepted_fraction=st.sampled_from([0.2, 0.5, 0.7, 1.0]),
    deadline=st.one_of(st.none(), st.floats(50.0, 5000.0)),
)

round_ = st.one_of(st.integers(0, 4), st.sampled_from([None, "1", True]))
index = st.one_of(st.integers(-1, MAX_SHARDS_DRAWN), st.sampled_from([True, None, "0", 1.5, 10**20]))
worker = st.one_of(st.sampled_from(WORKERS), st.sampled_from(["", None, 7]))
attempt = st.one_of(st.integers(-1, 6), st.sampled_from([None, "1", True]))
arbitrary_events = st.one_of(
    st.builds(LeaseGranted, round_, index, worker),
    st.builds(CheckpointSeen, round_, index, worker, attempt),
    st.builds(ReportReceived, round_, index, worker, attempt),
    st.builds(Released, round_, index, worker, attempt),
    st.builds(Revoked, round_, index, worker, attempt),
    st.builds(VerdictGiven, round_, index, attempt, st.one_of(st.booleans(), st.just("yes")), st.sampled_from(["", "bad", None])),
    st.builds(AggregatePublished, round_, st.sampled_from(["cid", "", None])),
    st.builds(Cancel, st.sampled_from([None, 7])),
    st.sampled_from([None, "junk", b"junk"]),
)


class History:
    """Facts gathered over one run, to check the properties that span many steps."""

    def __init__(self) -> None:
        self.accepted: set[tuple[int, int]] = set()  # (round, shard)
        self.lease_holder: dict[tuple[int, int, int], str] = {}  # (round, shard, attempt) -> worker

    def check(self, old: JobState, new: JobState, actions: tuple, now: float) -> None:
        config = new.config
        if old.terminal:
            assert new == old and actions == (), "a terminal job never changes"
            return
        for before, after in zip(old.shards, new.shards):
            # max_retries + 1 attempts whose worker failed, and apart up to as many excused ones (no verdict in time)
            assert after.excused <= config.attempts_per_round + 1, "excused attempts are bounded"
            assert after.attempt - after.excused <= config.attempts_per_round, \
                "a round allows max_retries + 1 failed attempts per shard"
            assert after.attempt <= 2 * config.attempts_per_round + 1, "a round allows a bounded number of leases"
            if new.round == old.round:
                assert after.attempt >= before.attempt, "attempt numbers never go back within a round"
            if after.phase in (LEASED, REPORTED):
                assert after.worker is not None and after.expires_at is not None
                holder = self.lease_holder.setdefault((new.round, after.index, after.attempt), after.worker)
                assert holder == after.worker, "a lease is held by one worker only"
            if after.phase is ACCEPTED and before.phase is not ACCEPTED:
                key = (new.round, after.index)
                assert key not in self.accepted, "a shard is accepted at most once per round"
                self.accepted.add(key)
            expired = before.phase in (LEASED, REPORTED) and before.expires_at <= now
            if expired and not new.terminal:
                assert after.attempt > before.attempt or after.phase in (OPEN, SHARD_FAILED), "expiry reopens or fails"
            if after.phase is SHARD_FAILED and before.phase is not SHARD_FAILED:
                assert (after.attempt - after.excused == config.attempts_per_round
                        or after.excused == config.attempts_per_round + 1), "a shard fails only once its attempts are spent"
        if new.phase is JobPhase.AGGREGATING and old.phase is not JobPhase.AGGREGATING:
            assert all(s.phase in (ACCEPTED, SHARD_FAILED) for s in new.shards)
            assert new.count(ACCEPTED) >= config.min_accepted_shards, "aggregate only when the acceptance rule holds"
            (aggregate,) = [a for a in actions if isinstance(a, Aggregate)]
            assert aggregate.accepted_shards == tuple(s.index for s in new.shards if s.phase is ACCEPTED)
        if new.round != old.round or new.phase is JobPhase.DONE:
            assert old.phase is JobPhase.AGGREGATING, "a round ends only by publishing its aggregate"
            assert len(new.published) == old.round
        if len(new.shards) - new.count(SHARD_FAILED) < config.min_accepted_shards:
            assert new.terminal, "a job whose acceptance rule cannot hold has ended"
        if not new.terminal and new.phase is not JobPhase.ANNOUNCED:
            live = any(s.phase in (OPEN, LEASED) for s in new.shards)
            settled = all(s.phase in (ACCEPTED, SHARD_FAILED) for s in new.shards)
            expected = JobPhase.AGGREGATING if settled else JobPhase.TRAINING if live else JobPhase.VERIFYING
            assert new.phase is expected, "a live job's phase follows from its shards"


def drive_to_the_end(job: JobState, now: float) -> JobState:
    """Workers that lease every open shard and never report, with time running far ahead: every
    shard spends its attempts, so the job must end even with no deadline."""
    for _ in range(job.config.attempts_per_round + 1):
        for shard in job.shards:
            if not job.terminal and job.shards[shard.index].phase is OPEN:
                job, _ = step(job, LeaseGranted(job.round, shard.index, "idler"), now)
        now += 10 * job.config.lease_seconds
        job, _ = step(job, Tick(), now)
    return job


class JobRun(RuleBasedStateMachine):
    """A job under random traffic: workers and verifiers doing their part, giving up, going silent,
    time jumping ahead, the submitter cancelling, and arbitrary (mostly malformed) events. Every
    step is checked against History; at the end time runs far ahead and the job must end."""

    @initialize(config=configs)
    def start(self, config: JobConfig) -> None:
        self.job = new_job(config)
        self.now = 0.0
        self.history = History()

    def feed(self, event) -> None:
        try:
            new, actions = step(self.job, event, self.now)
        except StateError:
            return  # the documented answer to an invalid event; the old state stands
        self.history.check(self.job, new, actions, self.now)
        self.job = new
        event_note(f"reached {new.phase.name} in round {new.round}")

    def shards_in(self, phase: ShardPhase) -> list[ShardState]:
        return [shard for shard in self.job.shards if shard.phase is phase]

    @precondition(lambda self: self.shards_in(OPEN))
    @rule(pick=st.integers(0, 20), worker=st.sampled_from(WORKERS))
    def lease(self, pick: int, worker: str) -> None:
        shards = self.shards_in(OPEN)
        self.feed(LeaseGranted(self.job.round, shards[pick % len(shards)].index, worker))

    @precondition(lambda self: self.shards_in(LEASED))
    @rule(pick=st.integers(0, 20), kind=st.sampled_from([ReportReceived, ReportReceived, CheckpointSeen, Released, Revoked]))
    def lease_holder_acts(self, pick: int, kind: type) -> None:
        shard = self.shards_in(LEASED)[pick % len(self.shards_in(LEASED))]
        self.feed(kind(self.job.round, shard.index, shard.worker, shard.attempt))

    @precondition(lambda self: self.shards_in(REPORTED))
    @rule(pick=st.integers(0, 20), accepted=st.sampled_from([True, True, True, False]))
    def verdict(self, pick: int, accepted: bool) -> None:
        shard = self.shards_in(REPORTED)[pick % len(self.shards_in(REPORTED))]
        self.feed(VerdictGiven(self.job.round, shard.index, shard.attempt, accepted, "" if accepted else "bad"))

    @precondition(lambda self: self.job.phase is JobPhase.AGGREGATING)
    @rule()
    def publish(self) -> None:
        self.feed(AggregatePublished(self.job.round, f"cid-{self.job.round}"))

    @rule(fraction=st.sampled_from([0.01, 0.1, 0.5, 1.0, 3.0]))
    def time_passes(self, fraction: float) -> None:
        self.now += fraction * self.job.config.lease_seconds
        self.feed(Tick())

    @rule(event=arbitrary_events)
    def arbitrary(self, event) -> None:
        self.feed(event)

    @rule(roll=st.sampled_from(range(100)))
    def submitter_may_cancel(self, roll: int) -> None:
        if roll == 0:
            self.feed(Cancel())

    def teardown(self) -> None:
        if not hasattr(self, "job"):
            return
        event_note(f"ended the run {self.job.phase.name} in round {self.job.round}")
        # Two ticks far ahead: the first may settle the last shards and open the aggregation
        # window, the second closes it.
        for far_future in (self.now + 1e9, self.now + 2e9):
            self.now = far_future
            self.feed(Tick())
        job = self.job
        if job.config.deadline is not None:
            assert job.terminal, "past the deadline every job has ended"
        elif not job.terminal:
            assert job.phase is not JobPhase.AGGREGATING
            assert all(s.phase in (OPEN, ACCEPTED, SHARD_FAILED) for s in job.shards), "only waiting for workers"
        assert drive_to_the_end(job, self.now).terminal, "no job hangs"


JobRun.TestCase.settings = settings(
    max_examples=200, stateful_step_count=80, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_random_event_sequences_keep_every_invariant = JobRun.TestCase


@settings(max_examples=100, deadline=None)
@given(config=configs)
def test_a_job_whose_shards_all_fail_ends_failed(config):
    """Every report rejected: each shard fails after max_retries + 1 attempts, and so does the job."""
    job = new_job(dataclasses.replace(config, deadline=None))
    now = 0.0
    while not job.terminal:
        for shard in job.shards:
            if job.shards[shard.index].phase is OPEN and not job.terminal:
                job, _ = step(job, LeaseGranted(1, shard.index, "w"), now)
                attempt = job.shards[shard.index].attempt
                job, _ = step(job, ReportReceived(1, shard.index, "w", attempt), now)
                job, _ = step(job, VerdictGiven(1, shard.index, attempt, False, "bad"), now)
        now += 1.0
    assert job.phase is JobPhase.FAILED
    assert job.round == 1 and job.published == ()


# ---------------------------------------------------------------------------------------------
# A revoked lease (IPIP-0004 §5.3)
# ---------------------------------------------------------------------------------------------


def test_a_revoked_lease_reopens_the_shard_and_is_excused():
    job = leased(JobConfig(shards=1, lease_seconds=3600, max_retries=0))
    job, actions = step(job, Revoked(1, 0, "w1", 1), 20.0)
    assert phases(job) == [OPEN] and job.shards[0].excused == 1
    assert [type(a) for a in actions] == [ReopenShard]
    job, _ = run(job, (21.0, LeaseGranted(1, 0, "w2")))  # attempt 2: max_retries 0 still leaves one failure
    assert job.shards[0].attempt == 2 and job.shards[0].phase is LEASED


def test_a_revoke_names_the_holder_and_the_current_attempt():
    job = leased(JobConfig(shards=1))
    with pytest.raises(StateError, match="w2 does not hold the lease"):
        step(job, Revoked(1, 0, "w2", 1), 1.0)
    with pytest.raises(StateError, match="attempt 2 is stale"):
        step(job, Revoked(1, 0, "w1", 2), 1.0)
    job, _ = run(job, (2.0, ReportReceived(1, 0, "w1", 1)))
    with pytest.raises(StateError, match="VERIFYING"):  # a report in hand is verified, never revoked
        step(job, Revoked(1, 0, "w1", 1), 3.0)
