"""Write ipips/vectors/envelope-*.json: exact envelope bytes for fixed keys, nonces and times.

Run it only when the envelope or message rules change on purpose; tests check that the code still
reproduces the committed vectors byte for byte.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from protocol.codec import canonical_encode, decode_canonical  # noqa: E402
from protocol.envelope import seal, signed_bytes  # noqa: E402
from protocol.identity import Identity  # noqa: E402
from protocol import messages as m  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "ipips" / "vectors"
NOW = 1_790_000_000.0
AGGREGATE_CID = "bafkreifjjcie6lypi6ny7amxnfftagclbuxndqonfipmb64f2km2devei4"
UPDATE_CID = "bafkreihdwdcefgh4dqkjv67uzcmw7ojee6xedzdetojuzjevtenxquvyku"


def sample_terms(submitter: Identity) -> m.JobTerms:
    return m.JobTerms(
        name="demo-arith",
        submitter=submitter.peer_id,
        base_model="tiny-qwen2",
        base_model_sha256=bytes(range(32)),
        method="lora",
        runtime="peft",
        seed=1234,
        shards=tuple(
            m.ShardRef(i, "bafkreifjjcie6lypi6ny7amxnfftagclbuxndqonfipmb64f2km2devei4", 100, 12)
            for i in range(2)
        ),
        validation_cid=None,
        training=m.TrainingTerms(1, 0.001, 8, 1, 256, 0),
        lora=m.LoraTerms(8, 16.0, 0.0, ("q_proj", "v_proj"), True),
        proof=m.ProofTerms(10, 2, 1e-4),
        rounds=2,
        aggregation="exact",
        min_accepted_fraction=1.0,
        max_retries=2,
        lease_seconds=120,
        min_vram_gb=0.0,
        deadline=1_790_086_400,
        price_per_hour=0.5,
        budget=10.0,
        created=1_790_000_000,
    )


def sample_capability() -> m.Capability:
    """A GPU worker's capability: two measured CUDA devices and one base model held."""
    devices = (
        m.Device("cuda", 0, "NVIDIA H100 80GB HBM3", 79.19, 78.5, "9.0", True),
        m.Device("cuda", 1, "Tesla T4", 14.58, 14.47, "7.5", False),
    )
    return m.Capability(
        m.Hardware("cuda", "NVIDIA H100 80GB HBM3", 79.19, 251.7, 32), ("peft", "unsloth"), 2.5, True, True, 2,
        "0.1.0", "AMD EPYC 9554 64-Core Processor", devices, (m.ModelHeld("tiny-qwen2", bytes(range(32))),))


def main() -> None:
    alice, bob = Identity(bytes([1]) * 32), Identity(bytes([2]) * 32)
    terms = sample_terms(alice)
    cases = [
        ("heartbeat", alice, m.Heartbeat(7, 1, ())),
        ("job", alice, m.JobAnnouncement.for_terms(terms)),
        ("ckpt", bob, m.CheckpointCommit(terms.job_id(), 0, 1, 0, 20, 2, bytes(32), bytes([9]) * 32, 2.5, None)),
        ("cap", bob, sample_capability()),
        # extension fields (IPIP-0002 §3, IPIP-0004 §12): measured speed; a job's max_nodes and providers
        ("cap-speeds", bob, replace(sample_capability(), speeds=(
            m.ModelSpeed(bytes(range(32)), 1834.5, "cuda:NVIDIA H100 80GB HBM3"),))),
        ("job-market", alice, m.JobAnnouncement.for_terms(replace(terms, max_nodes=2, providers=(bob.peer_id,)))),
        # a coded aggregate's update (IPIP-0006 §2.8.1), named by the early announcement and by the aggregate
        ("early-update", alice, m.EarlyStart(terms.job_id(), 3, 1, AGGREGATE_CID, (0, 1), (bob.peer_id, alice.peer_id),
                                             update_cid=UPDATE_CID)),
        ("aggregate-update", alice, m.AggregatePublished(terms.job_id(), 2, 1, AGGREGATE_CID, "exact", (0, 1), 40, False,
                                                         0.5, None, None, None, update_cid=UPDATE_CID)),
    ]
    vectors = []
    for i, (name, who, msg) in enumerate(cases):
        nonce = bytes([i]) * 16
        data = seal(who, msg, now=NOW, nonce=nonce)
        body = msg.to_wire()
        sb = signed_bytes(1, msg.TYPE, who.public_key, int(NOW * 1000), nonce, body)
        vectors.append({
            "name": name,
            "signer_seed_hex": who.seed.hex(),
            "signer_peer_id": who.peer_id,
            "timestamp_ms": int(NOW * 1000),
            "nonce_hex": nonce.hex(),
            "type": msg.TYPE,
            "body_canonical_hex": canonical_encode(body).hex(),
            "signed_bytes_hex": sb.hex(),
            "envelope_hex": data.hex(),
            "message_id_hex": __import__("hashlib").sha256(sb).hexdigest(),
        })
    doc = {
        "description": "Envelopes sealed with fixed keys (seed = byte repeated 32 times), nonces and time; "
        "see ipips/0001-envelope-identity.md. job_id of the 'job' case = sha256(b'infernet/job/v1\\x00' + "
        "canonical terms).",
        "now_s": NOW,
        "job_id_hex": terms.job_id().hex(),
        "vectors": vectors,
    }
    (OUT / "envelope-vectors.json").write_text(json.dumps(doc, indent=1) + "\n")
    ids = {"description": "Ed25519 seeds and their libp2p peer IDs", "vectors": [
        {"seed_hex": Identity(bytes([b]) * 32).seed.hex(), "public_key_hex": Identity(bytes([b]) * 32).public_key.hex(),
         "peer_id": Identity(bytes([b]) * 32).peer_id} for b in (0, 1, 2, 255)
    ]}
    (OUT / "identity-vectors.json").write_text(json.dumps(ids, indent=1) + "\n")
    (OUT / "envelope-blame.json").write_text(json.dumps(blame_vectors(alice, bob), indent=1) + "\n")
    print("wrote", OUT / "envelope-vectors.json", OUT / "identity-vectors.json", OUT / "envelope-blame.json")


def blame_vectors(alice: Identity, bob: Identity) -> dict:
    """IPIP-0001 §4: which rejections count against the forwarder, and the transport's seen window."""
    from protocol.envelope import MAX_AGE_S, MAX_SKEW_S, SEEN_TTL_S, blames_forwarder

    good = seal(alice, m.Heartbeat(7, 1, ()), now=NOW, nonce=bytes([1]) * 16)
    fields = decode_canonical(good, max_bytes=len(good))
    fields["s"] = bytes([fields["s"][0] ^ 1]) + fields["s"][1:]
    tampered = canonical_encode(fields)
    cases = [  # (name, envelope, received this many seconds after it was signed, accepted before, sent by)
        ("fresh", good, 1.0, False, alice),
        ("seen-before", good, 1.0, True, alice),
        # a copy between py-libp2p's default seen window (120 s) and the envelope's (300 s): issue 21
        ("seen-before-200s", good, 200.0, True, alice),
        ("expired", good, MAX_AGE_S + 1.0, False, alice),
        ("future", good, -(MAX_SKEW_S + 1.0), False, alice),
        ("bad-signature", tampered, 1.0, False, alice),
        ("wrong-signer", good, 1.0, False, bob),
    ]
    out = []
    for name, data, after, seen, sender in cases:
        reason = _reason(data, NOW + after, seen, sender)
        out.append({"name": name, "envelope_hex": data.hex(), "received_at_s": NOW + after, "accepted_before": seen,
                    "transport_sender": sender.peer_id, "reason": reason,
                    "blames_forwarder": reason is not None and blames_forwarder(reason)})
    return {
        "description": "Who is blamed for a rejected envelope (ipips/0001-envelope-identity.md §4): the reason "
        "open_envelope gives an envelope received at received_at_s (accepted_before: its message ID is in the "
        "receiver's replay cache), and whether that reason counts against the peer that forwarded it. A "
        "transport must remember seen messages at least seen_ttl_s = max_age_s + max_skew_s.",
        "max_age_s": MAX_AGE_S, "max_skew_s": MAX_SKEW_S, "seen_ttl_s": SEEN_TTL_S, "cases": out,
    }


def _reason(data: bytes, now: float, seen: bool, sender: Identity) -> str | None:
    from protocol.envelope import ReplayCache, open_envelope
    from protocol.errors import CodecError

    cache = ReplayCache()
    if seen:
        open_envelope(data, now=now - 0.5 if now - 0.5 > NOW else NOW, replay=cache)
    try:
        open_envelope(data, now=now, replay=cache, expected_signer=sender.peer_id)
    except CodecError as exc:
        return exc.reason
    return None


if __name__ == "__main__":
    main()
