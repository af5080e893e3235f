"""LoRA adapter aggregation: small pure functions over (adapter, num_samples) pairs.

An adapter is a peft state dict, name -> tensor, as in `adapter_model.safetensors`: for every
adapted module a `...lora_A.weight` of shape (r, in) and a `...lora_B.weight` of shape (out, r),
whose product B·A (times the scale alpha/r, the same for every worker of a job) is the update
added to the frozen base weight. Every rule here takes a list of (adapter, num_samples) pairs,
returns a new adapter with exactly the input keys (so it saves as a peft adapter), never mutates
its inputs, computes in float32 (float64 inputs stay float64) and returns the input dtype.

Why averaging A and B separately is not averaging the updates: the weighted mean of the
updates is Σ wᵢ·BᵢAᵢ, but the product of the means is (Σ wᵢBᵢ)(Σ wⱼAⱼ) = Σᵢⱼ wᵢwⱼ·BᵢAⱼ, which
mixes in cross terms BᵢAⱼ of factors that were never trained together. The factorisation is not
even unique (BA = (BG)(G⁻¹A) for any invertible G), so averaging factors averages arbitrary
coordinates: two workers with B=[1], A=[1] and B=[-1], A=[-1] made the same update 1, yet
mean(B)·mean(A) = 0.

What each rule guarantees (wᵢ = nᵢ / Σ nⱼ):
  fedavg        the weighted mean of every tensor, A and B separately. The naive baseline other
                systems ship: its product is NOT the mean update (unless all A or all B agree).
  exact         for FFA-LoRA, where A is frozen from the job seed and identical on every worker:
                returns that A and the weighted mean of B, so B̄·A = Σ wᵢ·BᵢA exactly (up to
                float rounding). Raises if any A differs from adapter 0's A (no tolerance).
  svd           the best rank-r approximation (Eckart–Young) of the mean update Σ wᵢ·BᵢAᵢ,
                factored back as B' (out, r) = U·√S and A' (r, in) = √S·Vᵀ (IPIP-0006); exact
                whenever r >= the rank of the mean update, always so when r >= K·r_in. Computed
                through QR of the thin stacked factors, never forming the out×in matrix. Where
                the update is null (an untrained module, B = 0) both factors come back zero.
                If r differs from the input rank, the caller must keep the adapter's scale:
                write lora_alpha' = lora_alpha·r/r_in (alpha/√r under rsLoRA) in the config.
  median        coordinate-wise median of every tensor (mean of the two middle values for an
                even count, as numpy does); robust to fewer than half arbitrary adapters.
  trimmed_mean  coordinate-wise mean after dropping the k = floor(trim_ratio·K) largest and
                smallest values of every coordinate (scipy's trim_mean rule); with the default
                0.1 and fewer than 10 adapters nothing is dropped.
The robust rules are naive like fedavg (factors, not updates) and ignore sample counts on
purpose: a dishonest peer could claim any count.

Tensors that are not LoRA factors (modules_to_save, DoRA magnitudes) are trained directly, so
fedavg, exact and svd give them the weighted mean (which is the mean update for them) and the
robust rules apply their own rule. Inputs are checked before anything is returned, and every
error is an AggregationError naming the adapter (by position), key or module at fault.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral, Real

import torch

Adapter = Mapping[str, torch.Tensor]
Pairs = Sequence[tuple[Adapter, int]]

# The name of the factor in a peft key, and its partner: `q_proj.lora_A.weight` for linear
# layers, `embed_tokens.lora_embedding_A` for embeddings (whose update is (B·A)ᵀ, still B·A).
_PARTNER_OF_A = {"lora_A": "lora_B", "lora_embedding_A": "lora_embedding_B"}
_A_OF_PARTNER = {b: a for a, b in _PARTNER_OF_A.items()}


class AggregationError(ValueError):
    """Adapters that cannot be aggregated; the message names the adapter, key or module."""


@dataclass(frozen=True)
class LoraModule:
    """One adapted module: its path and the keys of its A (r, in) and B (out, r) factors."""

    name: str
    a_key: str
    b_key: str


@dataclass(frozen=True)
class _Checked:
    adapters: list[Adapter]
    weights: list[float]  # nᵢ / Σ nⱼ
    modules: list[LoraModule]
    other_keys: list[str]  # keys that are not LoRA factors


# --- the rules ---------------------------------------------------------------------------------


@torch.no_grad()
def fedavg(pairs: Pairs, *, parallel: bool = True) -> dict[str, torch.Tensor]:
    """Sample-weighted mean of every tensor, A and B separately (naive: not the mean update). ``parallel``: see
    ``_weighted_means`` (the same result either way)."""
    checked = _check_pairs(pairs)
    return _weighted_means(checked, list(checked.adapters[0]), parallel)


PARALLEL_MIN_BYTES = 32 << 20  # below this, one thread: splitting costs more than it saves


def _weighted_means(checked: _Checked, keys: list[str], parallel: bool = True) -> dict[str, torch.Tensor]:
    """``_weighted_mean`` of every key; large inputs split by tensor over one Python thread per torch
    thread, each running single-threaded ops (the ops release the GIL).

    Each tensor of a LoRA is small (a 4096x16 factor is 256 KiB): one op per tensor spread over
    torch's intra-op threads spends much of its time waking them, so whole tensors go to separate
    threads instead. ``torch.set_num_threads`` is process-wide: it is lowered to 1 for the duration
    and restored after, which is safe only when nothing else runs torch meanwhile — in the agent,
    aggregation runs under the one torch lock (agent/train/runner.py TORCH_LOCK). With ``parallel`` False it
    never changes it (one op per tensor on torch's threads, elementwise: the same values), so it may run beside a
    replay (agent/roles/coordinator.py: a round's aggregate computed early, while the replays run).
    """
    threads = torch.get_num_threads()
    first = checked.adapters[0]  # every adapter has its layout (checked)
    size = len(checked.adapters) * sum(first[key].numel() * first[key].element_size() for key in keys)
    if not parallel or threads < 2 or size < PARALLEL_MIN_BYTES or len(keys) < 2 * threads:
        return {key: _weighted_mean(checked, key) for key in keys}
    from concurrent.futures import ThreadPoolExecutor

    chunks = [keys[i::threads] for i in range(threads)]
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(threads) as pool:
            parts = list(pool.map(lambda chunk: {key: _weighted_mean(checked, key) for key in chunk}, chunks))
    finally:
        torch.set_num_threads(threads)
    merged = {key: value for part in parts for key, value in part.items()}
    return {key: merged[key] for key in keys}


@torch.no_grad()
def exact(pairs: Pairs) -> dict[str, torch.Tensor]:
    """FFA-LoRA: every A must be identical; returns that A and the weighted mean of B."""
    checked = _check_pairs(pairs)
    result = {key: _weighted_mean(checked, key) for key in checked.other_keys}
    for module in checked.modules:
        a_first = checked.adapters[0][module.a_key]
        _require_finite(a_first, f"adapter 0: {module.a_key}")
        for index, adapter in enumerate(checked.adapters[1:], start=1):
            if not torch.equal(adapter[module.a_key], a_first):
                raise AggregationError(
                    f"exact: module {module.name}: lora_A of adapter {index} differs from "
                    f"adapter 0's; exact aggregation needs A frozen from the job seed (use svd)"
                )
        result[module.a_key] = a_first.clone()
        result[module.b_key] = _weighted_mean(checked, module.b_key)
    return _in_input_order(checked, result)


@torch.no_grad()
def svd(pairs: Pairs, rank: int | None = None) -> dict[str, torch.Tensor]:
    """Mean update Σ wᵢ·BᵢAᵢ re-factored to rank r (default: input rank) by thin QR + SVD."""
    checked = _check_pairs(pairs)
    if rank is not None and (not isinstance(rank, Integral) or isinstance(rank, bool) or rank < 1):
        raise AggregationError(f"svd: rank must be a positive integer, got {rank!r}")
    result = {key: _weighted_mean(checked, key) for key in checked.other_keys}
    for module in checked.modules:
        b_new, a_new = _refactor_mean_update(checked, module, rank)
        result[module.a_key] = a_new
        result[module.b_key] = b_new
    return _in_input_order(checked, result)


@torch.no_grad()
def median(pairs: Pairs) -> dict[str, torch.Tensor]:
    """Coordinate-wise median of every tensor (robust, naive like fedavg; counts ignored)."""
    checked = _check_pairs(pairs)
    count = len(checked.adapters)

    def median_of(key: str) -> torch.Tensor:
        ordered = _sorted_coordinates(checked, key)
        middle = (ordered[(count - 1) // 2] + ordered[count // 2]) / 2
        return middle.to(checked.adapters[0][key].dtype)

    return {key: median_of(key) for key in checked.adapters[0]}


@torch.no_grad()
def trimmed_mean(pairs: Pairs, trim_ratio: float = 0.1) -> dict[str, torch.Tensor]:
    """Coordinate-wise mean without the floor(trim_ratio·K) extremes each side (counts ignored)."""
    checked = _check_pairs(pairs)
    if not isinstance(trim_ratio, Real) or isinstance(trim_ratio, bool) or not 0 <= trim_ratio < 0.5:
        raise AggregationError(f"trimmed_mean: trim_ratio must be in [0, 0.5), got {trim_ratio!r}")
    count = len(checked.adapters)
    cut = int(trim_ratio * count)

    def trimmed_mean_of(key: str) -> torch.Tensor:
        kept = _sorted_coordinates(checked, key)[cut : count - cut]
        return (sum(kept[1:], kept[0]) / len(kept)).to(checked.adapters[0][key].dtype)

    return {key: trimmed_mean_of(key) for key in checked.adapters[0]}


METHODS: dict[str, Callable[..., dict[str, torch.Tensor]]] = {
    "fedavg": fedavg,
    "exact": exact,
    "svd": svd,
    "median": median,
    "trimmed_mean": trimmed_mean,
}


def aggregate(
    method: str, pairs: Pairs, *, rank: int | None = None, trim_ratio: float = 0.1, parallel: bool = True
) -> dict[str, torch.Tensor]:
    """Aggregate (adapter, num_samples) pairs with the rule named `method` (see METHODS). ``parallel`` False:
    no process-wide torch setting is changed meanwhile (``_weighted_means``), the same result."""
    if method not in METHODS:
        raise AggregationError(f"unknown aggregation method {method!r}; known: {', '.join(METHODS)}")
    if method == "svd":
        return svd(pairs, rank=rank)
    if rank is not None:
        raise AggregationError(f"rank applies only to the svd method, not to {method}")
    if method == "trimmed_mean":
        return trimmed_mean(pairs, trim_ratio=trim_ratio)
    if method == "fedavg":
        return fedavg(pairs, parallel=parallel)
    return METHODS[method](pairs)


# --- arithmetic --------------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # float32 at least, so bf16/fp16 adapters are summed without losing the small updates.
    return torch.promote_types(dtype, torch.float32)


def _weighted_mean(checked: _Checked, key: str) -> torch.Tensor:
    tensors = [adapter[key] for adapter in checked.adapters]
    dtype = tensors[0].dtype
    compute = _compute_dtype(dtype)
    # One output, accumulated in place: one pass over each input, no temporaries; add_ reads
    # bf16/fp16 inputs into the float32 total as it goes. Each op spans one whole tensor on
    # torch's intra-op threads: a thread pool over modules measured no faster (torch ops in pool
    # threads start OpenMP teams of their own; numpy ufuncs cost more per call). The dtype test
    # skips a no-op .to(), whose dispatch costs ~15% of this loop on float32 inputs.
    total = torch.mul(tensors[0] if dtype == compute else tensors[0].to(compute), checked.weights[0])
    for tensor, weight in zip(tensors[1:], checked.weights[1:]):
        total.add_(tensor, alpha=weight)
    # With positive weights a NaN or Inf anywhere in the inputs reaches the mean, so checking
    # the mean (1/K of the data) is enough; the inputs are only scanned to name the culprit.
    if not _is_finite(total):
        for index, tensor in enumerate(tensors):
            _require_finite(tensor, f"adapter {index}: {key}")
        raise AggregationError(f"{key}: the weighted mean overflowed {compute}")
    return total if dtype == compute else total.to(dtype)


def _sorted_coordinates(checked: _Checked, key: str) -> list[torch.Tensor]:
    """K tensors holding, coordinate by coordinate, the K adapters' values in ascending order."""
    tensors = [adapter[key] for adapter in checked.adapters]
    ordered = [t.to(_compute_dtype(t.dtype)) for t in tensors]
    # Odd-even transposition sort with elementwise min/max: K rounds sort K values, and for the
    # few adapters of a job this is ~8x faster than torch.sort along a short axis on CPU.
    for round_ in range(len(ordered)):
        for i in range(round_ % 2, len(ordered) - 1, 2):
            low, high = torch.minimum(ordered[i], ordered[i + 1]), torch.maximum(ordered[i], ordered[i + 1])
            ordered[i], ordered[i + 1] = low, high
    # ±Inf sorts to an end, and min/max copy a NaN to both sides of every comparison, which
    # spreads it to the ends too: the inputs are finite exactly when the two ends are.
    if not (_is_finite(ordered[0]) and _is_finite(ordered[-1])):
        for index, tensor in enumerate(tensors):
            _require_finite(tensor, f"adapter {index}: {key}")
    return ordered


def _refactor_mean_update(
    checked: _Checked, module: LoraModule, rank: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Best rank-r factors B' = U·S (out, r), A' = Vᵀ (r, in, orthonormal rows) of Σ wᵢ·BᵢAᵢ, never forming out×in.

    The singular values go to B so that A' keeps unit-norm rows even where the mean update is zero
    (an untrained module, a rank above the update's): a zero row of A could never train again in
    the next round, while a unit row is a fresh direction, as at LoRA's own initialisation.
    """
    a_factors = [adapter[module.a_key] for adapter in checked.adapters]
    b_factors = [adapter[module.b_key] for adapter in checked.adapters]
    for index, (a, b) in enumerate(zip(a_factors, b_factors)):
        _require_finite(a, f"adapter {index}: {module.a_key}")
        _require_finite(b, f"adapter {index}: {module.b_key}")
    dtype = a_factors[0].dtype
    compute = _compute_dtype(dtype)
    # Σ wᵢ·BᵢAᵢ = [√w₁B₁ | … | √w_K B_K] · [√w₁A₁; …; √w_K A_K] = Bs·As, Bs (out, Kr), As (Kr, in).
    roots = [math.sqrt(w) for w in checked.weights]
    b_stack = torch.cat([b.to(compute) * root for b, root in zip(b_factors, roots)], dim=1)
    a_stack = torch.cat([a.to(compute) * root for a, root in zip(a_factors, roots)], dim=0)
    # Bs = Qb·Rb and Asᵀ = Qa·Ra, so Bs·As = Qb·(Rb·Raᵀ)·Qaᵀ: the SVD of the small core
    # Rb·Raᵀ = U·S·Vᵀ gives the SVD of the mean update, Qb·U · S · (Qa·V)ᵀ.
    q_b, r_b = torch.linalg.qr(b_stack)
    q_a, r_a = torch.linalg.qr(a_stack.T)
    u, s, vh = torch.linalg.svd(r_b @ r_a.T, full_matrices=False)
    rank_in = a_factors[0].shape[0]
    rank_out = rank_in if rank is None else rank
    if rank_out > s.shape[0]:
        raise AggregationError(
            f"svd: rank {rank_out} exceeds the largest rank the mean update of module "
            f"{module.name} can have: min(out, in, K·r) = {s.shape[0]}"
        )
    b_new = q_b @ (u[:, :rank_out] * s[:rank_out])
    a_new = vh[:rank_out] @ q_a.T
    return b_new.to(dtype), a_new.to(dtype)


def _is_finite(tensor: torch.Tensor) -> bool:
    # A NaN or an infinity anywhere makes the sum non-finite, so a finite sum proves every element
    # finite (one reduction: ~2.5x faster than aminmax, ~40x than isfinite().all() on CPU). A
    # non-finite sum may be an overflow of finite values: aminmax (which propagates NaN) decides.
    if tensor.numel() == 0:
        return True
    if math.isfinite(tensor.sum().item()):
        return True
    low, high = torch.aminmax(tensor)
    return math.isfinite(low.item()) and math.isfinite(high.item())


def _require_finite(tensor: torch.Tensor, where: str) -> None:
    if not _is_finite(tensor):
        raise AggregationError(f"{where}: contains NaN or Inf")


def _in_input_order(checked: _Checked, result: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: result[key] for key in checked.adapters[0]}


# --- input checks ------------------------------------------------------------------------------


def _check_pairs(pairs: Pairs) -> _Checked:
    """Every adapter has the same keys, shapes, dtypes and ranks; every count is positive."""
    if not isinstance(pairs, Sequence) or len(pairs) == 0:
        raise AggregationError("no adapters to aggregate: expected a non-empty list of (adapter, num_samples)")
    adapters: list[Adapter] = []
    counts: list[int] = []
    for index, pair in enumerate(pairs):
        if not isinstance(pair, Sequence) or len(pair) != 2:
            raise AggregationError(f"pair {index}: expected (adapter, num_samples), got {type(pair).__name__}")
        adapter, count = pair
        if not isinstance(adapter, Mapping) or len(adapter) == 0:
            raise AggregationError(f"adapter {index}: expected a non-empty dict of name -> tensor")
        if not isinstance(count, Integral) or isinstance(count, bool) or count <= 0:
            raise AggregationError(f"adapter {index}: num_samples must be a positive integer, got {count!r}")
        adapters.append(adapter)
        counts.append(int(count))

    first = adapters[0]
    for key, tensor in first.items():
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            what = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise AggregationError(f"adapter 0: {key}: expected a floating-point tensor, got {what}")
    modules, other_keys = _lora_modules(first)

    # The common case, every adapter laid out like adapter 0, is one comparison of lists (a
    # 7B adapter has hundreds of tensors); only an adapter that differs is examined key by key.
    keys = list(first)
    layout = _layout(first, keys)
    for index, adapter in enumerate(adapters[1:], start=1):
        if adapter.keys() != first.keys() or _layout(adapter, keys) != layout:
            _raise_layout_mismatch(index, adapter, first, modules)

    total = sum(counts)
    return _Checked(adapters, [count / total for count in counts], modules, other_keys)


def _layout(adapter: Adapter, keys: list[str]) -> list[tuple[torch.Size, torch.dtype] | None]:
    return [
        (tensor.shape, tensor.dtype) if isinstance(tensor, torch.Tensor) else None
        for tensor in map(adapter.__getitem__, keys)
    ]


def _raise_layout_mismatch(index: int, adapter: Adapter, first: Adapter, modules: list[LoraModule]) -> None:
    """Raise the error naming how adapter `index` differs from adapter 0: keys, types, ranks, shapes.

    Called only when the layouts differ, so one of these checks raises.
    """
    missing, extra = first.keys() - adapter.keys(), adapter.keys() - first.keys()
    if missing or extra:
        raise AggregationError(
            f"adapter {index}: keys differ from adapter 0's: "
            f"missing {sorted(missing)[:3]}, unexpected {sorted(extra)[:3]}"
        )
    for key, tensor in adapter.items():
        if not isinstance(tensor, torch.Tensor):
            raise AggregationError(f"adapter {index}: {key}: expected a tensor, got {type(tensor).__name__}")
    for module in modules:
        a, a_first = adapter[module.a_key], first[module.a_key]
        if a.dim() == 2 and a.shape[0] != a_first.shape[0]:
            raise AggregationError(
                f"adapter {index}: module {module.name} has rank {a.shape[0]}, "
                f"adapter 0 has rank {a_first.shape[0]}"
            )
    for key, tensor in adapter.items():
        if tensor.shape != first[key].shape or tensor.dtype != first[key].dtype:
            raise AggregationError(
                f"adapter {index}: {key}: {tuple(tensor.shape)} {tensor.dtype}, "
                f"adapter 0 has {tuple(first[key].shape)} {first[key].dtype}"
            )


def _lora_modules(adapter: Adapter) -> tuple[list[LoraModule], list[str]]:
    """Pair every lora_A key with its lora_B key; the keys left over are not LoRA factors."""
    modules: list[LoraModule] = []
    paired: set[str] = set()
    for key in adapter:
        parts = key.split(".")
        at = b_at = -1  # the last lora_A part of the key, the last lora_B part
        for i, part in enumerate(parts):
            if part in _PARTNER_OF_A:
                at = i
            elif part in _A_OF_PARTNER:
                b_at = i
        if at < 0:
            if b_at >= 0:
                a_key = ".".join(parts[:b_at] + [_A_OF_PARTNER[parts[b_at]]] + parts[b_at + 1 :])
                if a_key not in adapter:
                    raise AggregationError(f"{key}: lora_B without its lora_A ({a_key} is missing)")
            continue
        b_key = ".".join(parts[:at] + [_PARTNER_OF_A[parts[at]]] + parts[at + 1 :])
        name = ".".join(parts[:at])
        if b_key not in adapter:
            raise AggregationError(f"{key}: lora_A without its lora_B ({b_key} is missing)")
        a, b = adapter[key], adapter[b_key]
        if a.dim() != 2 or b.dim() != 2:
            raise AggregationError(
                f"module {name}: expected 2-D factors, got lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}"
            )
        if a.shape[0] != b.shape[1]:
            raise AggregationError(
                f"module {name}: lora_A has rank {a.shape[0]} but lora_B has rank {b.shape[1]}"
            )
        modules.append(LoraModule(name, key, b_key))
        paired.update((key, b_key))
    return modules, [key for key in adapter if key not in paired]



# --- outer optimizers across rounds (IPIP-0006 §2.4) ---------------------------------------------
#
# A round's workers all start from the previous aggregate θ and each runs its inner steps; the rule
# above (exact, fedavg, ...) gives their mean θ̄. Plain averaging takes θ̄ as the next aggregate. An
# outer optimizer instead treats the pseudo-gradient g = θ − θ̄ as a gradient and takes one step of
# its own on θ (DiLoCo: Nesterov momentum; FedOpt: SGD with server lr, Adam). With ``sgd`` at lr 1
# and no momentum the step lands on θ̄ up to float rounding; ``none`` takes θ̄ itself.
#
# Determinism: every coordinator must get the same bits from the same inputs on the same CPU, so
# the arithmetic is float32 elementwise ops in a fixed order, per tensor, one thread per tensor,
# and the state is plain named tensors (safetensors) travelling in the aggregate's bundle.

OUTER_OPTIMIZERS = ("none", "sgd", "nesterov", "adam")
OUTER_STATE_FILE = "outer_state.safetensors"


@dataclass(frozen=True)
class OuterOptimizer:
    """The job's outer optimizer (spec key ``outer``): ``none`` keeps the mean θ̄ as is."""

    optimizer: str = "none"
    lr: float = 1.0
    momentum: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if self.optimizer not in OUTER_OPTIMIZERS:
            raise AggregationError(f"unknown outer optimizer {self.optimizer!r}; known: {', '.join(OUTER_OPTIMIZERS)}")
        for name, value, low, high in (("lr", self.lr, 0.0, 100.0), ("momentum", self.momentum, 0.0, 1.0),
                                       ("beta1", self.beta1, 0.0, 1.0), ("beta2", self.beta2, 0.0, 1.0)):
            if not (isinstance(value, Real) and math.isfinite(value) and low <= value < high) or \
                    (name == "lr" and value == 0):
                raise AggregationError(f"outer.{name} must be in {'(' if name == 'lr' else '['}{low:g}, {high:g}), got {value!r}")
        if not (isinstance(self.eps, Real) and 0 < self.eps < 1):
            raise AggregationError(f"outer.eps must be in (0, 1), got {self.eps!r}")

    @property
    def active(self) -> bool:
        return self.optimizer != "none"


@torch.no_grad()
def outer_step(
    previous: Adapter, averaged: Adapter, state: Mapping[str, torch.Tensor], outer: OuterOptimizer, *,
    step: int, frozen: Sequence[str] = (),
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One outer step from ``previous`` (θ) given this round's mean ``averaged`` (θ̄): (θ', state').

    ``step`` is this outer step's number, 1 for the first round (Adam's bias correction reads it).
    Keys in ``frozen`` (lora_A under FFA-LoRA) must be equal in θ and θ̄ and are copied; they keep no
    state. ``state`` is last round's (empty in round 1): ``<key>.momentum`` for sgd/nesterov, ``<key>.m``
    and ``<key>.v`` for adam. Raises AggregationError naming the key on a layout mismatch.
    """
    if previous.keys() != averaged.keys():
        missing, extra = previous.keys() - averaged.keys(), averaged.keys() - previous.keys()
        raise AggregationError(f"outer: the round's mean and the previous aggregate differ in keys: "
                               f"missing {sorted(missing)[:3]}, unexpected {sorted(extra)[:3]}")
    if not isinstance(step, Integral) or step < 1:
        raise AggregationError(f"outer: step must be a positive integer, got {step!r}")
    frozen_set = set(frozen)
    result: dict[str, torch.Tensor] = {}
    new_state: dict[str, torch.Tensor] = {}
    for key, theta in previous.items():
        mean = averaged[key]
        if theta.shape != mean.shape or theta.dtype != mean.dtype:
            raise AggregationError(f"outer: {key}: previous {tuple(theta.shape)} {theta.dtype}, "
                                   f"mean {tuple(mean.shape)} {mean.dtype}")
        if key in frozen_set:
            if not torch.equal(theta, mean):
                raise AggregationError(f"outer: {key} is frozen but the round's mean changed it")
            result[key] = theta.clone()
            continue
        if not outer.active:
            result[key] = mean.clone()
            continue
        compute = _compute_dtype(theta.dtype)
        theta32 = theta.to(compute)
        gradient = theta32 - mean.to(compute)  # the pseudo-gradient: where the workers did not go
        update, tensors = _outer_update(key, gradient, state, outer, step, compute)
        new_state.update(tensors)
        new = theta32 - outer.lr * update
        _require_finite(new, f"outer: {key}")
        result[key] = new.to(theta.dtype)
    expected = {name for name in new_state}
    unexpected = set(state) - expected
    if outer.active and unexpected:
        raise AggregationError(f"outer: state has tensors that fit no trained key: {sorted(unexpected)[:3]}")
    return result, new_state


def _outer_update(key: str, gradient: torch.Tensor, state: Mapping[str, torch.Tensor], outer: OuterOptimizer,
                  step: int, compute: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The step direction for one tensor (to be scaled by lr), and its new state tensors."""

    def previous_state(name: str) -> torch.Tensor:
        value = state.get(f"{key}.{name}")
        if value is None:
            return torch.zeros_like(gradient)
        if value.shape != gradient.shape:
            raise AggregationError(f"outer: state {key}.{name} has shape {tuple(value.shape)}, "
                                   f"expected {tuple(gradient.shape)}")
        _require_finite(value, f"outer: state {key}.{name}")
        return value.to(compute, copy=True)  # never update the caller's state in place

    if outer.optimizer == "sgd":
        if outer.momentum == 0:
            return gradient, {}
        buffer = previous_state("momentum").mul_(outer.momentum).add_(gradient)
        return buffer, {f"{key}.momentum": buffer}
    if outer.optimizer == "nesterov":  # torch.optim.SGD(nesterov=True): g + μ·(μ·buf + g)
        buffer = previous_state("momentum").mul_(outer.momentum).add_(gradient)
        return gradient + outer.momentum * buffer, {f"{key}.momentum": buffer}
    # adam, with bias correction (FedAdam without it is the same up to the first rounds' scale)
    m = previous_state("m").mul_(outer.beta1).add_(gradient, alpha=1 - outer.beta1)
    v = previous_state("v").mul_(outer.beta2).addcmul_(gradient, gradient, value=1 - outer.beta2)
    m_hat = m / (1 - outer.beta1 ** step)
    v_hat = v / (1 - outer.beta2 ** step)
    return m_hat / (v_hat.sqrt() + outer.eps), {f"{key}.m": m, f"{key}.v": v}


def frozen_keys(adapter: Adapter, freeze_a: bool) -> list[str]:
    """The keys an outer step leaves alone: every lora_A factor when A is frozen (FFA-LoRA)."""
    if not freeze_a:
        return []
    modules, _ = _lora_modules(adapter)
    return [module.a_key for module in modules]


# --- carried optimizer state (IPIP-0006 §2.3) ------------------------------------------------------
#
# With ``training.optimizer_state: carried`` a round's AdamW does not start afresh: the aggregate
# carries the accepted workers' final AdamW states, averaged, and every worker of the next round
# loads them. A fresh Adam's first steps are ±lr in every coordinate (m̂/√v̂ = g/|g|), noise
# included, so restarting it each round throws away the very averaging the round paid for
# (scripts/bench_quality.py measures it). The state's names are loop.py's:
# ``<adapter tensor>.exp_avg``, ``.exp_avg_sq`` and ``.step``.

OPTIMIZER_FILE = "optimizer.safetensors"


@torch.no_grad()
def average_optimizer_states(pairs: Pairs) -> dict[str, torch.Tensor]:
    """Sample-weighted mean of the ``exp_avg`` and ``exp_avg_sq`` tensors, and the largest ``step``."""
    if not isinstance(pairs, Sequence) or len(pairs) == 0:
        raise AggregationError("no optimizer states to average")
    states = [state for state, _ in pairs]
    counts = [count for _, count in pairs]
    if any(not isinstance(c, Integral) or isinstance(c, bool) or c <= 0 for c in counts):
        raise AggregationError(f"optimizer states: sample counts must be positive integers, got {counts}")
    first = states[0]
    if not first:
        raise AggregationError("optimizer state 0 is empty")
    for index, state in enumerate(states[1:], start=1):
        if state.keys() != first.keys():
            missing, extra = first.keys() - state.keys(), state.keys() - first.keys()
            raise AggregationError(f"optimizer state {index}: keys differ from state 0's: "
                                   f"missing {sorted(missing)[:3]}, unexpected {sorted(extra)[:3]}")
    total = sum(counts)
    weights = [count / total for count in counts]
    out = {}
    for key in first:
        tensors = [state[key] for state in states]
        for index, tensor in enumerate(tensors):
            if tensor.shape != first[key].shape or not tensor.is_floating_point():
                raise AggregationError(f"optimizer state {index}: {key}: {tuple(tensor.shape)} {tensor.dtype}, "
                                       f"state 0 has {tuple(first[key].shape)} {first[key].dtype}")
            _require_finite(tensor, f"optimizer state {index}: {key}")
        if key.endswith(".step"):
            out[key] = torch.stack([t.to(torch.float32).reshape(()) for t in tensors]).max().reshape(first[key].shape)
            continue
        if key.endswith(".exp_avg_sq") and any(bool((t < 0).any()) for t in tensors):
            raise AggregationError(f"{key}: a second moment is negative")
        total_tensor = tensors[0].to(torch.float32) * weights[0]
        for tensor, weight in zip(tensors[1:], weights[1:]):
            total_tensor.add_(tensor.to(torch.float32), alpha=weight)
        out[key] = total_tensor.to(first[key].dtype)
    return out
