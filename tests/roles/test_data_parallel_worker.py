"""One worker, two processes, through the real agents: the worker trains its shard data-parallel (gloo on
this CPU, ``train_processes = 2``), and a coordinator in one process replays its proof and accepts it."""

from __future__ import annotations

import pytest

from protocol import state as st
from tests.roles.conftest import fast_spec, network, write_dataset

def _one_gpu() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() < 2


pytestmark = [pytest.mark.network, pytest.mark.slow,
              pytest.mark.skipif(_one_gpu(), reason="two ranks need two GPUs on a CUDA machine (one per GPU)")]


async def test_a_two_process_worker_is_verified_by_a_one_process_coordinator(tmp_path, tiny_model_dir):
    dataset = write_dataset(tmp_path / "demo.jsonl")
    spec = fast_spec(shards=1, rounds=1)
    overrides = {0: {"train_processes": 2, "can_coordinate": False, "threads": 2},
                 1: {}}  # w1 alone may coordinate, and a coordinator never trains its own job
    async with network(tmp_path, tiny_model_dir, workers=2, overrides=overrides) as net:
        submitter, trainer, coordinator = net.submitter, net.agents["w0"], net.agents["w1"]
        terms = await submitter.submitter.prepare_terms(spec, dataset, str(tiny_model_dir))
        assert trainer.worker.train_processes(terms) == 2
        view = await submitter.submitter.announce(terms)
        await submitter.wait_for(lambda: view.state.terminal, timeout=240)
        assert view.state.phase is st.JobPhase.DONE, view.state.reason
        assert view.coordination.coordinator == coordinator.peer_id and trainer.counters["shards_trained"] == 1
        [report] = [e.data for e in trainer.store.ledger(view.job_id) if e.kind == "report"]
        # two ranks, one micro-batch of 4 each, one thread each; the coordinator replayed it in one process
        assert report["processes"] == 2 and report["micro_batch"] == 4 and report["hardware"] == "cpu"
        assert coordinator.counters["verdicts_accepted"] >= 1
