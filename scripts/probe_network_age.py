"""Probe: does a network older than the gossip windows take a restarted agent and a newcomer?

The way an operator met the fault (issue 21): separate `infernet agent run` processes on loopback,
real timings. A submitter and three workers run a first job; the network then idles until it is
``--age`` seconds old (older than py-libp2p's 120 s seen-message cache and the 300 s envelope
window, by default); then one worker is restarted with its home and a brand-new agent joins. After
``--settle`` seconds a second job runs. Printed, one JSON line per figure (scripts/ convention):

- ``replayed_rejections``: envelopes rejected as ``replayed`` on all agents (metrics);
- ``blacklistings``: "blacklisting" log lines on all agents;
- ``newcomers_trained``: of the restarted worker and the new agent, how many trained a shard of the
  second job or coordinated it (goal: both);
- the second job's end state;
- ``resyncs_after_restart``: after the submitter (kill -9) and a worker (SIGTERM) restart once both
  jobs are DONE, how many times their logs say a history was fetched, refused or rebuilt over the
  next ``--settle`` + 15 s (issue 21 §3: every 15 s, forever; at most the one catch-up each is fine).

Exit 0 when nobody was blacklisted and both newcomers trained, 1 otherwise. About age + 2 min.

    .venv/bin/python scripts/probe_network_age.py --age 330 --dir /tmp/probe
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.config import CONFIG_FILE, IDENTITY_FILE  # noqa: E402
from agent.keyfile import save_identity  # noqa: E402
from protocol.identity import Identity  # noqa: E402
from agent.channel import request  # noqa: E402
from agent.demo import DemoNetwork, DemoOptions, agent_config, demo_dataset, demo_spec  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProbeNetwork(DemoNetwork):
    """DemoNetwork whose agents also serve metrics, and whose agents can be restarted with their home."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.metrics: dict[str, int] = {}

    def launch(self, name: str, bootstrap: str | None, *, new: bool, accept: bool = True,
               coordinate: bool = True) -> None:
        import os

        home = self.home(name)
        if new:
            home.mkdir(parents=True, mode=0o700)
            os.chmod(home, 0o700)
            save_identity(Identity.generate(), home / IDENTITY_FILE)
            (home / CONFIG_FILE).write_text(agent_config(accept=accept, coordinate=coordinate,
                                                         model_path=self.model, writer="probe"))
        port = self.metrics.setdefault(name, free_port())
        command = [sys.executable, "-m", "agent.cli", "agent", "run", "--home", str(home),
                   "--log-file", str(home / "agent.log"), "--metrics-port", str(port)]
        if bootstrap:
            command += ["--bootstrap", bootstrap]
        if self.verbose:
            command += ["--verbose"]
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        stderr = open(home / "stderr.log", "ab")  # noqa: SIM115
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=env,
                                   start_new_session=True)
        stderr.close()
        self.processes = [(n, p) for n, p in self.processes if n != name] + [(name, process)]

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        process = dict(self.processes)[name]
        if process.poll() is None:
            process.send_signal(sig)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def scrape(self, name: str) -> dict[str, float]:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics[name]}/metrics", timeout=5).read().decode()
        except OSError:
            return {}
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def log_lines(self, name: str, pattern: str) -> list[str]:
        try:
            text = (self.home(name) / "agent.log").read_text(errors="replace")
        except OSError:
            return []
        return [line for line in text.splitlines() if re.search(pattern, line)]


def run_job(network: ProbeNetwork, root: Path, name: str, rounds: int, timeout: float) -> dict:
    submitter = network.home("submitter")
    options = DemoOptions(workers=3, shards=4, rounds=rounds, steps=8)
    spec = root / f"{name}.yml"
    spec.write_text(demo_spec(options).replace("name: infernet-demo", f"name: {name}"))
    dataset = root / "demo.jsonl"
    if not dataset.exists():
        shutil.copy(demo_dataset(), dataset)
    job = request(submitter, "job.announce", timeout=300, spec=str(spec), dataset=str(dataset))
    deadline = time.monotonic() + timeout
    while True:
        detail = request(submitter, "job.show", job=job["id"])
        if detail["state"] in ("DONE", "FAILED", "CANCELLED") or time.monotonic() > deadline:
            return detail
        time.sleep(1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--age", type=float, default=330.0, help="network age (s) at the restart and the join")
    parser.add_argument("--settle", type=float, default=30.0, help="seconds after them before job 2")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--verbose", action="store_true", help="the agents log at debug level")
    args = parser.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="infernet-probe-"))
    root.mkdir(parents=True, exist_ok=True)
    from agent.train.tiny import tiny_model

    network = ProbeNetwork(root, tiny_model(), args.verbose)
    started = time.monotonic()
    try:
        network.launch("submitter", None, new=True, accept=False, coordinate=False)
        bootstrap = network.wait_ready("submitter")["addrs"][0]
        for name in ("w0", "w1", "w2"):
            network.launch(name, bootstrap, new=True)
        for name in ("w0", "w1", "w2"):
            network.wait_ready(name)
        first = run_job(network, root, "probe-job-1", 3, 300)
        print(f"# job 1 {first['state']} at network age {time.monotonic() - started:.0f} s", file=sys.stderr)
        wait = args.age - (time.monotonic() - started)
        if wait > 0:
            time.sleep(wait)
        network.stop("w1")
        network.launch("w1", bootstrap, new=False)
        network.launch("w3", bootstrap, new=True)
        network.wait_ready("w1")
        network.wait_ready("w3")
        print(f"# restarted w1 and joined w3 at network age {time.monotonic() - started:.0f} s", file=sys.stderr)
        time.sleep(args.settle)
        second = run_job(network, root, "probe-job-2", 2, 300)
        names = ("submitter", "w0", "w1", "w2", "w3")
        replayed = sum(network.scrape(n).get('infernet_gossip_invalid_by_reason_total{reason="replayed"}', 0)
                       for n in names)
        blacklisted = sum(len(network.log_lines(n, "blacklisting")) for n in names)
        job2 = second["id"][:8]
        trained = {n: len(network.log_lines(n, rf"job {job2} shard \d+ attempt \d+: training")) for n in names}
        # the job's coordinator verifies and aggregates instead of training: it took part too
        coordinating = [n for n in names if network.log_lines(n, rf"job {job2}: coordinating")]
        newcomers = sum(1 for n in ("w1", "w3") if trained[n] or n in coordinating)
        for bench, value, unit, reference, goal in (
                ("replayed_rejections", replayed, "envelopes", 0, None),
                ("blacklistings", blacklisted, "log lines", 0, None),
                ("newcomers_trained", newcomers, "agents", 2, 1.0)):
            print(json.dumps({"bench": bench, "value": value, "unit": unit, "reference": reference,
                              "ratio": value / reference if reference else None, "goal": goal}))
        print(json.dumps({"job2": second["state"], "reason": second.get("reason"), "trained_shards": trained,
                          "coordinators": coordinating,
                          "dir": str(root)}))
        # issue 21 §3: after a restart, a DONE job's history was fetched again and again (the submitter,
        # "1 envelopes ... refused" every 15 s) and a worker rebuilt the DONE job's mirror every 15 s
        marks = {n: len(network.log_lines(n, ".")) for n in ("submitter", "w0")}
        network.stop("submitter", signal.SIGKILL)
        network.launch("submitter", None, new=False)
        network.wait_ready("submitter")
        network.stop("w0")
        network.launch("w0", bootstrap, new=False)
        network.wait_ready("w0")
        time.sleep(args.settle + 15)
        after = {n: network.log_lines(n, ".")[marks[n]:] for n in ("submitter", "w0")}
        resyncs = sum(1 for lines in after.values() for line in lines
                      if re.search("history refused|mirror rebuilt|caught up on", line))
        print(json.dumps({"bench": "resyncs_after_restart", "value": resyncs, "unit": "log lines",
                          "reference": 0, "ratio": 1.0 if resyncs <= 2 else 0.0, "goal": 1.0}))
        return 0 if blacklisted == 0 and newcomers == 2 and second["state"] == "DONE" and resyncs <= 2 else 1
    finally:
        network.close()


if __name__ == "__main__":
    sys.exit(main())
