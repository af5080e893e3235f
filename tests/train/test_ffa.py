"""FFA-LoRA on real trained adapters: with A frozen from the job seed, averaging B averages the updates."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from agent.train.run import TrainRequest, train_shard


def train_three(tmp_path, base_config, demo_files, freeze_a: bool):
    """Three workers, three shards, different step counts: (adapter, samples) pairs."""
    pairs = []
    for j, steps in enumerate((4, 6, 8)):
        config = base_config.with_(freeze_a=freeze_a, max_steps=steps, batch_size=4, checkpoint_every=100,
                                   log_every=100, dropout=0.0)
        result = train_shard(TrainRequest(config, demo_files[f"shard{j}"], tmp_path / f"worker{j}-{freeze_a}"))
        pairs.append((load_file(str(result.adapter_dir / "adapter_model.safetensors")), result.samples))
    return pairs


def modules(adapter):
    return sorted(name.removesuffix(".lora_A.weight") for name in adapter if name.endswith(".lora_A.weight"))


def weighted(pairs, fn):
    total = sum(n for _, n in pairs)
    return sum(fn(adapter).double() * (n / total) for adapter, n in pairs)


@pytest.fixture(scope="module")
def frozen_pairs(tmp_path_factory, base_config, demo_files):
    return train_three(tmp_path_factory.mktemp("ffa"), base_config, demo_files, freeze_a=True)


def test_average_of_b_is_the_average_update_when_a_is_frozen(frozen_pairs):
    pairs = frozen_pairs
    assert [n for _, n in pairs] == [16, 24, 32]
    first = pairs[0][0]
    for module in modules(first):
        a, b = f"{module}.lora_A.weight", f"{module}.lora_B.weight"
        assert all(torch.equal(adapter[a], first[a]) for adapter, _ in pairs)  # same seeded A everywhere
        assert not torch.equal(pairs[0][0][b], pairs[1][0][b])  # the workers learned different B
        mean_b = weighted(pairs, lambda ad: ad[b])
        mean_update = weighted(pairs, lambda ad: ad[b].double() @ ad[a].double())
        assert mean_update.norm() > 0
        torch.testing.assert_close(mean_b @ first[a].double(), mean_update, rtol=1e-12, atol=1e-12)
        # the same in float32, as an aggregator would compute it
        mean_b32 = weighted(pairs, lambda ad: ad[b]).float()
        torch.testing.assert_close((mean_b32 @ first[a]).double(), mean_update, rtol=1e-5, atol=1e-7)


def test_aggregate_exact_rule_agrees_on_real_adapters(frozen_pairs):
    exact = pytest.importorskip("agent.train.aggregate").exact
    pairs = frozen_pairs
    merged = exact(pairs)
    for module in modules(merged):
        a, b = f"{module}.lora_A.weight", f"{module}.lora_B.weight"
        mean_update = weighted(pairs, lambda ad: ad[b].double() @ ad[a].double())
        torch.testing.assert_close((merged[b] @ merged[a]).double(), mean_update, rtol=1e-5, atol=1e-7)


def test_averaging_factors_is_not_exact_when_a_trains(tmp_path, base_config, demo_files):
    """The reason for freeze_a: with A trained, mean(B) mean(A) misses the mean update."""
    pairs = train_three(tmp_path, base_config, demo_files, freeze_a=False)
    worst = 0.0
    for module in modules(pairs[0][0]):
        a, b = f"{module}.lora_A.weight", f"{module}.lora_B.weight"
        mean_update = weighted(pairs, lambda ad: ad[b].double() @ ad[a].double())
        naive = weighted(pairs, lambda ad: ad[b]) @ weighted(pairs, lambda ad: ad[a])
        worst = max(worst, ((naive - mean_update).norm() / mean_update.norm()).item())
    assert worst > 1e-3
