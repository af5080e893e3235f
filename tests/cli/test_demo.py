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
    # how busy the job kept its workers, from the signed reports' training seconds (issue 24 §5)
    busy = re.search(r"workers busy (\d+)% .*?\(([12]) worker\(s\), (\d+) s training over (\d+) s of rounds\): "
                     r"([\d.]+) machines", " ".join(done.stdout.split()))
    assert busy and 0 < int(busy.group(1)) <= 100 and 0 < float(busy.group(5)) <= 2.0, done.stdout[-1500:]
    adapter = root / "adapter"
    assert f"{adapter}" in done.stdout
    # the job's curves for TensorBoard (issue 27): the tensorboard program itself, headless, lists the scalars
    import subprocess
    import sys

    inspect = subprocess.run([sys.executable, "-m", "tensorboard.main", "--inspect", "--logdir", str(root / "tensorboard")],
                             capture_output=True, text=True, timeout=120)
    assert inspect.returncode == 0, inspect.stderr[-2000:]
    assert all(tag in inspect.stdout for tag in ("validation/aggregate", "validation/base", "train_loss/shard0/",
                                                 "rounds/wall_seconds")), inspect.stdout[-3000:]
    # the adapter, and the averaged AdamW state the job carries (IPIP-0006 §2.3; peft ignores it)
    assert {p.name for p in adapter.iterdir()} == {"adapter_config.json", "adapter_model.safetensors",
                                                   "optimizer.safetensors", "infernet-job.json"}
    # and the job it came from, so that `infernet publish` of this directory states the job's provenance
    from agent.pipeline.publish import model_card
    from agent.pipeline.source import resolve_source

    source = resolve_source(str(adapter))
    p = source.provenance
    assert p.kind == "job" and p.aggregate_cid == cid and p.round == 1 and p.validation_loss is not None
    assert p.ledger_head and p.ledger_entries and p.dataset_cids and f"the terms of job {p.job_id}" in p.spec_text
    card = model_card(source, "demo")
    assert cid in card and p.ledger_head in card and "locally" not in card
    for home in ("submitter", "worker0", "worker1"):  # every agent stopped cleanly (SIGTERM removes the socket)
        assert (root / home / "identity.key").exists() and not (root / home / "control.sock").exists()
        assert '"stopped"' in (root / home / "agent.log").read_text()


def test_demo_refuses_a_directory_in_use_and_bad_options(tmp_path):
    (tmp_path / "something").write_text("x")
    assert_one_line_error(cli("demo", "--dir", str(tmp_path)), "not empty")
    assert_one_line_error(cli("demo", "--workers", "1"), "--workers must be at least 2")


def test_demo_first_rounds_go_into_the_job_and_a_bad_plan_is_refused_before_any_agent_starts(tmp_path):
    from agent.demo import DemoOptions, demo_spec
    from protocol.jobspec import parse_spec

    spec = parse_spec(demo_spec(DemoOptions(rounds=5, steps=40, first_round_steps=(10, 20))))
    assert (spec.rounds, spec.training.max_steps, spec.training.first_round_steps) == (5, 40, (10, 20))
    assert parse_spec(demo_spec(DemoOptions())).training.first_round_steps == ()
    root = tmp_path / "net"
    done = cli("demo", "--rounds", "2", "--steps", "8", "--first-rounds", "4,4", "--dir", str(root))
    assert_one_line_error(done, "first_round_steps", "names 2 rounds")
    assert not (root / "submitter").exists()  # no agent was started


def test_agents_do_not_outlive_a_killed_demo_and_homes_are_private(tmp_path, tiny_model_dir):
    """Issue 17: `infernet demo` killed by SIGKILL (or SIGHUP) left its agents running in their own
    sessions; now the kernel stops each with SIGTERM (PR_SET_PDEATHSIG). Homes are 0700 with 0600
    keys, as `infernet agent init` makes them (they were 0755)."""
    import os
    import signal
    import stat
    import subprocess
    import sys
    import time

    from agent.channel import ControlError, request
    from tests.cli.conftest import REPO

    root = tmp_path / "demo"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    demo = subprocess.Popen([sys.executable, "-m", "agent.cli", "demo", "--workers", "2", "--shards", "2",
                             "--rounds", "1", "--steps", "400", "--dir", str(root)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    homes = [root / name for name in ("submitter", "worker0", "worker1")]
    pids = []
    try:
        deadline = time.monotonic() + 180
        while len(pids) < len(homes):
            assert demo.poll() is None and time.monotonic() < deadline, "the demo did not start its agents"
            try:
                pids = [request(home, "status", timeout=5)["pid"] for home in homes]
            except (ControlError, OSError):
                time.sleep(0.5)
        for home in homes:
            assert stat.S_IMODE(home.stat().st_mode) == 0o700, oct(home.stat().st_mode)
            assert stat.S_IMODE((home / "identity.key").stat().st_mode) == 0o600
        demo.send_signal(signal.SIGKILL)
        demo.wait(timeout=10)
        deadline = time.monotonic() + 30
        while [p for p in pids if _running(p)]:
            assert time.monotonic() < deadline, f"agents outlived the demo: {[p for p in pids if _running(p)]}"
            time.sleep(0.3)
        for home in homes:  # each was stopped by SIGTERM: it shut down cleanly
            assert '"SIGTERM: stopping' in (home / "agent.log").read_text()
    finally:
        demo.kill()
        for pid in pids:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a reparented child may wait for its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
