"""The Grafana dashboard (dashboards/grafana-infernet.json, issue 27): importable as Grafana reads it, and every
query asks for metrics a real agent serves (agent/daemon.metrics_text), a GPU's memory included."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from agent.daemon import metrics_text
from tests.roles.conftest import network
from tests.roles.test_gpu_jobs import declared_gpu

pytestmark = pytest.mark.network

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "grafana-infernet.json"


def _balanced(expr: str) -> bool:
    depth = {"(": 0, "[": 0, "{": 0}
    pairs = {")": "(", "]": "[", "}": "{"}
    for char in expr:
        if char in depth:
            depth[char] += 1
        elif char in pairs:
            depth[pairs[char]] -= 1
            if depth[pairs[char]] < 0:
                return False
    return not any(depth.values())


async def test_every_panel_queries_a_metric_the_agent_serves(tmp_path, tiny_model_dir):
    dashboard = json.loads(DASHBOARD.read_text())
    # what Grafana's import needs: the datasource input every query uses, a uid, a schema version, placed panels
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"] and dashboard["uid"]
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["panels"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(set(ids)) == len(ids)
    async with network(tmp_path, tiny_model_dir, workers=1, machines={0: declared_gpu()}) as net:
        served = set(re.findall(r"^# TYPE (\S+) (\S+)", metrics_text(net.agents["w0"]), re.M))
    kinds = dict(served)
    for panel in dashboard["panels"]:
        assert panel["type"] in ("timeseries", "stat") and {"h", "w", "x", "y"} <= set(panel["gridPos"]), panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}" and _balanced(expr), (panel["title"], expr)
            names = re.findall(r"\binfernet_[a-z_]+\b", expr)
            assert names, expr
            for name in names:
                assert name in kinds, f"{panel['title']}: {name} is not served"
                if re.search(rf"\b(rate|increase)\({name}\[", expr):  # rates only of counters
                    assert kinds[name] == "counter", (name, expr)
    used = {n for p in dashboard["panels"] for t in p["targets"] for n in re.findall(r"\binfernet_[a-z_]+\b", t["expr"])}
    assert "infernet_gpu_memory_free_bytes" in used and {"infernet_gpu_memory_total_bytes"} <= set(kinds)
