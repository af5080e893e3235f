"""One worker, several processes (agent/train/parallel.py): two gloo ranks on the CPU through the
backend the worker selects, against one process; the proof replays in one process within tolerance."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from agent.train.backends import PeftBackend, select_backend
from agent.train.config import TrainConfig, TrainError
from agent.train.parallel import DataParallelBackend, plan_processes, split_for
from agent.train.recorder import checkpoint_name
from agent.train.replay import relative_l2, verify_segment
from agent.train.run import TrainRequest
from protocol.proof import Commitment


def test_each_rank_gets_a_micro_batch_and_the_effective_batch_is_kept():
    config = TrainConfig(batch_size=8, gradient_accumulation_steps=1)
    assert split_for(config, 1) is config
    assert split_for(config, 2).micro_batch == 4 and split_for(config, 2).samples_per_step == 8
    assert split_for(config, 3).micro_batch == 2  # 4 micro-batches over 3 ranks: none idles
    assert split_for(config, 16).micro_batch == 1
    # never larger than what the worker chose for its VRAM
    assert split_for(config.with_(micro_batch_size=1), 2).micro_batch == 1
    assert split_for(TrainConfig(batch_size=6, gradient_accumulation_steps=2), 4).micro_batch == 3


def test_processes_follow_the_operator_else_the_gpus():
    assert plan_processes(0, 0) == 1 and plan_processes(0, 1) == 1 and plan_processes(0, 4) == 4
    assert plan_processes(2, 0) == 2 and plan_processes(1, 8) == 1  # 1: the operator wants one process
    assert isinstance(select_backend("peft", 2), DataParallelBackend)
    assert isinstance(select_backend("peft", 1), PeftBackend)
    with pytest.raises(ValueError):
        DataParallelBackend(1)


def test_two_gloo_processes_train_what_one_process_trains_and_one_process_verifies_it(
        tmp_path, base_config, demo_files):
    # dropout on: the masks must not depend on which rank runs a micro-batch (reseeded per micro-batch)
    config = split_for(base_config.with_(max_steps=4, checkpoint_every=2, dropout=0.1, device="cpu"), 2)  # gloo
    assert config.micro_batch == 4
    runs, events = {}, {"single": [], "ddp": []}
    for name, backend in (("single", PeftBackend()), ("ddp", select_backend("peft", 2))):
        # the one-process reference follows the data-parallel RNG rule, as a verifier's replay does
        request = TrainRequest(config.with_(micro_batch_rng=name == "single"), demo_files["shard0"],
                               tmp_path / name / "run", job_id=bytes(range(32)), worker="12D3KooWTestWorker")
        runs[name] = backend.train(request, events[name].append)
    single, ddp = runs["single"], runs["ddp"]
    assert ddp.environment["data_parallel"] == 2 and "data_parallel" not in single.environment
    assert ddp.environment["micro_batch"] == single.environment["micro_batch"] == 4

    # the adapter: the same within float summation order
    drift = relative_l2(load_file(str(ddp.adapter_dir / "adapter_model.safetensors")),
                        load_file(str(single.adapter_dir / "adapter_model.safetensors")))
    assert max(drift.values()) < 1e-5, max(drift.values())
    # without the rule, one process draws other dropout masks: far outside the tolerance
    plain = PeftBackend().train(TrainRequest(config, demo_files["shard0"], tmp_path / "plain" / "run"))
    drift = relative_l2(load_file(str(ddp.adapter_dir / "adapter_model.safetensors")),
                        load_file(str(plain.adapter_dir / "adapter_model.safetensors")))
    assert max(drift.values()) > 1e-3, max(drift.values())
    # the chain: the same steps, the same samples (the digest names every rank's), losses within tolerance
    chains = {name: Commitment.from_json(json.loads((run.run_dir / "proof.json").read_text()))
              for name, run in runs.items()}
    assert [link.step for link in chains["ddp"].links] == [link.step for link in chains["single"].links] == [2, 4]
    assert [link.batches_digest for link in chains["ddp"].links] == [link.batches_digest for link in chains["single"].links]
    for a, b in zip(chains["ddp"].links, chains["single"].links):
        assert a.loss == pytest.approx(b.loss, rel=1e-5)
    assert chains["ddp"].head == ddp.head
    # rank 0's checkpoints were announced as they happened, with the heads of the proof
    assert [e.head for e in events["ddp"]][-1] == ddp.head and len(events["ddp"]) == 2
    # a verifier in one process replays every segment of the two-process proof. Its environment differs
    # (data_parallel), so the tolerance applies; with two ranks the sum g0 + g1 is even bit for bit one
    # process's, so the hashes may well match
    for index, link in enumerate(chains["ddp"].links):
        start_step = chains["ddp"].segment_start(index)[0]
        checkpoints = ddp.run_dir / "checkpoints"
        verdict = verify_segment(chains["ddp"], index, start=checkpoints / checkpoint_name(start_step),
                                 end=checkpoints / checkpoint_name(link.step), shard=demo_files["shard0"],
                                 config=config.with_(micro_batch_size=0), claimed_head=ddp.head)
        assert verdict.accepted, verdict
    # nothing of the group is left behind
    assert not list((tmp_path / "ddp").glob(".*")) and not list((tmp_path / "ddp").glob("rank-*"))


def test_more_processes_than_gpus_is_one_line_before_any_work(tmp_path, base_config, demo_files):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA machine")
    n = torch.cuda.device_count() + 1
    with pytest.raises(TrainError, match=f"^{n} training processes asked for, but torch sees {n - 1} CUDA device"):
        DataParallelBackend(n).train(TrainRequest(base_config, demo_files["shard0"], tmp_path / "run"))


def test_a_failing_rank_ends_the_group_with_its_own_reason(tmp_path, base_config, demo_files):
    config = base_config.with_(max_steps=2, base_model_sha256="0" * 64, device="cpu")
    request = TrainRequest(config, demo_files["shard0"], tmp_path / "run")
    with pytest.raises(TrainError, match="a different model"):
        DataParallelBackend(2).train(request)


def test_train_processes_is_range_checked_in_the_config_file(tmp_path):
    from agent.config import ConfigError, load_config

    config = tmp_path / "config.toml"
    config.write_text("threads = 2\ntrain_processes = 2\n")
    assert load_config(tmp_path).train_processes == 2
    for value, message in [("65", "must be between 0 and 64 (0: one per CUDA device), got 65"),
                           ("-1", "must be between 0 and 64 (0: one per CUDA device), got -1"),
                           ("1.5", "expected an integer, got float")]:
        config.write_text(f"threads = 2\ntrain_processes = {value}\n")
        with pytest.raises(ConfigError) as error:
            load_config(tmp_path)
        assert str(error.value) == f"{config}:2: train_processes: {message}"
    assert load_config(tmp_path.with_name("absent")).train_processes == 0  # default: one per CUDA device


def test_the_micro_batch_seed_is_the_documented_hash():
    import hashlib
    import struct

    from protocol.proof import micro_seed, step_seed

    digest = hashlib.sha256(b"infernet/micro-rng/v1\0" + struct.pack("<QQQ", 7, 3, 1)).digest()
    assert micro_seed(7, 3, 1) == int.from_bytes(digest[:8], "little") & (2**63 - 1)
    assert len({micro_seed(7, 3, j) for j in range(4)} | {step_seed(7, 3)}) == 5
