"""Envelope rules (ipips/0001): every kind of bad input is rejected with its own reason, and only CodecError."""

import json

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.codec import canonical_encode, decode_canonical
from protocol.envelope import (
    MAX_AGE_S,
    MAX_ENVELOPE_BYTES,
    MAX_SKEW_S,
    SEEN_TTL_S,
    ReplayCache,
    blames_forwarder,
    open_envelope,
    seal,
)
from protocol.errors import CodecError
from protocol.identity import Identity
from protocol.messages import CheckpointCommit, Heartbeat, JobCancel
from tests.conftest import IPIP_VECTORS

NOW = 1_790_000_000.0
ALICE = Identity(bytes([1]) * 32)
MALLORY = Identity(bytes([3]) * 32)


def sealed(msg=None, who=ALICE, now=NOW):
    return seal(who, msg or Heartbeat(1, 0, ()), now=now)


def reject(data, reason, **kw):
    kw.setdefault("now", NOW)
    with pytest.raises(CodecError) as info:
        open_envelope(data, **kw)
    assert info.value.reason == reason, str(info.value)
    return info.value


def mutate(data, **changes):
    raw = msgpack.unpackb(data, raw=False)
    raw.update(changes)
    return canonical_encode(raw)


def test_good_envelope_opens_with_signer_and_message():
    opened = open_envelope(sealed(), now=NOW, replay=ReplayCache(), expected_signer=ALICE.peer_id)
    assert opened.signer == ALICE.peer_id
    assert opened.message == Heartbeat(1, 0, ())


def test_vectors_reproduce_byte_for_byte():
    doc = json.loads((IPIP_VECTORS / "envelope-vectors.json").read_text())
    for vec in doc["vectors"]:
        opened = open_envelope(bytes.fromhex(vec["envelope_hex"]), now=doc["now_s"])
        assert opened.signer == vec["signer_peer_id"]
        assert opened.envelope.message_id.hex() == vec["message_id_hex"]
        assert opened.envelope.signed_bytes().hex() == vec["signed_bytes_hex"]
        who = Identity(bytes.fromhex(vec["signer_seed_hex"]))
        again = seal(who, opened.message, now=doc["now_s"], nonce=bytes.fromhex(vec["nonce_hex"]))
        assert again.hex() == vec["envelope_hex"], vec["name"]
    ids = json.loads((IPIP_VECTORS / "identity-vectors.json").read_text())
    for vec in ids["vectors"]:
        assert Identity(bytes.fromhex(vec["seed_hex"])).peer_id == vec["peer_id"]


def test_truncated():
    data = sealed()
    for cut in (1, 10, len(data) // 2, len(data) - 1):
        reject(data[:cut], "truncated")
    reject(b"", "truncated")


def test_oversize_rejected_before_decoding():
    reject(b"\x00" * (MAX_ENVELOPE_BYTES + 1), "oversize")


def test_oversize_message_cannot_be_sealed():
    with pytest.raises(CodecError, match="oversize"):
        seal(ALICE, _Huge(), now=NOW)


class _Huge:
    TYPE = "cancel"

    def to_wire(self):
        return {"job_id": bytes(32), "reason": "x" * (MAX_ENVELOPE_BYTES + 10)}


def test_wrong_types_and_extra_and_missing_fields():
    data = sealed()
    reject(mutate(data, ts="yesterday"), "bad-envelope")
    reject(mutate(data, k=b"short"), "bad-envelope")
    reject(mutate(data, n=b"\x00" * 3), "bad-envelope")
    reject(mutate(data, extra=1), "bad-envelope")
    raw = msgpack.unpackb(data, raw=False)
    del raw["s"]
    reject(canonical_encode(raw), "bad-envelope")
    reject(canonical_encode([1, 2, 3]), "bad-envelope")


def test_body_schema_is_strict():
    body = {"seq": 1, "active_shards": 0, "coordinating": []}
    for bad, reason_text in [
        ({**body, "seq": "1"}, "seq: expected an integer"),
        ({**body, "seq": True}, "seq: expected an integer"),
        ({**body, "extra": 1}, "extra: unknown field"),
        ({k: v for k, v in body.items() if k != "seq"}, "seq: missing field"),
        ({**body, "seq": -1}, "seq: expected 0.."),
    ]:
        data = _resign(ALICE, "heartbeat", bad)
        err = reject(data, "bad-field")
        assert reason_text in str(err)


def _resign(who, type_tag, body, now=NOW, nonce=bytes(16)):
    """Sign an arbitrary body (what a misbehaving peer could send)."""
    from protocol.envelope import signed_bytes

    ts = int(now * 1000)
    sig = who.sign(signed_bytes(1, type_tag, who.public_key, ts, nonce, body))
    return canonical_encode({"v": 1, "t": type_tag, "k": who.public_key, "ts": ts, "n": nonce, "b": body, "s": sig})


def test_bad_signature_tampered_body_and_forged_signer():
    data = sealed()
    raw = msgpack.unpackb(data, raw=False)
    raw["b"]["seq"] = 2  # tampered after signing
    reject(canonical_encode(raw), "bad-signature")
    raw = msgpack.unpackb(data, raw=False)
    raw["k"] = MALLORY.public_key  # claims to be Mallory, signed by Alice
    reject(canonical_encode(raw), "bad-signature")
    raw = msgpack.unpackb(data, raw=False)
    raw["s"] = bytes(64)
    reject(canonical_encode(raw), "bad-signature")


def test_signature_is_domain_separated_by_type():
    # the same body signed as one type must not verify as another
    data = sealed(JobCancel(bytes(32), "x"))
    raw = msgpack.unpackb(data, raw=False)
    raw["t"] = "heartbeat"
    reject(canonical_encode(raw), "bad-signature")


def test_wrong_signer_against_transport_sender():
    reject(sealed(), "wrong-signer", expected_signer=MALLORY.peer_id)


def test_replayed():
    cache = ReplayCache()
    data = sealed()
    open_envelope(data, now=NOW, replay=cache)
    reject(data, "replayed", replay=cache)
    reject(data, "replayed", replay=cache, now=NOW + MAX_AGE_S - 1)
    # once its window has passed, the replay is refused as expired, and the cache has forgotten it
    reject(data, "expired", replay=cache, now=NOW + MAX_AGE_S + 1)


def test_blame_vectors_who_is_held_responsible_for_a_rejected_envelope():
    """IPIP-0001 §4 (issue 21): ``expired`` and ``replayed`` say nothing against the forwarder (caches and
    relays hand them on in good faith); every other rejection does. The transport's seen window covers
    the envelope's whole acceptance window."""
    doc = json.loads((IPIP_VECTORS / "envelope-blame.json").read_text())
    assert (doc["max_age_s"], doc["max_skew_s"], doc["seen_ttl_s"]) == (MAX_AGE_S, MAX_SKEW_S, SEEN_TTL_S)
    assert SEEN_TTL_S >= MAX_AGE_S + MAX_SKEW_S
    assert {c["name"] for c in doc["cases"]} >= {"seen-before-200s", "expired", "bad-signature"}
    for case in doc["cases"]:
        data, now = bytes.fromhex(case["envelope_hex"]), case["received_at_s"]
        cache = ReplayCache()
        if case["accepted_before"]:
            open_envelope(data, now=NOW, replay=cache)
        try:
            open_envelope(data, now=now, replay=cache, expected_signer=case["transport_sender"])
            reason = None
        except CodecError as exc:
            reason = exc.reason
        assert reason == case["reason"], case["name"]
        assert (reason is not None and blames_forwarder(reason)) == case["blames_forwarder"], case["name"]


def test_replay_cache_is_bounded_and_forgets_expired():
    cache = ReplayCache(max_entries=10)
    for i in range(50):
        assert cache.check_and_add(bytes([i]) * 32, NOW + 100, NOW)
    assert len(cache) <= 10
    assert cache.check_and_add(b"new" * 11, NOW + 1, NOW + 200)
    assert len(cache) == 1, "expired IDs were dropped"


def test_future_dated_and_expired():
    reject(sealed(now=NOW + MAX_SKEW_S + 5), "future")
    open_envelope(sealed(now=NOW + MAX_SKEW_S - 5), now=NOW)
    reject(sealed(now=NOW - MAX_AGE_S - 5), "expired")


def test_unknown_version_and_type():
    reject(mutate(sealed(), v=2), "bad-version")
    reject(_resign(ALICE, "teleport", {}), "unknown-type")


def test_non_canonical_encoding_rejected():
    raw = msgpack.unpackb(sealed(), raw=False)
    reordered = msgpack.packb(dict(reversed(list(raw.items()))), use_bin_type=True)
    reject(reordered, "non-canonical")


def test_message_fields_are_checked_after_signature():
    job = bytes(32)
    good = CheckpointCommit(job, 0, 0, 0, 10, 1, bytes(32), bytes(32), 1.0, None)
    body = good.to_wire()
    err = reject(_resign(ALICE, "ckpt", {**body, "checkpoint_cid": "not-a-cid"}), "bad-field")
    assert "checkpoint_cid" in str(err)
    err = reject(_resign(ALICE, "ckpt", {**body, "chain_head": b"short"}), "bad-field")
    assert "chain_head: expected a 32-byte digest" in str(err)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400))
def test_random_bytes_only_raise_codec_error(data):
    with pytest.raises(CodecError):
        open_envelope(data, now=NOW)


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_mutated_envelopes_never_open_and_only_raise_codec_error(data):
    good = sealed(CheckpointCommit(bytes(32), 0, 1, 0, 10, 1, bytes(32), bytes(32), 1.0, None))
    pos = data.draw(st.integers(0, len(good) - 1))
    new = data.draw(st.integers(0, 255).filter(lambda b: b != good[pos]))
    mutated = good[:pos] + bytes([new]) + good[pos + 1:]
    with pytest.raises(CodecError):
        open_envelope(mutated, now=NOW)


def test_codec_decode_limits():
    with pytest.raises(CodecError) as info:
        decode_canonical(b"\x91" * 40 + b"\x01")
    assert info.value.reason in {"too-deep", "malformed"}
    with pytest.raises(CodecError):
        decode_canonical(msgpack.packb(float("nan")))
    with pytest.raises(CodecError):
        canonical_encode({"x": object()})
