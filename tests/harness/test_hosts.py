"""Harness hosts: network namespaces, NAT, shaped links; read strictly from scenarios; removed after use."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from agent.harness.hosts import (PREFIX, Hosts, HostSpec, HostsError, Link, namespaces, parse_duration_ms,
                                 parse_percent, parse_rate_mbit, sweep, unavailable_reason)
from agent.harness.scenario import parse_scenario
from protocol.errors import SpecError

needs_hosts = pytest.mark.skipif(unavailable_reason() is not None, reason=f"no harness hosts here: {unavailable_reason()}")

GOOD = """\
name: t
agents: {workers: 3}
hosts:
  home: {agents: [submitter], nat: true, link: {delay: 80ms, jitter: 20ms, loss: 1%, rate: 20mbit}}
  dc: {agents: [w0, w1]}
  far: {agents: [w2], link: {rate: 512kbit}}
"""


def test_hosts_are_read_and_workers_away_from_the_submitter_run_as_processes():
    scenario = parse_scenario(GOOD, "x.yml")
    assert scenario.placement == {"submitter": "home", "w0": "dc", "w1": "dc", "w2": "far"}
    assert scenario.hosts["home"] == HostSpec("home", True, Link(80.0, 20.0, 1.0, 20.0))
    assert scenario.hosts["far"].link.rate_mbit == 0.512
    assert set(scenario.processes) == {"w0", "w1", "w2"}


BAD = [
    ("hosts: {}\n", "x.yml:3: hosts: expected at least one host"),
    ("hosts:\n  Home: {agents: [submitter, w0]}\n", "x.yml:4: hosts.Home: a host name is 1-8 lowercase"),
    ("hosts:\n  a: {agents: [submitter, w0], nate: true}\n", "x.yml:4: hosts.a.nate: unknown key (did you mean 'nat'?)"),
    ("hosts:\n  a: {agents: [submitter, w0, w9]}\n", "x.yml:4: hosts.a.agents[2]: no agent called 'w9'"),
    ("hosts:\n  a: {agents: [submitter, w0]}\n  b: {agents: [w0]}\n", "x.yml:5: hosts.b.agents[0]: w0 is already on host a"),
    ("hosts:\n  a: {agents: [submitter]}\n", "x.yml:4: hosts: every agent needs a host; not placed: w0"),
    ("hosts:\n  a: {agents: [submitter, w0], link: {delay: 80}}\n", None),
    ("hosts:\n  a: {agents: [submitter, w0], link: {delay: fast}}\n",
     "x.yml:4: hosts.a.link.delay: expected a value such as 80ms, got 'fast'"),
    ("hosts:\n  a: {agents: [submitter, w0], link: {rate: 20mb}}\n",
     "x.yml:4: hosts.a.link.rate: expected a value such as 20mbit, got '20mb'"),
    ("hosts:\n  a: {agents: [submitter, w0], link: {loss: 101%}}\n", "x.yml:4: hosts.a.link.loss: out of range: '101%'"),
    ("hosts:\n  a: {agents: [submitter, w0], link: {delay: 10ms, jitter: 20ms}}\n",
     "x.yml:4: hosts.a.link.jitter: jitter larger than the delay"),
    ("hosts:\n  a: {agents: [submitter, w0], nat: yes please}\n", "x.yml:4: hosts.a.nat: expected true or false"),
    ("hosts:\n  a: {agents: [submitter], nat: true}\n  b: {agents: [w0], nat: true}\n",
     "x.yml:4: hosts: every agent is behind a NAT"),
]


@pytest.mark.parametrize("text,message", BAD)
def test_a_bad_hosts_key_is_one_line_naming_file_line_and_field(text, message):
    source = "name: t\nagents: {workers: 1}\n" + text
    if message is None:
        parse_scenario(source, "x.yml")  # a bare number of milliseconds is fine
        return
    with pytest.raises(SpecError) as error:
        parse_scenario(source, "x.yml")
    assert str(error.value).startswith(message), str(error.value)
    assert "\n" not in str(error.value)


def test_byzantine_agents_stay_on_the_harness_host():
    with pytest.raises(SpecError) as error:
        parse_scenario("name: t\nagents:\n  workers: 2\n  byzantine: {w1: random_adapter}\nhosts:\n"
                       "  a: {agents: [submitter, w0]}\n  b: {agents: [w1]}\n", "x.yml")
    assert str(error.value).startswith("x.yml:7: hosts.b.agents[0]: w1 runs in the harness's process, so on the submitter's host")


def test_units():
    assert parse_duration_ms("80ms") == 80 and parse_duration_ms("0.5s") == 500 and parse_duration_ms(3) == 3
    assert parse_duration_ms("80") is None and parse_duration_ms(True) is None
    assert parse_rate_mbit("20mbit") == 20 and parse_rate_mbit("1Gbit") == 1000 and parse_rate_mbit(20) is None
    assert parse_percent("1%") == 1 and parse_percent(0.5) == 0.5 and parse_percent("1") is None


CONNECT = ("import socket, sys\ntry:\n    socket.create_connection((sys.argv[1], 4001), timeout=3).close()\n"
           "    print('connected')\nexcept OSError as exc:\n    print(type(exc).__name__)\n")
SERVE = ("import socket\ns = socket.socket()\ns.bind(('0.0.0.0', 4001))\ns.listen()\nprint('up', flush=True)\n"
         "while True:\n    c, a = s.accept()\n    c.close()\n")


@needs_hosts
def test_a_nat_lets_connections_out_and_none_in_and_everything_is_removed():
    before = namespaces(os.getpid())
    hosts = Hosts({"pub": HostSpec("pub"), "home": HostSpec("home", nat=True, link=Link(loss=1, rate_mbit=20))})
    try:
        hosts.create()
        assert hosts.ip("home").startswith("192.168.") and hosts.public["home"] != hosts.ip("home")
        servers = [subprocess.Popen(hosts.exec_prefix(h) + [sys.executable, "-c", SERVE], stdout=subprocess.PIPE,
                                    text=True) for h in ("pub", "home")]
        try:
            assert [s.stdout.readline().strip() for s in servers] == ["up", "up"]

            def connect(src: str, dst: str) -> str:
                done = subprocess.run(hosts.exec_prefix(src) + [sys.executable, "-c", CONNECT, dst],
                                      capture_output=True, text=True, timeout=30)
                return done.stdout.strip()

            assert connect("home", hosts.ip("pub")) == "connected"  # out through the NAT
            assert connect("pub", hosts.public["home"]) == "TimeoutError"  # nothing forwarded in, and no reset
            assert connect("pub", hosts.ip("home")).endswith("Error")  # private addresses are not routed
        finally:
            for server in servers:
                server.kill()
                server.wait()
        router = hosts.ns("nat-home")  # the link's shape: tbf for the rate, iptables statistic for the loss
        qdisc = subprocess.run(["ip", "netns", "exec", router, "tc", "qdisc", "show", "dev", "eth0"],
                               capture_output=True, text=True).stdout
        rules = subprocess.run(["ip", "netns", "exec", router, "iptables", "-S"], capture_output=True, text=True).stdout
        assert ("netem" in qdisc or "tbf" in qdisc) and "rate 20Mbit" in qdisc, qdisc
        assert "netem" in qdisc or rules.count("-m statistic --mode random --probability 0.0099") == 4, rules
        made = set(hosts.made)
        assert made <= namespaces() and all(n.startswith(PREFIX) for n in made)
    finally:
        hosts.close()
    assert namespaces(os.getpid()) == before  # nothing of ours left


@needs_hosts
def test_a_failed_setup_removes_what_it_made_and_stale_runs_are_swept():
    before = namespaces(os.getpid())
    hosts = Hosts({"a": HostSpec("a"), "b": HostSpec("b")})
    hosts._shape = lambda *args: (_ for _ in ()).throw(HostsError("boom"))  # fails half-way
    hosts.specs["b"] = HostSpec("b", link=Link(rate_mbit=1))
    with pytest.raises(HostsError):
        hosts.create()
    assert namespaces(os.getpid()) == before and not hosts.made
    dead = 2**22 + 7  # above any pid_max default: no such process
    while True:
        try:
            os.kill(dead, 0)
            dead += 1
        except ProcessLookupError:
            break
    stale = f"{PREFIX}{dead}x1-inet"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    assert stale in sweep()
    assert stale not in namespaces()
