"""Hosts for the harness: Linux network namespaces, a bridge as "the internet", NAT routers, shaped links.

Rules of this file:
- Everything is made inside namespaces this run creates; nothing is added to the namespace the
  harness was started in (no interface, no address, no route, no firewall rule). All commands are
  ``ip -n NS ...`` / ``ip netns exec NS ...``: the host's own network is never touched.
- Every namespace name starts with ``PREFIX`` followed by the harness's pid and a per-run counter
  (``infh-<pid>x<n>-<name>``). ``Hosts.close`` deletes what the run made (also on failure and
  Ctrl-C: it runs in ``finally``), and ``sweep`` deletes namespaces of runs whose process is gone
  (a run killed with SIGKILL), so a crashed run never leaves namespaces behind for long.
- Layout (addresses are per run: every run has its own "internet", so they never collide)::

      inet (bridge br0, 10.1.0.0/16 "the internet")
       ├── veth ── host A          10.1.0.11   public: anyone can connect to it
       ├── veth ── host B          10.1.0.12   public, its link shaped (tc on both ends)
       └── veth ── router nat-C    10.1.0.101  MASQUERADE; unasked inbound packets are dropped
                     └── veth ── host C  192.168.3.2 (default via 192.168.3.1): outbound only

- A link's shape applies in both directions of the host's access link: a host's link adds
  ``delay ± jitter`` to every round trip through it, ``loss`` is per direction, ``rate`` caps each
  direction. With the kernel's ``sch_netem`` one netem qdisc per end does it all (delay and jitter
  half each way). Without it: rate with ``tbf``, loss with iptables ``statistic``, and delay and
  jitter with ``delay.py``, a userspace delayer the run starts in the namespace that owns the link
  (the host, or its NAT router): iptables (``-t mangle PREROUTING -i eth0 -j NFQUEUE``) hands it
  the packets coming in through the link, and it accepts each after the whole ``delay ± jitter``
  without reordering them (same round trips as netem; ``Hosts._delay`` says why incoming only).
  The run owns those processes: ``close`` stops them before deleting the namespaces, and they
  exit on their own when the run dies (their stdin closes). ``delay_method()`` says which is used
  ("netem", "nfqueue", or None: delay impossible here, and a scenario asking for it says so);
  ``INFERNET_HARNESS_DELAY=nfqueue`` forces the delayer where netem exists.
- ``HostsUnavailable`` is raised (and tests skip on it) when the machine cannot make hosts: not
  root, no ``ip``, no ``iptables``, namespaces refused.
"""

from __future__ import annotations

import ctypes
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from itertools import count

PREFIX = "infh-"
INET = "inet"
PUBLIC_NET = "10.1.0"
_counter = count(1)


class HostsUnavailable(Exception):
    """This machine cannot make harness hosts (the reason is the message)."""


class HostsError(Exception):
    """A command making the hosts failed (the command and its error are the message)."""


@dataclass(frozen=True)
class Link:
    """The shape of a host's access link."""

    delay_ms: float = 0.0  # added to each round trip through this link (netem: half each direction)
    jitter_ms: float = 0.0  # ± around the delay (netem: half each direction)
    loss: float = 0.0  # percent of packets lost, each direction
    rate_mbit: float = 0.0  # 0 = unlimited

    @property
    def shaped(self) -> bool:
        return bool(self.delay_ms or self.jitter_ms or self.loss or self.rate_mbit)

    def describe(self) -> str:
        parts = []
        if self.delay_ms or self.jitter_ms:
            parts.append(f"rtt +{self.delay_ms:g}±{self.jitter_ms:g} ms")
        if self.loss:
            parts.append(f"loss {self.loss:g}%")
        if self.rate_mbit:
            parts.append(f"{self.rate_mbit:g} Mbit/s")
        return ", ".join(parts) or "unshaped"


@dataclass(frozen=True)
class HostSpec:
    name: str
    nat: bool = False
    link: Link = Link()


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s)\s*$")
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(kbit|mbit|gbit)\s*$", re.I)
_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


def parse_duration_ms(value: object) -> float | None:
    """``"80ms"``, ``"0.08s"`` or a number of milliseconds; None if it is none of those."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    match = _DURATION.match(value) if isinstance(value, str) else None
    if not match:
        return None
    return float(match.group(1)) * (1000.0 if match.group(2) == "s" else 1.0)


def parse_rate_mbit(value: object) -> float | None:
    """``"20mbit"``, ``"512kbit"``, ``"1gbit"``; None if not a rate."""
    match = _RATE.match(value) if isinstance(value, str) else None
    if not match:
        return None
    return float(match.group(1)) * {"kbit": 0.001, "mbit": 1.0, "gbit": 1000.0}[match.group(2).lower()]


def parse_percent(value: object) -> float | None:
    """``"1%"`` or a number of percent; None if neither."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    match = _PERCENT.match(value) if isinstance(value, str) else None
    return float(match.group(1)) if match else None


# -- can this machine do it ------------------------------------------------------------------------


def unavailable_reason() -> str | None:
    """Why harness hosts cannot be made here, or None when they can."""
    if os.name != "posix" or not os.path.exists("/proc/self/ns/net"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (run the tests as root)"
    for tool in ("ip", "tc", "iptables"):
        if shutil.which(tool) is None:
            return f"no '{tool}' command (apt-get install iproute2 iptables)"
    return None


def scenario_unavailable(specs: dict[str, "HostSpec"]) -> str | None:
    """Why hosts with these specs cannot be made here (a test skips with it), or None."""
    reason = unavailable_reason()
    if reason is None:
        delayed = [s.name for s in specs.values() if s.link.delay_ms or s.link.jitter_ms]
        if delayed and delay_method() is None:
            reason = f"host {delayed[0]}: link delay/jitter: {_delay_reason}"
    return reason


_netem: bool | None = None
_method: str | None = None
_method_probed = False
_delay_reason = ""
DELAYER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "delay.py")


def delay_method() -> str | None:
    """How links get delay and jitter here: "netem", "nfqueue" (the userspace delayer) or None.

    netem when the kernel has it, else the delayer when nfnetlink_queue and the NFQUEUE target work
    (probed once, in a throwaway namespace); ``INFERNET_HARNESS_DELAY=nfqueue`` (or ``netem``)
    insists on one, and None follows when it cannot be had.
    """
    global _method, _method_probed, _delay_reason
    if not _method_probed:
        wanted = os.environ.get("INFERNET_HARNESS_DELAY", "")
        if wanted not in ("", "netem", "nfqueue"):
            _delay_reason = f"INFERNET_HARNESS_DELAY={wanted!r}: expected netem or nfqueue"
        elif _use_netem():
            _method = "netem"
        elif wanted == "netem":
            _delay_reason = "INFERNET_HARNESS_DELAY=netem, but the kernel has no sch_netem (CONFIG_NET_SCH_NETEM)"
        else:
            problem = _nfqueue_problem()
            if problem is None:
                _method = "nfqueue"
            else:
                _delay_reason = (f"the kernel has no sch_netem (CONFIG_NET_SCH_NETEM) and the userspace delayer "
                                 f"cannot run: {problem}")
        _method_probed = True
    return _method


def _use_netem() -> bool:
    """Shape links with netem (else tbf, iptables and the delayer): netem exists and is not refused."""
    return os.environ.get("INFERNET_HARNESS_DELAY", "") != "nfqueue" and netem_available()


def _nfqueue_problem() -> str | None:
    """Why the NFQUEUE delayer cannot run here (None: it can): tried in a throwaway namespace."""
    name = f"{PREFIX}{os.getpid()}x0-dprobe"
    delayer = None
    try:
        run_command(["ip", "netns", "add", name])
        delayer = _start_delayer(["ip", "netns", "exec", name], {0: (1.0, 0.0)})
        run_command(["ip", "netns", "exec", name, "iptables", "-t", "mangle", "-A", "POSTROUTING", "-o", "lo",
              "-j", "NFQUEUE", "--queue-num", "0"])
        return None
    except HostsError as exc:
        return str(exc)
    finally:
        if delayer is not None:
            _stop_delayer(delayer)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _start_delayer(prefix: list[str], queues: dict[int, tuple[float, float]]) -> subprocess.Popen:
    """Start delay.py (``prefix`` puts it in a namespace) and wait until its queues are bound."""
    args = prefix + [sys.executable, DELAYER]
    for queue, (delay_ms, jitter_ms) in queues.items():
        args += ["--queue", f"{queue}:{delay_ms:g}:{jitter_ms:g}"]
    with tempfile.TemporaryFile() as errors:  # the child writes its own copy; read here on failure only
        process = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors)
        deadline = time.monotonic() + 20
        line = b""
        try:
            while not line.endswith(b"\n") and time.monotonic() < deadline:
                ready, _, _ = select.select([process.stdout], [], [], max(0.0, deadline - time.monotonic()))
                chunk = os.read(process.stdout.fileno(), 64) if ready else b""
                if not chunk:
                    break
                line += chunk
        except BaseException:  # Ctrl-C while it starts: it is not ours to forget
            _stop_delayer(process)
            raise
        if line.strip() != b"ready":
            _stop_delayer(process)
            errors.seek(0)
            said = errors.read().decode(errors="replace").strip().splitlines()
            raise HostsError(f"{' '.join(args)}: {said[-1] if said else 'did not say ready within 20 s'}")
    return process


def _stop_delayer(process: subprocess.Popen) -> None:
    """Stop a delayer: close its stdin (it exits), then SIGTERM, then SIGKILL. Never raises."""
    from agent.train.child import end_child

    end_child(process, grace=2.0)


def netem_available() -> bool:
    """Does the kernel have sch_netem (delay, jitter)? Probed once in a throwaway namespace."""
    global _netem
    if _netem is None:
        name = f"{PREFIX}{os.getpid()}x0-probe"
        try:
            run_command(["ip", "netns", "add", name])
            probe = subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root",
                                    "netem", "delay", "1ms"], capture_output=True, text=True)
            _netem = probe.returncode == 0
        except HostsError:
            _netem = False
        finally:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return _netem


def namespaces(pid: int | None = None) -> set[str]:
    """The machine's network namespaces; with ``pid``, only the harness's of that process (``PREFIX`` pid x)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = {line.split()[0] for line in listed.splitlines() if line.split()}
    return names if pid is None else {n for n in names if n.startswith(f"{PREFIX}{pid}x")}


def sweep() -> list[str]:
    """Delete the namespaces of harness runs whose process no longer exists; return their names."""
    removed = []
    for name in sorted(namespaces()):
        match = re.match(rf"^{re.escape(PREFIX)}(\d+)x\d+-", name)
        if match and not _pid_alive(int(match.group(1))):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            removed.append(name)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_command(args: list[str]) -> str:
    """Run one host command (``ip``, ``iptables``, ``tc``); its stdout, or HostsError with its one line."""
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise HostsError(f"{' '.join(args)}: {(done.stderr or done.stdout).strip()}")
    return done.stdout


# -- the hosts of one run --------------------------------------------------------------------------


@dataclass
class Hosts:
    """The namespaces of one run: ``ns(host)`` is a host's namespace, ``ip(host)`` its address."""

    specs: dict[str, HostSpec]
    run_id: str = field(default_factory=lambda: f"{os.getpid()}x{next(_counter)}")
    made: list[str] = field(default_factory=list)  # namespaces, in creation order
    addresses: dict[str, str] = field(default_factory=dict)  # host -> its own IPv4 address
    public: dict[str, str] = field(default_factory=dict)  # host -> the address the internet sees
    delayers: list[subprocess.Popen] = field(default_factory=list)  # delay.py processes (no netem)

    def ns(self, host: str) -> str:
        return f"{PREFIX}{self.run_id}-{host}"

    def ip(self, host: str) -> str:
        return self.addresses[host]

    def exec_prefix(self, host: str) -> list[str]:
        """The command prefix that runs a program on ``host``."""
        return ["ip", "netns", "exec", self.ns(host)]

    def create(self) -> "Hosts":
        """Make the internet, the routers and the hosts; on any failure undo what was made and raise."""
        reason = unavailable_reason()
        if reason:
            raise HostsUnavailable(reason)
        sweep()
        reason = scenario_unavailable(self.specs)
        if reason:
            raise HostsUnavailable(reason)
        try:
            inet = self._namespace(INET)
            run_command(["ip", "-n", inet, "link", "add", "br0", "type", "bridge"])
            run_command(["ip", "-n", inet, "addr", "add", f"{PUBLIC_NET}.1/16", "dev", "br0"])
            run_command(["ip", "-n", inet, "link", "set", "br0", "up"])
            for index, spec in enumerate(self.specs.values(), start=1):
                self._host(index, spec)
        except BaseException:
            self.close()
            raise
        return self

    def _namespace(self, name: str) -> str:
        ns = self.ns(name)
        run_command(["ip", "netns", "add", ns])
        self.made.append(ns)
        run_command(["ip", "-n", ns, "link", "set", "lo", "up"])
        return ns

    def _attach(self, ns: str, bridge_ns: str, bridge: str, outside: str) -> None:
        """A veth from ``ns`` (its end: eth0) to ``bridge`` in ``bridge_ns`` (its end: ``outside``)."""
        run_command(["ip", "-n", bridge_ns, "link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", ns])
        run_command(["ip", "-n", bridge_ns, "link", "set", outside, "master", bridge])
        run_command(["ip", "-n", bridge_ns, "link", "set", outside, "up"])
        run_command(["ip", "-n", ns, "link", "set", "eth0", "up"])

    def _host(self, index: int, spec: HostSpec) -> None:
        inet = self.ns(INET)
        ns = self._namespace(spec.name)
        outside = f"v{index}"
        if not spec.nat:
            address = f"{PUBLIC_NET}.{10 + index}"
            self._attach(ns, inet, "br0", outside)
            run_command(["ip", "-n", ns, "addr", "add", f"{address}/16", "dev", "eth0"])
            self.addresses[spec.name] = self.public[spec.name] = address
            self._shape(ns, "eth0", inet, outside, spec.link)
            return
        router = self._namespace(f"nat-{spec.name}")
        router_ip = f"{PUBLIC_NET}.{100 + index}"
        self._attach(router, inet, "br0", outside)
        run_command(["ip", "-n", router, "addr", "add", f"{router_ip}/16", "dev", "eth0"])
        run_command(["ip", "-n", router, "link", "add", "lan", "type", "bridge"])
        run_command(["ip", "-n", router, "addr", "add", f"192.168.{index}.1/24", "dev", "lan"])
        run_command(["ip", "-n", router, "link", "set", "lan", "up"])
        self._attach(ns, router, "lan", "h0")
        address = f"192.168.{index}.2"
        run_command(["ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0"])
        run_command(["ip", "-n", ns, "route", "add", "default", "via", f"192.168.{index}.1"])
        run_command(["ip", "netns", "exec", router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
        iptables = ["ip", "netns", "exec", router, "iptables"]
        run_command(iptables + ["-t", "nat", "-A", "POSTROUTING", "-o", "eth0", "-j", "MASQUERADE"])
        # a home router: replies to what went out come back; nothing new comes in
        run_command(iptables + ["-A", "FORWARD", "-i", "eth0", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
                         "-j", "ACCEPT"])
        run_command(iptables + ["-A", "FORWARD", "-i", "eth0", "-j", "DROP"])
        # and it drops (not resets) what comes in unasked for the router itself: a SYN to a port no
        # mapping holds yet is silently lost, as home routers do. A reset here would kill the first
        # SYN of a TCP simultaneous open (hole punching, agent/net/reach.py ``_DCUtR``) for good.
        run_command(iptables + ["-A", "INPUT", "-i", "eth0", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
                         "-j", "ACCEPT"])
        run_command(iptables + ["-A", "INPUT", "-i", "eth0", "-j", "DROP"])
        self.addresses[spec.name] = address
        self.public[spec.name] = router_ip
        self._shape(router, "eth0", inet, outside, spec.link)

    def _shape(self, ns: str, dev: str, peer_ns: str, peer_dev: str, link: Link) -> None:
        """Shape both directions of an access link: ``dev`` in ``ns`` and its peer end."""
        if not link.shaped:
            return
        for where, name in ((ns, dev), (peer_ns, peer_dev)):
            if _use_netem():
                args = ["ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", name, "root", "netem"]
                if link.delay_ms or link.jitter_ms:
                    args += ["delay", f"{link.delay_ms / 2:g}ms"]
                    if link.jitter_ms:
                        args += [f"{link.jitter_ms / 2:g}ms", "distribution", "normal"]
                if link.loss:
                    args += ["loss", f"{link.loss:g}%"]
                if link.rate_mbit:
                    args += ["rate", f"{link.rate_mbit * 1000:g}kbit"]
                run_command(args)
                continue
            if link.rate_mbit:
                run_command(["ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", name, "root", "tbf",
                      "rate", f"{link.rate_mbit * 1000:g}kbit", "burst", "32kb", "latency", "400ms"])
        if link.loss and not _use_netem():  # both directions, at the host end of the link
            for chain, flag in (("OUTPUT", "-o"), ("INPUT", "-i"), ("FORWARD", "-o"), ("FORWARD", "-i")):
                run_command(["ip", "netns", "exec", ns, "iptables", "-I", chain, "1", flag, dev, "-m", "statistic",
                      "--mode", "random", "--probability", f"{link.loss / 100:.6f}", "-j", "DROP"])
        if (link.delay_ms or link.jitter_ms) and not _use_netem():
            self._delay(ns, dev, link)

    def _delay(self, ns: str, dev: str, link: Link) -> None:
        """Delay and jitter without netem: a delayer in ``ns`` holds the packets coming in on ``dev``
        (mangle PREROUTING: forwarded ones too, on a router) for the link's whole ``delay ± jitter``.

        Only incoming packets: a packet going out of the host that sent it still belongs to its
        socket until it leaves, and TCP Small Queues would then stall the sender after a couple of
        packets per delay (netem orphans the packets it holds; a userspace queue cannot). Round trips
        are what netem gives (each link on the path adds its delay once); one way, A to B takes B's
        link's delay instead of half of each.
        """
        if delay_method() != "nfqueue":
            raise HostsUnavailable(f"link delay/jitter: {_delay_reason}")
        self.delayers.append(_start_delayer(["ip", "netns", "exec", ns], {0: (link.delay_ms, link.jitter_ms)}))
        run_command(["ip", "netns", "exec", ns, "iptables", "-t", "mangle", "-A", "PREROUTING", "-i", dev,
              "-j", "NFQUEUE", "--queue-num", "0"])

    def close(self) -> None:
        """Stop this run's delayers and delete every namespace it made (their veths and rules go with
        them). Never raises."""
        for delayer in self.delayers:
            _stop_delayer(delayer)
        self.delayers.clear()
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made.clear()


# -- entering a host from this process -------------------------------------------------------------

CLONE_NEWNET = 0x40000000


class Entered:
    """This thread inside a host's namespace (sockets made from now on live there) until ``leave``."""

    def __init__(self, ns: str) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
        try:
            self._setns(target)
        except BaseException:
            os.close(self._home)
            raise
        finally:
            os.close(target)

    def _setns(self, fd: int) -> None:
        if self._libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise HostsError(f"setns: {os.strerror(errno)}")

    def leave(self) -> None:
        if self._home >= 0:
            self._setns(self._home)
            os.close(self._home)
            self._home = -1
