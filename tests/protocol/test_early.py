"""ipips/vectors/early-start.json (IPIP-0006 §2.9): protocol/early.py's rules, replayed from the vectors."""

from __future__ import annotations

import json
from pathlib import Path

from protocol import early
from protocol.messages import EarlyStart, Verdict
from protocol.unixfs import deal
from scripts.make_early_vectors import state_of

DOC = json.loads((Path(__file__).resolve().parents[2] / "ipips/vectors/early-start.json").read_text())


def test_when_a_round_may_be_announced():
    assert {c["ready"] for c in DOC["ready"]} == {True, False}
    for case in DOC["ready"]:
        assert early.ready(state_of(case["state"]), case["rounds"]) == case["ready"], case["name"]


def test_who_is_announced_which_shard():
    for case in DOC["assignment"]:
        verdicts = [Verdict(bytes(32), 1, 0, 1, v["worker"], 1, v["accepted"], "x", ()) for v in case["verdicts"]]
        pairs = [tuple(p) for p in case["trained"]]
        assert [list(p) for p in early.assignment(pairs, case["coordinator"], verdicts)] == case["announced"], case["name"]


def test_when_a_worker_takes_an_announcement():
    assert {c["taken"] for c in DOC["refusal"]} == {True, False}
    for case in DOC["refusal"]:
        msg = EarlyStart(bytes(32), case["early_round"], case["early_term"], "bafkreifjjcie6lypi6ny7amxnfftagclbuxndqonfipmb64f2km2devei4",
                         tuple(case["early_shards"]), tuple("A" for _ in case["early_shards"]))
        why = early.refusal(msg, case["signer"], case["coordinator"], case["coordination_term"],
                            state_of(case["state"]), case["rounds"])
        assert (why is None) == case["taken"], case["name"]


def test_where_an_early_start_stands():
    assert {c["standing"] for c in DOC["standing"]} == {early.OURS, early.WAIT, early.OPEN, "void"}
    for case in DOC["standing"]:
        out = early.standing(state_of(case["state"]), case["published"], case["round"], case["shard"], case["attempt"],
                             case["worker"], case["start"])
        assert (out if out in (early.OURS, early.WAIT, early.OPEN) else "void") == case["standing"], case["name"]


def test_who_fetches_an_announced_start_together_and_which_parts_each_takes():
    for case in DOC["swarm"]:
        msg = EarlyStart(bytes(32), 2, 1, "bafkreifjjcie6lypi6ny7amxnfftagclbuxndqonfipmb64f2km2devei4",
                         tuple(range(len(case["early_workers"]))), tuple(case["early_workers"]))
        assert list(early.swarm(msg, case["submitter"])) == case["members"], case["name"]
    for case in DOC["deal"]:
        dealt = deal(case["parts"], case["members"])
        assert dealt == case["dealt"], case["name"]
        assert sorted(j for indices in dealt.values() for j in indices) == list(range(case["parts"])), case["name"]


def test_when_a_worker_claims_its_early_shard_again():
    assert {c["reclaim"] for c in DOC["reclaim"]} == {True, False}
    for case in DOC["reclaim"]:
        assert early.reclaim(case["open_for"], case["early_term"], case["term"], case["holding"]) == case["reclaim"], \
            case["name"]


def test_which_shards_a_worker_trains_after_its_announced_one_and_which_it_claims_last():
    assert any(c["queued"] for c in DOC["queue"]) and any(not c["queued"] for c in DOC["queue"])
    for case in DOC["queue"]:
        announced = case["announced"]
        msg = EarlyStart(bytes(32), 2, 1, "bafkreifjjcie6lypi6ny7amxnfftagclbuxndqonfipmb64f2km2devei4",
                         tuple(i for i, _ in announced), tuple(w for _, w in announced))
        trained = [tuple(p) for p in case["trained"]]
        assert list(early.queued(trained, msg, case["worker"])) == case["queued"], case["name"]
        reserved = early.reserved(trained, msg, case["worker"])
        assert sorted(reserved) == case["reserved"], case["name"]
        assert early.claimable(case["open"], reserved) == case["claimable"], case["name"]
        # a worker's queue and its announced shard are never another's: nobody else trains them early
        others = {w for _, w in announced} - {case["worker"]}
        for other in others:
            assert not set(early.queued(trained, msg, other)) & set(case["queued"]), case["name"]
