"""One daemon driven through its control socket: status, peers, metrics, announce, cancel, ledger, SIGTERM."""

from __future__ import annotations

import socket
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

from tests.cli.conftest import Daemon, assert_one_line_error, cli, cli_json, model_config, small_spec


def test_daemon_answers_the_cli_and_stops_cleanly_on_sigterm(tmp_path, daemons, tiny_model_dir):
    home = tmp_path / "sub"
    daemon = Daemon(home, "--metrics-port", "0").init(model_config(tiny_model_dir, can_coordinate=False))
    daemons.append(daemon)
    status = daemon.start()
    assert set(status) >= {"peer_id", "addrs", "peers", "jobs", "accept_training", "pid", "uptime_s"}
    assert status["accept_training"] is False and status["addrs"][0].startswith("/ip4/127.0.0.1/tcp/")
    # py-libp2p's stream budget, which every new stream waits for (a soak looked for a leak of it)
    streams = status["streams"]
    assert streams["open"] >= 0 and streams["connections"] == 0 and streams["slots_free"] + streams["held"] == 10000
    sock = home / "control.sock"
    assert stat.S_ISSOCK(sock.stat().st_mode) and stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert "listening" in cli("agent", "status", "--home", str(home), check=True).stdout
    assert cli_json("peers", "--home", str(home)) == []

    # a second daemon in the same home is refused; one on a port in use too
    assert_one_line_error(cli("agent", "run", "--home", str(home)), "already running")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    other = tmp_path / "other"
    cli("agent", "init", "--home", str(other), check=True)
    port = busy.getsockname()[1]
    assert_one_line_error(cli("agent", "run", "--home", str(other), "--listen", f"/ip4/127.0.0.1/tcp/{port}"),
                          "in use")
    busy.close()

    # metrics: plain-text exposition on localhost
    log = (home / "agent.log").read_text()
    port = int(log.split("127.0.0.1:")[1].split("/metrics")[0])
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "# TYPE infernet_peers gauge" in text and "infernet_shards_trained_total 0" in text
    assert "infernet_event_loop_stalls_total " in text and "infernet_event_loop_lag_seconds_max " in text

    # a dataset that cannot be trained is refused before anything is written or announced (issue 17)
    (tmp_path / "bad").mkdir()
    bad = small_spec(tmp_path / "bad" / "spec.yml", shards=2)
    bad_data = tmp_path / "bad" / "data.jsonl"
    bad_data.write_text("")
    assert_one_line_error(cli("job", "announce", str(bad), "--home", str(home)), f"{bad_data}: no records")
    bad_data.write_text(bad_data.with_name("data.jsonl").read_text() or
                        '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n')
    assert_one_line_error(cli("job", "announce", str(bad), "--home", str(home)),
                          f"{bad_data}: 1 records leave 1 to train for 2 shards: every shard needs at least one record")
    assert cli_json("job", "list", "--home", str(home)) == []

    # a job nobody could train is not announced unless asked to wait (issue 25: it sat ANNOUNCED, unsaid)
    spec = small_spec(tmp_path / "spec.yml")
    assert_one_line_error(cli("job", "announce", str(spec), "--home", str(home), timeout=180),
                          "not announced: no live peer can train it (1 known, this agent included): 1 peer: "
                          "its capability says it does not accept training", "--wait")
    assert cli_json("job", "list", "--home", str(home)) == []
    # announced with --wait, it says what it waits for (and job show says it too); list it, cancel it, read its ledger
    job = cli_json("job", "announce", str(spec), "--home", str(home), "--wait", timeout=180)
    assert set(job) >= {"id", "name", "state", "round", "rounds", "shards", "accepted"}
    assert job["state"] == "ANNOUNCED" and job["shards"] == 2 and len(job["id"]) == 64
    assert "holds infernet-tiny" in job["waiting"]
    assert "waiting: no live peer can train it" in cli("job", "show", job["id"][:12], "--home", str(home)).stdout
    listed = cli_json("job", "list", "--home", str(home))
    assert [j["id"] for j in listed] == [job["id"]] and listed[0]["role"] == "submitter"
    assert_one_line_error(cli("job", "fetch", job["id"][:12], "--out", str(tmp_path / "out"), "--home", str(home)),
                          "no published aggregate")
    assert_one_line_error(cli("job", "cancel", "ffffffff", "--home", str(home)), "unknown job")
    assert_one_line_error(cli("job", "cancel", "zz", "--home", str(home)), "not a job ID")
    cancelled = cli_json("job", "cancel", job["id"][:12], "--home", str(home))
    assert cancelled["state"] == "CANCELLED"
    assert_one_line_error(cli("job", "cancel", job["id"][:12], "--home", str(home)), "already ended")
    watch = cli("job", "watch", job["id"][:12], "--home", str(home))
    assert watch.returncode == 1 and "CANCELLED" in watch.stdout
    ledger = cli_json("job", "ledger", job["id"][:12], "--home", str(home))
    assert ledger["verified"] is True and [e["kind"] for e in ledger["entries"]] == ["announced", "cancel"]
    assert "chain and signatures verified" in cli("job", "ledger", job["id"][:12], "--home", str(home)).stdout

    assert daemon.terminate() == 0
    assert not sock.exists()
    assert '"SIGTERM: stopping' in (home / "agent.log").read_text()


_SIGNAL_IN_A_CALLBACK = """
import os, signal, sys, weakref
sys.path.insert(0, {root!r})
{install}

class Thing:
    pass

def callback(ref):  # the signal is handled while Python runs this weakref callback, as in an import lock's
    os.kill(os.getpid(), signal.SIGTERM)
    sum(range(100000))

thing = Thing()
ref = weakref.ref(thing, callback)
del thing
print("still running", flush=True)
"""


def _run_signal_in_a_callback(install: str) -> subprocess.CompletedProcess:
    root = str(Path(__file__).resolve().parents[2])
    code = _SIGNAL_IN_A_CALLBACK.format(root=root, install=install)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_a_sigterm_while_starting_ends_the_process_even_inside_a_callback():
    """The soak's failure (w0 exited -9 on SIGTERM): a SIGTERM handled while `agent run` was still importing
    landed in an import lock's weakref callback, where the SystemExit of the early handler was printed as
    "Exception ignored" and dropped; the agent started anyway and ignored the SIGTERM. The early handler
    (agent/cli.py ``exit_before_ready``) now ends the process at once, with status 0, wherever it runs."""
    old = _run_signal_in_a_callback("signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))")
    assert "still running" in old.stdout and "Exception ignored" in old.stderr  # the way it failed
    new = _run_signal_in_a_callback("from agent.cli import exit_before_ready\n"
                                    "signal.signal(signal.SIGTERM, exit_before_ready)")
    assert new.returncode == 0 and "still running" not in new.stdout, (new.stdout, new.stderr[-2000:])
