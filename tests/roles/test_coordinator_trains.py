"""Issue 24: a job's coordinator trains too (IPIP-0004 §5.1 rule 1), its reports judged by another peer.

With one shard per machine, a coordinator that never leased itself left one of W machines idle and made
another train two shards a round. Here three workers, three shards: every worker trains one shard, the
coordinator included, and the verdict on the coordinator's report is the judge's (IPIP-0006 rule 6:
the first eligible peer by rank after it), never its own. It is the agent's choice
(``coordinator_trains``, off by default): declined, the coordinator trains nothing and the other two
train the three shards.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from protocol import state as st
from protocol.election import judge_of
from tests.roles.conftest import fast_spec, network, write_dataset

pytestmark = pytest.mark.network


def _trained_by(view) -> dict[int, str]:
    """shard -> the worker whose report of it was accepted."""
    accepted = {(v.round, v.shard, v.attempt) for v in view.verdicts.values() if v.accepted}
    return {key[1]: worker for key, (_, worker) in view.reports.items() if key in accepted}


async def test_the_coordinator_trains_and_another_peer_judges_it(tmp_path, tiny_model_dir):
    dataset = write_dataset(tmp_path / "demo.jsonl")
    overrides = {i: {"coordinator_trains": True} for i in range(3)}
    async with network(tmp_path, tiny_model_dir, workers=3, overrides=overrides) as net:
        submitter, workers = net.submitter, net.workers
        terms = await submitter.submitter.prepare_terms(fast_spec(shards=3, rounds=1), dataset, str(tiny_model_dir))
        view = await submitter.submitter.announce(terms)
        await submitter.wait_for(lambda: view.state.terminal, timeout=120)
        assert view.state.phase is st.JobPhase.DONE, view.state.reason
        coordinator = view.coordination.coordinator
        trained = _trained_by(view)
        assert sorted(trained) == [0, 1, 2] and set(trained.values()) == {w.peer_id for w in workers}, trained
        ours = [(key, v) for key, v in view.verdicts.items() if v.worker == coordinator]
        assert len(ours) == 1
        judge = judge_of(view.job_id, coordinator, coordinator, {w.peer_id for w in workers})
        assert judge not in (None, coordinator)
        coordinator_agent = next(w for w in workers if w.peer_id == coordinator)
        judge_agent = next(w for w in workers if w.peer_id == judge)
        assert coordinator_agent.counters["shards_trained"] == 1
        assert judge_agent.counters["verdicts_accepted"] >= 1  # the judge signed the verdict on the coordinator's work

        # declined (the default): the coordinator trains nothing (the config is read while running)
        for w in workers:
            w.config = replace(w.config, coordinator_trains=False)
        terms = await submitter.submitter.prepare_terms(fast_spec(shards=3, rounds=1), dataset, str(tiny_model_dir))
        view = await submitter.submitter.announce(terms)
        await submitter.wait_for(lambda: view.state.terminal, timeout=120)
        assert view.state.phase is st.JobPhase.DONE, view.state.reason
        trained = _trained_by(view)
        assert sorted(trained) == [0, 1, 2] and view.coordination.coordinator not in trained.values(), trained
