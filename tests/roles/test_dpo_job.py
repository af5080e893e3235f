"""A DPO job through real agents (issue 26 step 2): preference shards, workers training the DPO loss, the
coordinator replaying a segment of each, and every round scored with the DPO loss and reward accuracy."""

from __future__ import annotations

import math

import pytest

from agent.train.data import write_chatml
from agent.train.preference import demo_preferences
from protocol import state as st
from tests.roles.conftest import fast_spec, network

pytestmark = pytest.mark.network


async def test_a_dpo_job_runs_replay_verified_and_each_round_scores_its_preferences(tmp_path, tiny_model_dir):
    dataset = tmp_path / "preferences.jsonl"
    write_chatml(dataset, demo_preferences(80, seed=5))
    spec = fast_spec(shards=2, rounds=2, extra="type: dpo\ndpo: {beta: 0.1}\n")
    assert spec.input.format == "preference"
    async with network(tmp_path, tiny_model_dir, workers=2) as net:
        submitter = net.submitter
        terms = await submitter.submitter.prepare_terms(spec, dataset, str(tiny_model_dir))
        assert (terms.training.objective, terms.training.dpo_beta) == ("dpo", 0.1)
        view = await submitter.submitter.announce(terms)
        await submitter.wait_for(lambda: view.state.terminal, timeout=240)
        assert view.state.phase is st.JobPhase.DONE, view.state.reason
        verdicts = list(view.verdicts.values())
        assert verdicts and all(v.accepted for v in verdicts), verdicts  # each report's segment replayed
        first, last = view.aggregates[1], view.aggregates[2]
        assert first.base_validation_loss == pytest.approx(math.log(2), abs=1e-5)  # the policy is its reference
        assert last.validation_loss < first.base_validation_loss
        assert 0.0 <= last.reward_accuracy <= 1.0 and last.reward_accuracy > 0.5, last
        assert last.reward_margin > 0
