"""A job whose input is a Hugging Face dataset (input.hf), through real agents: the submitter converts the split,
shards it, names the Hub source and the converted file's CID in the terms, and the job runs to DONE (issue 26)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.pipeline.test_hfdata import sharegpt_repo  # also turns the Hub off for datasets (before its import)
from protocol import state as st
from tests.roles.conftest import fast_spec, network

pytestmark = pytest.mark.network


async def test_a_job_from_a_hugging_face_dataset_runs_and_names_its_source(tmp_path, tiny_model_dir):
    from agent.hfdata import spec_dataset

    repo = sharegpt_repo(tmp_path / "repo", rows=120)
    spec = fast_spec(shards=2, rounds=1)
    spec = replace(spec, input=replace(spec.input, dataset="", hf=str(repo), split="train"))
    async with network(tmp_path, tiny_model_dir, workers=2) as net:
        submitter = net.submitter
        dataset = spec_dataset(spec.input, submitter.work_dir / "datasets")
        terms = await submitter.submitter.prepare_terms(spec, dataset, str(tiny_model_dir))
        assert terms.dataset_source == f"hf:{repo} split=train"
        from protocol.cid import parse_cid

        assert terms.dataset_cid and submitter.content.store.has(parse_cid(terms.dataset_cid))  # the file, by CID
        assert sum(shard.records for shard in terms.shards) == 108  # 120 rows less the 10 % validation split
        view = await submitter.submitter.announce(terms)
        await submitter.wait_for(lambda: view.state.terminal, timeout=240)
        assert view.state.phase is st.JobPhase.DONE, view.state.reason
