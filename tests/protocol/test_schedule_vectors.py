"""ipips/vectors/round-schedule.json (IPIP-0006 §2.5): protocol/schedule.py's rules, replayed from the vectors."""

from __future__ import annotations

import json
from pathlib import Path

from protocol import schedule

DOC = json.loads((Path(__file__).resolve().parents[2] / "ipips/vectors/round-schedule.json").read_text())


def test_round_rates_replay():
    for case in DOC["rates"]:
        got = [schedule.round_learning_rate(case["base"], r, case["rounds"], schedule=case["schedule"],
                                            warmup_rounds=case["warmup_rounds"]) for r in range(1, case["rounds"] + 1)]
        assert got == case["rates"], case


def test_inner_factors_replay():
    for case in DOC["factors"]:
        got = [schedule.inner_rate_factor(case["inner_schedule"], s, case["steps"]) for s in range(case["steps"])]
        assert got == case["factors"], case


def test_round_lengths_and_stream_offsets_replay():
    assert any(case["first_round_steps"] for case in DOC["lengths"])
    for case in DOC["lengths"]:
        rounds = range(1, case["rounds"] + 1)
        assert [schedule.round_steps(case["max_steps"], case["first_round_steps"], r) for r in rounds] == \
            case["round_steps"], case
        assert [schedule.stream_offset(case["max_steps"], case["first_round_steps"], r) for r in rounds] == \
            case["stream_offset"], case
