"""IPIP-0008 §5-§6: one chain per author, comparing copies (fork, truncation), and the export file,
with the vectors in ipips/vectors/ledger-export.json.

``python -m tests.protocol.test_ledger_chains write-vectors`` rewrites the vectors (only when the IPIP changes).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

from protocol.identity import Identity
from protocol.ledger import (
    EXPORT_FORMAT, ZERO_HASH, LedgerEntry, LedgerError, compare_chain, export_document, heads_data, verify_chain,
    verify_export,
)

ROOT = Path(__file__).resolve().parents[2]
VECTORS = ROOT / "ipips/vectors/ledger-export.json"
ALICE = Identity(bytes([5]) * 32)  # the submitter in the vectors
BOB = Identity(bytes([6]) * 32)  # a worker
JOB = bytes.fromhex("961c31ceb871be7d3b864ec981e85428255a44e87de542a36c1942d5a33f0143")


def chain(identity: Identity, kinds: list[tuple[str, dict]], job: bytes = JOB, start: float = 1790000000.0):
    out, prev = [], ZERO_HASH
    for seq, (kind, data) in enumerate(kinds):
        entry = LedgerEntry.create(identity, job, seq, prev, start + seq, identity.peer_id, kind, data)
        out.append(entry)
        prev = entry.hash
    return out


def sample_chains() -> dict[bytes, list[LedgerEntry]]:
    """Alice (the submitter) ends her chain with a heads entry: she held Bob's 3 entries (IPIP-0008 §6.1)."""
    bob = _bob_chain()
    announced = ("announced", {"submitter": ALICE.peer_id, "model": "tiny", "parameters": {}, "shards": 1,
                               "price_per_hour": 0.0, "budget": 0.0})
    return {
        ALICE.public_key: chain(ALICE, [announced, ("done", {}), ("heads", heads_data({BOB.public_key: bob},
                                                                                     ALICE.public_key))]),
        BOB.public_key: bob,
    }


def _bob_chain() -> list[LedgerEntry]:
    worker = BOB.peer_id
    return chain(BOB, [
            ("checkpoint", {"round": 1, "shard": 0, "attempt": 1, "step": 4, "loss": 2.5}),
            ("report", {"round": 1, "shard": 0, "attempt": 1, "worker": worker, "adapter_cid": "bafy", "duration": 9.0,
                        "samples": 8, "hardware": "cpu", "price_per_hour": 1.0}),
            ("verdict", {"round": 1, "shard": 0, "attempt": 1, "worker": worker, "accepted": True, "reason": ""})])


def _mutations(document: dict) -> list[tuple[str, dict]]:
    """(name, mutated document): each must fail with the error the vectors record."""
    cases = []

    def case(name, mutate):
        doc = copy.deepcopy(document)
        mutate(doc)
        cases.append((name, doc))

    def flip(doc, i, j):
        raw = bytearray.fromhex(doc["chains"][i]["entries"][j]["signature"])
        raw[0] ^= 1
        doc["chains"][i]["entries"][j]["signature"] = raw.hex()

    case("a signature flipped", lambda d: flip(d, 1, 2))
    case("an entry dropped from the middle", lambda d: d["chains"][1]["entries"].pop(1))
    case("two entries swapped", lambda d: d["chains"][1]["entries"].__setitem__(
        slice(0, 2), [d["chains"][1]["entries"][1], d["chains"][1]["entries"][0]]))
    case("an entry of one author moved into another's chain",
         lambda d: d["chains"][0]["entries"].append(d["chains"][1]["entries"][2]))
    case("a chain's last entry cut", lambda d: d["chains"][1]["entries"].pop())
    case("a participant's whole chain left out", lambda d: (d["chains"].pop(1), d["keys"].pop(BOB.peer_id)))
    case("an author's key replaced", lambda d: d["keys"].__setitem__(BOB.peer_id, ALICE.public_key.hex()))
    case("terms that do not hash to the job", lambda d: d.__setitem__("terms", "80"))
    case("not hex", lambda d: d["chains"][0]["entries"][1].__setitem__("entry", "zz"))
    case("another format", lambda d: d.__setitem__("format", "something/2"))
    return cases


def build_vectors() -> dict:
    document = export_document(JOB, None, sample_chains())
    return {
        "description": "A ledger export file (ipips/0008-ledger.md §6) of two chains, authors with seeds 0x05*32 and "
                       "0x06*32, and mutations of it that `infernet ledger verify` must refuse with exactly these lines.",
        "valid": {"document": document, "chains": {ALICE.peer_id: 3, BOB.peer_id: 3}},
        "invalid": [{"name": name, "document": doc, "error": _error(doc)} for name, doc in _mutations(document)],
    }


def _error(document: dict) -> str:
    try:
        verify_export(document)
    except LedgerError as exc:
        return str(exc)
    raise AssertionError("a mutation verified")


# -- tests ------------------------------------------------------------------------------------------

def test_vectors_are_reproduced_and_each_mutation_fails_with_its_line():
    vectors = json.loads(VECTORS.read_text())
    assert vectors == build_vectors()  # signatures are deterministic: the file is byte for byte ours
    result = verify_export(vectors["valid"]["document"])
    assert {p: len(c) for p, c in result.chains.items()} == vectors["valid"]["chains"]
    for case in vectors["invalid"]:
        with pytest.raises(LedgerError) as caught:
            verify_export(case["document"])
        assert str(caught.value) == case["error"], case["name"]
        assert "\n" not in case["error"]
    errors = {c["name"]: c["error"] for c in vectors["invalid"]}
    assert errors["a signature flipped"].startswith("chains[1].entries[2]: bad signature")
    assert errors["an entry dropped from the middle"].startswith("chains[1].entries[1]: missing")
    assert errors["an entry of one author moved into another's chain"].startswith("chains[0].entries[3]:")
    assert errors["a chain's last entry cut"].startswith("chains[1]: 2 entries, but ") and "cut short" in \
        errors["a chain's last entry cut"]
    assert errors["a participant's whole chain left out"].startswith("chains[0].entries[2]: ") and \
        "no chain of it" in errors["a participant's whole chain left out"]


def test_heads_entries_vouch_for_content_entries_only_and_name_a_changed_head():
    from protocol.ledger import attested_length

    bob = _bob_chain()
    later = chain(BOB, [(e.kind, e.data) for e in bob] + [("heads", {"chains": {}})])
    assert attested_length(later) == 3 == attested_length(bob)  # a heads entry never calls for another
    doc = export_document(JOB, None, sample_chains())
    forked = chain(BOB, [(e.kind, e.data) for e in bob[:2]] + [("done", {})])  # Bob signed another 3rd entry
    doc["chains"][1]["entries"] = [{"entry": e.encoded.hex(), "signature": e.signature.hex()} for e in forked]
    with pytest.raises(LedgerError, match=r"chains\[1\]\.entries\[2\]: is not the head .* signed at "
                                          r"chains\[0\]\.entries\[2\]"):
        verify_export(doc)


def test_verify_chain_names_the_first_bad_entry():
    entries = sample_chains()[BOB.public_key]
    assert verify_chain(entries, JOB, BOB.public_key) == 3
    with pytest.raises(LedgerError, match="seq 0: signed by .*not by the chain's author"):
        verify_chain(entries, JOB, ALICE.public_key)
    with pytest.raises(LedgerError, match="seq 1: missing"):
        verify_chain([entries[0], entries[2]], JOB)
    other = chain(BOB, [("done", {})], job=bytes(32))
    with pytest.raises(LedgerError, match="seq 0: entry names job 0000"):
        verify_chain(other, JOB)


def test_compare_finds_extension_fork_and_truncation_by_its_author_only():
    full = sample_chains()[BOB.public_key]
    conflict, new = compare_chain(full[:1], full, BOB.public_key, ALICE.peer_id)
    assert conflict is None and new == full[1:]
    forged = LedgerEntry.create(BOB, JOB, 1, full[0].hash, 1.0, BOB.peer_id, "done", {})
    conflict, new = compare_chain(full, [full[0], forged], BOB.public_key, ALICE.peer_id)
    assert conflict.kind == "fork" and conflict.seq == 1 and not new
    assert conflict.held.signer == conflict.served.signer == BOB.public_key  # two entries at one seq: the proof
    assert "signed two different entries at seq 1" in conflict.describe()
    conflict, _ = compare_chain(full, full[:2], BOB.public_key, BOB.peer_id)  # the author serves less
    assert conflict.kind == "truncated" and (conflict.held_length, conflict.served_length) == (3, 2)
    assert compare_chain(full, full[:2], BOB.public_key, ALICE.peer_id) == (None, [])  # someone else holds less


def test_export_with_terms_names_the_job_and_checks_them():
    from protocol.codec import canonical_encode
    from scripts.make_envelope_vectors import sample_terms

    terms = sample_terms(ALICE)
    job = terms.job_id()
    chains = {BOB.public_key: chain(BOB, [("done", {})], job=job)}
    document = json.loads(json.dumps(export_document(job, canonical_encode(terms.to_wire()), chains)))
    assert document["format"] == EXPORT_FORMAT
    assert verify_export(document).job_name == terms.name


if __name__ == "__main__":
    if sys.argv[1:] == ["write-vectors"]:
        VECTORS.write_text(json.dumps(build_vectors(), indent=1) + "\n")
