"""GPU jobs between real agents: declared GPUs take them, CPU-only peers refuse them, only peers that can
replay them are elected to coordinate, and the ledger says what the work really ran on.

The peers' hardware is declared (agent/hardware.Machine), so the test means the same on a CPU machine and on
a CUDA one; what differs is only what torch reports: on a CUDA machine a declared GPU's free VRAM is measured
again (hardware.refresh_free, GPU 0 is the real GPU 0) and training runs on the real GPU in bf16 (where it
has bf16), so the expectations below read what the agents measured and what torch says."""

from __future__ import annotations

import math
import os
import sys
from dataclasses import replace

import pytest
import torch

from agent import hardware
from protocol import messages as m
from protocol import state as st
from agent.harness.network import MODEL_NAME
from tests.roles.conftest import fast_spec, network, write_dataset

pytestmark = pytest.mark.network


def declared_gpu(free_gb: float = 20.0) -> hardware.Machine:
    return hardware.Machine("declared CPU", 2, 16.0, (m.Device("cuda", 0, "Declared GPU", 24.0, free_gb, "8.9", True),))


def declared_cpu() -> hardware.Machine:
    return hardware.Machine("declared CPU", 2, 16.0, ())


def trained_on() -> dict:
    """What the ledger should say a declared-GPU worker's training ran on: this process's CUDA GPU when torch
    sees one (bf16 where it supports it; the VRAM the worker declared, whose name differs from the real
    one), else the CPU in float32."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return {"hardware": f"cuda:{torch.cuda.get_device_name()}", "device_class": f"cuda-sm{major}{minor}",
                "dtype": "bfloat16" if torch.cuda.is_bf16_supported() else "float32", "vram_gb": 24.0}
    return {"hardware": "cpu", "device_class": "cpu", "dtype": "float32", "vram_gb": 0.0}


def gpu_spec():
    """A small job that needs 8 GB of VRAM. On CUDA it trains in bf16, which no replay reproduces bit for bit
    (IPIP-0005 §8.1): the job then keeps the default half-precision tolerance instead of fast_spec's 1e-4."""
    spec = fast_spec(shards=2, rounds=1)
    spec = replace(spec, training=replace(spec.training, batch_size=2, gradient_accumulation_steps=4),
                   resources=replace(spec.resources, min_vram_gb=8.0))
    if trained_on()["dtype"] != "float32":
        spec = replace(spec, proof=replace(spec.proof, tolerance=1e-2))
    return spec


async def test_a_gpu_job_goes_to_gpu_workers_and_the_ledger_records_the_real_device(tmp_path, tiny_model_dir):
    dataset = write_dataset(tmp_path / "demo.jsonl")
    spec = gpu_spec()
    machines = {0: declared_cpu(), 1: declared_gpu(), 2: declared_gpu()}
    async with network(tmp_path, tiny_model_dir, workers=3, machines=machines) as net:
        submitter = net.submitter
        cpu_worker, gpu_workers = net.agents["w0"], [net.agents["w1"], net.agents["w2"]]
        # the free VRAM the GPU workers measured: the declared 20 GB here, the real GPU's on a CUDA machine
        free = gpu_workers[0].capabilities.machine.best_free_vram_gb()
        if not torch.cuda.is_available():
            assert free == 20.0
        # the capability of a CPU-only machine: no GPU; the model we hold is listed by hash
        cap = cpu_worker.capabilities.published
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
        free = gpu_workers[0].capabilities.machine.best_free_vram_gb()  # read again: the capability is measured anew when published
        need = math.floor(free) + 2
        assert gpu_workers[0].worker.refusal(replace(terms, min_vram_gb=float(need))).startswith(
            f"job needs {need} GB of free VRAM on one GPU; the most free here is {free:.1f} GB")
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
        heard = row["gpus"][0]["vram_free_gb"]  # as last published: the real GPU's free memory may move a little
        assert row["gpus"][0]["name"] == "Declared GPU" and heard == pytest.approx(free, abs=0 if free == 20.0 else 2)
        assert row["models"] == [{"name": MODEL_NAME, "sha256": terms.base_model_sha256.hex()}] and not row["busy"]
        text = peers_table(table).splitlines()
        assert "vram GB" in text[0] and any("Declared GPU" in line and f"{heard:.0f}/24" in line and MODEL_NAME in line
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
        for data in reports:  # training ran on this machine's GPU if torch sees one, else its CPU; the ledger says which
            assert {k: data[k] for k in ("hardware", "device_class", "dtype", "vram_gb")} == trained_on()
            assert data["runtime"] == "peft" and data["processes"] == 1
            assert data["micro_batch"] == 8  # chosen from the free VRAM (20 GB or more): the whole step
        # the coordinator's lease-time check (IPIP-0004 §5.1), on the capabilities it heard over gossip:
        # a claim from the CPU worker or the submitter would get no lease, the other GPU worker's would
        coordinator = next(a for a in gpu_workers if a.peer_id == view.coordination.coordinator)
        other = next(a for a in gpu_workers if a is not coordinator)
        mirror = coordinator.jobs[view.job_id]
        assert coordinator.coordinator.lease_refusal(mirror, cpu_worker.peer_id) == \
            "job needs 8 GB of VRAM; this agent has no GPU"
        # the submitter declared no machine: it measured this one's, so it has no GPU only where torch sees none
        refusal = "its capability says it does not accept training"
        if not torch.cuda.is_available():
            refusal += "; job needs 8 GB of VRAM; this agent has no GPU"
        assert coordinator.coordinator.lease_refusal(mirror, submitter.peer_id) == refusal
        assert coordinator.coordinator.lease_refusal(mirror, other.peer_id) is None


STAND_IN_UNSLOTH = '''"""A stand-in for unsloth (tests/roles/test_gpu_jobs.py): FastLanguageModel through transformers and peft on
the CPU, so the real runner (agent/train/unsloth_runner.py) runs its real protocol in a real child process."""
import os

import torch

__version__ = "0+stand-in"


class FastLanguageModel:
    @staticmethod
    def from_pretrained(model_name, max_seq_length=None, dtype=None, load_in_4bit=False):
        from agent.train.model import load_base_model, load_tokenizer

        with open(os.environ["STAND_IN_UNSLOTH_LOG"], "a") as log:
            log.write(f"{os.getpid()} {model_name}\\n")
        return load_base_model(model_name, device="cpu", dtype=dtype or torch.float32,
                               quantize_4bit=load_in_4bit), load_tokenizer(model_name)

    @staticmethod
    def get_peft_model(model, r, lora_alpha, lora_dropout, target_modules, bias, random_state,
                       use_gradient_checkpointing):
        from peft import LoraConfig, get_peft_model

        return get_peft_model(model, LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                                                target_modules=list(target_modules), bias=bias, task_type="CAUSAL_LM"))
'''


def stand_in_unsloth_python(where) -> str:
    """An interpreter for INFERNET_UNSLOTH_PYTHON: this Python, with the stand-in unsloth first on its path."""
    package = where / "site" / "unsloth"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(STAND_IN_UNSLOTH)
    python = where / "python"
    path = os.pathsep.join([str(where / "site"), *filter(None, [os.environ.get("PYTHONPATH")]), os.getcwd()])
    python.write_text(f"#!/bin/sh\nPYTHONPATH='{path}' exec '{sys.executable}' \"$@\"\n")
    python.chmod(0o755)
    return str(python)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a real GPU the worker runs the real unsloth child; "
                    "scripts/gpu_check.sh measures it")
async def test_a_runtime_unsloth_job_goes_through_the_worker_s_unsloth_child(tmp_path, tiny_model_dir, monkeypatch):
    """The worker chooses the backend by the job's runtime: an unsloth job runs in the unsloth child process
    (agent/train/unsloth_runner.py, the real runner, with a stand-in unsloth module since this machine has
    no GPU), its checkpoints are committed and its report verified as peft's are, and the ledger says unsloth.
    Without a GPU the worker gives the shard back with one line (the real check); the stand-in is reached
    only with that one check (backends.cuda_available) answered yes."""
    from agent.train import backends
    from agent.train.config import TrainError

    assert not backends.cuda_available()
    with pytest.raises(TrainError) as caught:  # what a worker without CUDA releases the shard with
        backends.select_backend("unsloth")
    assert str(caught.value) == "runtime unsloth needs a CUDA GPU; none found — use runtime: peft"

    log = tmp_path / "stand-in.log"
    monkeypatch.setenv("STAND_IN_UNSLOTH_LOG", str(log))
    monkeypatch.setenv("INFERNET_UNSLOTH_PYTHON", stand_in_unsloth_python(tmp_path / "unsloth"))
    monkeypatch.setattr(backends, "cuda_available", lambda: True)  # only the worker's check; torch is untouched
    dataset = write_dataset(tmp_path / "demo.jsonl")
    spec = replace(fast_spec(shards=1, rounds=1), runtime="unsloth")
    async with network(tmp_path, tiny_model_dir, workers=2, machines={0: declared_gpu(), 1: declared_gpu()}) as net:
        submitter = net.submitter
        gpu_workers = [net.agents["w0"], net.agents["w1"]]
        assert gpu_workers[0].capabilities.published.backends == ("peft", "unsloth")
        terms = await submitter.submitter.prepare_terms(spec, dataset, str(tiny_model_dir))
        assert terms.runtime == "unsloth"
        assert gpu_workers[0].worker.refusal(terms) is None and gpu_workers[0].worker.train_processes(terms) == 1
        view = await submitter.submitter.announce(terms)
        await submitter.wait_for(lambda: view.state.terminal, timeout=240)
        assert view.state.phase is st.JobPhase.DONE, view.state.reason
        # the shard was trained in a child process that loaded the stand-in unsloth
        [loaded] = log.read_text().splitlines()  # once: the replay reused the warm child's built model
        pid, model = loaded.split(maxsplit=1)
        assert int(pid) != os.getpid() and model == str(tiny_model_dir)
        for worker in gpu_workers:
            entries = worker.store.ledger(view.job_id)
            reports = [e.data for e in entries if e.kind == "report"]
            checkpoints = [e.data for e in entries if e.kind == "checkpoint"]
            for data in reports:
                assert data["runtime"] == "unsloth" and data["hardware"] == "cpu" and data["processes"] == 1
                # the child's checkpoint events reached the worker: each committed with its checkpoint's CID
                steps = sorted(c["step"] for c in checkpoints if c["shard"] == data["shard"])
                assert steps == [4, 8] and all(c["checkpoint_cid"] for c in checkpoints)
        assert sum(len([e for e in w.store.ledger(view.job_id) if e.kind == "report"]) for w in gpu_workers) == 1
        # the coordinator (a GPU peer offering unsloth: only those can replay an unsloth job) replayed it with
        # unsloth, in the same warm child the worker trained in (these agents share one process), and accepted it
        assert view.coordination.coordinator in {a.peer_id for a in gpu_workers}
        assert len(view.reports) == 1
        child = backends.warm_child(os.environ["INFERNET_UNSLOTH_PYTHON"])
        assert child.started == 1 and child.requests["train"] == 1 and child.requests["replay"] >= 1
