"""An agent started on a full disk waits for room to open its store, and starts once there is; a SIGTERM
while it waits ends it with status 0 (the soak: it exited 1, "not a usable infernet store: disk I/O error")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.cli.conftest import REPO, cli, cli_json
from tests.conftest import fill_disk


def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.3)
    return False


@pytest.mark.network
def test_an_agent_started_on_a_full_disk_waits_for_room_and_a_sigterm_meanwhile_ends_it_cleanly(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(home)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    logs = tmp_path / "logs"  # beside the small disk, so the lines that say why are kept
    logs.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("INFERNET_ACCEPT_TRAINING", None)
    command = [sys.executable, "-m", "agent.cli", "agent", "run", "--home", str(home), "--log-file",
               str(logs / "agent.log"), "--listen", "/ip4/127.0.0.1/tcp/0"]
    try:
        cli("agent", "init", "--home", str(home), check=True)
        (home / "config.toml").write_text('listen = ["/ip4/127.0.0.1/tcp/0"]\nmeasure_speed = false\n')
        first = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=REPO)
        assert _wait_for(lambda: cli("agent", "status", "--home", str(home)).returncode == 0, 60)
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=30) == 0  # a store now exists, closed cleanly

        for ending in ("room", "sigterm"):
            fill_disk(home / "filler")
            agent = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(logs / "stderr.log", "wb"),
                                     env=env, cwd=REPO)
            assert _wait_for(lambda: "cannot open the store: the disk is full" in
                             (logs / "agent.log").read_text(errors="replace"), 60), (logs / "stderr.log").read_text()
            assert agent.poll() is None  # waiting, not gone
            if ending == "room":
                (home / "filler").unlink()
                assert _wait_for(lambda: cli("agent", "status", "--home", str(home)).returncode == 0, 30)
                assert cli_json("agent", "status", "--home", str(home))["refusing_work"] is None
                (logs / "agent.log").write_text("")
            agent.send_signal(signal.SIGTERM)
            assert agent.wait(timeout=30) == 0, (logs / "stderr.log").read_text()
            (home / "filler").unlink(missing_ok=True)
    finally:
        subprocess.run(["umount", "-l", str(home)], capture_output=True)
