"""Link delay without sch_netem (agent/harness/delay.py): a delayed link really adds its delay to round
trips, jitter never reorders, and the delayers go away with the run (also when the run is killed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from agent.harness import hosts as hosts_module
from agent.harness.hosts import Hosts, HostSpec, Link, namespaces, sweep, unavailable_reason


@pytest.fixture
def shim(monkeypatch):
    """The userspace delayer, even where the kernel has netem; skip (saying why) where it cannot run."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no harness hosts here: {reason}")
    monkeypatch.setenv("INFERNET_HARNESS_DELAY", "nfqueue")
    monkeypatch.setattr(hosts_module, "_method_probed", False)
    monkeypatch.setattr(hosts_module, "_method", None)
    if hosts_module.delay_method() != "nfqueue":
        pytest.skip(f"the NFQUEUE delayer cannot run here: {hosts_module._delay_reason}")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


ECHO = ("import socket\ns = socket.socket()\ns.bind(('0.0.0.0', 4001))\ns.listen()\nprint('up', flush=True)\n"
        "c, _ = s.accept()\nwhile (d := c.recv(100)):\n    c.sendall(d)\n")
PING = ("import socket, sys, time\ns = socket.create_connection((sys.argv[1], 4001), timeout=10)\n"
        "s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\nrtts = []\nfor _ in range(8):\n"
        "    t = time.monotonic(); s.sendall(b'x'); s.recv(10); rtts.append((time.monotonic() - t) * 1000)\n"
        "print(sorted(rtts)[len(rtts) // 2])\n")
# 300 numbered datagrams as fast as they go; the receiver prints whether they came in order
UDP_RECV = ("import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\ns.bind(('0.0.0.0', 4002))\n"
            "s.settimeout(5)\nprint('up', flush=True)\ngot = []\ntry:\n    while len(got) < 300:\n"
            "        got.append(int(s.recv(100)))\nexcept socket.timeout:\n    pass\n"
            "print(len(got), got == sorted(got))\n")
UDP_SEND = ("import socket, sys\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            "for i in range(300):\n    s.sendto(str(i).encode(), (sys.argv[1], 4002))\n")


def test_a_delayed_link_adds_its_delay_to_round_trips_jitter_keeps_order_and_close_leaves_nothing(shim):
    before = namespaces(os.getpid())
    # a public host whose link adds 60 ± 20 ms, a host behind a NAT whose link (the router's) adds 40
    hosts = Hosts({"pub": HostSpec("pub", link=Link(delay_ms=60, jitter_ms=20)),
                   "home": HostSpec("home", nat=True, link=Link(delay_ms=40))})
    try:
        hosts.create()
        pids = [d.pid for d in hosts.delayers]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        rules = subprocess.run(["ip", "netns", "exec", hosts.ns("nat-home"), "iptables", "-t", "mangle", "-S"],
                               capture_output=True, text=True).stdout
        assert "-A PREROUTING -i eth0 -j NFQUEUE --queue-num 0" in rules, rules
        server = subprocess.Popen(hosts.exec_prefix("pub") + [sys.executable, "-c", ECHO], stdout=subprocess.PIPE,
                                  text=True)
        try:
            assert server.stdout.readline().strip() == "up"
            done = subprocess.run(hosts.exec_prefix("home") + [sys.executable, "-c", PING, hosts.ip("pub")],
                                  capture_output=True, text=True, timeout=60)
            rtt = float(done.stdout)
        finally:
            server.kill()
            server.wait()
        assert 100 * 0.7 <= rtt <= 100 + 250, f"median round trip {rtt:.1f} ms through links adding 60 + 40 ms"

        receiver = subprocess.Popen(hosts.exec_prefix("pub") + [sys.executable, "-c", UDP_RECV],
                                    stdout=subprocess.PIPE, text=True)
        assert receiver.stdout.readline().strip() == "up"
        subprocess.run(hosts.exec_prefix("home") + [sys.executable, "-c", UDP_SEND, hosts.ip("pub")],
                       check=True, timeout=30)
        count, ordered = receiver.communicate(timeout=30)[0].split()
        assert int(count) > 250 and ordered == "True", (count, ordered)  # into pub: jittered (±20 ms), never reordered
    finally:
        hosts.close()
    assert not any(_alive(p) for p in pids)
    assert namespaces(os.getpid()) == before


KILLED = """\
import sys, time
from agent.harness.hosts import Hosts, HostSpec, Link
hosts = Hosts({"a": HostSpec("a", link=Link(delay_ms=20))}).create()
print(hosts.delayers[0].pid, flush=True)
time.sleep(600)
"""


def test_the_delayers_of_a_killed_run_exit_and_its_namespaces_are_swept(shim):
    run = subprocess.Popen([sys.executable, "-c", KILLED], stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        delayer = int(run.stdout.readline())
        assert _alive(delayer)
    finally:
        run.send_signal(signal.SIGKILL)  # no finally, no close: the harness just dies
        run.wait()
    deadline = time.monotonic() + 10
    while _alive(delayer) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(delayer), "the delayer outlived its run"
    stale = namespaces(run.pid)
    assert stale and stale <= set(sweep())
    assert not namespaces(run.pid)


def test_a_setup_failing_after_a_delayer_started_stops_it_and_removes_everything(shim, monkeypatch):
    before = namespaces(os.getpid())
    started = []
    real_start, real_run = hosts_module._start_delayer, hosts_module.run_command

    def start(*args, **kwargs):
        started.append(real_start(*args, **kwargs))
        return started[-1]

    def run(args):
        if "NFQUEUE" in args:  # the rule that would hand the link's packets to the delayer
            raise hosts_module.HostsError("iptables: refused (as a test)")
        return real_run(args)

    monkeypatch.setattr(hosts_module, "_start_delayer", start)
    monkeypatch.setattr(hosts_module, "run_command", run)
    hosts = Hosts({"a": HostSpec("a", link=Link(delay_ms=20))})
    with pytest.raises(hosts_module.HostsError, match="refused"):
        hosts.create()
    assert len(started) == 1 and started[0].poll() is not None  # stopped, not left running
    assert not hosts.delayers and not hosts.made and namespaces(os.getpid()) == before
