"""ipips/0010-sealed-results.md: keys derived from the identity, sealed boxes only the submitter opens,
vectors in ipips/vectors/sealed-vectors.json; and the spec/terms fields that ask for it (IPIP-0007).

``python -m tests.protocol.test_sealed write-vectors`` rewrites the vectors (a sealed box is random:
only when the IPIP changes)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from protocol.codec import canonical_encode
from protocol.errors import CodecError, SpecError
from protocol.identity import Identity
from protocol.jobspec import dataset_cid, parse_spec
from protocol.messages import JobTerms
from protocol.sealed import SEAL_OVERHEAD, SealError, seal, unseal, x25519_private_key, x25519_public_key

ROOT = Path(__file__).resolve().parents[2]
VECTORS = ROOT / "ipips/vectors/sealed-vectors.json"
SUBMITTER = Identity(bytes([7]) * 32)
WORKER = Identity(bytes([8]) * 32)


def build_vectors() -> dict:
    plaintext = b"adapter_model.safetensors bytes of the final aggregate"
    return {
        "description": "Sealed results (ipips/0010-sealed-results.md): the X25519 keys derived from an Ed25519 "
                       "identity (seed 0x07*32), a libsodium sealed box of 'plaintext' to it, and the seed of "
                       "another identity (a worker) that must fail to open it.",
        "submitter_seed_hex": SUBMITTER.seed.hex(),
        "submitter_peer_id": SUBMITTER.peer_id,
        "x25519_public_hex": x25519_public_key(SUBMITTER.peer_id).hex(),
        "x25519_private_hex": x25519_private_key(SUBMITTER).hex(),
        "plaintext_hex": plaintext.hex(),
        "sealed_hex": seal(plaintext, SUBMITTER.peer_id).hex(),
        "worker_seed_hex": WORKER.seed.hex(),
    }


def test_vectors_open_with_the_submitter_key_only():
    v = json.loads(VECTORS.read_text())
    submitter = Identity(bytes.fromhex(v["submitter_seed_hex"]))
    assert submitter.peer_id == v["submitter_peer_id"]
    assert x25519_public_key(submitter.peer_id).hex() == v["x25519_public_hex"]
    assert x25519_private_key(submitter).hex() == v["x25519_private_hex"]
    sealed = bytes.fromhex(v["sealed_hex"])
    assert len(sealed) == len(bytes.fromhex(v["plaintext_hex"])) + SEAL_OVERHEAD
    assert unseal(sealed, submitter).hex() == v["plaintext_hex"]
    with pytest.raises(SealError, match="cannot be opened with the key of"):
        unseal(sealed, Identity(bytes.fromhex(v["worker_seed_hex"])))


def test_a_sealed_result_opens_with_the_submitters_key_not_a_workers_nor_changed():
    data = bytes(range(256)) * 10
    sealed = seal(data, SUBMITTER.peer_id)
    assert sealed != seal(data, SUBMITTER.peer_id)  # randomised: the CID names these bytes, not the plaintext
    assert unseal(sealed, SUBMITTER) == data
    with pytest.raises(SealError):
        unseal(sealed, WORKER)
    changed = bytearray(sealed)
    changed[100] ^= 1
    with pytest.raises(SealError, match="the thing: cannot be opened"):
        unseal(bytes(changed), SUBMITTER, "the thing")
    with pytest.raises(SealError, match="shorter than a sealed box"):
        unseal(b"short", SUBMITTER)
    with pytest.raises(SealError, match="cannot seal to"):
        seal(b"x", "not-a-peer")


def test_new_spec_keys_and_terms_fields_leave_old_job_ids_alone():
    from scripts.make_envelope_vectors import sample_terms

    terms = sample_terms(SUBMITTER)
    wire = terms.to_wire()
    assert not {"description", "private", "dataset_cid"} & set(wire)  # omitted at their defaults
    private = replace(terms, private=True, description="what for", dataset_cid="bafkreifjjcie6lypi6ny7amxnfftagclbuxndqonfipmb64f2km2devei4")
    assert private.job_id() != terms.job_id()
    assert JobTerms.from_wire(private.to_wire()) == private
    with pytest.raises(CodecError, match="private: holds its default"):
        JobTerms.from_wire({**wire, "private": False})
    assert canonical_encode(JobTerms.from_wire(wire).to_wire()) == canonical_encode(wire)


def test_spec_reads_description_private_and_a_dataset_cid():
    cid = "bafkreifjjcie6lypi6ny7amxnfftagclbuxndqonfipmb64f2km2devei4"
    spec = parse_spec(f"name: x\nbase_model: m\ndescription: |\n  two\n  lines\nprivate: true\n"
                      f"input: {{dataset: 'ipfs://{cid}'}}\n", "s.yml")
    assert spec.private and spec.description == "two\nlines\n"
    assert dataset_cid(spec.input.dataset) == cid == dataset_cid(cid) == dataset_cid(f"ipfs://{cid}/")
    assert dataset_cid("./train.jsonl") is None and dataset_cid("train") is None and dataset_cid(f"./{cid}") is None
    with pytest.raises(SpecError, match=r"^s.yml:4: input.dataset: not an IPFS CID"):
        parse_spec("name: x\nbase_model: m\ninput:\n  dataset: ipfs://nope\n", "s.yml")
    with pytest.raises(SpecError, match=r"^s.yml:1: private: expected true or false"):
        parse_spec("private: 'yes'\nname: x\nbase_model: m\ninput: {dataset: d}\n", "s.yml")


if __name__ == "__main__":
    if sys.argv[1:] == ["write-vectors"]:
        VECTORS.write_text(json.dumps(build_vectors(), indent=1) + "\n")
