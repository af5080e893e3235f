"""Real agents on loopback in one trio run: the harness's network, also the Python API for pytest.

Rules of this file:
- Every agent is a real ``agent.node.Agent``: its own identity, home (SQLite store, blockstore),
  py-libp2p host on 127.0.0.1, GossipSub and DHT. Agents are named: ``submitter`` (the bootstrap
  peer; it announces jobs and never coordinates), ``w0``..``wN-1`` (training agents) and, when a
  scenario attacks, ``mallory`` (a peer with a valid identity that follows no rules).
- Identities come from the seed (``identity_for``), so the same seed gives the same peer IDs, hence
  the same rendezvous elections; nothing else in an agent is seeded (gossip timing is real).
- ``kill`` stops an agent abruptly: its tasks are cancelled, no release or goodbye is sent, and its
  peers drop their connections to it, as the OS would for a dead process. A training thread it had
  finishes its current step and stops at its next checkpoint (threads cannot be killed). A test that
  needs a real ``kill -9`` runs agents as processes (tests/cli).
- ``restart`` starts a new Agent with the identity and home of a killed one: it resumes from its store.
- Agents named in ``processes`` run as ``infernet agent run`` subprocesses instead (their home holds
  the seeded key and a config.toml): ``kill`` is then a real SIGKILL, and ``restart`` runs the same
  home again. The harness sees them only through the network (their gossip, the submitter's mirror).
- Partitions cut gossip between groups (each side drops the other side's messages, GossipFaults);
  connections stay up, so content can still be fetched across a partition.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import trio

from agent.harness.byzantine import FAULTY, byzantine
from agent.hooks import AgentHooks
from agent.net.gossip import GossipFaults
from agent.node import Agent, AgentConfig
from protocol.identity import Identity

MODEL_NAME = "infernet-tiny"


def identity_for(seed: int, name: str) -> Identity:
    """The harness identity of agent ``name`` in a run with ``seed``."""
    return Identity(hashlib.sha256(f"infernet-harness/v1/{seed}/{name}".encode()).digest())


@dataclass
class LoopbackNet:
    """A running set of named agents. Methods are for the harness and tests (one trio run)."""

    nursery: trio.Nursery
    seed: int
    home: Path
    agents: dict[str, Agent] = field(default_factory=dict)
    configs: dict[str, AgentConfig] = field(default_factory=dict)
    scopes: dict[str, trio.CancelScope] = field(default_factory=dict)
    observer: Callable[[str, Agent, str, tuple], None] | None = None  # (name, agent, kind, args)
    blocked: dict[str, frozenset[str]] = field(default_factory=dict)  # partition: name -> peer IDs cut off
    gossip_faults: dict[str, dict] = field(default_factory=dict)  # name -> GossipFaults settings
    processes: dict[str, Any] = field(default_factory=dict)  # name -> subprocess.Popen (agents run as processes)
    process_names: set[str] = field(default_factory=set)  # agents that run as processes
    machines: dict[str, Any] = field(default_factory=dict)  # name -> declared agent/hardware.Machine (tests)
    misbehave: dict[str, str] = field(default_factory=dict)  # name -> agent/harness/byzantine.py mode
    hosts: Any = None  # agent.harness.hosts.Hosts: agents on separate hosts (None: all on loopback)
    placement: dict[str, str] = field(default_factory=dict)  # name -> host, when ``hosts``

    # -- who is who -------------------------------------------------------------------------------

    @property
    def submitter(self) -> Agent:
        return self.agents["submitter"]

    @property
    def workers(self) -> list[Agent]:
        return [a for n, a in self.agents.items() if n.startswith("w")]

    def name_of(self, peer_id: str | None) -> str:
        for name, agent in self.agents.items():
            if agent.peer_id == peer_id:
                return name
        for name in self.configs:
            if identity_for(self.seed, name).peer_id == peer_id:
                return name
        return (peer_id or "none")[-8:]

    def running(self, name: str) -> bool:
        if name in self.processes:
            return self.processes[name].poll() is None
        scope = self.scopes.get(name)
        return scope is not None and not scope.cancel_called

    def alive(self) -> list[Agent]:
        """Training agents still running (in this process)."""
        return [a for n, a in self.agents.items() if n.startswith("w") and self.running(n)]

    def worker_names(self) -> list[str]:
        """Every training agent, in-process or not, started or not."""
        return sorted(n for n in self.configs if n.startswith("w"))

    # -- life cycle -------------------------------------------------------------------------------

    async def start(self, name: str, config: AgentConfig) -> Agent | None:
        """Start agent ``name`` (again, if it ran before: same identity and home)."""
        self.configs[name] = config
        if name in self.process_names:
            await self._start_process(name, config)
            return None
        agent = Agent(identity_for(self.seed, name), config, machine=self.machines.get(name),
                      hooks=self._hooks(name))
        scope = trio.CancelScope()
        self.scopes[name] = scope
        self.agents[name] = agent
        await self.nursery.start(_run, agent, scope)
        self._apply_faults(name)
        return agent

    def _hooks(self, name: str) -> AgentHooks:
        """What the harness injects into agent ``name``: the observer's tap, its misbehaviour."""
        observer = None
        if self.observer is not None:  # called only while the agent runs: it is self.agents[name] by then
            def observer(kind: str, *args: Any, _n: str = name) -> None:
                self.observer(_n, self.agents[_n], kind, args)
        return AgentHooks(observer=observer, training=byzantine(self.misbehave.get(name)))

    def _named(self, who: "str | Agent") -> str:
        return who if isinstance(who, str) else self.name_of(who.peer_id)

    async def kill(self, who: "str | Agent") -> None:
        """Stop an agent abruptly (no release, no goodbye); its peers drop their connections to it."""
        from agent.net.host import to_libp2p_id

        name = self._named(who)
        if name in self.processes:
            process = self.processes[name]
            process.kill()  # SIGKILL: no release, no goodbye, sockets closed by the OS
            await trio.to_thread.run_sync(process.wait)
            return
        agent = self.agents[name]
        self.scopes[name].cancel()
        for other, peer in self.agents.items():
            if other != name and self.running(other):
                with trio.move_on_after(5):
                    await peer.net.host.libp2p.disconnect(to_libp2p_id(agent.peer_id))

    async def restart(self, who: "str | Agent") -> Agent:
        """Start a killed agent again with its identity and home; it resumes from its store."""
        from dataclasses import replace

        name = self._named(who)
        config = self.configs[name]
        if self.running(name):
            await self.kill(name)
        if not config.bootstrap and name not in self.process_names:
            # the bootstrap peer itself (the submitter): an operator restarts it pointing at a peer
            peers = [a for n, a in sorted(self.agents.items()) if n != name and self.running(n) and a.net]
            if peers:
                config = replace(config, bootstrap=(peers[0].addrs()[0],))
        return await self.start(name, config)

    def listen_for(self, name: str) -> tuple[str, ...] | None:
        """An agent's listen address on its host (port 4001 + its index there); None on loopback."""
        if self.hosts is None:
            return None
        host = self.placement[name]
        index = sorted(n for n, h in self.placement.items() if h == host).index(name)
        return (f"/ip4/{self.hosts.ip(host)}/tcp/{4001 + index}",)

    def dial_address(self, name: str) -> str:
        """Where the other hosts dial agent ``name`` (it must be on a public host)."""
        return f"{self.listen_for(name)[0]}/p2p/{identity_for(self.seed, name).peer_id}"

    async def wait_listening(self, name: str, timeout: float = 120.0) -> None:
        """Until agent ``name`` accepts TCP connections (a process that has no submitter to heartbeat to yet)."""
        _, _, ip, _, port = self.listen_for(name)[0].split("/")
        with trio.fail_after(timeout):
            while True:
                if name in self.processes and self.processes[name].poll() is not None:
                    raise RuntimeError(f"agent process {name} exited {self.processes[name].returncode}: "
                                       f"{(self.configs[name].home / 'stderr.log').read_text()[-500:]}")
                try:
                    with trio.move_on_after(2):
                        stream = await trio.open_tcp_stream(ip, int(port))
                        await stream.aclose()
                        return
                except OSError:
                    pass
                await trio.sleep(0.3)

    async def _start_process(self, name: str, config: AgentConfig, timeout: float = 120.0) -> None:
        """``infernet agent run`` in the agent's home; returns once the submitter hears its heartbeats."""
        import os
        import subprocess
        import sys

        from agent.config import IDENTITY_FILE
        from agent.keyfile import save_identity

        home = config.home
        home.mkdir(parents=True, exist_ok=True)
        identity = identity_for(self.seed, name)
        if not (home / IDENTITY_FILE).exists():
            save_identity(identity, home / IDENTITY_FILE)
        (home / "config.toml").write_text(_config_toml(config))
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.pop("INFERNET_ACCEPT_TRAINING", None)
        on_host = self.hosts.exec_prefix(self.placement[name]) if self.hosts is not None else []
        with open(home / "stderr.log", "ab") as stderr:
            self.processes[name] = subprocess.Popen(
                [*on_host, sys.executable, "-m", "agent.cli", "agent", "run", "--home", str(home),
                 "--log-file", str(home / "agent.log")], stdout=subprocess.DEVNULL, stderr=stderr, env=env)
        self.processes[name].started_at = time.time()  # a heartbeat after this is from the new process
        submitter = self.agents.get("submitter")
        if submitter is None and self.hosts is not None:  # the bootstrap peer, started before the submitter
            await self.wait_listening(name, timeout)
            return
        with trio.fail_after(timeout):
            while submitter is not None and not _hears_since(submitter, identity.peer_id, self.processes[name]):
                if self.processes[name].poll() is not None:
                    raise RuntimeError(f"agent process {name} exited {self.processes[name].returncode}: "
                                       f"{(home / 'stderr.log').read_text()[-500:]}")
                await trio.sleep(0.2)

    def stop_processes(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()

    # -- gossip faults ----------------------------------------------------------------------------

    def partition(self, groups: list[list[str]]) -> None:
        """Cut gossip between ``groups`` (names); agents named in no group form one more group."""
        named = {n for g in groups for n in g}
        groups = [list(g) for g in groups] + [[n for n in self.configs if n not in named]]
        ids = {n: identity_for(self.seed, n).peer_id for n in self.configs}
        self.blocked = {}
        for group in groups:
            others = frozenset(ids[n] for g in groups if g is not group for n in g)
            for name in group:
                self.blocked[name] = others
        for name in self.agents:
            self._apply_faults(name)

    def cut(self, pairs: list[list[str]]) -> None:
        """Cut gossip between the two agents of each pair, either way (names), on top of any partition: each drops
        what the other signed, relayed or not, as a peer does that never got the other's messages. ``heal`` ends
        it; a ``partition`` replaces it."""
        ids = {n: identity_for(self.seed, n).peer_id for n in self.configs}
        for a, b in pairs:
            self.blocked[a] = self.blocked.get(a, frozenset()) | {ids[b]}
            self.blocked[b] = self.blocked.get(b, frozenset()) | {ids[a]}
        for name in {n for pair in pairs for n in pair} & set(self.agents):
            self._apply_faults(name)

    def heal(self) -> None:
        self.blocked = {}
        for name in self.agents:
            self._apply_faults(name)

    def set_gossip_faults(self, names: list[str], **settings: Any) -> None:
        """drop / duplicate / delay=(low, high) for what ``names`` receive; no settings clears them."""
        for name in names:
            self.gossip_faults[name] = settings
            if name in self.agents:
                self._apply_faults(name)

    def _apply_faults(self, name: str) -> None:
        agent = self.agents[name]
        if agent.net is None:
            return
        settings = self.gossip_faults.get(name, {})
        blocked = self.blocked.get(name, frozenset())
        if not settings and not blocked:
            agent.net.gossip.faults = None
            return
        old = agent.net.gossip.faults
        faults = GossipFaults(drop=settings.get("drop", 0.0), duplicate=settings.get("duplicate", 0.0),
                              delay=tuple(settings.get("delay", (0.0, 0.0))), blocked=blocked,
                              seed=_seed_of(self.seed, name))
        if old is not None:
            faults.rng, faults.injected = old.rng, old.injected  # one random stream and tally per agent
        agent.net.gossip.faults = faults

    # -- waiting ----------------------------------------------------------------------------------

    async def wait_until_meshed(self, names: list[str], coordinators: int, timeout: float = 30) -> None:
        """Until every agent in ``names`` sees ``coordinators`` eligible coordinators (heartbeats)."""
        with trio.fail_after(timeout):
            while any(len(self.agents[n].eligible_coordinators()) < coordinators for n in names):
                await trio.sleep(0.2)


def _hears_since(agent: Agent, peer_id: str, process: Any) -> bool:
    """Has ``agent`` heard a heartbeat of ``peer_id`` since ``process`` started?"""
    info = agent.peers.get(peer_id)
    return info is not None and info.last_heartbeat >= getattr(process, "started_at", 0.0)


def _config_toml(config: AgentConfig) -> str:
    """config.toml for an agent process (the keys agent/config.py reads)."""
    import json
    from dataclasses import fields

    lines, models = [], []
    for f in fields(AgentConfig):
        value = getattr(config, f.name)
        if f.name == "home" or value is None:
            continue
        if f.name == "models":
            models = [f"{json.dumps(k)} = {json.dumps(v)}" for k, v in value]
        elif isinstance(value, bool):
            lines.append(f"{f.name} = {'true' if value else 'false'}")
        elif isinstance(value, (int, float)):
            lines.append(f"{f.name} = {value!r}")
        elif isinstance(value, str):
            lines.append(f"{f.name} = {json.dumps(value)}")
        else:
            lines.append(f"{f.name} = {json.dumps(list(value))}")
    return "\n".join(lines + ["", "[models]", *models, ""])


def _seed_of(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"faults/{seed}/{name}".encode()).digest()[:8], "big")


async def _run(agent: Agent, scope: trio.CancelScope, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    with scope:
        await agent.run(task_status=task_status)


def worker_config(home: Path, model_dir: Path, bootstrap: tuple[str, ...], **overrides: Any) -> AgentConfig:
    settings = {"models": ((MODEL_NAME, str(model_dir)),), "accept_training": True,
                **overrides}  # an override may name its own copy, or train nothing
    return AgentConfig(home=home, bootstrap=bootstrap, **settings)


@asynccontextmanager
async def network(home: Path, model_dir: Path, workers: int = 3, *, seed: int = 0,
                  misbehave: dict[int, str] | None = None,
                  overrides: dict[int, dict] | None = None,
                  late: tuple[int, ...] = (),
                  observer: Callable[[str, Agent, str, tuple], None] | None = None,
                  reannounce_seconds: float | None = None,
                  common: dict | None = None,
                  processes: tuple[int, ...] = (),
                  machines: dict[int, Any] | None = None,
                  hosts: Any = None, placement: dict[str, str] | None = None) -> AsyncIterator[LoopbackNet]:
    """A submitter (bootstrap, never a coordinator) and ``workers`` training agents ``w0``...

    Byzantine workers never coordinate (a Byzantine coordinator is another test's subject); a
    ``crash`` worker (faulty, not malicious) may.
    Workers in ``late`` are configured but not started: ``net.start(name, net.configs[name])``.
    ``common`` are AgentConfig fields for the submitter (``overrides`` are per worker).
    ``machines`` declares a worker's hardware (agent/hardware.Machine) instead of measuring it.
    ``hosts`` (agent/harness/hosts.Hosts) and ``placement`` (name -> host) put agents on separate
    hosts: each listens on its host's address; this process must already be on the submitter's host
    (hosts.Entered), and workers elsewhere must be in ``processes``. When the submitter is behind a
    NAT, the first worker on a public host is the bootstrap peer and is started first.
    Waits until every started agent hears every honest coordinator-to-be, then yields.
    """
    misbehave = misbehave or {}
    models = ((MODEL_NAME, str(model_dir)),)
    async with trio.open_nursery() as nursery:
        net = LoopbackNet(nursery, seed, home, observer=observer)
        net.process_names = {f"w{i}" for i in processes}
        net.machines = {f"w{i}": machine for i, machine in (machines or {}).items()}
        net.hosts, net.placement = hosts, dict(placement or {})
        net.misbehave = {f"w{i}": mode for i, mode in misbehave.items() if mode is not None}

        def settings_of(i: int) -> dict:
            settings = {"can_coordinate": misbehave.get(i) in (None, *FAULTY),
                        **(overrides or {}).get(i, {})}
            listen = net.listen_for(f"w{i}")
            return {**settings, "listen": listen} if listen else settings

        first = None  # a worker that is the bootstrap peer (the submitter is behind a NAT)
        if hosts is not None and hosts.specs[net.placement["submitter"]].nat:
            first = next(i for i in range(workers) if i not in late
                         and not hosts.specs[net.placement[f"w{i}"]].nat)
            await net.start(f"w{first}", worker_config(home / f"w{first}", model_dir, (), **settings_of(first)))
        listen = net.listen_for("submitter")
        submitter = await net.start("submitter", AgentConfig(
            home=home / "submitter", can_coordinate=False, models=models, **(common or {}),
            **({"listen": listen} if listen else {}),
            **({"bootstrap": (net.dial_address(f"w{first}"),)} if first is not None else {})))
        if reannounce_seconds is not None:
            submitter.submitter.reannounce_seconds = reannounce_seconds
        bootstrap = (net.dial_address(f"w{first}") if first is not None else
                     net.dial_address("submitter") if hosts is not None else submitter.addrs()[0],)
        for i in range(workers):
            if i == first:
                continue
            config = worker_config(home / f"w{i}", model_dir, bootstrap, **settings_of(i))
            if i in late:
                net.configs[f"w{i}"] = config
            elif i in processes:
                nursery.start_soon(net.start, f"w{i}", config)  # they start in parallel (imports take seconds)
            else:
                await net.start(f"w{i}", config)
        honest = len([i for i in range(workers) if misbehave.get(i) in (None, *FAULTY) and i not in late
                      and (overrides or {}).get(i, {}).get("can_coordinate", True)])
        try:
            await net.wait_until_meshed([n for n in net.agents], honest, timeout=120 if processes else 30)
            yield net
        finally:
            net.stop_processes()
            nursery.cancel_scope.cancel()


def mallory_config(home: Path, bootstrap: tuple[str, ...]) -> AgentConfig:
    """An attacker's agent: follows jobs, trains nothing, coordinates nothing."""
    return AgentConfig(home=home, bootstrap=bootstrap, can_coordinate=False)


