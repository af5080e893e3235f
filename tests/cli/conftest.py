"""The CLI as a user runs it: real `infernet` commands as subprocesses, real daemons on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str, timeout: float = 120, env: dict | None = None, check: bool = False) -> subprocess.CompletedProcess:
    """Run ``infernet ARGS`` and return the finished process (text stdout/stderr)."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    full_env.pop("INFERNET_ACCEPT_TRAINING", None)
    done = subprocess.run([sys.executable, "-m", "agent.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=REPO)
    if check and done.returncode != 0:
        raise AssertionError(f"infernet {' '.join(args)} exited {done.returncode}: {done.stderr}")
    return done


def cli_json(*args: str, timeout: float = 120) -> object:
    done = cli(*args, "--json", timeout=timeout, check=True)
    return json.loads(done.stdout)


def assert_one_line_error(done: subprocess.CompletedProcess, *fragments: str) -> None:
    """Exit status 1, one line on stderr starting 'infernet: ', naming what is wrong; no traceback."""
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("infernet: "), done.stderr
    assert "Traceback" not in done.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


class Daemon:
    """An `infernet agent run` subprocess in its own home."""

    def __init__(self, home: Path, *args: str) -> None:
        self.home = home
        self.args = args
        self.process: subprocess.Popen | None = None

    def init(self, config: str | None = None) -> "Daemon":
        cli("agent", "init", "--home", str(self.home), check=True)
        if config is not None:
            (self.home / "config.toml").write_text(config)
        return self

    def start(self, timeout: float = 60) -> dict:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.pop("INFERNET_ACCEPT_TRAINING", None)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "agent", "run", "--home", str(self.home),
             "--log-file", str(self.home / "agent.log"), *self.args],
            stdout=subprocess.DEVNULL, stderr=open(self.home / "stderr.log", "wb"), env=env, cwd=REPO)
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"daemon exited {self.process.returncode}: {(self.home / 'stderr.log').read_text()}")
            done = cli("agent", "status", "--home", str(self.home), "--json")
            if done.returncode == 0:
                return json.loads(done.stdout)
            if time.monotonic() > deadline:
                raise AssertionError(f"daemon in {self.home} did not answer: {done.stderr}")
            time.sleep(0.3)

    @property
    def addr(self) -> str:
        return cli_json("agent", "status", "--home", str(self.home))["addrs"][0]

    def terminate(self, timeout: float = 30) -> int:
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def kill9(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)


@pytest.fixture
def daemons():
    """Daemons started in a test; any still running at the end are stopped (SIGTERM, then SIGKILL)."""
    started: list[Daemon] = []
    yield started
    for daemon in started:
        if daemon.process is not None and daemon.process.poll() is None:
            daemon.process.send_signal(signal.SIGTERM)
    for daemon in started:
        if daemon.process is not None:
            try:
                daemon.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.process.kill()
                daemon.process.wait()


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from agent.train.tiny import tiny_model

    return tiny_model()


def model_config(model_dir: Path, *, accept_training: bool = False, can_coordinate: bool = True) -> str:
    return f"""
listen = ["/ip4/127.0.0.1/tcp/0"]
accept_training = {str(accept_training).lower()}
can_coordinate = {str(can_coordinate).lower()}
threads = 1
[models]
"infernet-tiny" = "{model_dir}"
"""


def small_spec(path: Path, *, shards: int = 2, rounds: int = 1, steps: int = 8) -> Path:
    path.write_text(f"""
name: cli-test
base_model: infernet-tiny
seed: 3
input: {{dataset: data.jsonl, validation_split: 0.1}}
training: {{batch_size: 8, learning_rate: 0.01, max_steps: {steps}, max_seq_len: 96}}
lora: {{rank: 4, alpha: 8, target_modules: [q_proj, v_proj]}}
shards: {shards}
rounds: {rounds}
proof: {{checkpoint_every: 4, verify_segments: 1}}
lease_seconds: 60
""")
    from agent.train.data import write_chatml
    from agent.train.tiny import demo_records

    write_chatml(path.parent / "data.jsonl", demo_records(120, seed=5))
    return path
