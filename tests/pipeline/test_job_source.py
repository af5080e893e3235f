"""infer and publish from a job ID: the aggregate fetched by CID through the running agent (real daemons)."""

from __future__ import annotations

import json

import pytest

from tests.cli.conftest import cli, cli_json, daemons, small_spec, tiny_model_dir  # noqa: F401 - fixtures
from tests.cli.test_job_flow import _network


@pytest.mark.slow
def test_infer_and_publish_a_jobs_aggregate(tmp_path, daemons, tiny_model_dir):  # noqa: F811
    submitter = _network(tmp_path, daemons, tiny_model_dir, workers=2)
    home = str(submitter.home)
    job = cli_json("job", "announce", str(small_spec(tmp_path / "spec.yml")), "--home", home, timeout=180)
    watch = cli("job", "watch", job["id"][:12], "--home", home, "--json", "--interval", "0.5", "--timeout", "240",
                timeout=300)
    assert watch.returncode == 0, watch.stderr
    final = json.loads(watch.stdout.splitlines()[-1])
    answer = cli_json("infer", job["id"][:12], "--home", home, "--prompt", "Spell the word cat.",
                      "--temperature", "0", "--max-new-tokens", "8", timeout=180)
    adapter = submitter.home / "adapters" / f"{job['id'][:16]}-r{final['aggregates'][-1]['round']}"
    assert answer["adapter"] == str(adapter) and isinstance(answer["results"][0]["output"], str)
    out = tmp_path / "merged"
    done = cli("publish", job["id"][:12], "--home", home, "--merged", str(out), timeout=180)
    assert done.returncode == 0, done.stderr
    card = (out / "README.md").read_text()
    ledger = cli_json("job", "ledger", job["id"][:12], "--home", home)
    assert job["id"] in card and final["aggregates"][-1]["cid"] in card
    assert ledger["entries"][-1]["hash"] in card and "Dataset shard-0" in card
    provenance = json.loads((out / "infernet.json").read_text())
    assert provenance["job_id"] == job["id"] and provenance["base_model_sha256"]
    for daemon in daemons:
        assert daemon.terminate() == 0
