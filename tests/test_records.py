"""Sealed bundles (agent/sealing.py) and the store's copies of other peers' ledger chains with what
agent/ledger_sync.py makes of served chains (no network: two real stores)."""

from __future__ import annotations

import sqlite3

import pytest

from agent.bundle import pack_dir
from agent.ledger_sync import absorb, served_chains
from agent.sealing import must_seal, open_bundle, seal_dir
from agent.store import Store
from protocol.identity import Identity
from protocol.ledger import LedgerEntry, LedgerError
from protocol.sealed import SealError

SUBMITTER = Identity(bytes([7]) * 32)
WORKER = Identity(bytes([8]) * 32)
JOB = bytes(range(32))


def test_a_sealed_bundle_opens_for_the_submitter_only_and_leaves_nothing_behind(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 4}')
    (adapter / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 40)
    sealed = seal_dir(adapter, tmp_path / "sealed", SUBMITTER.peer_id)
    assert sorted(p.name for p in sealed.iterdir()) == ["adapter_config.json.sealed", "adapter_model.safetensors.sealed"]
    bundle = pack_dir(sealed, tmp_path / "final.tar")
    with pytest.raises(SealError, match=f"final.tar: adapter_.*cannot be opened with the key of {WORKER.peer_id}"):
        open_bundle(bundle, tmp_path / "worker-out", WORKER)
    assert not (tmp_path / "worker-out").exists() and not any(p.name.startswith(".worker-out") for p in tmp_path.iterdir())
    out, was_sealed = open_bundle(bundle, tmp_path / "out", SUBMITTER)
    assert was_sealed
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (out / name).read_bytes() == (adapter / name).read_bytes()
    plain, was_sealed = open_bundle(pack_dir(adapter, tmp_path / "plain.tar"), tmp_path / "plain", WORKER)
    assert not was_sealed and (plain / "adapter_config.json").read_text() == '{"r": 4}'


def test_only_the_final_aggregate_of_a_private_job_is_sealed():
    class Terms:
        private = True

    assert must_seal(Terms, final=True) and not must_seal(Terms, final=False)
    Terms.private = False
    assert not must_seal(Terms, final=True)


def _store(tmp_path, identity, name):
    return Store(tmp_path / name / "agent.sqlite3", identity)


def _served(store):
    return [(e.encoded, e.signature) for entries in store.chains(JOB).values() for e in entries]


def test_copies_extend_and_conflicts_are_kept_once(tmp_path):
    with _store(tmp_path, WORKER, "w") as worker, _store(tmp_path, SUBMITTER, "s") as submitter:
        for i in range(3):
            worker.append_event(JOB, "checkpoint", {"round": 1, "shard": 0, "attempt": 1, "step": i, "loss": 1.0}, 10.0 + i)
        chains, problems = served_chains(_served(worker), JOB, WORKER.peer_id)
        assert not problems and absorb(submitter, JOB, chains, WORKER.peer_id, 1.0) == (3, [])
        assert absorb(submitter, JOB, chains, WORKER.peer_id, 1.0) == (0, [])  # nothing new
        assert [e.hash for e in submitter.chains(JOB)[WORKER.public_key]] == [e.hash for e in worker.ledger(JOB)]
        with pytest.raises(LedgerError, match="does not continue our copy"):
            submitter.extend_copy(JOB, WORKER.public_key, worker.ledger(JOB)[:1])
        # the worker rewrites its last entry: a fork, recorded once with both signed entries
        last = worker.ledger(JOB)[-1]
        forged = LedgerEntry.create(WORKER, JOB, 2, last.prev, 99.0, WORKER.peer_id, "done", {})
        worker._db.execute("UPDATE ledger SET entry = ?, signature = ?, hash = ?, kind = 'done' WHERE seq = 2",
                           (forged.encoded, forged.signature, forged.hash))
        chains, _ = served_chains(_served(worker), JOB, WORKER.peer_id)
        added, found = absorb(submitter, JOB, chains, WORKER.peer_id, 2.0)
        assert added == 0 and [c.kind for c in found] == ["fork"]
        assert absorb(submitter, JOB, chains, WORKER.peer_id, 3.0) == (0, [])
        assert [(c["kind"], c["seq"], c["author"]) for c in submitter.conflicts(JOB)] == [("fork", 2, WORKER.peer_id)]


def test_served_junk_is_refused_per_chain(tmp_path):
    with _store(tmp_path, WORKER, "w") as worker, _store(tmp_path, SUBMITTER, "s") as submitter:
        for i in range(3):
            worker.append_event(JOB, "checkpoint", {"round": 1, "shard": 0, "attempt": 1, "step": i, "loss": 1.0}, 1.0)
        pairs = _served(worker)
        chains, invalid = served_chains([pairs[0], pairs[2]], JOB, "peer")  # a chain with a gap
        assert not chains and [(c.kind, c.author, c.seq) for c in invalid] == [("invalid", WORKER.public_key, 1)]
        assert invalid[0].describe().startswith(f"invalid copy: peer served {WORKER.peer_id}'s chain with a bad entry "
                                                "at seq 1: missing")
        # a part of the chain (what a 1.1.0 server sends) that does not continue the copy we hold: refused
        chains, invalid = served_chains([pairs[1]], JOB, "peer")
        assert not invalid and absorb(submitter, JOB, chains, "peer", 1.0)[1][0].describe() == (
            f"invalid copy: peer served {WORKER.peer_id}'s chain with a bad entry at seq 1: "
            "entries from seq 1 do not continue the 0 we hold")
        assert submitter.chains(JOB) == {}
        chains, invalid = served_chains([(pairs[0][0], bytes(64)), pairs[1]], JOB, "peer")
        assert not chains and "bad signature" in invalid[0].describe()
        # a copy of ours that rots on disk is still served (raw): the receiver names it, we do not crash
        worker._db.execute("UPDATE ledger SET signature = ? WHERE seq = 1", (bytes(64),))
        from agent.ledger_sync import frames_for

        assert len(frames_for(worker, JOB)) == 3


def test_a_store_without_the_copy_tables_gets_them_on_open(tmp_path):
    path = tmp_path / "old" / "agent.sqlite3"
    Store(path, WORKER).close()
    db = sqlite3.connect(path)
    db.execute("DROP TABLE ledger_copies")
    db.execute("DROP TABLE ledger_conflicts")
    db.commit()
    db.close()
    with Store(path, WORKER) as store:
        assert store.chains(JOB) == {} and store.conflicts(JOB) == []


def test_only_chains_of_the_jobs_participants_are_kept(tmp_path):
    with _store(tmp_path, WORKER, "w") as worker, _store(tmp_path, SUBMITTER, "s") as submitter:
        worker.append_event(JOB, "done", {}, 1.0)
        chains, _ = served_chains(_served(worker), JOB, WORKER.peer_id)
        assert absorb(submitter, JOB, chains, WORKER.peer_id, 1.0, authors={SUBMITTER.public_key}) == (0, [])
        assert submitter.chains(JOB) == {}
        assert absorb(submitter, JOB, chains, WORKER.peer_id, 1.0, authors={WORKER.public_key}) == (1, [])


def _asked(server, client):
    """What a 1.1.0 server sends a client that names what it holds, as served_chains reads it."""
    from agent.ledger_sync import frames_for
    from protocol.codec import decode_canonical

    return [tuple(decode_canonical(data)) for data in frames_for(server, JOB, client.chain_heads(JOB))]


def test_a_client_that_names_what_it_holds_is_sent_only_what_it_lacks(tmp_path):
    """IPIP-0008 §5.1: each sync used to send and check every entry of every chain (quadratic in a job's length);
    a client that names what it holds is sent the rest, and a truncation or a fork is still found."""
    with _store(tmp_path, WORKER, "w") as worker, _store(tmp_path, SUBMITTER, "s") as submitter:
        for i in range(5):
            worker.append_event(JOB, "checkpoint", {"round": 1, "shard": 0, "attempt": 1, "step": i, "loss": 1.0}, 1.0 + i)
        chains, _ = served_chains(_served(worker)[:3], JOB, "peer")
        assert absorb(submitter, JOB, chains, "peer", 1.0) == (3, [])
        assert submitter.chain_heads(JOB) == {WORKER.public_key: (3, worker.ledger(JOB)[2].hash)}
        sent = _asked(worker, submitter)
        assert [LedgerEntry.decode(*pair).seq for pair in sent] == [3, 4]  # only what it lacks
        chains, invalid = served_chains(sent, JOB, WORKER.peer_id)
        assert not invalid and absorb(submitter, JOB, chains, WORKER.peer_id, 2.0) == (2, [])
        assert [e.hash for e in submitter.ledger_copy(JOB, WORKER.public_key)] == [e.hash for e in worker.ledger(JOB)]
        assert _asked(worker, submitter) == []  # up to date: nothing
        # the worker drops its last entry: it serves its new last one, and the client sees the truncation
        worker._db.execute("DELETE FROM ledger WHERE seq = 4")
        sent = _asked(worker, submitter)
        assert [LedgerEntry.decode(*pair).seq for pair in sent] == [3]
        chains, _ = served_chains(sent, JOB, WORKER.peer_id)
        assert [(c.kind, c.seq, c.held_length, c.served_length) for c in absorb(submitter, JOB, chains, WORKER.peer_id, 3.0)[1]] \
            == [("truncated", 4, 5, 4)]
        # ... and rewrites its entry 3: a fork, proven by the two entries it signed at seq 3
        last = worker.ledger(JOB)[-1]
        forged = LedgerEntry.create(WORKER, JOB, 3, last.prev, 99.0, WORKER.peer_id, "done", {})
        worker._db.execute("UPDATE ledger SET entry = ?, signature = ?, hash = ?, kind = 'done' WHERE seq = 3",
                           (forged.encoded, forged.signature, forged.hash))
        chains, _ = served_chains(_asked(worker, submitter), JOB, WORKER.peer_id)
        found = absorb(submitter, JOB, chains, WORKER.peer_id, 4.0)[1]
        assert [(c.kind, c.seq) for c in found] == [("fork", 3)] and found[0].held.hash == last.hash and \
            found[0].served.hash == forged.hash
        assert len(submitter.ledger_copy(JOB, WORKER.public_key)) == 5  # the copy is never shortened


def test_a_served_part_of_our_own_chain_longer_than_ours_says_our_store_lost_entries(tmp_path):
    with _store(tmp_path, WORKER, "w") as worker, _store(tmp_path, SUBMITTER, "s") as submitter:
        for i in range(3):
            worker.append_event(JOB, "checkpoint", {"round": 1, "shard": 0, "attempt": 1, "step": i, "loss": 1.0}, 1.0)
        chains, _ = served_chains(_served(worker), JOB, WORKER.peer_id)
        absorb(submitter, JOB, chains, WORKER.peer_id, 1.0)
        worker._db.execute("DELETE FROM ledger WHERE seq = 2")
        chains, _ = served_chains(_asked(submitter, worker), JOB, SUBMITTER.peer_id)
        assert [(c.kind, c.seq, c.held_length, c.served_length) for c in absorb(worker, JOB, chains, SUBMITTER.peer_id, 2.0)[1]] \
            == [("truncated", 2, 2, 3)]
