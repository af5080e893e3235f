"""A full fine-tuning job through real agents (issue 26 step 3): every weight of the tiny model trains on each
worker, each report is replay-verified, the weights are averaged (fedavg), every round is scored, and the
submitter's fetch is a model directory transformers loads."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agent.train.data import write_chatml
from agent.train.tiny import demo_records
from protocol import state as st
from tests.roles.conftest import fast_spec, network

pytestmark = pytest.mark.network


async def test_a_full_fine_tuning_job_runs_replay_verified_and_fetches_as_a_model(tmp_path, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from agent.control import HANDLERS

    dataset = tmp_path / "demo.jsonl"
    write_chatml(dataset, demo_records(80, seed=5))
    spec = fast_spec(shards=2, rounds=2, extra="method: full\n")
    spec = replace(spec, training=replace(spec.training, learning_rate=0.001))  # every weight: a smaller step
    assert (spec.method, spec.aggregation, spec.lora.freeze_a) == ("full", "fedavg", False)
    async with network(tmp_path, tiny_model_dir, workers=2) as net:
        submitter = net.submitter
        terms = await submitter.submitter.prepare_terms(spec, dataset, str(tiny_model_dir))
        view = await submitter.submitter.announce(terms)
        await submitter.wait_for(lambda: view.state.terminal, timeout=240)
        assert view.state.phase is st.JobPhase.DONE, view.state.reason
        verdicts = list(view.verdicts.values())
        assert verdicts and all(v.accepted for v in verdicts), verdicts
        first, last = view.aggregates[1], view.aggregates[2]
        assert last.method == "fedavg" and last.validation_loss < first.validation_loss < first.base_validation_loss
        fetched = await HANDLERS["job.fetch"](submitter, job=view.job_id.hex(), out=str(tmp_path / "model"))
    assert fetched["layout"] == "model"
    model = AutoModelForCausalLM.from_pretrained(fetched["path"], dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) > 500_000  # the whole model, not an adapter
