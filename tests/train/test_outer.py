"""Outer optimizers across rounds (agent/train/aggregate.outer_step, IPIP-0006 §2.4), checked
against plain numpy written from the formulas, plus the round schedule (protocol/schedule.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from agent.train.aggregate import AggregationError, OuterOptimizer, exact, frozen_keys, outer_step
from protocol.schedule import round_learning_rate

A, B = "m.lora_A.weight", "m.lora_B.weight"


def adapter(b: np.ndarray, a: np.ndarray | None = None) -> dict[str, torch.Tensor]:
    a = np.ones((b.shape[1], 3)) if a is None else a
    return {A: torch.tensor(a, dtype=torch.float32), B: torch.tensor(b, dtype=torch.float32)}


def rounds_of(outer: OuterOptimizer, means: list[np.ndarray], start: np.ndarray):
    theta, state = adapter(start), {}
    out = []
    for step, mean in enumerate(means, start=1):
        theta, state = outer_step(theta, adapter(mean), state, outer, step=step, frozen=[A])
        out.append(theta[B].numpy().astype(np.float64))
    return out, state


def test_none_takes_the_mean_exactly_and_plain_sgd_up_to_rounding():
    rng = np.random.default_rng(0)
    start, mean = rng.normal(size=(4, 2)), rng.normal(size=(4, 2))
    for outer in (OuterOptimizer(), OuterOptimizer("sgd", 1.0, 0.0)):
        theta, state = outer_step(adapter(start), adapter(mean), {}, outer, step=1, frozen=[A])
        if outer.active:
            torch.testing.assert_close(theta[B], torch.tensor(mean, dtype=torch.float32), rtol=0, atol=1e-6)
        else:
            assert torch.equal(theta[B], torch.tensor(mean, dtype=torch.float32))
        assert torch.equal(theta[A], adapter(start)[A]) and state == {}


@pytest.mark.parametrize("lr,mu", [(0.7, 0.9), (1.5, 0.5)])
def test_nesterov_matches_numpy_over_rounds(lr, mu):
    rng = np.random.default_rng(1)
    start = rng.normal(size=(4, 2)).astype(np.float32)
    means = [rng.normal(size=(4, 2)).astype(np.float32) for _ in range(3)]
    got, state = rounds_of(OuterOptimizer("nesterov", lr, mu), means, start)
    theta, buf = start.astype(np.float64), np.zeros_like(start, dtype=np.float64)
    for mean, mine in zip(means, got):
        g = theta - mean
        buf = mu * buf + g
        theta = theta - lr * (g + mu * buf)
        np.testing.assert_allclose(mine, theta, rtol=1e-5, atol=1e-5)
        theta = mine  # continue from the float32 result, as the protocol does
    assert set(state) == {f"{B}.momentum"}


def test_sgd_momentum_and_adam_match_numpy():
    rng = np.random.default_rng(2)
    start = rng.normal(size=(3, 2)).astype(np.float32)
    means = [rng.normal(size=(3, 2)).astype(np.float32) for _ in range(3)]
    got, _ = rounds_of(OuterOptimizer("sgd", 0.9, 0.5), means, start)
    theta, buf = start.astype(np.float64), 0.0
    for mean, mine in zip(means, got):
        buf = 0.5 * buf + (theta - mean)
        np.testing.assert_allclose(mine, theta - 0.9 * buf, rtol=1e-5, atol=1e-5)
        theta = mine
    got, state = rounds_of(OuterOptimizer("adam", 0.05, 0.0, 0.8, 0.95, 1e-8), means, start)
    theta, m, v = start.astype(np.float64), 0.0, 0.0
    for t, (mean, mine) in enumerate(zip(means, got), start=1):
        g = theta - mean
        m, v = 0.8 * m + 0.2 * g, 0.95 * v + 0.05 * g * g
        expected = theta - 0.05 * (m / (1 - 0.8**t)) / (np.sqrt(v / (1 - 0.95**t)) + 1e-8)
        np.testing.assert_allclose(mine, expected, rtol=1e-4, atol=1e-6)
        theta = mine
    assert set(state) == {f"{B}.m", f"{B}.v"}


def test_outer_step_is_deterministic_and_leaves_its_inputs_alone():
    """Two coordinators, the same inputs: the same bits (a failover must not change the aggregate)."""
    rng = np.random.default_rng(3)
    previous = adapter(rng.normal(size=(64, 16)))
    state = {f"{B}.momentum": torch.tensor(rng.normal(size=(64, 16)), dtype=torch.float32)}
    kept = {k: v.clone() for k, v in state.items()}
    workers = [(adapter(rng.normal(size=(64, 16))), n) for n in (3, 5, 7)]
    outer = OuterOptimizer("nesterov", 0.7, 0.9)
    one = outer_step(previous, exact(workers), state, outer, step=2, frozen=[A])
    two = outer_step(previous, exact(workers), state, outer, step=2, frozen=[A])
    for first, second in zip(one, two):
        assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert all(torch.equal(state[k], kept[k]) for k in state)


def test_outer_step_refuses_what_does_not_fit():
    outer = OuterOptimizer("nesterov", 0.7, 0.9)
    moved_a = adapter(np.zeros((4, 2)), a=np.full((2, 3), 2.0))
    with pytest.raises(AggregationError, match=r"lora_A.weight is frozen but the round's mean changed it"):
        outer_step(adapter(np.zeros((4, 2))), moved_a, {}, outer, step=1, frozen=[A])
    with pytest.raises(AggregationError, match=r"state m.lora_B.weight.momentum has shape \(3, 3\)"):
        outer_step(adapter(np.zeros((4, 2))), adapter(np.ones((4, 2))),
                   {f"{B}.momentum": torch.zeros(3, 3)}, outer, step=2, frozen=[A])
    with pytest.raises(AggregationError, match="fit no trained key"):
        outer_step(adapter(np.zeros((4, 2))), adapter(np.ones((4, 2))),
                   {"other.momentum": torch.zeros(1)}, outer, step=2, frozen=[A])
    with pytest.raises(AggregationError, match="outer.momentum must be in"):
        OuterOptimizer("nesterov", 0.7, 1.0)
    assert frozen_keys(adapter(np.zeros((4, 2))), freeze_a=True) == [A]
    assert frozen_keys(adapter(np.zeros((4, 2))), freeze_a=False) == []


def test_round_learning_rate():
    assert [round_learning_rate(0.01, r, 4) for r in range(1, 5)] == [0.01] * 4
    cosine = [round_learning_rate(0.01, r, 5, schedule="cosine") for r in range(1, 6)]
    assert cosine[0] == 0.01 and math.isclose(cosine[-1], 0.001) and cosine == sorted(cosine, reverse=True)
    warm = [round_learning_rate(0.01, r, 5, schedule="cosine", warmup_rounds=1) for r in range(1, 6)]
    assert warm[0] == 0.005 and warm[1] == 0.01 and math.isclose(warm[-1], 0.001)
    with pytest.raises(ValueError, match="outside 1..3"):
        round_learning_rate(0.01, 4, 3)


# --- carried optimizer state (IPIP-0006 §2.3) ------------------------------------------------------

def test_optimizer_states_average_by_samples_and_keep_the_largest_step():
    from agent.train.aggregate import average_optimizer_states

    one = {"b.exp_avg": torch.tensor([1.0, -1.0]), "b.exp_avg_sq": torch.tensor([1.0, 4.0]), "b.step": torch.tensor(12.0)}
    two = {"b.exp_avg": torch.tensor([0.0, 3.0]), "b.exp_avg_sq": torch.tensor([3.0, 0.0]), "b.step": torch.tensor(10.0)}
    mean = average_optimizer_states([(one, 1), (two, 3)])
    assert torch.equal(mean["b.exp_avg"], torch.tensor([0.25, 2.0]))
    assert torch.equal(mean["b.exp_avg_sq"], torch.tensor([2.5, 1.0]))
    assert mean["b.step"].item() == 12.0 and mean["b.step"].shape == ()
    with pytest.raises(AggregationError, match="optimizer state 1: keys differ"):
        average_optimizer_states([(one, 1), ({"b.exp_avg": torch.zeros(2)}, 1)])
    with pytest.raises(AggregationError, match="b.exp_avg_sq: a second moment is negative"):
        average_optimizer_states([(one, 1), ({**two, "b.exp_avg_sq": torch.tensor([-1.0, 0.0])}, 1)])
    with pytest.raises(AggregationError, match="optimizer state 1: b.exp_avg: contains NaN"):
        average_optimizer_states([(one, 1), ({**two, "b.exp_avg": torch.tensor([float("nan"), 0.0])}, 1)])


def test_a_round_that_carries_the_state_proves_where_it_started(tmp_path, base_config, demo_files):
    """Round 2 starts from round 1's AdamW state; the proof binds it; a fresh start is refused."""
    from safetensors.torch import load_file

    from agent.train.aggregate import OPTIMIZER_FILE
    from agent.train.recorder import read_checkpoint
    from agent.train.replay import check_initial_adapter, verify_segment
    from agent.train.run import TrainRequest, train_shard
    from protocol.proof import EMPTY_TENSOR_SET, Commitment

    config = base_config.with_(carry_optimizer=True, max_steps=8, checkpoint_every=4, dropout=0.0)
    first = train_shard(TrainRequest(config, demo_files["shard0"], tmp_path / "r1"))
    assert (first.adapter_dir / OPTIMIZER_FILE).exists()
    second = train_shard(TrainRequest(config.with_(round=2), demo_files["shard1"], tmp_path / "r2",
                                      initial_adapter=first.adapter_dir, round=2))
    commitment = Commitment.from_json(__import__("json").loads((tmp_path / "r2" / "proof.json").read_text()))
    assert commitment.header.initial_optimizer_hash != EMPTY_TENSOR_SET
    genesis = tmp_path / "r2" / "checkpoints" / "step-000000"
    start, carried = load_file(str(first.adapter_dir / "adapter_model.safetensors")), load_file(
        str(first.adapter_dir / OPTIMIZER_FILE))
    assert check_initial_adapter(genesis, commitment, start, carried) is None
    assert "did not start from the job's optimizer state" in check_initial_adapter(genesis, commitment, start, {})
    # segment 0 replays from the carried state, exactly
    verdict = verify_segment(commitment, 0, start=genesis, shard=demo_files["shard1"], config=config.with_(round=2),
                             claimed_head=second.head)
    assert verdict.accepted and verdict.exact, verdict
    _, optimizer, _ = read_checkpoint(genesis)
    assert set(optimizer) == set(carried)


def test_the_stop_rule():
    from protocol.schedule import should_stop

    assert not should_stop(0.0, 0, [3.0, 2.0, 1.0])
    assert should_stop(0.5, 0, [3.0, 0.4]) and not should_stop(0.5, 0, [3.0, 0.6])
    assert not should_stop(0.5, 0, [0.1, None])  # an unscored round never stops a job
    # patience 2: the best of the last two rounds is no better than the best before them
    assert should_stop(0.0, 2, [3.0, 1.0, 1.2, 1.0])
    assert not should_stop(0.0, 2, [3.0, 1.0, 1.2, 0.9])
    assert not should_stop(0.0, 2, [3.0, 1.0])  # not enough rounds yet
    from protocol.schedule import is_final

    assert is_final(2, 0.0, 0, [3.0, 1.0]) and not is_final(3, 0.0, 0, [3.0, 1.0])
    assert is_final(3, 1.5, 0, [3.0, 1.0]) and not is_final(3, 0.5, 0, [3.0, 1.0])


def test_the_inner_schedule_within_a_round():
    """IPIP-0006 §2.5 training.inner_schedule: triangle warms up over max(1, steps // 10) steps, then
    decays linearly to 0.1x at the round's last step; constant is 1 everywhere."""
    from protocol.schedule import inner_rate_factor

    assert [inner_rate_factor("constant", s, 12) for s in range(12)] == [1.0] * 12
    twelve = [inner_rate_factor("triangle", s, 12) for s in range(12)]
    assert twelve[0] == 0.5 and twelve[1] == 1.0 and math.isclose(twelve[-1], 0.1)
    assert all(a > b for a, b in zip(twelve[1:], twelve[2:]))
    hundred = [inner_rate_factor("triangle", s, 100) for s in range(100)]
    assert hundred[:10] == [(s + 1) / 11 for s in range(10)] and hundred[10] == 1.0 and math.isclose(hundred[99], 0.1)
    assert inner_rate_factor("triangle", 0, 1) == 1.0
    with pytest.raises(ValueError):
        inner_rate_factor("triangle", 12, 12)
    with pytest.raises(ValueError):
        inner_rate_factor("sawtooth", 0, 12)


def test_a_triangle_round_replays_bit_for_bit(tmp_path, base_config, demo_files):
    """The rate depends on the step's place in the round, which a verifier replaying a middle segment
    knows: the replay lands on the committed state exactly, and the run logged the rates it used."""
    import json

    from agent.train.recorder import checkpoint_name
    from agent.train.replay import verify_segment
    from agent.train.run import TrainRequest, train_shard
    from protocol.proof import Commitment
    from protocol.schedule import inner_rate_factor

    config = base_config.with_(inner_schedule="triangle", dropout=0.0, max_steps=20, log_every=5)
    run = tmp_path / "run"
    train_shard(TrainRequest(config, demo_files["shard2"], run, job_id=bytes(range(32)), worker="12D3KooWTestWorker"))
    commitment = Commitment.from_json(json.loads((run / "proof.json").read_text()))
    checkpoints = run / "checkpoints"
    verdict = verify_segment(commitment, 1, start=checkpoints / checkpoint_name(commitment.links[0].step),
                             shard=demo_files["shard2"], config=config)
    assert verdict.accepted, verdict.reason
    flat = verify_segment(commitment, 1, start=checkpoints / checkpoint_name(commitment.links[0].step),
                          shard=demo_files["shard2"], config=config.with_(inner_schedule="constant"))
    assert not flat.accepted  # the rate matters: a worker that trained flat would be caught
    rates = [json.loads(line)["learning_rate"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rates == [config.learning_rate * inner_rate_factor("triangle", s - 1, 20) for s in (5, 10, 15, 20)]


def test_the_first_rounds_steps_and_where_each_round_starts_in_the_stream():
    """IPIP-0006 §2.5 training.first_round_steps: the job's first rounds train their own steps, the rest
    max_steps, and each round's step 0 is where the round before it stopped in the shard's stream."""
    from agent.train.config import TrainConfig
    from protocol.schedule import round_steps, stream_offset

    first = (25, 25, 50)
    assert [round_steps(100, first, r) for r in range(1, 7)] == [25, 25, 50, 100, 100, 100]
    assert [stream_offset(100, first, r) for r in range(1, 7)] == [0, 25, 50, 100, 200, 300]
    assert [stream_offset(12, (), r) for r in (1, 2, 3)] == [0, 12, 24]  # no first rounds: as before
    config = TrainConfig(base_model="m", max_steps=100, first_round_steps=first)
    assert [config.with_(round=r).total_steps(1000) for r in (1, 3, 4)] == [25, 50, 100]
    assert config.with_(round=5).stream_offset(1000) == 200
    assert TrainConfig.from_json(config.to_json()) == config
    with pytest.raises(ValueError):
        round_steps(100, first, 0)


def test_a_shorter_first_round_replays_bit_for_bit_from_where_the_last_one_stopped(tmp_path, base_config, demo_files):
    """Round 2 of a job whose first rounds train 4 and 6 steps: 6 steps from stream position 4. A verifier
    with the job's terms replays a segment exactly; one that puts the round elsewhere in the stream does not."""
    import json

    from agent.train.recorder import checkpoint_name
    from agent.train.replay import verify_segment
    from agent.train.run import TrainRequest, train_shard
    from protocol.proof import Commitment

    config = base_config.with_(dropout=0.0, max_steps=10, first_round_steps=(4, 6), round=2, checkpoint_every=3)
    run = tmp_path / "run"
    result = train_shard(TrainRequest(config, demo_files["shard2"], run, job_id=bytes(range(32)), round=2,
                                      worker="12D3KooWTestWorker"))
    assert result.steps == 6
    commitment = Commitment.from_json(json.loads((run / "proof.json").read_text()))
    start = run / "checkpoints" / checkpoint_name(commitment.links[0].step)
    assert verify_segment(commitment, 1, start=start, shard=demo_files["shard2"], config=config).accepted
    elsewhere = config.with_(first_round_steps=(5, 6))  # the same round, from stream position 5
    assert not verify_segment(commitment, 1, start=start, shard=demo_files["shard2"], config=elsewhere).accepted
