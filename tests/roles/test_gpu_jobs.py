"""GPU jobs between real agents: declared GPUs (this machine has none) take them, CPU-only peers refuse them,
only peers that can replay them are elected to coordinate, and the ledger says what the work really ran on."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agent import hardware
from protocol import messages as m
from protocol import state as st
from agent.harness.network import MODEL_NAME
from tests.roles.conftest import fast_spec, network, write_dataset

pytestmark = pytest.mark.network


def declared_gpu(free_gb: float = 20.0) -> hardware.Machine:
    return hardware.Machine("declared CPU", 2, 16.0, (m.Device("cuda", 0, "Declared GPU", 24.0, free_gb, "8.9", True),))


async def test_a_gpu_job_goes_to_gpu_workers_and_the_ledger_records_the_real_device(tmp_path, tiny_model_dir):
    dataset = write_dataset(tmp_path / "demo.jsonl")
    spec = fast_spec(shards=2, rounds=1)
    spec = replace(spec, training=replace(spec.training, batch_size=2, gradient_accumulation_steps=4),
                   resources=replace(spec.resources, min_vram_gb=8.0))
    async with network(tmp_path, tiny_model_dir, workers=3, machines={1: declared_gpu(), 2: declared_gpu()}) as net:
        submitter = net.submitter
        cpu_worker, gpu_workers = net.agents["w0"], [net.agents["w1"], net.agents["w2"]]
        # the measured capability: this CPU machine has no GPU; the model we hold is listed by hash
        cap = cpu_worker.published_capability
        assert cap.hardware.device == "cpu" and cap.devices == () and cap.backends == ("peft",)
        assert [x.name for x in cap.models] == [MODEL_NAME]
        # the model's file hashes are in the store: a restart does not read the model again
        stored = {key[0] for key, _ in cpu_worker.store.file_hashes()}
        assert str((tiny_model_dir / "model.safetensors").resolve()) in stored
        terms = await submitter.submitter.prepare_terms(spec, dataset, str(tiny_model_dir))
        assert terms.min_vram_gb == 8.0 and cap.models[0].sha256 == terms.base_model_sha256
        assert cpu_worker.worker.refusal(terms) == "job needs 8 GB of VRAM; this agent has no GPU"
        assert gpu_workers[0].worker.refusal(terms) is None
        # one process per GPU: asking for more than the machine has is refused before any claim
        config = gpu_workers[0].config
        gpu_workers[0].config = replace(config, train_processes=2)
        assert gpu_workers[0].worker.refusal(terms) == \
            "train_processes = 2, but this machine has 1 CUDA device(s): one training process per GPU"
        gpu_workers[0].config = config
        assert gpu_workers[0].worker.train_processes(terms) == 1  # 0: one per CUDA device, and it has one
        assert gpu_workers[0].worker.refusal(replace(terms, min_vram_gb=22.0)).startswith(
            "job needs 22 GB of free VRAM on one GPU; the most free here is 20.0 GB")
        # unsloth: one clear reason without CUDA; with a GPU but no unsloth installed, another
        unsloth = replace(terms, runtime="unsloth", min_vram_gb=0.0)
        assert cpu_worker.worker.refusal(unsloth) == "runtime unsloth needs a CUDA GPU; this agent has none"
        if not hardware.unsloth_installed():
            assert gpu_workers[0].worker.refusal(unsloth) == "runtime unsloth is not offered here (offers: peft)"
        # only the declared-GPU peers can replay it, so only they are eligible to coordinate
        assert submitter.eligible_coordinators(terms) == frozenset(a.peer_id for a in gpu_workers)
        # what `infernet peers` shows: GPU, VRAM free/total, models, price, busy/idle
        from agent.cli import peers_table
        from agent.control import _peers

        table = await _peers(submitter)
        row = next(p for p in table if p["peer_id"] == gpu_workers[0].peer_id)
        assert row["gpus"][0]["name"] == "Declared GPU" and row["gpus"][0]["vram_free_gb"] == 20.0
        assert row["models"] == [{"name": MODEL_NAME, "sha256": terms.base_model_sha256.hex()}] and not row["busy"]
        text = peers_table(table).splitlines()
        assert "vram GB" in text[0] and any("Declared GPU" in line and "20/24" in line and MODEL_NAME in line
                                            and " idle " in line for line in text[1:])
        assert any(" cpu " in line for line in text[1:])  # the CPU worker
        view = await submitter.submitter.announce(terms)
        await submitter.wait_for(lambda: view.state.terminal, timeout=240)
        assert view.state.phase is st.JobPhase.DONE, view.state.reason
        assert view.coordination.coordinator in {a.peer_id for a in gpu_workers}
        trainers = {report.worker if hasattr(report, "worker") else by for report, by in view.reports.values()}
        assert trainers <= {a.peer_id for a in gpu_workers} and cpu_worker.counters["shards_trained"] == 0
        reports = [e.data for w in gpu_workers for e in w.store.ledger(view.job_id) if e.kind == "report"]
        assert reports
        for data in reports:  # training ran on this machine's CPU, and the ledger says so
            assert data["hardware"] == "cpu" and data["device_class"] == "cpu" and data["runtime"] == "peft"
            assert data["dtype"] == "float32" and data["micro_batch"] == 8  # chosen from 20 GB free: the whole step
        # the coordinator's lease-time check (IPIP-0004 §5.1), on the capabilities it heard over gossip:
        # a claim from the CPU worker or the submitter would get no lease, the other GPU worker's would
        coordinator = next(a for a in gpu_workers if a.peer_id == view.coordination.coordinator)
        other = next(a for a in gpu_workers if a is not coordinator)
        mirror = coordinator.jobs[view.job_id]
        assert coordinator.coordinator.lease_refusal(mirror, cpu_worker.peer_id) == \
            "job needs 8 GB of VRAM; this agent has no GPU"
        assert coordinator.coordinator.lease_refusal(mirror, submitter.peer_id) == \
            "its capability says it does not accept training; job needs 8 GB of VRAM; this agent has no GPU"
        assert coordinator.coordinator.lease_refusal(mirror, other.peer_id) is None
