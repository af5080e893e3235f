"""agent/store.py: records round-trip, the ledger chain verifies and catches tampering, data survives
close/reopen and kill -9, and the ledger vectors (ipips/0008-ledger.md) are reproduced byte for byte.

Run as ``python -m tests.test_store child DB START`` it is the writer the kill -9 test kills;
``python -m tests.test_store write-vectors`` rewrites ipips/vectors/ledger-vectors.json (only when
the ledger rules change on purpose).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys

import msgpack
import nacl.signing
import pytest

from agent.store import (
    LEDGER_DOMAIN, SCHEMA_VERSION, LedgerEntry, LedgerError, Store, StoreError, announced_data,
)
from protocol import messages as m
from protocol.codec import canonical_encode
from protocol.envelope import seal
from protocol.identity import Identity
from scripts.make_envelope_vectors import sample_terms
from tests.conftest import IPIP_VECTORS, REPO_ROOT

NOW = 1_790_000_000.0
SUBMITTER = Identity(bytes([1]) * 32)
COORD = Identity(bytes([3]) * 32)
WORKER = Identity(bytes([4]) * 32)
CID = "bafkreifjjcie6lypi6ny7amxnfftagclbuxndqonfipmb64f2km2devei4"
TERMS = sample_terms(SUBMITTER)
JOB = TERMS.job_id()
HARDWARE = {"device": "cpu", "device_name": "x86_64", "vram_gb": 0.0, "ram_gb": 24.0, "cpu_threads": 2}
VECTORS = IPIP_VECTORS / "ledger-vectors.json"


def report_envelope(n: int, who: Identity = WORKER, shard: int = 0) -> bytes:
    msg = m.ShardReport(JOB, 1, shard, 1, CID, CID, bytes(32), 3, 30, 100, 1.25, {"n": float(n)})
    return seal(who, msg, now=NOW + n, nonce=n.to_bytes(16, "big"))


def report_data(n: int) -> dict:
    return {"round": 1, "shard": 0, "attempt": 1, "worker": WORKER.peer_id, "adapter_cid": CID, "duration": 95.5,
            "samples": 100, "hardware": HARDWARE, "price_per_hour": 0.5, "n": n}


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "data" / "agent.sqlite3"


@pytest.fixture
def store(db_path):
    with Store(db_path, COORD) as s:
        yield s


def raw(path) -> sqlite3.Connection:
    return sqlite3.connect(str(path), isolation_level=None)


# -- jobs and shards ---------------------------------------------------------------------------------

def test_jobs_round_trip(store):
    rec = store.add_job(TERMS, "coordinator", NOW)
    assert (rec.job_id, rec.terms, rec.role, rec.state, rec.round, rec.coordinator_term) == \
        (JOB, TERMS, "coordinator", "ANNOUNCED", 1, 0)
    assert store.add_job(TERMS, "worker", NOW + 5) == rec  # seen again on gossip: unchanged
    updated = store.update_job(JOB, NOW + 10, state="TRAINING", coordinator_term=2)
    assert (updated.state, updated.round, updated.coordinator_term, updated.created, updated.updated) == \
        ("TRAINING", 1, 2, NOW, NOW + 10)
    assert store.jobs() == [updated]
    assert store.job(bytes(32)) is None
    with pytest.raises(StoreError, match="no job 0000000000000000 in the store"):
        store.update_job(bytes(32), NOW, state="DONE")
    with pytest.raises(StoreError, match="role: expected one of submitter, worker, coordinator, observer"):
        store.add_job(TERMS, "boss", NOW)


def test_stored_terms_are_checked_against_the_job_id(store, db_path):
    store.add_job(TERMS, "worker", NOW)
    other = sample_terms(WORKER)
    raw(db_path).execute("UPDATE jobs SET terms = ?", (canonical_encode(other.to_wire()),))
    with pytest.raises(StoreError, match="terms of job .* do not hash to its ID"):
        store.job(JOB)


def test_shards_round_trip(store):
    store.set_shard(JOB, 1, 0, "OPEN", NOW)
    store.set_shard(JOB, 1, 1, "LEASED", NOW, attempt=1, worker=WORKER.peer_id, lease_expires=NOW + 120)
    store.set_shard(JOB, 1, 0, "LEASED", NOW + 1, attempt=2, worker=WORKER.peer_id, lease_expires=NOW + 121)
    store.set_shard(JOB, 2, 0, "OPEN", NOW + 2)
    round1 = store.shards(JOB, round=1)
    assert [(s.shard, s.state, s.attempt, s.worker, s.lease_expires, s.updated) for s in round1] == [
        (0, "LEASED", 2, WORKER.peer_id, NOW + 121, NOW + 1),
        (1, "LEASED", 1, WORKER.peer_id, NOW + 120, NOW),
    ]
    assert [(s.round, s.shard) for s in store.shards(JOB)] == [(1, 0), (1, 1), (2, 0)]


# -- signed envelopes --------------------------------------------------------------------------------

def test_each_message_kind_round_trips_byte_for_byte(store):
    sealed = {
        "job": seal(SUBMITTER, m.JobAnnouncement.for_terms(TERMS), now=NOW),
        "lease": seal(COORD, m.ShardLease(JOB, 1, 0, 1, WORKER.peer_id, 1, NOW + 120, None), now=NOW + 1),
        "report": report_envelope(2),
        "verdict": seal(COORD, m.Verdict(JOB, 1, 0, 1, WORKER.peer_id, 1, True, "2 segments", (0, 2)), now=NOW + 3),
        "aggregate": seal(COORD, m.AggregatePublished(JOB, 1, 1, CID, "exact", (0, 1), 200, False), now=NOW + 4),
        "claim": seal(WORKER, m.ShardClaim(JOB, 1, 0), now=NOW + 5),
    }
    for i, data in enumerate(sealed.values()):
        stored = store.record(data, NOW + 100 + i)
        assert stored.data == data
    assert store.record(sealed["report"], NOW + 999).received == NOW + 102  # a duplicate is a no-op

    def only(found):
        assert len(found) == 1
        return found[0]

    for kind, found in [("lease", store.leases(JOB)), ("report", store.reports(JOB)),
                        ("verdict", store.verdicts(JOB)), ("aggregate", store.aggregates(JOB))]:
        stored = only(found)
        assert stored.type == kind and stored.data == sealed[kind]
    assert only(store.reports(JOB, round=1)).signer == WORKER.peer_id
    assert only(store.verdicts(JOB)).message.segments_checked == (0, 2)
    assert only(store.aggregates(JOB, round=1)).message.shards == (0, 1)
    assert store.reports(JOB, round=2) == []
    assert [s.type for s in store.envelopes(JOB)] == ["job", "lease", "report", "verdict", "aggregate", "claim"]
    assert [s.data for s in store.envelopes(type="claim")] == [sealed["claim"]]


def test_envelopes_that_do_not_verify_are_refused_and_tampering_is_caught_on_read(store, db_path):
    data = bytearray(report_envelope(1))
    data[-5] ^= 1  # inside the body or signature: the signature no longer verifies
    with pytest.raises(StoreError, match="refusing to store an envelope that does not verify"):
        store.record(bytes(data), NOW)
    assert store.envelopes() == []
    good = store.record(report_envelope(1), NOW)
    raw(db_path).execute("UPDATE envelopes SET data = ?", (bytes(data),))
    with pytest.raises(StoreError, match=f"stored envelope {good.message_id.hex()[:16]} does not verify"):
        store.reports(JOB)


# -- transactions ------------------------------------------------------------------------------------

def test_a_failing_block_writes_nothing_and_a_caught_inner_failure_undoes_only_itself(store):
    with pytest.raises(RuntimeError):
        with store.transaction():
            store.record(report_envelope(1), NOW)
            store.append_event(JOB, "report", report_data(1), NOW)
            raise RuntimeError("crash before commit")
    assert store.reports(JOB) == [] and store.ledger(JOB) == []

    with store.transaction():
        store.record(report_envelope(2), NOW)
        with pytest.raises(LedgerError):
            store.append_event(JOB, "report", {"round": 1}, NOW)
        store.append_event(JOB, "report", report_data(2), NOW)
    assert len(store.reports(JOB)) == 1 and [e.seq for e in store.ledger(JOB)] == [0]


# -- the ledger --------------------------------------------------------------------------------------

def fill_ledger(store: Store, n: int = 3) -> list[LedgerEntry]:
    kinds = [("announced", announced_data(TERMS), SUBMITTER.peer_id),
             ("lease", {"round": 1, "shard": 0, "attempt": 1, "worker": WORKER.peer_id, "expires_at": NOW + 120}, None),
             ("report", report_data(0), WORKER.peer_id)]
    return [store.append_event(JOB, kind, data, NOW + i, peer=peer) for i, (kind, data, peer) in enumerate(kinds[:n])]


def test_ledger_round_trip_and_chain(store):
    appended = fill_ledger(store)
    entries = store.ledger(JOB)
    assert entries == appended
    assert [e.seq for e in entries] == [0, 1, 2]
    assert entries[0].prev == bytes(32)
    assert [e.prev for e in entries[1:]] == [e.hash for e in entries[:-1]]
    assert [e.peer for e in entries] == [SUBMITTER.peer_id, COORD.peer_id, WORKER.peer_id]
    assert {e.signer_peer_id for e in entries} == {COORD.peer_id}
    assert entries[0].data["model"] == "tiny-qwen2" and entries[0].data["parameters"]["lora"]["rank"] == 8
    assert entries[2].data["hardware"] == HARDWARE and entries[2].time == NOW + 2
    assert store.verify_ledger(JOB) == 3
    assert store.verify_ledger(bytes(32)) == 0


@pytest.mark.parametrize("column", ["entry", "signature", "hash", "signer"])
def test_flipping_any_stored_byte_is_caught_at_its_seq(store, db_path, column):
    fill_ledger(store)
    db = raw(db_path)
    (original,) = db.execute(f"SELECT {column} FROM ledger WHERE seq = 1").fetchone()
    for i in range(len(original)):
        tampered = bytearray(original)
        tampered[i] ^= 0x01
        db.execute(f"UPDATE ledger SET {column} = ? WHERE seq = 1", (bytes(tampered),))
        with pytest.raises(LedgerError) as caught:
            store.verify_ledger(JOB)
        assert caught.value.seq == 1, (i, str(caught.value))
        assert "seq 1:" in str(caught.value)
    db.execute(f"UPDATE ledger SET {column} = ? WHERE seq = 1", (original,))
    assert store.verify_ledger(JOB) == 3


def test_gaps_reordering_and_relabelled_columns_are_caught(store, db_path):
    fill_ledger(store)
    db = raw(db_path)
    db.execute("UPDATE ledger SET kind = 'verdict' WHERE seq = 2")
    with pytest.raises(LedgerError, match="seq 2: stored kind/signer/hash columns disagree"):
        store.verify_ledger(JOB)
    db.execute("UPDATE ledger SET kind = 'report' WHERE seq = 2")
    db.execute("UPDATE ledger SET seq = 9 WHERE seq = 1")  # moved: its entry still says seq 1
    with pytest.raises(LedgerError, match=r"seq 1: missing \(the next stored entry is seq 2\)"):
        store.verify_ledger(JOB)
    db.execute("UPDATE ledger SET seq = 3 WHERE seq = 2")
    db.execute("UPDATE ledger SET seq = 2 WHERE seq = 9")
    db.execute("UPDATE ledger SET seq = 1 WHERE seq = 3")  # seq 1 and 2 swapped
    with pytest.raises(LedgerError, match="seq 1: entry names job .* seq 2"):
        store.verify_ledger(JOB)


def test_a_re_signed_replacement_entry_breaks_the_chain(store, db_path):
    fill_ledger(store)
    forger = Store(db_path.with_name("forger.sqlite3"), COORD)
    forged = forger.append_event(JOB, "announced", {**announced_data(TERMS), "budget": 1e6}, NOW)
    raw(db_path).execute("UPDATE ledger SET entry = ?, signature = ?, hash = ? WHERE seq = 0",
                         (forged.encoded, forged.signature, forged.hash))
    with pytest.raises(LedgerError, match="seq 1: broken chain"):
        store.verify_ledger(JOB)
    forger.close()


@pytest.mark.parametrize("kind, data, peer, expected", [
    ("paid", {}, None, "kind: expected one of announced, coordinator, lease"),
    ("report", {**report_data(0), "gpu_hours": 0.03}, None, None),  # more keys than required are fine
    ("report", {k: v for k, v in report_data(0).items() if k != "duration"}, None,
     "data.duration: missing \\(a report entry records round, shard, attempt, worker, adapter_cid, duration"),
    ("cancel", {"reason": "x"}, "bob", "peer: not an Ed25519 peer ID: 'bob'"),
    ("cancel", {"reason": {1, 2}}, None, "data cannot be encoded"),
    ("cancel", {"reason": "x" * 70_000}, None, r"entry is \d+ bytes > 65536"),
])
def test_append_checks_the_entry_and_writes_nothing_when_it_is_bad(store, kind, data, peer, expected):
    fill_ledger(store, 1)
    if expected is None:
        assert store.append_event(JOB, kind, data, NOW, peer=peer).seq == 1
        return
    with pytest.raises(LedgerError, match="seq 1: " + kind + ": " + expected):
        store.append_event(JOB, kind, data, NOW, peer=peer)
    assert store.verify_ledger(JOB) == 1


def test_import_continues_another_peers_ledger(store, db_path):
    theirs = fill_ledger(store)
    successor = Store(db_path.with_name("successor.sqlite3"), WORKER)
    with pytest.raises(LedgerError, match="seq 1: cannot import: the next local seq is 0"):
        successor.import_entry(theirs[1].encoded, theirs[1].signature)
    for entry in theirs:
        assert successor.import_entry(entry.encoded, entry.signature) == entry
    assert successor.import_entry(theirs[1].encoded, theirs[1].signature) == theirs[1]  # again: no-op
    mine = successor.append_event(JOB, "coordinator", {"term": 2}, NOW + 10)
    assert mine.prev == theirs[-1].hash
    assert [e.signer_peer_id for e in successor.ledger(JOB)] == [COORD.peer_id] * 3 + [WORKER.peer_id]
    assert successor.verify_ledger(JOB) == 4

    fork = store.append_event(JOB, "cancel", {"reason": "fork"}, NOW + 11)
    with pytest.raises(LedgerError, match="seq 3: conflicts with the entry stored at that seq"):
        successor.import_entry(fork.encoded, fork.signature)
    bad_signature = bytes([fork.signature[0] ^ 1]) + fork.signature[1:]
    with pytest.raises(LedgerError, match=f"seq 3: bad signature \\(signer {COORD.peer_id}\\)"):
        successor.import_entry(fork.encoded, bad_signature)
    with pytest.raises(LedgerError, match="entry: not a canonical entry"):
        successor.import_entry(b"\x81\xa1a\x01\x00", fork.signature)
    assert successor.verify_ledger(JOB) == 4
    successor.close()


def test_import_checks_prev_when_seq_fits(store, db_path):
    theirs = fill_ledger(store, 2)
    other = Store(db_path.with_name("other.sqlite3"), WORKER)
    other.import_entry(theirs[0].encoded, theirs[0].signature)
    stranger = Store(db_path.with_name("stranger.sqlite3"), SUBMITTER)
    stranger.append_event(JOB, "announced", announced_data(TERMS), NOW)
    unrelated = stranger.append_event(JOB, "cancel", {"reason": "x"}, NOW)
    with pytest.raises(LedgerError, match="seq 1: prev does not match the hash of local seq 0"):
        other.import_entry(unrelated.encoded, unrelated.signature)
    other.close()
    stranger.close()


# -- files: reopen, versions, foreign files ----------------------------------------------------------

def test_reopen_sees_everything_committed(db_path):
    with Store(db_path, COORD) as store:
        store.add_job(TERMS, "coordinator", NOW)
        store.set_shard(JOB, 1, 0, "REPORTED", NOW, attempt=1, worker=WORKER.peer_id, lease_expires=NOW + 60)
        report = store.record(report_envelope(1), NOW)
        entries = fill_ledger(store)
    with Store.in_data_dir(db_path.parent, COORD) as again:
        assert again.job(JOB).terms == TERMS
        assert again.shards(JOB)[0].state == "REPORTED"
        assert again.reports(JOB) == [report]
        assert again.ledger(JOB) == entries and again.verify_ledger(JOB) == 3
        assert again.append_event(JOB, "done", {}, NOW + 9).prev == entries[-1].hash


def test_a_newer_schema_and_foreign_files_are_refused(db_path, tmp_path):
    Store(db_path, COORD).close()
    raw(db_path).execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    with pytest.raises(StoreError, match=f"written by a newer infernet-agent \\(schema version {SCHEMA_VERSION + 1}, "
                                         f"this one reads up to {SCHEMA_VERSION}\\)"):
        Store(db_path, COORD)
    junk = tmp_path / "junk.sqlite3"
    junk.write_bytes(b"not a database at all" * 100)
    with pytest.raises(StoreError, match="junk.sqlite3: not a usable infernet store"):
        Store(junk, COORD)
    foreign = tmp_path / "foreign.sqlite3"
    raw(foreign).execute("CREATE TABLE t (x)")
    with pytest.raises(StoreError, match="foreign.sqlite3: not an infernet store"):
        Store(foreign, COORD)


# -- kill -9 -----------------------------------------------------------------------------------------

def child(path: str, start: int) -> None:
    """Commit one report and its ledger entry per transaction, forever; print each n once committed."""
    store = Store(path, COORD)
    for n in range(start, start + 1_000_000):
        with store.transaction():
            store.record(report_envelope(n), NOW + n)
            store.append_event(JOB, "report", report_data(n), NOW + n, peer=WORKER.peer_id)
        print(n, flush=True)


def test_kill_9_loses_nothing_committed_and_tears_nothing(db_path):
    db_path.parent.mkdir(parents=True)
    committed: list[int] = []
    start = 0
    for kill_after in (25, 7, 40):
        proc = subprocess.Popen([sys.executable, "-m", "tests.test_store", "child", str(db_path), str(start)],
                                cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
        seen = 0
        for line in proc.stdout:
            committed.append(int(line))
            seen += 1
            if seen == kill_after:
                os.kill(proc.pid, signal.SIGKILL)  # while it is in its next transaction
                break
        proc.wait(timeout=30)
        proc.stdout.close()
        assert proc.returncode == -signal.SIGKILL and seen == kill_after

        with Store(db_path, COORD) as store:
            reported = [int(r.message.metrics["n"]) for r in store.reports(JOB)]
            logged = [e.data["n"] for e in store.ledger(JOB)]
            assert reported == logged  # each report and its entry committed together or not at all
            assert set(committed) <= set(logged)
            assert logged == list(range(len(logged)))
            assert store.verify_ledger(JOB) == len(logged)
            assert store._db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
            start = logged[-1] + 1
    assert len(committed) == 72


# -- vectors -----------------------------------------------------------------------------------------

VECTOR_SIGNER = Identity(bytes([5]) * 32)
VECTOR_WORKER = Identity(bytes([6]) * 32)
VECTOR_JOB = hashlib.sha256(b"infernet ledger vector job").digest()


def vector_events() -> list[tuple[str, dict, str, float]]:
    signer, worker = VECTOR_SIGNER.peer_id, VECTOR_WORKER.peer_id
    return [
        ("announced", {"name": "vector-job", "submitter": signer, "model": "tiny-qwen2",
                       "parameters": {"rank": 8, "learning_rate": 0.001, "epochs": 1},
                       "shards": 2, "price_per_hour": 0.5, "budget": 10.0}, signer, NOW),
        ("lease", {"round": 1, "shard": 0, "attempt": 1, "worker": worker, "expires_at": NOW + 120.0}, signer, NOW + 1),
        ("report", {"round": 1, "shard": 0, "attempt": 1, "worker": worker, "adapter_cid": CID, "duration": 95.5,
                    "samples": 100, "hardware": HARDWARE, "price_per_hour": 0.5}, worker, NOW + 97),
        ("verdict", {"round": 1, "shard": 0, "attempt": 1, "worker": worker, "accepted": True,
                     "reason": "2 segments replayed within tolerance"}, signer, NOW + 130),
        ("aggregate", {"round": 1, "adapter_cid": CID, "method": "exact", "shards": [0]}, signer, NOW + 140),
    ]


def write_vectors(path) -> None:
    with Store(path, VECTOR_SIGNER) as store:
        entries = [store.append_event(VECTOR_JOB, kind, data, time, peer=peer)
                   for kind, data, peer, time in vector_events()]
    doc = {
        "description": "Ledger entries of one job appended by a store whose identity has seed 0x05 * 32; see "
                       "ipips/0008-ledger.md. hash = sha256(domain || entry), signature = Ed25519(domain || entry).",
        "domain_hex": LEDGER_DOMAIN.hex(),
        "signer_seed_hex": VECTOR_SIGNER.seed.hex(),
        "signer_public_key_hex": VECTOR_SIGNER.public_key.hex(),
        "signer_peer_id": VECTOR_SIGNER.peer_id,
        "job_id_hex": VECTOR_JOB.hex(),
        "entries": [{
            "seq": e.seq, "time": e.time, "peer": e.peer, "kind": e.kind, "data": e.data,
            "prev_hex": e.prev.hex(), "entry_hex": e.encoded.hex(), "hash_hex": e.hash.hex(),
            "signature_hex": e.signature.hex(),
        } for e in entries],
    }
    VECTORS.write_text(json.dumps(doc, indent=1) + "\n")


def sorted_map(value):
    """Canonical key order, computed here independently of protocol/codec.py."""
    if isinstance(value, dict):
        return {k: sorted_map(value[k]) for k in sorted(value, key=lambda k: k.encode())}
    if isinstance(value, list):
        return [sorted_map(v) for v in value]
    return value


def test_vectors_are_reproduced_and_check_independently(db_path):
    doc = json.loads(VECTORS.read_text())
    assert Identity(bytes.fromhex(doc["signer_seed_hex"])).public_key.hex() == doc["signer_public_key_hex"]
    domain = bytes.fromhex(doc["domain_hex"])
    assert domain == b"infernet/ledger/v1\x00"
    verify_key = nacl.signing.VerifyKey(bytes.fromhex(doc["signer_public_key_hex"]))
    prev = bytes(32)
    with Store(db_path, Identity(bytes.fromhex(doc["signer_seed_hex"]))) as store:
        for vec in doc["entries"]:
            entry = store.append_event(bytes.fromhex(doc["job_id_hex"]), vec["kind"], vec["data"], vec["time"],
                                       peer=vec["peer"])
            assert (entry.encoded.hex(), entry.hash.hex(), entry.signature.hex()) == \
                (vec["entry_hex"], vec["hash_hex"], vec["signature_hex"])
            encoded = bytes.fromhex(vec["entry_hex"])
            expected_map = {"job_id": bytes.fromhex(doc["job_id_hex"]), "seq": vec["seq"], "prev": prev,
                            "time": vec["time"], "peer": vec["peer"], "kind": vec["kind"], "data": vec["data"],
                            "signer": verify_key.encode()}
            assert msgpack.packb(sorted_map(expected_map), use_bin_type=True) == encoded
            assert hashlib.sha256(domain + encoded).hexdigest() == vec["hash_hex"]
            verify_key.verify(domain + encoded, bytes.fromhex(vec["signature_hex"]))
            assert vec["prev_hex"] == prev.hex()
            prev = bytes.fromhex(vec["hash_hex"])
        assert store.verify_ledger(bytes.fromhex(doc["job_id_hex"])) == len(doc["entries"])


if __name__ == "__main__":
    if sys.argv[1] == "child":
        child(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1] == "write-vectors":
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            write_vectors(os.path.join(tmp, "vectors.sqlite3"))


# -- the file-hash cache (version 2) -----------------------------------------------------------------

def test_file_hashes_persist_and_a_version_1_store_is_migrated(db_path):
    entries = [(("/models/a/model.safetensors", 10, 123), "ab" * 32), (("/models/a/config.json", 5, 9), "cd" * 32)]
    with Store(db_path, COORD) as store:
        store.add_job(TERMS, "coordinator", NOW)
        store.save_file_hashes(entries)
        store.save_file_hashes([(("/models/a/config.json", 6, 10), "ef" * 32)])  # the file changed: replaced
    with Store(db_path, COORD) as again:
        assert sorted(again.file_hashes()) == sorted([entries[0], (("/models/a/config.json", 6, 10), "ef" * 32)])
    # a store written by version 1 (no file_hashes table) opens, keeps its jobs and gains the table
    db = raw(db_path)
    db.execute("DROP TABLE file_hashes")
    db.execute("UPDATE schema_version SET version = 1")
    db.commit()
    db.close()
    with Store(db_path, COORD) as migrated:
        assert migrated.job(JOB).terms == TERMS and migrated.file_hashes() == []
        migrated.save_file_hashes(entries[:1])
    assert raw(db_path).execute("SELECT version FROM schema_version").fetchone()[0] == SCHEMA_VERSION == 3


# -- faults (issue 17) -------------------------------------------------------------------------------

def test_a_store_truncated_to_zero_bytes_is_refused_not_started_anew(db_path):
    with Store(db_path, COORD) as s:
        s.add_job(TERMS, "coordinator", NOW)
        s.record(report_envelope(1), NOW)
    db_path.write_bytes(b"")  # truncated (the WAL was checkpointed into the file at close)
    assert not db_path.with_name(db_path.name + "-wal").exists()
    with pytest.raises(StoreError, match=r"agent.sqlite3: the store is empty \(0 bytes\): it was truncated"):
        Store(db_path, COORD)
    assert db_path.stat().st_size == 0  # and nothing was written over it


def test_a_store_truncated_after_a_kill_9_beside_its_wal_is_refused(db_path):
    """Issue 25: kill -9 left agent.sqlite3-wal; the store was then truncated to 0 bytes, and the agent
    started on a fresh schema (3 jobs and 21 ledger entries gone, no message). The WAL excused the 0
    bytes. Now the store is refused when neither the file nor its WAL holds the schema."""
    db_path.parent.mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-m", "tests.test_store", "child", str(db_path), "0"],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    for n, _ in enumerate(proc.stdout):
        if n == 5:  # its pages so far checkpointed into the file (as SQLite does every 1000 pages), then killed
            checkpoint = raw(db_path)
            checkpoint.execute("PRAGMA wal_checkpoint(PASSIVE)")
            checkpoint.close()
        if n == 8:
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=30)
    proc.stdout.close()
    wal = db_path.with_name(db_path.name + "-wal")
    assert wal.exists()
    db_path.write_bytes(b"")
    with pytest.raises(StoreError, match=r"agent.sqlite3: the store is empty \(0 bytes; its WAL holds no schema\)"):
        Store(db_path, COORD)
    assert db_path.stat().st_size == 0


def test_random_bytes_over_a_ledger_signature_or_a_stored_report_are_refused_at_open(db_path):
    """Issue 25: 32 random bytes over a stored ledger signature, or inside a stored report's envelope,
    went unnoticed at start (only `job ledger` found the first; nothing found the second)."""
    with Store(db_path, COORD) as s:
        fill_ledger(s)
        good = s.record(report_envelope(1), NOW)
    db = raw(db_path)
    (signature,) = db.execute("SELECT signature FROM ledger WHERE seq = 1").fetchone()
    db.execute("UPDATE ledger SET signature = ? WHERE seq = 1", (os.urandom(32) + signature[32:],))
    db.commit()
    with pytest.raises(StoreError, match=rf"agent.sqlite3: the store is damaged: ledger record job {JOB.hex()[:16]} "
                                         r"seq 1 does not match its digest"):
        Store(db_path, COORD)
    db.execute("UPDATE ledger SET signature = ? WHERE seq = 1", (signature,))
    (data,) = db.execute("SELECT data FROM envelopes").fetchone()
    damaged = bytearray(data)
    damaged[40:72] = os.urandom(32)
    db.execute("UPDATE envelopes SET data = ?", (bytes(damaged),))
    db.commit()
    with pytest.raises(StoreError, match=rf"envelopes record message {good.message_id.hex()[:16]} does not match"):
        Store(db_path, COORD)
    db.execute("UPDATE envelopes SET data = ?", (data,))
    db.commit()
    with Store(db_path, COORD) as again:
        assert again.verify_ledger(JOB) == 3 and len(again.reports(JOB)) == 1


def test_a_version_2_store_is_verified_in_full_once_and_given_digests(db_path):
    with Store(db_path, COORD) as s:
        fill_ledger(s)
        s.record(report_envelope(1), NOW)
    db = raw(db_path)
    db.execute("UPDATE envelopes SET digest = NULL")
    db.execute("UPDATE ledger SET digest = NULL")
    db.execute("UPDATE schema_version SET version = 2")
    (signature,) = db.execute("SELECT signature FROM ledger WHERE seq = 2").fetchone()
    db.execute("UPDATE ledger SET signature = ? WHERE seq = 2", (bytes(64),))
    db.commit()
    with pytest.raises(StoreError, match=rf"ledger record job {JOB.hex()[:16]} seq 2 does not verify"):
        Store(db_path, COORD)
    db.execute("UPDATE ledger SET signature = ? WHERE seq = 2", (signature,))
    db.commit()
    with Store(db_path, COORD) as migrated:
        assert migrated.verify_ledger(JOB) == 3
    assert db.execute("SELECT COUNT(*) FROM ledger WHERE digest IS NULL").fetchone() == (0,)
    assert db.execute("SELECT COUNT(*) FROM envelopes WHERE digest IS NULL").fetchone() == (0,)
    assert db.execute("SELECT version FROM schema_version").fetchone() == (SCHEMA_VERSION,)


def test_garbage_in_a_middle_page_is_refused_at_open(db_path):
    with Store(db_path, COORD) as s:
        s.add_job(TERMS, "coordinator", NOW)
        for n in range(300):
            s.record(report_envelope(n), NOW + n)
    page = raw(db_path).execute("PRAGMA page_size").fetchone()[0]
    size = db_path.stat().st_size
    assert size > 8 * page
    data = bytearray(db_path.read_bytes())
    middle = (size // page // 2) * page
    data[middle:middle + page] = bytes((i * 37 + 11) % 256 for i in range(page))
    db_path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="agent.sqlite3: (the store is damaged|not a usable infernet store)"):
        Store(db_path, COORD)


def test_a_full_disk_is_a_store_full_error_and_nothing_half_written(store):
    from agent.store import StoreFullError

    store.add_job(TERMS, "coordinator", NOW)
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count = {pages}")  # SQLite's own 'disk is full' (SQLITE_FULL)
    with pytest.raises(StoreFullError, match="agent.sqlite3: cannot write: the disk is full"):
        for n in range(200):
            store.record(report_envelope(n), NOW + n)
    with pytest.raises(StoreFullError):
        store.probe_write()
    kept = len(store.envelopes(JOB))
    store._db.execute("PRAGMA max_page_count = 1073741823")  # space again: the same store carries on
    store.probe_write()
    store.record(report_envelope(1000), NOW + 1000)
    assert len(store.envelopes(JOB)) == kept + 1
