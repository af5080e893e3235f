"""IPIP-0005 §8 report checks as pure rules (protocol/acceptance.py) against ipips/vectors/acceptance-report.json:
the checks a verifier makes before any replay, the |x| <= 1e4 bound included (issue 23)."""

from __future__ import annotations

import json

from protocol.acceptance import MAX_ABS_VALUE, TensorFacts, adapter_refusal, chain_refusal, header_refusal
from tests.conftest import IPIP_VECTORS


def test_report_check_vectors():
    doc = json.loads((IPIP_VECTORS / "acceptance-report.json").read_text())
    assert doc["max_abs_value"] == MAX_ABS_VALUE
    assert {c["check"] for c in doc["cases"]} == {"header", "chain", "adapter"}
    for case in doc["cases"]:
        if case["check"] == "header":
            refusal = header_refusal(case["header"], case["expected"])
        elif case["check"] == "chain":
            refusal = chain_refusal(case["reported_checkpoints"], case["links"],
                                    [bytes.fromhex(h) for h in case["heads"]],
                                    [(i, bytes.fromhex(h)) for i, h in case["gossiped"]])
        else:
            refusal = adapter_refusal(case["config"], [TensorFacts(t[0], tuple(t[1]), t[2], t[3])
                                                       for t in case["tensors"]],
                                      case["rank"], case["target_modules"], case.get("method", "lora"))
        assert (refusal is None) == case["accept"], (case["name"], refusal)
        assert refusal is None or "\n" not in refusal
