"""scripts/bench_wan.py's announce-to-all-leased figure, read from a harness trace."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_wan", REPO / "scripts" / "bench_wan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_announce_to_all_leased_takes_each_shards_first_lease_at_the_submitter(tmp_path):
    lines = [{"t": 0.5, "kind": "start"}, {"t": 1.0, "kind": "job", "job": "ab", "name": "bench-wan"},
             {"t": 1.4, "kind": "recv", "agent": "w0", "type": "lease", "round": 1, "shard": 0},  # not the submitter
             {"t": 1.6, "kind": "recv", "agent": "submitter", "type": "lease", "round": 1, "shard": 0, "attempt": 1},
             {"t": 2.5, "kind": "recv", "agent": "submitter", "type": "lease", "round": 1, "shard": 1, "attempt": 1},
             {"t": 9.0, "kind": "recv", "agent": "submitter", "type": "lease", "round": 1, "shard": 0, "attempt": 2},
             {"t": 12.0, "kind": "recv", "agent": "submitter", "type": "lease", "round": 2, "shard": 0}]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    bench = _bench()
    assert abs(bench.announce_to_all_leased(trace, 2) - 1.5) < 1e-9
    assert bench.announce_to_all_leased(trace, 3) is None  # a shard never leased: no figure
