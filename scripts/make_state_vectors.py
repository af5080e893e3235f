"""Write ipips/vectors/state-*.json: event sequences run through protocol.state, reviewed by hand."""
import dataclasses, json, sys
from pathlib import Path
sys.path.insert(0, ".")
from protocol.state import *
from protocol.errors import StateError

def ev(e):
    fields = dataclasses.asdict(e)
    if isinstance(e, AggregatePublished) and not e.final:
        del fields["final"]  # the default: the vectors written before it existed stay the same
    if isinstance(e, Released) and not e.excused:
        del fields["excused"]  # (the same)
    return {"type": type(e).__name__, **fields}

def act(a):
    d = {k: v for k, v in dataclasses.asdict(a).items() if k != "reason"}
    if "accepted_shards" in d: d["accepted_shards"] = list(d["accepted_shards"])
    return {"type": type(a).__name__, **d}

def make(name, description, config, steps):
    job = new_job(JobConfig(**config))
    out = []
    for now, e in steps:
        item = {"now": now, "event": ev(e)}
        try:
            job, actions = step(job, e, now)
            item["actions"] = [act(a) for a in actions]
        except StateError as exc:
            item["error"] = True
            item["why"] = str(exc)
        item["job"] = job.phase.name
        item["round"] = job.round
        item["shards"] = [s.phase.name for s in job.shards]
        out.append(item)
    doc = {
        "description": description,
        "format": "Replay: job = new_job(config); for each step, step(job, event, now). A step with error: true must be refused with StateError and leave the state unchanged; 'why' is this implementation's message, not normative. Otherwise 'actions' are the actions returned, in order, without their human-readable 'reason' fields. After each step the job phase, round and shard phases must equal 'job', 'round' and 'shards'.",
        "config": config,
        "steps": out,
    }
    Path(f"ipips/vectors/state-{name}.json").write_text(json.dumps(doc, indent=1) + "\n")

A, B, C = "12D3KooWAlice", "12D3KooWBob", "12D3KooWCarol"
base = dict(shards=2, rounds=2, lease_seconds=60.0, max_retries=1, min_accepted_fraction=1.0, deadline=None)

make("happy-path", "Two shards, two rounds, every report accepted: ANNOUNCED -> TRAINING -> VERIFYING -> AGGREGATING -> TRAINING (round 2) -> ... -> DONE. A checkpoint extends a lease; attempts are numbered per round, and an event naming the previous round is refused.", base, [
    (0.0, LeaseGranted(1, 0, A)),
    (1.0, LeaseGranted(1, 1, B)),
    (30.0, CheckpointSeen(1, 0, A, 1)),
    (55.0, ReportReceived(1, 1, B, 1)),
    (80.0, ReportReceived(1, 0, A, 1)),
    (90.0, VerdictGiven(1, 1, 1, True, "")),
    (91.0, VerdictGiven(1, 0, 1, True, "")),
    (100.0, AggregatePublished(1, "bafkround1")),
    (101.0, LeaseGranted(2, 1, A)),
    (102.0, LeaseGranted(2, 0, C)),
    (105.0, ReportReceived(1, 0, C, 1)),
    (110.0, ReportReceived(2, 0, C, 1)),
    (111.0, ReportReceived(2, 1, A, 1)),
    (112.0, VerdictGiven(2, 1, 1, True, "")),
    (113.0, VerdictGiven(2, 0, 1, True, "")),
    (120.0, AggregatePublished(2, "bafkround2")),
    (121.0, Tick()),
])

make("expiry-and-retry", "Shard 0: its lease expires at exactly expires_at and it reopens; the second attempt is accepted. Shard 1: its report is rejected and it reopens; its second lease expires, which spends its last attempt (max_retries=1), so it FAILS. With min_accepted_fraction 0.5 one accepted shard of two suffices, so the round aggregates shard 0 alone.",
     dict(shards=2, rounds=1, lease_seconds=60.0, max_retries=1, min_accepted_fraction=0.5, deadline=None), [
    (0.0, LeaseGranted(1, 0, A)),
    (0.0, LeaseGranted(1, 1, B)),
    (10.0, ReportReceived(1, 1, B, 1)),
    (59.0, Tick()),
    (60.0, Tick()),
    (61.0, LeaseGranted(1, 0, C)),
    (62.0, VerdictGiven(1, 1, 1, False, "loss does not replay")),
    (63.0, LeaseGranted(1, 1, A)),
    (70.0, ReportReceived(1, 0, C, 2)),
    (71.0, VerdictGiven(1, 0, 2, True, "")),
    (123.0, Tick()),
    (124.0, AggregatePublished(1, "bafkonly0")),
])

make("job-fails", "max_retries=0 and every shard required: one release fails the shard and the job at once; later events are refused.",
     dict(shards=3, rounds=1, lease_seconds=60.0, max_retries=0, min_accepted_fraction=1.0, deadline=None), [
    (0.0, LeaseGranted(1, 0, A)),
    (1.0, LeaseGranted(1, 1, B)),
    (2.0, Released(1, 1, B, 1)),
    (3.0, LeaseGranted(1, 2, C)),
    (4.0, Tick()),
])

make("no-verdict-excused", "An attempt whose report got no verdict within lease_seconds is excused, not its worker's failure (the coordinator died, or the submitter could not keep the adapter: IPIP-0006 §2.6.1): max_retries=1 allows 2 failed attempts and, apart, 2 excused ones a round. Attempts 1 and 2 end with no verdict (excused 1, 2: reopened); attempt 3's lease expires (failed 1: reopened); attempt 4 ends with no verdict again (excused 3 > 2): the shard FAILS, and the job with it.",
     dict(shards=1, rounds=1, lease_seconds=60.0, max_retries=1, min_accepted_fraction=1.0, deadline=None), [
    (0.0, LeaseGranted(1, 0, A)),
    (10.0, ReportReceived(1, 0, A, 1)),
    (70.0, Tick()),
    (71.0, LeaseGranted(1, 0, B)),
    (80.0, ReportReceived(1, 0, B, 2)),
    (140.0, Tick()),
    (141.0, LeaseGranted(1, 0, C)),
    (201.0, Tick()),
    (202.0, LeaseGranted(1, 0, A)),
    (210.0, ReportReceived(1, 0, A, 4)),
    (270.0, Tick()),
])

make("release-excused", "A release for a cause on the worker's own machine (its disk filled, it restarted: the wire's cause 'local', Released.excused) is excused like an attempt with no verdict in time, not a failure of the shard's work: max_retries=0 allows 1 failed attempt and, apart, 1 excused one a round. Attempt 1 is given back with its disk full (excused 1: reopened); attempt 2 is given back plainly (failed 1 of 1) and the shard FAILS, and the job with it. A plain release alone fails it at once (state-job-fails).",
     dict(shards=1, rounds=1, lease_seconds=60.0, max_retries=0, min_accepted_fraction=1.0, deadline=None), [
    (0.0, LeaseGranted(1, 0, A)),
    (5.0, Released(1, 0, A, 1, True)),
    (6.0, LeaseGranted(1, 0, B)),
    (7.0, Released(1, 0, B, 2)),
    (8.0, LeaseGranted(1, 0, C)),
])

make("release-excused-budget", "Excused releases have the budget of excused attempts (max_retries + 1), so a worker that gives a shard back for its own machine again and again cannot hold it forever: max_retries=1, attempts 1 and 2 given back excused (reopened), attempt 3 given back excused (excused 3 > 2): the shard FAILS.",
     dict(shards=1, rounds=1, lease_seconds=60.0, max_retries=1, min_accepted_fraction=1.0, deadline=None), [
    (0.0, LeaseGranted(1, 0, A)),
    (1.0, Released(1, 0, A, 1, True)),
    (2.0, LeaseGranted(1, 0, A)),
    (3.0, Released(1, 0, A, 2, True)),
    (4.0, LeaseGranted(1, 0, B)),
    (5.0, Released(1, 0, B, 3, True)),
])

make("lease-revoked", "A lease the coordinator revoked because its holder fell silent (IPIP-0004 §5.3; the wire's revoke) reopens the shard at once, long before lease_seconds, and is excused like an attempt with no verdict in time: max_retries=0 allows 1 failed attempt and, apart, 1 excused one a round. A revoke naming another worker than the holder, or another attempt, is refused. Attempt 1 is revoked (excused 1: reopened); attempt 2 is revoked too (excused 2 > 1): the shard FAILS, and the job with it (min_accepted_fraction 1).",
     dict(shards=2, rounds=1, lease_seconds=3600.0, max_retries=0, min_accepted_fraction=1.0, deadline=None), [
    (0.0, LeaseGranted(1, 0, A)),
    (0.0, LeaseGranted(1, 1, B)),
    (20.0, Revoked(1, 0, B, 1)),
    (20.0, Revoked(1, 0, A, 2)),
    (20.0, Revoked(1, 0, A, 1)),
    (21.0, LeaseGranted(1, 0, C)),
    (30.0, Revoked(1, 0, C, 2)),
])

make("timers", "Verification window and aggregation window: a report without a verdict within lease_seconds reopens the shard (an excused attempt, see state-no-verdict-excused); an aggregate not published within lease_seconds fails the job.",
     dict(shards=1, rounds=1, lease_seconds=60.0, max_retries=1, min_accepted_fraction=1.0, deadline=None), [
    (0.0, LeaseGranted(1, 0, A)),
    (10.0, ReportReceived(1, 0, A, 1)),
    (70.0, Tick()),
    (71.0, LeaseGranted(1, 0, B)),
    (80.0, ReportReceived(1, 0, B, 2)),
    (90.0, VerdictGiven(1, 0, 2, True, "")),
    (149.0, Tick()),
    (150.0, Tick()),
    (151.0, AggregatePublished(1, "bafktoolate")),
])

make("deadline", "The job deadline fails a live job at now >= deadline, whatever its phase; a terminal job refuses every event but Tick.",
     dict(shards=2, rounds=1, lease_seconds=60.0, max_retries=2, min_accepted_fraction=1.0, deadline=100.0), [
    (0.0, LeaseGranted(1, 0, A)),
    (50.0, CheckpointSeen(1, 0, A, 1)),
    (99.0, LeaseGranted(1, 1, B)),
    (99.5, Tick()),
    (100.0, Tick()),
    (101.0, ReportReceived(1, 0, A, 1)),
    (102.0, Cancel("too late")),
])

make("cancel", "The submitter cancels a job in TRAINING; the job is CANCELLED and accepts nothing more but ticks.",
     dict(shards=2, rounds=3, lease_seconds=60.0, max_retries=2, min_accepted_fraction=1.0, deadline=None), [
    (0.0, LeaseGranted(1, 0, A)),
    (5.0, Cancel("cancelled by the submitter")),
    (6.0, ReportReceived(1, 0, A, 1)),
    (7.0, Tick()),
])

make("invalid-events", "Events from a peer that does not hold the lease, for a stale attempt, in the wrong state or malformed are refused (StateError) and leave the state unchanged.",
     dict(shards=2, rounds=1, lease_seconds=60.0, max_retries=2, min_accepted_fraction=1.0, deadline=None), [
    (0.0, LeaseGranted(1, 0, A)),
    (1.0, LeaseGranted(1, 0, B)),
    (2.0, CheckpointSeen(1, 0, B, 1)),
    (3.0, ReportReceived(1, 0, A, 2)),
    (4.0, Released(1, 1, A, 1)),
    (5.0, VerdictGiven(1, 0, 1, True, "")),
    (6.0, AggregatePublished(1, "bafk")),
    (7.0, LeaseGranted(1, 2, A)),
    (8.0, LeaseGranted(1, -1, A)),
    (9.0, ReportReceived(1, 0, "", 1)),
    (10.0, Released(1, 0, A, 1)),
    (11.0, LeaseGranted(1, 0, A)),
    (12.0, ReportReceived(1, 0, A, 1)),
    (13.0, ReportReceived(1, 0, A, 2)),
    (14.0, VerdictGiven(1, 0, 1, True, "")),
])

make("stop-early", "A job with a stop rule (stop_early: true) ends DONE with a final aggregate before its last round; the same final aggregate in a job without one is refused. Whether the stop rule holds is checked by the job's followers against the signed validation losses (protocol/schedule.should_stop), not by this machine.",
     dict(shards=1, rounds=4, lease_seconds=60.0, max_retries=1, min_accepted_fraction=1.0, deadline=None, stop_early=True), [
    (0.0, LeaseGranted(1, 0, A)),
    (10.0, ReportReceived(1, 0, A, 1)),
    (11.0, VerdictGiven(1, 0, 1, True, "")),
    (12.0, AggregatePublished(1, "bafkround1")),
    (13.0, LeaseGranted(2, 0, B)),
    (20.0, ReportReceived(2, 0, B, 1)),
    (21.0, VerdictGiven(2, 0, 1, True, "")),
    (22.0, AggregatePublished(2, "bafkround2", True)),
    (23.0, LeaseGranted(3, 0, A)),
])
make("no-stop-rule", "Without a stop rule a final aggregate before the last round is refused, and the job goes on.",
     dict(shards=1, rounds=3, lease_seconds=60.0, max_retries=1, min_accepted_fraction=1.0, deadline=None), [
    (0.0, LeaseGranted(1, 0, A)),
    (10.0, ReportReceived(1, 0, A, 1)),
    (11.0, VerdictGiven(1, 0, 1, True, "")),
    (12.0, AggregatePublished(1, "bafkround1", True)),
    (13.0, AggregatePublished(1, "bafkround1")),
])
make("checkpoint-cap", "An attempt commits at most max_checkpoints checkpoints (read off the terms: ceil(steps / checkpoint_every) + 2, protocol/proof.checkpoint_cap). The third commit of attempt 1 is refused and extends nothing, so the lease expires 60 s after the second; attempt 2 starts with a fresh allowance.",
     dict(shards=1, rounds=1, lease_seconds=60.0, max_retries=1, min_accepted_fraction=1.0, deadline=None, max_checkpoints=2), [
    (0.0, LeaseGranted(1, 0, A)),
    (10.0, CheckpointSeen(1, 0, A, 1)),
    (20.0, CheckpointSeen(1, 0, A, 1)),
    (30.0, CheckpointSeen(1, 0, A, 1)),
    (79.0, Tick()),
    (80.0, Tick()),
    (81.0, LeaseGranted(1, 0, B)),
    (90.0, CheckpointSeen(1, 0, B, 2)),
    (91.0, ReportReceived(1, 0, B, 2)),
])
