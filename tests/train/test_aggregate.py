"""LoRA aggregation rules, each checked against an independent numpy computation (float64)."""

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from agent.train.aggregate import METHODS, AggregationError, aggregate, exact, fedavg, median, svd, trimmed_mean

PREFIX = "base_model.model.model.layers"
OTHER_KEY = "base_model.model.score.weight"  # a directly trained tensor (modules_to_save)


def module_names(layers=2, projections=("q_proj", "v_proj")):
    return [f"{PREFIX}.{layer}.self_attn.{proj}" for layer in range(layers) for proj in projections]


def make_adapter(rng, *, rank=4, out=12, inp=10, layers=2, shared_a=None, dtype=np.float64):
    """A peft-shaped adapter as numpy arrays: lora_A (rank, in), lora_B (out, rank), one plain tensor."""
    arrays = {}
    for name in module_names(layers):
        a = shared_a[name] if shared_a is not None else rng.standard_normal((rank, inp))
        arrays[f"{name}.lora_A.weight"] = a.astype(dtype)
        arrays[f"{name}.lora_B.weight"] = rng.standard_normal((out, rank)).astype(dtype)
    arrays[OTHER_KEY] = rng.standard_normal((3, out)).astype(dtype)
    return arrays


def to_torch(arrays):
    return {key: torch.from_numpy(np.array(value)) for key, value in arrays.items()}


def numpy_mean_update(adapters, counts, name):
    """Σ wᵢ·BᵢAᵢ, computed densely in numpy."""
    updates = [a[f"{name}.lora_B.weight"] @ a[f"{name}.lora_A.weight"] for a in adapters]
    return np.average(np.stack(updates), axis=0, weights=counts)


def product(result, name):
    return result[f"{name}.lora_B.weight"].double().numpy() @ result[f"{name}.lora_A.weight"].double().numpy()


@pytest.fixture
def rng():
    return np.random.default_rng(20240611)


# --- fedavg ------------------------------------------------------------------------------------


def test_fedavg_is_the_numpy_sample_weighted_mean_of_every_tensor(rng):
    arrays = [make_adapter(rng) for _ in range(3)]
    counts = [10, 30, 60]
    result = fedavg([(to_torch(a), n) for a, n in zip(arrays, counts)])
    assert list(result) == list(arrays[0])
    for key in arrays[0]:
        expected = np.average(np.stack([a[key] for a in arrays]), axis=0, weights=counts)
        assert result[key].dtype == torch.float64
        np.testing.assert_allclose(result[key].numpy(), expected, rtol=1e-12, atol=1e-12)


def test_fedavg_split_over_threads_is_the_same_mean_and_restores_torch_threads(rng, monkeypatch):
    import agent.train.aggregate as module

    arrays = [make_adapter(rng, layers=8) for _ in range(4)]
    counts = [5, 10, 20, 40]
    pairs = [(to_torch(a), n) for a, n in zip(arrays, counts)]
    serial = fedavg(pairs)
    monkeypatch.setattr(module, "PARALLEL_MIN_BYTES", 0)  # these small adapters take the threaded path
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        threaded = fedavg(pairs)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert list(threaded) == list(serial)
    for key in serial:
        assert torch.equal(threaded[key], serial[key]), key
    # beside a replay (a round's aggregate computed early) it must not touch the process-wide thread count: the
    # same mean without the split
    from agent.train.aggregate import aggregate

    calls: list[int] = []
    real_set = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append(n), real_set(n)))
    real_set(2)
    try:
        beside = aggregate("fedavg", pairs, parallel=False)
    finally:
        real_set(before)
    assert calls == [] and all(torch.equal(beside[key], serial[key]) for key in serial)
    monkeypatch.setattr(torch, "set_num_threads", real_set)
    bad = to_torch(arrays[1])
    bad[sorted(bad)[3]][0, 0] = float("nan")
    monkeypatch.setattr(module, "PARALLEL_MIN_BYTES", 0)
    torch.set_num_threads(2)
    try:
        with pytest.raises(AggregationError, match="adapter 1"):
            fedavg([pairs[0], (bad, 10), *pairs[2:]])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_fedavg_keeps_float32_and_bfloat16_dtypes(rng):
    arrays = [make_adapter(rng, dtype=np.float32) for _ in range(4)]
    counts = [1, 2, 3, 4]
    for dtype, tolerance in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        pairs = [({k: v.to(dtype) for k, v in to_torch(a).items()}, n) for a, n in zip(arrays, counts)]
        result = fedavg(pairs)
        for key in arrays[0]:
            inputs = np.stack([pair[0][key].float().numpy() for pair in pairs])
            expected = np.average(inputs, axis=0, weights=counts)
            assert result[key].dtype == dtype
            np.testing.assert_allclose(result[key].float().numpy(), expected, rtol=tolerance, atol=tolerance)


def test_mean_of_factors_is_not_mean_of_updates_which_is_why_exact_and_svd_exist():
    # Two workers made the same update ΔW = [[1]] through sign-flipped factors.
    pairs = [({"m.lora_A.weight": torch.tensor([[1.0]]), "m.lora_B.weight": torch.tensor([[1.0]])}, 1),
             ({"m.lora_A.weight": torch.tensor([[-1.0]]), "m.lora_B.weight": torch.tensor([[-1.0]])}, 1)]
    assert product(fedavg(pairs), "m") == pytest.approx(0.0)  # the update vanished
    assert product(svd(pairs), "m") == pytest.approx(1.0)  # the mean update survives


def test_fedavg_product_misses_the_mean_update_on_random_adapters(rng):
    arrays = [make_adapter(rng) for _ in range(3)]
    counts = [5, 5, 10]
    pairs = [(to_torch(a), n) for a, n in zip(arrays, counts)]
    for name in module_names():
        expected = numpy_mean_update(arrays, counts, name)
        naive_error = np.linalg.norm(product(fedavg(pairs), name) - expected) / np.linalg.norm(expected)
        assert naive_error > 0.3
        np.testing.assert_allclose(product(svd(pairs, rank=10), name), expected, rtol=1e-9, atol=1e-9)


# --- exact -------------------------------------------------------------------------------------


def test_exact_product_is_the_weighted_mean_update_when_a_is_shared(rng):
    shared = {name: rng.standard_normal((4, 10)) for name in module_names()}
    arrays = [make_adapter(rng, shared_a=shared) for _ in range(3)]
    counts = [7, 1, 12]
    result = exact([(to_torch(a), n) for a, n in zip(arrays, counts)])
    assert list(result) == list(arrays[0])
    for name in module_names():
        np.testing.assert_array_equal(result[f"{name}.lora_A.weight"].numpy(), shared[name])
        expected = numpy_mean_update(arrays, counts, name)
        np.testing.assert_allclose(product(result, name), expected, rtol=1e-12, atol=1e-12)
    expected_other = np.average(np.stack([a[OTHER_KEY] for a in arrays]), axis=0, weights=counts)
    np.testing.assert_allclose(result[OTHER_KEY].numpy(), expected_other, rtol=1e-12)


def test_exact_raises_naming_the_module_when_an_a_differs_by_one_ulp(rng):
    shared = {name: rng.standard_normal((4, 10)) for name in module_names()}
    arrays = [make_adapter(rng, shared_a=shared) for _ in range(3)]
    name = module_names()[1]
    a = arrays[2][f"{name}.lora_A.weight"]
    a[1, 3] = np.nextafter(a[1, 3], np.inf)
    with pytest.raises(AggregationError, match=rf"module {name}: lora_A of adapter 2 differs"):
        exact([(to_torch(x), 1) for x in arrays])


# --- svd ---------------------------------------------------------------------------------------


def test_svd_recovers_the_exact_mean_update_when_the_rank_allows(rng):
    arrays = [make_adapter(rng, rank=4) for _ in range(2)]
    counts = [3, 9]
    result = svd([(to_torch(a), n) for a, n in zip(arrays, counts)], rank=8)
    assert list(result) == list(arrays[0])
    for name in module_names():
        assert result[f"{name}.lora_A.weight"].shape == (8, 10)
        assert result[f"{name}.lora_B.weight"].shape == (12, 8)
        expected = numpy_mean_update(arrays, counts, name)
        np.testing.assert_allclose(product(result, name), expected, rtol=1e-10, atol=1e-10)
    expected_other = np.average(np.stack([a[OTHER_KEY] for a in arrays]), axis=0, weights=counts)
    np.testing.assert_allclose(result[OTHER_KEY].numpy(), expected_other, rtol=1e-12)


def test_svd_at_the_input_rank_is_the_best_rank_r_approximation_of_the_mean_update(rng):
    arrays = [make_adapter(rng, rank=4) for _ in range(2)]
    counts = [4, 6]
    result = svd([(to_torch(a), n) for a, n in zip(arrays, counts)])
    for name in module_names():
        assert result[f"{name}.lora_A.weight"].shape == (4, 10)
        u, s, vh = np.linalg.svd(numpy_mean_update(arrays, counts, name))
        best = (u[:, :4] * s[:4]) @ vh[:4]
        np.testing.assert_allclose(product(result, name), best, rtol=1e-9, atol=1e-9)
        # IPIP-0006: A' has orthonormal rows and B' carries S, so AAᵀ = I and BᵀB = diag(S²)
        b, a = result[f"{name}.lora_B.weight"].numpy(), result[f"{name}.lora_A.weight"].numpy()
        np.testing.assert_allclose(a @ a.T, np.eye(4), atol=1e-9)
        np.testing.assert_allclose(b.T @ b, np.diag(s[:4] ** 2), rtol=1e-9, atol=1e-9)


def test_svd_keeps_a_trainable_where_the_mean_update_is_zero(rng):
    # untrained modules: B = 0 everywhere, so the mean update is 0; A' must not collapse to 0
    arrays = [make_adapter(rng, rank=4) for _ in range(2)]
    for adapter in arrays:
        for name in module_names():
            adapter[f"{name}.lora_B.weight"][:] = 0
    result = svd([(to_torch(a), n) for a, n in zip(arrays, [1, 1])])
    for name in module_names():
        a = result[f"{name}.lora_A.weight"].numpy()
        np.testing.assert_allclose(a @ a.T, np.eye(4), atol=1e-9)
        assert not result[f"{name}.lora_B.weight"].numpy().any()


def test_svd_in_float32_keeps_the_dtype_and_matches_to_float_tolerance(rng):
    arrays = [make_adapter(rng, rank=4, dtype=np.float32) for _ in range(3)]
    counts = [1, 1, 2]
    result = svd([(to_torch(a), n) for a, n in zip(arrays, counts)], rank=10)
    for name in module_names():
        assert result[f"{name}.lora_B.weight"].dtype == torch.float32
        expected = numpy_mean_update([{k: v.astype(np.float64) for k, v in a.items()} for a in arrays], counts, name)
        np.testing.assert_allclose(product(result, name), expected, rtol=1e-4, atol=1e-4)


def test_svd_pairs_embedding_factors(rng):
    adapters = [{"emb.lora_embedding_A": rng.standard_normal((2, 20)),
                 "emb.lora_embedding_B": rng.standard_normal((6, 2))} for _ in range(2)]
    result = svd([(to_torch(a), 1) for a in adapters], rank=4)
    expected = sum(a["emb.lora_embedding_B"] @ a["emb.lora_embedding_A"] for a in adapters) / 2
    merged = result["emb.lora_embedding_B"].numpy() @ result["emb.lora_embedding_A"].numpy()
    np.testing.assert_allclose(merged, expected, atol=1e-10)


class LargestTensor(TorchFunctionMode):
    """Records the largest tensor any torch call returns while active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, tuple) else (out,):
            if isinstance(value, torch.Tensor):
                self.numel = max(self.numel, value.numel())
        return out


def test_svd_never_builds_the_dense_out_by_in_update(rng):
    arrays = [make_adapter(rng, rank=4, out=256, inp=256, layers=1) for _ in range(2)]
    pairs = [(to_torch(a), 1) for a in arrays]
    with LargestTensor() as watch:
        svd(pairs)
    assert watch.numel <= 256 * 2 * 4  # the stacked thin factors, far below 256 * 256
    with LargestTensor() as watch:
        dense = pairs[0][0][f"{module_names(1)[0]}.lora_B.weight"] @ pairs[0][0][f"{module_names(1)[0]}.lora_A.weight"]
    assert watch.numel == dense.numel() == 256 * 256  # the watch does see a dense product


def test_svd_rejects_a_rank_the_inputs_cannot_fill_and_bad_ranks(rng):
    pairs = [(to_torch(make_adapter(rng, rank=4)), 1) for _ in range(2)]
    with pytest.raises(AggregationError, match=r"rank 9 exceeds .* min\(out, in, K·r\) = 8"):
        svd(pairs, rank=9)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(AggregationError, match="rank must be a positive integer"):
            svd(pairs, rank=bad)


# --- robust rules ------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [4, 5])
def test_median_is_the_numpy_coordinate_wise_median(rng, count):
    arrays = [make_adapter(rng) for _ in range(count)]
    result = median([(to_torch(a), n) for n, a in enumerate(arrays, start=1)])
    for key in arrays[0]:
        expected = np.median(np.stack([a[key] for a in arrays]), axis=0)
        np.testing.assert_allclose(result[key].numpy(), expected, rtol=1e-12)


@pytest.mark.parametrize(("count", "trim_ratio", "cut"), [(10, 0.1, 1), (8, 0.25, 2), (5, 0.1, 0), (7, 0.0, 0)])
def test_trimmed_mean_is_the_numpy_mean_without_the_extremes(rng, count, trim_ratio, cut):
    arrays = [make_adapter(rng) for _ in range(count)]
    result = trimmed_mean([(to_torch(a), 1) for a in arrays], trim_ratio=trim_ratio)
    for key in arrays[0]:
        ordered = np.sort(np.stack([a[key] for a in arrays]), axis=0)
        np.testing.assert_allclose(result[key].numpy(), ordered[cut : count - cut].mean(axis=0), rtol=1e-12)


@pytest.mark.parametrize("count", range(1, 10))
def test_robust_rules_sort_ties_and_every_count_like_numpy(rng, count):
    arrays = [{"t": rng.integers(-2, 3, size=(6, 7)).astype(np.float64)} for _ in range(count)]
    pairs = [(to_torch(a), 1) for a in arrays]
    ordered = np.sort(np.stack([a["t"] for a in arrays]), axis=0)
    np.testing.assert_array_equal(median(pairs)["t"].numpy(), np.median(ordered, axis=0))
    cut = int(0.25 * count)
    expected = ordered[cut : count - cut].mean(axis=0)
    np.testing.assert_allclose(trimmed_mean(pairs, trim_ratio=0.25)["t"].numpy(), expected)


@pytest.mark.parametrize("position", range(8))
@pytest.mark.parametrize("method", ["median", "trimmed_mean"])
def test_robust_rules_find_a_nan_held_by_any_adapter(rng, position, method):
    arrays = [{"t": rng.standard_normal((3, 4))} for _ in range(8)]
    arrays[position]["t"][2, 1] = np.nan
    with pytest.raises(AggregationError, match=rf"adapter {position}: t: contains NaN or Inf"):
        aggregate(method, [(to_torch(a), 1) for a in arrays])


def test_robust_rules_ignore_an_outlier_and_its_claimed_sample_count(rng):
    arrays = [make_adapter(rng) for _ in range(5)]
    honest = median([(to_torch(a), 1) for a in arrays[:4]] + [(to_torch(arrays[4]), 1)])
    arrays[4] = {key: np.full_like(value, 1e6) for key, value in arrays[4].items()}
    poisoned = [(to_torch(a), 1) for a in arrays[:4]] + [(to_torch(arrays[4]), 10**9)]
    for key, value in median(poisoned).items():
        assert value.abs().max() < 10 and np.abs(value.numpy() - honest[key].numpy()).max() < 10
    for value in trimmed_mean(poisoned, trim_ratio=0.2).values():
        assert value.abs().max() < 10
    assert max(v.abs().max() for v in fedavg(poisoned).values()) > 1e5  # fedavg is captured


def test_trimmed_mean_rejects_a_ratio_outside_zero_to_half(rng):
    pairs = [(to_torch(make_adapter(rng)), 1) for _ in range(3)]
    for bad in (-0.1, 0.5, 1, "0.1"):
        with pytest.raises(AggregationError, match=r"trim_ratio must be in \[0, 0.5\)"):
            trimmed_mean(pairs, trim_ratio=bad)


# --- dispatcher, purity, errors ----------------------------------------------------------------


def test_dispatcher_runs_every_registered_method_without_touching_the_inputs(rng):
    shared = {name: rng.standard_normal((4, 10)) for name in module_names()}
    arrays = [make_adapter(rng, shared_a=shared) for _ in range(4)]
    pairs = [(to_torch(a), n) for a, n in zip(arrays, [1, 2, 3, 4])]
    direct = {"fedavg": fedavg(pairs), "exact": exact(pairs), "svd": svd(pairs), "median": median(pairs),
              "trimmed_mean": trimmed_mean(pairs, trim_ratio=0.25)}
    assert set(METHODS) == set(direct)
    for method, expected in direct.items():
        result = aggregate(method, pairs, trim_ratio=0.25)
        assert list(result) == list(arrays[0])
        for key in expected:
            assert torch.equal(result[key], expected[key])
            assert result[key].data_ptr() not in {pair[0][key].data_ptr() for pair in pairs}
    for (adapter, _), original in zip(pairs, arrays):
        for key, value in original.items():
            np.testing.assert_array_equal(adapter[key].numpy(), value)


def test_dispatcher_rejects_unknown_methods_and_misplaced_rank(rng):
    pairs = [(to_torch(make_adapter(rng)), 1)]
    with pytest.raises(AggregationError, match="unknown aggregation method 'mean'; known: fedavg, exact"):
        aggregate("mean", pairs)
    with pytest.raises(AggregationError, match="rank applies only to the svd method, not to fedavg"):
        aggregate("fedavg", pairs, rank=4)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_names_the_tensor_holding_nan_or_inf(rng, method):
    shared = {name: rng.standard_normal((4, 10)) for name in module_names()}
    arrays = [make_adapter(rng, shared_a=shared) for _ in range(3)]
    bad_key = f"{module_names()[2]}.lora_B.weight"
    for bad_value in (np.nan, np.inf, -np.inf):
        broken = [dict(a) for a in arrays]
        broken[1] = {**arrays[1], bad_key: arrays[1][bad_key].copy()}
        broken[1][bad_key][0, 0] = bad_value
        with pytest.raises(AggregationError, match=rf"adapter 1: {bad_key}: contains NaN or Inf"):
            aggregate(method, [(to_torch(a), 1) for a in broken])


def with_key(arrays, key, value):
    changed = dict(arrays)
    changed[key] = value
    return changed


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda rng, a: [], "no adapters to aggregate"),
        (lambda rng, a: [(a, 0)], r"adapter 0: num_samples must be a positive integer, got 0"),
        (lambda rng, a: [(a, 1), (a, -3)], r"adapter 1: num_samples must be a positive integer, got -3"),
        (lambda rng, a: [(a, True)], r"num_samples must be a positive integer, got True"),
        (lambda rng, a: [(a, 2.5)], r"num_samples must be a positive integer, got 2.5"),
        (lambda rng, a: [(a,)], r"pair 0: expected \(adapter, num_samples\)"),
        (lambda rng, a: [({}, 1)], r"adapter 0: expected a non-empty dict"),
        (lambda rng, a: [(a, 1), ({k: v for k, v in a.items() if k != OTHER_KEY}, 1)],
         rf"adapter 1: keys differ from adapter 0's: missing \['{OTHER_KEY}'\]"),
        (lambda rng, a: [(a, 1), (with_key(a, OTHER_KEY, torch.zeros(3, 13, dtype=torch.float64)), 1)],
         rf"adapter 1: {OTHER_KEY}: \(3, 13\) torch.float64, adapter 0 has \(3, 12\) torch.float64"),
        (lambda rng, a: [(a, 1), (with_key(a, OTHER_KEY, a[OTHER_KEY].float()), 1)],
         rf"adapter 1: {OTHER_KEY}: \(3, 12\) torch.float32, adapter 0 has \(3, 12\) torch.float64"),
        (lambda rng, a: [(a, 1), (with_key(a, OTHER_KEY, "x"), 1)],
         rf"adapter 1: {OTHER_KEY}: expected a tensor, got str"),
        (lambda rng, a: [(with_key(a, OTHER_KEY, torch.zeros(3, dtype=torch.int64)), 1)],
         rf"adapter 0: {OTHER_KEY}: expected a floating-point tensor, got torch.int64"),
        (lambda rng, a: [(a, 1), (to_torch(make_adapter(rng, rank=3)), 1)],
         rf"adapter 1: module {PREFIX}.0.self_attn.q_proj has rank 3, adapter 0 has rank 4"),
        (lambda rng, a: [(with_key(a, f"{PREFIX}.1.self_attn.v_proj.lora_B.weight", torch.zeros(12, 3).double()), 1)],
         rf"module {PREFIX}.1.self_attn.v_proj: lora_A has rank 4 but lora_B has rank 3"),
        (lambda rng, a: [({k: v for k, v in a.items() if k != f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"}, 1)],
         rf"{PREFIX}.0.self_attn.q_proj.lora_A.weight: lora_A without its lora_B"),
        (lambda rng, a: [({k: v for k, v in a.items() if k != f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"}, 1)],
         rf"{PREFIX}.0.self_attn.q_proj.lora_B.weight: lora_B without its lora_A"),
        (lambda rng, a: [(with_key(a, f"{PREFIX}.0.self_attn.q_proj.lora_A.weight", torch.zeros(4, 10, 1).double()), 1)],
         rf"module {PREFIX}.0.self_attn.q_proj: expected 2-D factors"),
    ],
)
@pytest.mark.parametrize("method", sorted(METHODS))
def test_bad_inputs_raise_one_clear_error(rng, build, message, method):
    with pytest.raises(AggregationError, match=message):
        aggregate(method, build(rng, to_torch(make_adapter(rng))))
