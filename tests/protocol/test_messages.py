"""Messages (ipips/0002): every type round-trips through its envelope; job IDs bind the terms."""

import dataclasses

import pytest

from protocol import messages as m
from protocol.envelope import open_envelope, seal
from protocol.errors import CodecError
from protocol.identity import Identity
from scripts.make_envelope_vectors import sample_capability, sample_terms

NOW = 1_790_000_000.0
ALICE = Identity(bytes([1]) * 32)
BOB = Identity(bytes([2]) * 32)
CID = "bafkreifjjcie6lypi6ny7amxnfftagclbuxndqonfipmb64f2km2devei4"
TERMS = sample_terms(ALICE)
JOB = TERMS.job_id()


def every_message():
    return [
        m.JobAnnouncement.for_terms(TERMS),
        sample_capability(),
        m.ShardClaim(JOB, 0, 1),
        m.ShardLease(JOB, 0, 1, 0, BOB.peer_id, 1, NOW + 120, None),
        m.ShardRelease(JOB, 0, 1, 0, "dataset hash mismatch"),
        m.ShardRevoke(JOB, 0, 1, 0, BOB.peer_id, 1, 16.5),
        m.CheckpointCommit(JOB, 0, 1, 0, 10, 1, bytes(32), bytes(32), 2.5, CID),
        m.ShardReport(JOB, 0, 1, 0, CID, CID, bytes(32), 3, 30, 100, 1.25, {"val_loss": 1.5}),
        m.Verdict(JOB, 0, 1, 0, BOB.peer_id, 1, True, "replayed 2 segments exactly", (0, 2)),
        m.AggregatePublished(JOB, 0, 1, CID, "exact", (0, 1), 200, False),
        m.EarlyStart(JOB, 2, 1, CID, (1, 0), (BOB.peer_id, ALICE.peer_id)),
        m.JobCancel(JOB, "submitter cancelled"),
        m.Heartbeat(3, 1, (m.CoordinatorTerm(JOB, 1),)),
    ]


def test_every_type_is_registered_and_round_trips_through_an_envelope():
    msgs = every_message()
    assert {type(x).TYPE for x in msgs} == set(m.MESSAGE_TYPES)
    for msg in msgs:
        opened = open_envelope(seal(BOB, msg, now=NOW), now=NOW)
        assert opened.message == msg
        assert type(opened.message) is type(msg)


def test_topics():
    assert m.topic_for(m.JobAnnouncement.for_terms(TERMS)) == m.TOPIC_JOBS
    assert m.topic_for(m.ShardClaim(JOB, 0, 1)) == "infernet/v1/job/" + JOB.hex()
    assert m.topic_for(m.Heartbeat(1, 0, ())) == m.TOPIC_JOBS


def test_job_id_is_the_hash_of_the_terms_and_is_checked():
    ann = m.JobAnnouncement.for_terms(TERMS)
    changed = dataclasses.replace(TERMS, budget=11.0)
    assert changed.job_id() != JOB
    forged = m.JobAnnouncement(JOB, changed).to_wire()
    with pytest.raises(CodecError, match="job_id: does not match"):
        m.decode_body("job", forged)
    assert m.decode_body("job", ann.to_wire()) == ann


def test_ints_given_for_float_fields_are_normalised():
    terms = dataclasses.replace(TERMS, budget=10)
    assert isinstance(terms.budget, float)
    assert terms.job_id() == JOB


@pytest.mark.parametrize(
    "patch, expected",
    [
        ({"shards": []}, "terms.shards: a job needs at least one shard"),
        ({"aggregation": "mean"}, "terms.aggregation: expected one of fedavg, exact, svd, median, trimmed_mean"),
        ({"submitter": "bob"}, "terms.submitter: not an Ed25519 peer ID"),
        ({"validation_cid": "Qm123"}, "terms.validation_cid: invalid CID"),
        ({"min_accepted_fraction": 1.5}, "terms.min_accepted_fraction: expected (0, 1]"),
        ({"training": {"epochs": 1}}, "terms.training.learning_rate: missing field"),
        ({"budget": float("inf")}, "terms.budget: expected a finite float"),
    ],
)
def test_terms_errors_name_the_field(patch, expected):
    wire = m.JobAnnouncement.for_terms(TERMS).to_wire()
    wire["terms"].update(patch)
    with pytest.raises(CodecError) as info:
        m.decode_body("job", wire)
    assert expected in str(info.value)


def test_shard_indices_must_be_dense():
    wire = m.JobAnnouncement.for_terms(TERMS).to_wire()
    wire["terms"]["shards"][1]["index"] = 5
    with pytest.raises(CodecError, match="indices must be 0..n-1"):
        m.decode_body("job", wire)


def test_lists_and_maps_are_bounded():
    wire = m.Verdict(JOB, 0, 1, 0, BOB.peer_id, 1, True, "", ()).to_wire()
    wire["segments_checked"] = list(range(m.MAX_LIST + 1))
    with pytest.raises(CodecError, match="more than"):
        m.decode_body("verdict", wire)
    report = next(x for x in every_message() if isinstance(x, m.ShardReport)).to_wire()
    report["metrics"] = {f"k{i}": 1.0 for i in range(m.MAX_MAP + 1)}
    with pytest.raises(CodecError, match="more than"):
        m.decode_body("report", report)


def test_a_revoke_names_a_silence_that_is_not_negative():
    wire = m.ShardRevoke(JOB, 1, 0, 1, BOB.peer_id, 1, 15.0).to_wire()
    wire["silent_seconds"] = -1.0
    with pytest.raises(CodecError, match=r"silent_seconds: must be >= 0"):
        m.decode_body("revoke", wire)
    wire["silent_seconds"] = float("inf")
    with pytest.raises(CodecError, match="finite"):
        m.decode_body("revoke", wire)


# --- extension fields (added after the message first shipped) -----------------------------------

def test_extension_fields_at_their_default_leave_the_wire_and_the_job_id_unchanged():
    wire = TERMS.to_wire()
    assert "outer" not in wire and "schedule" not in wire["training"] and "warmup_rounds" not in wire["training"]
    outer = m.OuterTerms("nesterov", 0.7, 0.9, 0.9, 0.99)
    training = dataclasses.replace(TERMS.training, schedule="cosine", warmup_rounds=1)
    changed = dataclasses.replace(TERMS, outer=outer, training=training)
    assert changed.job_id() != JOB
    ann = m.JobAnnouncement.for_terms(changed)
    assert m.decode_body("job", ann.to_wire()) == ann
    published = m.AggregatePublished(JOB, 1, 1, CID, "exact", (0, 1), 200, False, 0.5, 9.25)
    assert m.decode_body("aggregate", published.to_wire()) == published
    assert "validation_loss" not in m.AggregatePublished(JOB, 1, 1, CID, "exact", (0,), 2, True).to_wire()


@pytest.mark.parametrize(
    "patch, expected",
    [
        ({"outer": None}, "terms.outer: holds its default; leave it out"),
        ({"training": {**TERMS.training.to_wire(), "schedule": "constant"}},
         "terms.training.schedule: holds its default; leave it out"),
        ({"training": {**TERMS.training.to_wire(), "schedule": "linear"}},
         "terms.training.schedule: expected one of constant, cosine"),
        ({"outer": {"optimizer": "none", "lr": 1.0, "momentum": 0.0, "beta1": 0.9, "beta2": 0.99}},
         "terms.outer.optimizer: 'none' is written by leaving outer out"),
        ({"outer": {"optimizer": "sgd", "lr": 0.0, "momentum": 0.0, "beta1": 0.9, "beta2": 0.99}},
         "terms.outer.lr: expected (0, 100)"),
        ({"outer": {"optimizer": "nesterov", "lr": 0.7, "momentum": 1.0, "beta1": 0.9, "beta2": 0.99}},
         "terms.outer.momentum: expected [0, 1)"),
        ({"aggregation": "svd", "outer": {"optimizer": "sgd", "lr": 0.7, "momentum": 0.0, "beta1": 0.9, "beta2": 0.99}},
         "terms.outer: an outer optimizer needs aggregation fedavg or exact, not svd"),
    ],
)
def test_extension_fields_are_strict(patch, expected):
    wire = m.JobAnnouncement.for_terms(TERMS).to_wire()
    wire["terms"].update(patch)
    with pytest.raises(CodecError) as info:
        m.decode_body("job", wire)
    assert expected in str(info.value)


def test_capability_devices_and_models_are_bounded_and_checked():
    from scripts.make_envelope_vectors import sample_capability

    cap = sample_capability()
    wire = cap.to_wire()
    assert m.Capability.from_wire(wire) == cap
    device = wire["devices"][0]
    cases = [
        ({**wire, "devices": [device, device]}, "devices: a device is listed twice"),
        ({**wire, "devices": [{**device, "vram_free_gb": 90.0}]}, "devices[0].vram_free_gb: expected 0..vram_total_gb"),
        ({**wire, "devices": [{**device, "vram_total_gb": -1.0}]}, "devices[0].vram_total_gb"),
        ({**wire, "devices": [{**device, "kind": "tpu"}]}, "devices[0].kind: expected one of cuda, mps"),
        ({**wire, "devices": [{**device, "index": i} for i in range(17)]}, "devices: more than 16 items"),
        ({**wire, "devices": [{**device, "bf16": 1}]}, "devices[0].bf16: expected a boolean"),
        ({**wire, "models": [{"name": "x", "sha256": b"short"}]}, "models[0].sha256: expected a 32-byte digest"),
        ({**wire, "models": [{"name": "x", "sha256": bytes(32)}] * 65}, "models: more than 64 items"),
        ({k: v for k, v in wire.items() if k != "devices"}, "devices: missing field"),
        ({**wire, "cpu_model": "x" * 300}, "cpu_model: string longer than 256"),
    ]
    for bad, message in cases:
        with pytest.raises(CodecError, match=message.replace("[", r"\[").replace("]", r"\]")):
            m.Capability.from_wire(bad, "cap")


@pytest.mark.parametrize("shards, workers, rnd, message", [
    ((0, 1), ("B",), 2, "1 workers for 2 shards"),
    ((0, 0), ("A", "B"), 2, "named twice"),
    ((0, 1), ("A", "A"), 2, "named twice"),
    ((0,), ("A",), 1, "round 2 or later"),
    ((-1,), ("A",), 2, "outside 0"),
])
def test_an_early_start_names_each_shard_and_worker_once(shards, workers, rnd, message):
    peers = {"A": ALICE.peer_id, "B": BOB.peer_id}
    early = m.EarlyStart(JOB, rnd, 1, CID, shards, tuple(peers[w] for w in workers))
    with pytest.raises(CodecError, match=message):
        m.decode_body("early", early.to_wire())
