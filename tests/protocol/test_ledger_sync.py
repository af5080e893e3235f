"""ipips/vectors/ledger-sync.json (IPIP-0008 §5.1): what a 1.1.0 sync request says and from which seq a server
sends each chain, replayed from the vectors; and untrusted request bodies are refused with the problem named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from protocol.codec import canonical_encode
from protocol.errors import ProtocolError
from protocol.ledger import MAX_HELD, decode_held, encode_held, serve_from

DOC = json.loads((Path(__file__).resolve().parents[2] / "ipips/vectors/ledger-sync.json").read_text())


def test_the_request_body_is_the_canonical_list_of_what_the_client_holds():
    held = {bytes.fromhex(a): (n, bytes.fromhex(h)) for a, n, h in DOC["request"]["held"]}
    assert encode_held(held).hex() == DOC["request"]["body_hex"]
    assert decode_held(bytes.fromhex(DOC["request"]["body_hex"])) == held


def test_from_which_seq_a_server_sends_a_chain():
    assert {c["start"] for c in DOC["serve_from"]} >= {0, 2, 3, 5}
    for case in DOC["serve_from"]:
        held = None if case["held"] is None else (case["held"][0], bytes.fromhex(case["held"][1]))
        assert serve_from([bytes.fromhex(h) for h in case["server_hashes"]], held) == case["start"], case["name"]


@pytest.mark.parametrize("body, problem", [
    (b"\xc1", "not canonical"),
    (canonical_encode({"a": 1}), "expected a list"),
    (canonical_encode([[bytes(32), 1]]), "chain 0: expected [author (32 bytes), length, head (32 bytes)]"),
    (canonical_encode([[bytes(31), 1, bytes(32)]]), "chain 0: expected"),
    (canonical_encode([[bytes(32), -1, bytes(32)]]), "chain 0: expected"),
    (canonical_encode([[bytes(32), True, bytes(32)]]), "chain 0: expected"),
    (canonical_encode([[bytes(32), 1, bytes(32)], [bytes(32), 2, bytes(32)]]), "chain 1: author named twice"),
    (canonical_encode([[bytes([i % 256, i // 256]) + bytes(30), 1, bytes(32)] for i in range(MAX_HELD + 1)]),
     "4096"),  # (the codec's own array bound, the same number)
])
def test_a_bad_request_body_is_refused_with_its_problem(body, problem):
    with pytest.raises(ProtocolError, match=problem.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        decode_held(body)
