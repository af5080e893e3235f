"""train run --resume: an interrupted run continues from its last checkpoint to the same bits and chain."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file

from agent.train.config import TrainError
from agent.train.run import TrainRequest, train_shard
from protocol.proof import Commitment


class Interrupted(Exception):
    pass


def _stop_at(step: int):
    def on_checkpoint(event):
        if event.step == step:
            raise Interrupted(step)
    return on_checkpoint


@pytest.fixture(scope="module")
def config(base_config):
    return base_config.with_(max_steps=12, checkpoint_every=4, log_every=2, target_modules=("q_proj", "v_proj"))


def test_a_resumed_run_ends_bit_for_bit_where_an_uninterrupted_one_does(tmp_path, config, demo_files):
    whole = train_shard(TrainRequest(config, demo_files["shard0"], tmp_path / "whole", validation=demo_files["validation"]))
    request = TrainRequest(config, demo_files["shard0"], tmp_path / "cut", validation=demo_files["validation"])
    with pytest.raises(Interrupted):
        train_shard(request, _stop_at(8))
    # the process died after the step-8 checkpoint: a later, half-written one must not be trusted
    (tmp_path / "cut" / "checkpoints" / ".step-000012.partial").mkdir()
    seen = []
    resumed = train_shard(request, resume=True, on_step=lambda step, total, loss, tokens, s: seen.append(step))
    assert seen == [9, 10, 11, 12]  # only the steps after the checkpoint ran again
    assert resumed.head == whole.head
    proof = Commitment.from_json(json.loads((tmp_path / "cut" / "proof.json").read_text()))
    assert proof.head == whole.head and [link.step for link in proof.links] == [4, 8, 12]
    a = load_file(str(whole.adapter_dir / "adapter_model.safetensors"))
    b = load_file(str(resumed.adapter_dir / "adapter_model.safetensors"))
    assert all((a[k] == b[k]).all() for k in a)
    steps = [json.loads(line)["step"] for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    # no line twice; step 8's line was lost with the process (it dies in the checkpoint callback, before
    # the log line of that step is written); the lines after the checkpoint come from the resumed run
    assert steps == [2, 4, 6, 10, 12]
    assert resumed.initial_validation_loss == whole.initial_validation_loss


def test_resume_refuses_a_finished_run_and_a_tampered_checkpoint_is_skipped(tmp_path, config, demo_files):
    request = TrainRequest(config, demo_files["shard0"], tmp_path / "run")
    with pytest.raises(Interrupted):
        train_shard(request, _stop_at(8))
    # the step-8 checkpoint no longer matches its commitment: resume goes back to step 4
    step8 = tmp_path / "run" / "checkpoints" / "step-000008"
    shutil.copy(tmp_path / "run" / "checkpoints" / "step-000004" / "adapter_model.safetensors", step8)
    seen = []
    result = train_shard(request, resume=True, on_step=lambda step, *rest: seen.append(step))
    assert seen[0] == 5 and result.steps == 12
    with pytest.raises(TrainError, match="already finished"):
        train_shard(request, resume=True)


def test_resume_refuses_a_run_of_another_job(tmp_path, config, demo_files):
    request = TrainRequest(config, demo_files["shard0"], tmp_path / "run")
    with pytest.raises(Interrupted):
        train_shard(request, _stop_at(4))
    other = TrainRequest(config.with_(seed=config.seed + 1), demo_files["shard0"], tmp_path / "run")
    with pytest.raises(TrainError, match="differs in"):
        train_shard(other, resume=True)
