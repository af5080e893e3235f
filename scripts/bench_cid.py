"""CID computation throughput (protocol.unixfs.compute_cid) as a ratio to plain hashlib.sha256.

Computing a UnixFS CID hashes every byte once more or less (leaves) plus a little more (CIDv0
leaf framing, inner nodes), so sha256 over the same bytes in the same run is the ceiling.
Prints one JSON object per figure; each side is the best of a few interleaved repeats.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protocol.unixfs import compute_cid  # noqa: E402

GOAL = 0.8


def seconds(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=96, help="data size in MiB (default 96)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    data = os.urandom(args.mib << 20)
    mib = len(data) / (1 << 20)
    work = {
        "sha256": lambda: hashlib.sha256(data).digest(),
        "cid_v1_throughput": lambda: compute_cid(data, cid_version=1),
        "cid_v0_throughput": lambda: compute_cid(data, cid_version=0),
    }
    # Interleaved repeats, so both sides see the same load on a shared machine.
    best = {name: float("inf") for name in work}
    for _ in range(args.repeats):
        for name, run in work.items():
            best[name] = min(best[name], seconds(run))
    reference = mib / best.pop("sha256")
    for name, elapsed in best.items():
        value = mib / elapsed
        figure = {
            "bench": name,
            "value": round(value, 1),
            "unit": "MiB/s",
            "reference": round(reference, 1),
            "ratio": round(value / reference, 3),
            "goal": GOAL,
        }
        print(json.dumps(figure), flush=True)


if __name__ == "__main__":
    main()
