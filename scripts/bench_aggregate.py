"""Time and memory of the LoRA aggregation rules (agent.train.aggregate) on 7B-shaped adapters.

Input: K=8 random float32 adapters shaped like a 7B model's rank-16 adapter (32 layers × q,k,v,o
on a 4096×4096 base: lora_A 16×4096, lora_B 4096×16; 64 MiB each, 512 MiB in all). For `exact`
the same adapters with every lora_A replaced by adapter 0's (FFA-LoRA: A frozen from the seed).
Every rule reads all 512 MiB, so aggregate_read_floor (one torch pass summing every input) is
printed too: fedavg's time over it shows how close to memory bandwidth it runs. Every rule also
returns 64 MiB of fresh tensors, whose page faults are a large part of fedavg's time on a VM;
aggregate_write_floor (allocating and filling tensors shaped like one adapter) shows that part,
which the reference pays as well.

Reference, measured in the same run: a plain numpy sample-weighted mean over the same tensors
(a loop over keys of Σ wᵢ·xᵢ on zero-copy numpy views). Prints one JSON object per line:
  aggregate_<method>:  value = seconds (best of --repeats interleaved with the reference; fewer
                       runs once a method's runs add up to 10 s),
                       reference = numpy seconds, ratio = reference / value (the speedup, higher
                       is better), goal = 2.0 for fedavg (>= 2x faster than numpy), null otherwise.
  aggregate_peak_rss_<method>: value = peak RSS growth in MiB while the method runs (its result
                       included), reference = the same for the numpy reference, ratio =
                       reference / value; measured as VmHWM - VmRSS after resetting the high-water
                       mark through /proc/self/clear_refs (rss_source says so), or as the
                       ru_maxrss delta where that reset is refused (which then only sees growth
                       above the earlier peak).
--threads defaults to 1, like the single-threaded numpy reference (like with like); --threads 2
uses both cores of the dev machine, but two intra-op threads stall at every op whenever the other
core is taken, so only on a quiet machine.
--only fedavg (a comma-separated list of methods) times just those, with the reference and the
floors, for quick iterations.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.train.aggregate import aggregate  # noqa: E402

FEDAVG_GOAL = 2.0
NOTES = {"read_floor": "seconds of one torch pass reading every input (sum): the floor for any rule; "
                       "ratio = reference/value",
         "write_floor": "seconds to allocate and fill tensors shaped like one adapter (page faults "
                        "included): every result, the reference's too, pays it; ratio = reference/value"}
METHODS = ("fedavg", "exact", "svd", "median", "trimmed_mean")
FLOORS = ("read_floor", "write_floor")
BUDGET_S = 10.0  # no further repeats of a method once its runs have taken this long
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def make_adapters(count: int, layers: int, hidden: int, rank: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    adapters = []
    for _ in range(count):
        adapter = {}
        for layer in range(layers):
            for projection in PROJECTIONS:
                name = f"base_model.model.model.layers.{layer}.self_attn.{projection}"
                adapter[f"{name}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator)
                adapter[f"{name}.lora_B.weight"] = torch.randn(hidden, rank, generator=generator)
        adapters.append(adapter)
    return adapters


def numpy_weighted_mean(arrays: list[dict[str, np.ndarray]], weights: list[float]) -> dict[str, np.ndarray]:
    return {key: sum(w * adapter[key] for w, adapter in zip(weights, arrays)) for key in arrays[0]}


class Meter:
    """Seconds and peak RSS growth (MiB, the result included) of one call."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL("libc.so.6")
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.rss_source = "VmHWM-VmRSS after /proc/self/clear_refs reset"
        except OSError:
            self.rss_source = "ru_maxrss delta (growth above the earlier peak only)"

    def measure(self, work) -> tuple[float, float]:
        gc.collect()
        self._libc.malloc_trim(0)  # hand freed heap back, so the baseline is what is live
        if self.rss_source.startswith("VmHWM"):
            Path("/proc/self/clear_refs").write_text("5")
            base = _status_kib("VmRSS")
        else:
            base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.perf_counter()
        result = work()
        elapsed = time.perf_counter() - start
        if self.rss_source.startswith("VmHWM"):
            peak = _status_kib("VmHWM")
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        del result
        return elapsed, (peak - base) / 1024


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=9, help="timed runs per method (best kept)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1, like the numpy reference)")
    parser.add_argument("--trim-ratio", type=float, default=0.125, help="0.125 drops 1 of 8 per side")
    parser.add_argument("--only", default=",".join(METHODS), help="comma-separated methods to time")
    args = parser.parse_args()
    methods = args.only.split(",")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"--only: unknown methods {unknown}; known: {', '.join(METHODS)}")
    torch.set_num_threads(args.threads)

    adapters = make_adapters(args.adapters, args.layers, args.hidden, args.rank)
    counts = [1000 + 100 * i for i in range(args.adapters)]
    weights = [n / sum(counts) for n in counts]
    pairs = list(zip(adapters, counts))
    shared_a = [({k: (adapters[0][k] if ".lora_A." in k else v) for k, v in a.items()}, n) for a, n in pairs]
    arrays = [{key: tensor.numpy() for key, tensor in adapter.items()} for adapter in adapters]

    rules = {
        "fedavg": lambda: aggregate("fedavg", pairs),
        "exact": lambda: aggregate("exact", shared_a),
        "svd": lambda: aggregate("svd", pairs),
        "median": lambda: aggregate("median", pairs),
        "trimmed_mean": lambda: aggregate("trimmed_mean", pairs, trim_ratio=args.trim_ratio),
    }
    work = {
        "reference": lambda: numpy_weighted_mean(arrays, weights),
        "read_floor": lambda: [tensor.sum() for adapter in adapters for tensor in adapter.values()],
        "write_floor": lambda: [torch.empty_like(tensor).fill_(1.0) for tensor in adapters[0].values()],
        **{method: rules[method] for method in METHODS if method in methods},
    }
    shape = {"adapters": args.adapters, "modules": args.layers * len(PROJECTIONS), "rank": args.rank,
             "hidden": args.hidden, "threads": args.threads}

    # Interleaved repeats, so the reference and every method see the same load on a shared
    # machine; a method stops repeating once its runs add up to BUDGET_S (svd: one or two runs).
    meter = Meter()
    best: dict[str, float] = {}
    spent = {name: 0.0 for name in work}
    peak: dict[str, float] = {}
    for _ in range(args.repeats):
        for name, run in work.items():
            if spent[name] > BUDGET_S:
                continue
            elapsed, grown = meter.measure(run)
            spent[name] += elapsed
            best[name] = min(best.get(name, float("inf")), elapsed)
            peak[name] = max(peak.get(name, 0.0), grown)

    reference, reference_peak = best.pop("reference"), peak.pop("reference")
    input_mib = round(sum(t.numel() * t.element_size() for a in adapters for t in a.values()) / 2**20)
    for method, elapsed in best.items():
        figure = {"bench": f"aggregate_{method}", "value": round(elapsed, 4), "unit": "s",
                  "reference": round(reference, 4), "ratio": round(reference / elapsed, 3),
                  "goal": FEDAVG_GOAL if method == "fedavg" else None,
                  "note": NOTES.get(method, "value = seconds, ratio = reference/value (speedup)"), **shape}
        if method == "trimmed_mean":
            figure["trim_ratio"] = args.trim_ratio
        print(json.dumps(figure), flush=True)
    for method, grown in peak.items():
        if method in FLOORS:
            continue
        figure = {"bench": f"aggregate_peak_rss_{method}", "value": round(grown, 1), "unit": "MiB",
                  "reference": round(reference_peak, 1), "ratio": round(reference_peak / grown, 3),
                  "goal": None, "note": "value = peak RSS growth incl. the result, ratio = reference/value",
                  "rss_source": meter.rss_source, "input_mib": input_mib}
        print(json.dumps(figure), flush=True)


if __name__ == "__main__":
    main()
