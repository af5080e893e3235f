"""How busy a job kept its workers (agent/utilization.py), and the mirror's figures from signed reports."""

from __future__ import annotations

import math

import pytest

from agent.utilization import Trained, measure, of_mirror


def test_a_worker_idle_between_rounds_and_the_rounds_fixed_cost():
    # two workers, two rounds of 10 s: round 1 from t=0; w1 trains 6 s and w2 4 s, each report lands at t=8;
    # aggregate at 10; round 2 trains 7 s (w1) and 5 s (w2), reports at 18 and 17; aggregate at 20
    trained = [Trained("w1", 1, 8.0, 6.0), Trained("w2", 1, 8.0, 4.0),
               Trained("w1", 2, 18.0, 7.0), Trained("w2", 2, 17.0, 5.0)]
    u = measure(trained, {1: 10.0, 2: 20.0}, start=0.0)
    assert [r.wall for r in u.rounds] == [10.0, 10.0]
    assert [r.busiest for r in u.rounds] == [6.0, 7.0] and [r.fixed for r in u.rounds] == [4.0, 3.0]
    assert u.fixed_per_round == 3.5
    # w1 trains [2,8] and [11,18]: idle 3 s; w2 [4,8] and [12,17]: idle 4 s
    assert (u.workers["w1"].training, u.workers["w1"].idle) == (13.0, 3.0)
    assert (u.workers["w2"].training, u.workers["w2"].idle) == (9.0, 4.0)
    assert math.isclose(u.workers["w1"].utilization, 13 / 16)
    assert math.isclose(u.utilization, 22 / 29)
    assert math.isclose(u.speedup, 22 / 20)  # 1.1 machines' worth of training per second of the job


def test_rounds_without_their_start_and_overlapping_shards_are_counted_once():
    # round 2 has no known start when round 1's aggregate is missing; overlapping spans are not idle
    trained = [Trained("w1", 2, 10.0, 5.0), Trained("w1", 2, 12.0, 4.0)]
    u = measure(trained, {2: 15.0}, start=None)
    assert u.rounds == [] and u.speedup == 0.0
    assert (u.workers["w1"].training, u.workers["w1"].idle) == (9.0, 0.0)
    assert measure([], {}, None).as_json()["utilization"] == 0.0


def test_the_mirror_measures_from_signed_reports_and_bounds_a_workers_stated_seconds_by_its_lease():
    from protocol import messages as m
    from tests.roles.test_job_view import COORD, ELIGIBLE, JOB, NOW, TERMS, W1, W2, lease, view

    def report(shard, seconds):
        return m.ShardReport(JOB, 1, shard, 1, TERMS.shards[shard].cid, TERMS.shards[shard].cid, bytes(32), 1, 4, 32,
                             1.0, {"train_seconds": seconds})

    v = view()
    v.receive(lease(0, 1, W1), COORD.peer_id, NOW, ELIGIBLE)
    v.receive(lease(1, 1, W2), COORD.peer_id, NOW + 1, ELIGIBLE)
    v.receive(report(0, 6.0), W1.peer_id, NOW + 7, ELIGIBLE)
    v.receive(report(1, 1e9), W2.peer_id, NOW + 5, ELIGIBLE)  # a worker claiming more than it could have trained
    for shard, worker in ((0, W1), (1, W2)):
        v.receive(m.Verdict(JOB, 1, shard, 1, worker.peer_id, 1, True, "ok", (0,)), COORD.peer_id, NOW + 8, ELIGIBLE)
    assert v.receive(m.AggregatePublished(JOB, 1, 1, TERMS.shards[0].cid, "exact", (0, 1), 64, False),
                   COORD.peer_id, NOW + 10, ELIGIBLE).actions is not None
    u = of_mirror(v)
    assert u.workers[W1.peer_id].training == 6.0
    assert u.workers[W2.peer_id].training == 4.0  # bounded by the 4 s since its lease applied here
    [r1] = u.rounds
    assert (r1.wall, r1.busiest, r1.fixed) == (10.0, 6.0, 4.0)
