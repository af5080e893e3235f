"""`infernet demo` end to end, on a smaller job than `make demo` runs (same code path, fewer steps)."""

from __future__ import annotations

import re

from tests.cli.conftest import assert_one_line_error, cli


def test_demo_runs_a_job_through_agent_processes_and_the_adapter_lowers_the_loss(tmp_path, tiny_model_dir):
    root = tmp_path / "demo"
    done = cli("demo", "--workers", "2", "--shards", "2", "--rounds", "1", "--steps", "30", "--dir", str(root),
               timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    cid = re.search(r"aggregate CID:\s+(\S+)", done.stdout).group(1)
    before, after = map(float, re.search(r"validation loss: ([\d.]+) \(base\) -> ([\d.]+)", done.stdout).groups())
    assert cid.startswith("bafy") and after < before - 1.0, done.stdout[-1000:]
    adapter = root / "adapter"
    assert f"{adapter}" in done.stdout
    assert {p.name for p in adapter.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    for home in ("submitter", "worker0", "worker1"):  # every agent stopped cleanly (SIGTERM removes the socket)
        assert (root / home / "identity.key").exists() and not (root / home / "control.sock").exists()
        assert '"stopped"' in (root / home / "agent.log").read_text()


def test_demo_refuses_a_directory_in_use_and_bad_options(tmp_path):
    (tmp_path / "something").write_text("x")
    assert_one_line_error(cli("demo", "--dir", str(tmp_path)), "not empty")
    assert_one_line_error(cli("demo", "--workers", "1"), "--workers must be at least 2")
