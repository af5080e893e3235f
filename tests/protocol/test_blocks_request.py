"""ipips/vectors/blocks-request.json (IPIP-0003 §4, §4.2): protocol/blocks.py's request, replayed from the vectors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from protocol import blocks
from protocol.cid import parse_cid
from protocol.errors import CodecError

DOC = json.loads((Path(__file__).resolve().parents[2] / "ipips/vectors/blocks-request.json").read_text())


def test_a_request_is_sent_and_read_as_the_vectors_say():
    assert {c["read"] is None for c in DOC["well_formed"]} == {True, False}
    for case in DOC["well_formed"]:
        wire = bytes.fromhex(case["wire_hex"])
        body = wire[1:]
        assert wire[0] == len(body), case["name"]
        if case["read"] is None:
            with pytest.raises(CodecError):
                blocks.parse_request(body, case["protocol"])
            continue
        got = blocks.parse_request(body, case["protocol"])
        assert [str(c) for c in got.wants] == case["read"]["wants"], case["name"]
        assert (got.wait_ms, got.shallow) == (case["read"]["wait_ms"], case["read"]["shallow"]), case["name"]
        again = blocks.encode_request([parse_cid(c) for c in case["read"]["wants"]], got.wait_ms, got.shallow)
        assert again == wire, case["name"]  # one encoding: a key only when it asks for something


def test_malformed_requests_are_refused():
    for case in DOC["malformed"]:
        with pytest.raises(CodecError):
            blocks.parse_request(bytes.fromhex(case["body_hex"]), case["protocol"])
