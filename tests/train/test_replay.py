"""Replay verification: an honest segment passes in a fresh process; tampering and skipping fail."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from agent.train.env import strict_cpu_env
from agent.train.replay import verify_segment
from protocol.proof import ChainLink, Commitment
from tests.conftest import REPO_ROOT


def commitment_of(run_dir: Path) -> Commitment:
    return Commitment.from_json(json.loads((run_dir / "proof.json").read_text()))


def replay_in_child(run_dir: Path, shard: Path, segment: int, env: dict | None = None) -> tuple[int, dict]:
    child = subprocess.run(
        [sys.executable, "-m", "agent.train.replay", "--proof", str(run_dir / "proof.json"),
         "--segment", str(segment), "--checkpoints", str(run_dir / "checkpoints"), "--shard", str(shard),
         "--config", str(run_dir / "train_config.json")],
        capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=240,
    )
    return child.returncode, json.loads(child.stdout.strip().splitlines()[-1])


def test_segment_replays_exactly_in_a_fresh_process(trained_run):
    request, _, _ = trained_run
    status, verdict = replay_in_child(request.run_dir, request.shard, 1)
    assert (status, verdict["accepted"], verdict["exact"]) == (0, True, True), verdict


def test_honest_segment_passes_in_process(trained_run):
    request, result, _ = trained_run
    checkpoints = request.run_dir / "checkpoints"
    verdict = verify_segment(commitment_of(request.run_dir), 0, start=checkpoints / "step-000000",
                             shard=request.shard, config=request.config, claimed_head=result.head)
    assert verdict.accepted and verdict.exact, verdict


def test_tampered_start_checkpoint_fails(trained_run, tmp_path):
    request, _, _ = trained_run
    start = tmp_path / "step-000010"
    shutil.copytree(request.run_dir / "checkpoints" / "step-000010", start)
    tensors = load_file(str(start / "adapter_model.safetensors"))
    name = next(n for n in sorted(tensors) if ".lora_B." in n)
    tensors[name] = tensors[name] + 1e-6
    save_file(tensors, str(start / "adapter_model.safetensors"))
    verdict = verify_segment(commitment_of(request.run_dir), 1, start=start, shard=request.shard, config=request.config)
    assert not verdict.accepted and "does not match the committed hashes" in verdict.reason


def test_skipped_segment_fails(trained_run):
    """A worker that skips segment 2's training and recommits segment 1's state is caught by its replay."""
    request, _, _ = trained_run
    honest = commitment_of(request.run_dir)
    last, before = honest.links[2], honest.links[1]
    fake_link = ChainLink(step=last.step, adapter_hash=before.adapter_hash, optimizer_hash=before.optimizer_hash,
                          batches_digest=last.batches_digest, loss=last.loss)
    fake = Commitment(honest.header, honest.links[:2] + (fake_link,))
    fake.check()  # the fake chain is well formed: only a replay can tell
    checkpoints = request.run_dir / "checkpoints"
    verdict = verify_segment(fake, 2, start=checkpoints / "step-000020", shard=request.shard, config=request.config)
    assert not verdict.accepted and "differs" in verdict.reason, verdict
    # the segments before it still verify
    assert verify_segment(fake, 1, start=checkpoints / "step-000010", shard=request.shard,
                          config=request.config).accepted


def test_a_segment_replays_from_the_round_start_without_its_start_checkpoint(trained_run):
    """IPIP-0005 §8: a verifier that holds the round's start may replay to a segment's start instead of fetching
    its checkpoint; the verdict is the one a replay from that checkpoint gives."""
    request, result, _ = trained_run
    checkpoints = request.run_dir / "checkpoints"
    commitment = commitment_of(request.run_dir)
    for index in (1, 2):
        verdict = verify_segment(commitment, index, start=checkpoints / "step-000000", shard=request.shard,
                                 config=request.config, claimed_head=result.head, from_round_start=True)
        assert verdict is not None and verdict.accepted and verdict.exact, verdict
    # a worker that skipped segment 2: the replay from the round's start judges it as a replay from its start does
    last, before = commitment.links[2], commitment.links[1]
    fake = Commitment(commitment.header, commitment.links[:2] + (ChainLink(
        step=last.step, adapter_hash=before.adapter_hash, optimizer_hash=before.optimizer_hash,
        batches_digest=last.batches_digest, loss=last.loss),))
    verdict = verify_segment(fake, 2, start=checkpoints / "step-000000", shard=request.shard, config=request.config,
                             from_round_start=True)
    assert verdict is not None and not verdict.accepted and "differs" in verdict.reason, verdict


def test_a_replay_from_the_round_start_that_misses_the_committed_start_gives_no_verdict(trained_run):
    """Segment 1 committed a state the steps before it do not reach (the worker trained segment 0 otherwise, or
    this machine is not bit for bit): no verdict, so the verifier fetches the segment's start checkpoint and the
    replay from it decides (a mismatch before the segment is not this segment's evidence)."""
    request, _, _ = trained_run
    honest = commitment_of(request.run_dir)
    first = honest.links[0]
    moved = ChainLink(step=first.step, adapter_hash=bytes(32), optimizer_hash=first.optimizer_hash,
                      batches_digest=first.batches_digest, loss=first.loss)
    fake = Commitment(honest.header, (moved,) + honest.links[1:])
    assert verify_segment(fake, 1, start=request.run_dir / "checkpoints" / "step-000000", shard=request.shard,
                          config=request.config, from_round_start=True) is None


def test_wrong_shard_fails(trained_run, demo_files):
    request, _, _ = trained_run
    verdict = verify_segment(commitment_of(request.run_dir), 1, start=request.run_dir / "checkpoints" / "step-000010",
                             shard=demo_files["shard1"], config=request.config)
    assert not verdict.accepted


def test_other_environment_is_judged_by_distance(trained_run):
    """Header claims 2 threads and strict MKL: the verifier replays that way, so bits may drift,
    and the segment passes only within the fp32 tolerance, measured against the end checkpoint."""
    request, _, _ = trained_run
    honest = commitment_of(request.run_dir)
    environment = {**honest.header.environment, "threads": 2, "mkl_cbwr": "AVX2,STRICT"}
    claimed = Commitment(replace(honest.header, environment=environment), honest.links)
    checkpoints = request.run_dir / "checkpoints"
    config = request.config.with_(tolerance=None)
    verdict = verify_segment(claimed, 1, start=checkpoints / "step-000010", end=checkpoints / "step-000020",
                             shard=request.shard, config=config)
    assert verdict.accepted, verdict
    assert verdict.exact or 0 < verdict.max_distance <= 1e-4
    # a verifier that fetches the end checkpoint only when a replay asks for it (agent/roles/coordinator.py):
    # without it, the same replay is either exact or undecided -- never rejected for the missing file
    first = verify_segment(claimed, 1, start=checkpoints / "step-000010", shard=request.shard, config=config)
    assert (first.accepted and first.exact) if verdict.exact else (first.needs_end and not first.accepted), first


@pytest.mark.slow
def test_replay_under_strict_cpu_env_in_a_fresh_process(trained_run):
    """A verifier started with MKL_CBWR/ATEN_CPU_CAPABILITY pinned differs in environment from the
    worker: it must accept by tolerance (or exactly, if the bits happen to agree)."""
    request, _, _ = trained_run
    status, verdict = replay_in_child(request.run_dir, request.shard, 2, env=strict_cpu_env())
    assert status == 0 and verdict["accepted"], verdict
    assert verdict["exact"] or verdict["max_distance"] <= 1e-4


def test_unreadable_checkpoint_is_a_rejection_not_a_crash(trained_run, tmp_path):
    request, _, _ = trained_run
    start = tmp_path / "step-000010"
    shutil.copytree(request.run_dir / "checkpoints" / "step-000010", start)
    (start / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    verdict = verify_segment(commitment_of(request.run_dir), 1, start=start, shard=request.shard, config=request.config)
    assert not verdict.accepted and "unreadable" in verdict.reason
    shutil.rmtree(start)
    verdict = verify_segment(commitment_of(request.run_dir), 1, start=start, shard=request.shard, config=request.config)
    assert not verdict.accepted and "unreadable" in verdict.reason


# -- the start of training (coordinator check: the proof's step-0 checkpoint) -------------------------


def test_the_step0_checkpoint_is_the_seeded_init_or_the_run_is_rejected(trained_run, base_config, tmp_path):
    from dataclasses import replace

    import torch
    from safetensors.torch import save_file

    from agent.train.replay import check_initial_adapter, expected_initial_adapter

    request, _, _ = trained_run
    commitment = commitment_of(request.run_dir)
    genesis = request.run_dir / "checkpoints" / "step-000000"
    seeded = expected_initial_adapter(base_config)
    assert check_initial_adapter(genesis, commitment, seeded) is None
    assert any(t.abs().sum() > 0 for n, t in seeded.items() if "lora_A" in n)
    assert all(t.abs().sum() == 0 for n, t in seeded.items() if "lora_B" in n)

    other_seed = expected_initial_adapter(replace(base_config, seed=base_config.seed + 1))
    assert "did not start from the job's initial adapter" in check_initial_adapter(genesis, commitment, other_seed)

    nudged = dict(seeded)
    name = sorted(nudged)[0]
    nudged[name] = nudged[name] + 1e-6
    assert f"tensor {name} differs" in check_initial_adapter(genesis, commitment, nudged)

    # round 2 and later: the previous round's aggregate, read from its HF-layout directory
    aggregate = tmp_path / "aggregate"
    aggregate.mkdir()
    save_file({k: v.contiguous() for k, v in seeded.items()}, str(aggregate / "adapter_model.safetensors"))
    loaded = expected_initial_adapter(base_config, aggregate)
    assert all(torch.equal(loaded[k], seeded[k]) for k in seeded)

    # a step-0 checkpoint that is not the one the chain committed to
    forged = commitment.__class__(replace(commitment.header, initial_adapter_hash=bytes(32)), commitment.links)
    assert "does not hash to the proof's initial_adapter_hash" in check_initial_adapter(genesis, forged, seeded)
