"""Scenarios: a job run by real agents on loopback, faults at chosen moments, and checks at the end.

A scenario is a YAML file (see agent/harness/scenarios/ for the shipped ones and README's "Protocol
developers" section for the format); ``load_scenario`` reads it with the job spec's YAML rules (a
mistake is one line naming file:line and the field path), ``run_scenario`` runs it:

1. start the agents (``agent.harness.network``), seeded identities, a tiny model built in code;
2. write a dataset from the seed and announce the job (the scenario's ``job`` keys over a small job);
3. fire each fault when its trigger comes (``at`` seconds after the announcement, or ``when`` an
   event is first seen by the submitter, plus ``after`` seconds);
4. wait for the job to end (``timeout``), let the live agents' mirrors settle, check, summarise.

Checks always made, whatever the scenario expects: no work of a Byzantine or attacking peer is
accepted; no verdict is signed by the worker it judges; at most one accepted verdict per (round, shard); every shard accepted in a round is in
that round's aggregate (no accepted work lost); the live agents' mirrors agree on the outcome.

Seeded: identities (so elections), the dataset, the job, the harness's choices (fault targets are
resolved by sorted name) and the gossip-fault random streams. Gossip timing and thread scheduling
are real, so two runs with one seed make the same decisions wherever the protocol is deterministic
(who coordinates, which peer is hit by which fault, which segments a nonce selects is not).
"""

from __future__ import annotations

import copy
import logging
import random
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import trio

from agent.specfile import read_text
from protocol.errors import SpecError
from protocol.jobspec import Where, read_job, read_yaml

log = logging.getLogger(__name__)

SCENARIOS_DIR = Path(__file__).parent / "scenarios"

BASE_JOB: dict[str, Any] = {
    "base_model": "infernet-tiny",
    "seed": 3,
    "input": {"dataset": "dataset.jsonl", "validation_split": 0.1},
    "training": {"batch_size": 8, "learning_rate": 0.01, "max_steps": 8, "max_seq_len": 96},
    "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "shards": 3,
    "rounds": 1,
    "max_retries": 3,
    "proof": {"checkpoint_every": 4, "verify_segments": 1, "tolerance": 0.0001},
    "lease_seconds": 30,
}

KEEP_ANSWER_DELAY = 2.0  # seconds, with an "aggregating" trigger (see TRIGGERS)
PINNED_CREATED = 1_700_000_000  # seconds since the epoch (+ the seed): the jobs' 'created'
PINNED_DEADLINE = 4_000_000_000  # far away: a scenario's job ends by its own faults or its timeout
# "aggregating": the coordinator computed a round's aggregate and asked the submitter to keep it; nothing
# is published yet (the harness then slows the submitter's answer by KEEP_ANSWER_DELAY, so that a kill
# lands between the two);
# "rejected": a verdict rejected some work;
# "aggregate": the first aggregate is published, "aggregate-2" round 2's;
# "early-3": the coordinator announced round 3's start early (IPIP-0006 §2.9), before publishing round 2's aggregate
TRIGGERS = ("training", "all-training", "checkpoint", "report", "accepted", "rejected", "aggregating", "aggregate", "aggregate-2",
            "aggregate-3", "round-2", "round-3", "early-2", "early-3")
ACTIONS = ("kill", "restart", "start", "partition", "cut", "heal", "gossip", "attack", "tamper")
ATTACKS = ("replay", "spoof", "stale", "malformed", "oversize", "claim_flood", "flood")
SELECTORS = ("coordinator", "trainer", "workers", "killed")
AGENT_KEYS = {"claim_interval": float, "max_concurrent_shards": int, "can_coordinate": bool, "coordinator_trains": bool, "early_start": bool,
              "price_per_hour": float, "min_price_per_hour": float, "fetch_timeout": float,
              "gossip_max_rate": float, "gossip_max_burst": float, "relay": bool, "grace_seconds": float}
EXPECT_KEYS = ("phase", "reason", "min_term", "reassigned", "rejected", "released", "gossip_rejected",
               "rate_limited", "trained", "not_trained", "coordinator_judged", "relayed", "direct", "max_term",
               "recovered", "revoked")


@dataclass(frozen=True)
class Fault:
    line: int  # where the scenario file says it (for the trace and errors)
    action: str
    value: Any  # the action's argument: a target, groups, settings
    at: float | None = None
    when: str | None = None
    after: float = 0.0

    def describe(self) -> str:
        trigger = f"at {self.at:g} s" if self.at is not None else f"when {self.when}" + (
            f" + {self.after:g} s" if self.after else "")
        return f"{self.action} {_short(self.value)} ({trigger})"


@dataclass(frozen=True)
class Scenario:
    name: str
    source: str
    description: str = ""
    seed: int = 1
    timeout: float = 180.0
    workers: int = 3
    byzantine: dict[str, str] = field(default_factory=dict)
    late: tuple[str, ...] = ()
    processes: tuple[str, ...] = ()  # workers run as `infernet agent run` subprocesses (kill = SIGKILL)
    mallory: bool = False
    agent_config: dict[str, dict] = field(default_factory=dict)
    records: int = 160
    job: dict = field(default_factory=dict)
    faults: tuple[Fault, ...] = ()
    expect: dict = field(default_factory=dict)
    slow: bool = False
    hosts: dict = field(default_factory=dict)  # host name -> agent.harness.hosts.HostSpec (empty: all on loopback)
    placement: dict[str, str] = field(default_factory=dict)  # agent name -> host name

    def spec(self) -> Any:
        from protocol.jobspec import parse_spec

        return parse_spec(_to_yaml(self.job), f"{self.source} (job)")

    def names(self) -> list[str]:
        return [f"w{i}" for i in range(self.workers)]


# -- reading ---------------------------------------------------------------------------------------


def load_scenario(path: str | Path) -> Scenario:
    """Read and check a scenario file; every mistake is a SpecError naming file:line and field."""
    return parse_scenario(read_text(path), str(path))


def parse_scenario(text: str, source: str = "<scenario>") -> Scenario:
    data, where = read_yaml(text, source, "scenario settings")
    r = _Reader(where)
    root = r.mapping(data, ())
    r.only(root, (), ("name", "description", "seed", "timeout", "slow", "agents", "hosts", "job", "faults", "expect"))
    name = r.text(r.need(root, (), "name"), ("name",))
    agents = r.mapping(root.get("agents", {}), ("agents",))
    r.only(agents, ("agents",), ("workers", "byzantine", "late", "mallory", "config", "records", "processes"))
    workers = r.integer(agents.get("workers", 3), ("agents", "workers"), 1, 16)
    names = [f"w{i}" for i in range(workers)]
    known = ["submitter", *names] + (["mallory"] if agents.get("mallory") else [])
    from agent.harness.byzantine import MISBEHAVIOURS

    byzantine = {}
    for key, mode in r.mapping(agents.get("byzantine", {}), ("agents", "byzantine")).items():
        r.agent_name(key, ("agents", "byzantine", key), names, key_error=True)
        byzantine[key] = r.choice(mode, ("agents", "byzantine", key), MISBEHAVIOURS)
    late = tuple(r.agent_name(n, ("agents", "late", i), names)
                 for i, n in enumerate(r.sequence(agents.get("late", []), ("agents", "late"))))
    processes = tuple(r.agent_name(n, ("agents", "processes", i), names)
                      for i, n in enumerate(r.sequence(agents.get("processes", []), ("agents", "processes"))))
    for i, worker in enumerate(processes):
        if worker in byzantine:
            raise where.bad_value(("agents", "processes", i), f"{worker} is Byzantine: a Byzantine worker runs "
                                  "in the harness's process (an agent process has no misbehave setting)")
    config = {}
    for key, values in r.mapping(agents.get("config", {}), ("agents", "config")).items():
        r.agent_name(key, ("agents", "config", key), ["all", "submitter", *names], key_error=True)
        values = r.mapping(values, ("agents", "config", key))
        r.only(values, ("agents", "config", key), tuple(AGENT_KEYS))
        config[key] = {k: r.typed(v, ("agents", "config", key, k), AGENT_KEYS[k]) for k, v in values.items()}
    job = _merge(copy.deepcopy(BASE_JOB), {"name": name, **r.mapping(root.get("job", {}), ("job",))})
    try:  # the job keys are a job spec's: its own rules and messages, located in this file
        shifted = Where(where.source, {p[1:]: ln for p, ln in where.value_lines.items() if p[:1] == ("job",)},
                         {p[1:]: ln for p, ln in where.key_lines.items() if p[:1] == ("job",)})
        read_job(job, shifted)
    except SpecError as exc:
        raise SpecError(f"job.{exc.path}" if exc.path else "job", exc.message,
                        exc.location or where.at(where.key_lines.get(("job",)))) from None
    faults = tuple(r.fault(item, ("faults", i), known, names)
                   for i, item in enumerate(r.sequence(root.get("faults", []), ("faults",))))
    for fault in faults:
        if fault.action == "attack" and "mallory" not in known:
            raise where.bad_value(("faults",), f"line {fault.line}: an attack needs agents.mallory: true")
        if fault.action == "start" and fault.value not in late:
            raise where.bad_value(("faults",), f"line {fault.line}: start {fault.value}: only agents listed "
                                  "in agents.late are started by a fault")
    expect = r.expect(r.mapping(root.get("expect", {}), ("expect",)), known)
    hosts, placement = r.hosts(root["hosts"], known, byzantine) if "hosts" in root else ({}, {})
    if hosts:  # workers away from the harness's host (the submitter's) run as agent processes there
        home = placement["submitter"]
        processes = processes + tuple(n for n in names if placement[n] != home and n not in processes)
    return Scenario(
        name=name, source=source,
        description=r.text(root.get("description", ""), ("description",)),
        seed=r.integer(root.get("seed", 1), ("seed",), 0, 2**63),
        timeout=r.number(root.get("timeout", 180), ("timeout",), 1, 3600),
        slow=r.typed(root.get("slow", False), ("slow",), bool),
        workers=workers, byzantine=byzantine, late=late, processes=processes,
        mallory=bool(agents.get("mallory", False)),
        agent_config=config, records=r.integer(agents.get("records", 160), ("agents", "records"), 20, 100_000),
        job=job, faults=faults, expect=expect, hosts=hosts, placement=placement)


HOST_NAME = re.compile(r"^[a-z][a-z0-9]{0,7}$")


class _Reader:
    """Type checks on the plain value, each error located at the value's line."""

    def __init__(self, where: Where) -> None:
        self.where = where

    def fail(self, path: tuple, message: str) -> SpecError:
        return self.where.bad_value(path, message)

    def mapping(self, value: Any, path: tuple) -> dict:
        if not isinstance(value, dict):
            raise self.fail(path, f"expected a mapping, got {_kind(value)}")
        return value

    def sequence(self, value: Any, path: tuple) -> list:
        if not isinstance(value, list):
            raise self.fail(path, f"expected a list, got {_kind(value)}")
        return value

    def only(self, data: dict, path: tuple, allowed: tuple) -> None:
        import difflib

        for key in data:
            if key not in allowed:
                near = difflib.get_close_matches(key, allowed, 1)
                hint = f" (did you mean {near[0]!r}?)" if near else f" (one of: {', '.join(allowed)})"
                raise self.where.bad_key(path + (key,), f"unknown key{hint}")

    def need(self, data: dict, path: tuple, key: str) -> Any:
        if key not in data:
            raise self.where.missing(path + (key,))
        return data[key]

    def text(self, value: Any, path: tuple) -> str:
        if not isinstance(value, str) or len(value) > 2000:
            raise self.fail(path, f"expected text, got {_kind(value)}")
        return value

    def typed(self, value: Any, path: tuple, kind: type) -> Any:
        if kind is bool:
            if not isinstance(value, bool):
                raise self.fail(path, f"expected true or false, got {_kind(value)}")
            return value
        if kind is int:
            return self.integer(value, path, 0, 2**31)
        return self.number(value, path, 0, 1e9)

    def integer(self, value: Any, path: tuple, low: int, high: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(path, f"expected an integer, got {_kind(value)}")
        if not low <= value <= high:
            raise self.fail(path, f"must be between {low} and {high}, got {value}")
        return value

    def number(self, value: Any, path: tuple, low: float, high: float) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise self.fail(path, f"expected a number, got {_kind(value)}")
        if not low <= value <= high:
            raise self.fail(path, f"must be between {low:g} and {high:g}, got {value:g}")
        return float(value)

    def choice(self, value: Any, path: tuple, allowed: tuple) -> str:
        if value not in allowed:
            raise self.fail(path, f"expected one of {', '.join(allowed)}; got {_short(value)}")
        return value

    def agent_name(self, value: Any, path: tuple, allowed: list[str], key_error: bool = False) -> str:
        if value not in allowed:
            message = f"no agent called {_short(value)} (agents: {', '.join(allowed)})"
            raise self.where.bad_key(path, message) if key_error else self.fail(path, message)
        return value

    def target(self, value: Any, path: tuple, known: list[str]) -> str:
        if value not in known and value not in SELECTORS:
            raise self.fail(path, f"no agent called {_short(value)} (agents: {', '.join(known)}; "
                            f"or one of: {', '.join(SELECTORS)})")
        return value

    def fault(self, item: Any, path: tuple, known: list[str], workers: list[str]) -> Fault:
        item = self.mapping(item, path)
        actions = [a for a in ACTIONS if a in item]
        if len(actions) != 1:
            self.only(item, path, ("at", "when", "after", *ACTIONS))
            raise self.fail(path, f"a fault has exactly one action of: {', '.join(ACTIONS)}")
        action = actions[0]
        self.only(item, path, ("at", "when", "after", action))
        if ("at" in item) == ("when" in item):
            raise self.fail(path, "a fault has either 'at' (seconds after the announcement) or 'when' (an event)")
        at = self.number(item["at"], path + ("at",), 0, 3600) if "at" in item else None
        when = self.choice(item["when"], path + ("when",), TRIGGERS) if "when" in item else None
        after = self.number(item.get("after", 0), path + ("after",), 0, 3600)
        vpath = path + (action,)
        raw = item[action]
        if action in ("kill", "restart"):
            value: Any = self.target(raw, vpath, known)
        elif action == "start":
            value = self.agent_name(raw, vpath, workers)
        elif action in ("partition", "cut"):  # groups of agents; a cut's are pairs whose gossip does not cross
            value = [[self.agent_name(n, vpath + (i, j), known) for j, n in enumerate(self.sequence(g, vpath + (i,)))]
                     for i, g in enumerate(self.sequence(raw, vpath))]
            if action == "cut":
                for i, pair in enumerate(value):
                    if len(pair) != 2 or pair[0] == pair[1]:
                        raise self.fail(vpath + (i,), "expected a pair of two agents, like [w1, w2]")
        elif action == "heal":
            value = self.typed(raw, vpath, bool)
        elif action == "gossip":
            settings = self.mapping(raw, vpath)
            self.only(settings, vpath, ("to", "drop", "duplicate", "delay"))
            value = {"to": [self.agent_name(n, vpath + ("to", i), known)
                            for i, n in enumerate(self.sequence(settings.get("to", known), vpath + ("to",)))]}
            for key in ("drop", "duplicate"):
                if key in settings:
                    value[key] = self.number(settings[key], vpath + (key,), 0, 1)
            if "delay" in settings:
                delay = self.sequence(settings["delay"], vpath + ("delay",))
                if len(delay) != 2:
                    raise self.fail(vpath + ("delay",), "expected [low, high] in seconds")
                value["delay"] = tuple(self.number(d, vpath + ("delay", i), 0, 60) for i, d in enumerate(delay))
        elif action == "attack":
            settings = self.mapping(raw, vpath)
            self.only(settings, vpath, ("kind", "count"))
            value = {"kind": self.choice(self.need(settings, vpath, "kind"), vpath + ("kind",), ATTACKS),
                     "count": self.integer(settings.get("count", 10), vpath + ("count",), 1, 100_000)}
        else:  # tamper
            settings = self.mapping(raw, vpath)
            self.only(settings, vpath, ("shard",))
            value = {"shard": self.integer(self.need(settings, vpath, "shard"), vpath + ("shard",), 0, 1023)}
        return Fault(self.where.value_lines.get(path, 0), action, value, at, when, after)

    def hosts(self, raw: Any, known: list[str], byzantine: dict[str, str]) -> tuple[dict, dict[str, str]]:
        """``hosts:``: name -> {agents, nat, link}; every agent on exactly one host (agent/harness/hosts.py)."""
        from agent.harness.hosts import HostSpec, Link, parse_duration_ms, parse_percent, parse_rate_mbit

        path = ("hosts",)
        data = self.mapping(raw, path)
        if not data:
            raise self.fail(path, "expected at least one host")
        if len(data) > 32:
            raise self.fail(path, f"at most 32 hosts, got {len(data)}")
        specs: dict[str, Any] = {}
        placement: dict[str, str] = {}
        where_placed: dict[str, tuple] = {}
        for name, settings in data.items():
            hpath = path + (name,)
            if not isinstance(name, str) or not HOST_NAME.match(name) or name == "inet":
                raise self.where.bad_key(hpath, "a host name is 1-8 lowercase letters or digits, starting with a "
                                         "letter (and not 'inet')")
            settings = self.mapping(settings, hpath)
            self.only(settings, hpath, ("agents", "nat", "link"))
            agents = self.sequence(self.need(settings, hpath, "agents"), hpath + ("agents",))
            for i, agent in enumerate(agents):
                self.agent_name(agent, hpath + ("agents", i), known)
                if agent in placement:
                    raise self.fail(hpath + ("agents", i), f"{agent} is already on host {placement[agent]}")
                placement[agent] = name
                where_placed[agent] = hpath + ("agents", i)
            nat = self.typed(settings.get("nat", False), hpath + ("nat",), bool)
            link = Link()
            if "link" in settings:
                lpath = hpath + ("link",)
                shape = self.mapping(settings["link"], lpath)
                self.only(shape, lpath, ("delay", "jitter", "loss", "rate"))
                values: dict[str, float] = {}
                for key, parse, low, high, example in (
                        ("delay", parse_duration_ms, 0, 10_000, "80ms"), ("jitter", parse_duration_ms, 0, 10_000, "20ms"),
                        ("loss", parse_percent, 0, 100, "1%"), ("rate", parse_rate_mbit, 0.01, 100_000, "20mbit")):
                    if key not in shape:
                        continue
                    value = parse(shape[key])
                    if value is None:
                        raise self.fail(lpath + (key,), f"expected a value such as {example}, got {_short(shape[key])}")
                    if not low <= value <= high:
                        raise self.fail(lpath + (key,), f"out of range: {_short(shape[key])}")
                    values[key] = value
                if values.get("jitter", 0) > values.get("delay", 0):
                    raise self.fail(lpath + ("jitter",), "jitter larger than the delay")
                link = Link(values.get("delay", 0.0), values.get("jitter", 0.0), values.get("loss", 0.0),
                            values.get("rate", 0.0))
            specs[name] = HostSpec(name, nat, link)
        missing = [n for n in known if n not in placement]
        if missing:
            raise self.fail(path, f"every agent needs a host; not placed: {', '.join(missing)}")
        home = placement["submitter"]
        for agent in [*byzantine, *(["mallory"] if "mallory" in known else [])]:
            if placement[agent] != home:
                raise self.fail(where_placed[agent], f"{agent} runs in the harness's process, so on the submitter's host "
                                f"({home}), not on {placement[agent]}")
        if specs[home].nat and all(specs[placement[n]].nat for n in known):
            raise self.fail(path, "every agent is behind a NAT: nobody could accept a connection")
        return specs, placement

    def expect(self, data: dict, known: list[str]) -> dict:
        path = ("expect",)
        self.only(data, path, EXPECT_KEYS)
        out: dict[str, Any] = {"phase": self.choice(data.get("phase", "DONE"), path + ("phase",),
                                                    ("DONE", "FAILED", "CANCELLED"))}
        if "reason" in data:
            out["reason"] = self.text(data["reason"], path + ("reason",))
        for key in ("min_term", "max_term"):
            if key in data:
                out[key] = self.integer(data[key], path + (key,), 1, 1000)
        for key in ("reassigned", "rate_limited", "coordinator_judged", "relayed", "direct", "recovered", "revoked"):
            if key in data:
                out[key] = self.typed(data[key], path + (key,), bool)
        if "released" in data:
            out["released"] = self.text(data["released"], path + ("released",))
        if "rejected" in data:
            rejected = self.mapping(data["rejected"], path + ("rejected",))
            out["rejected"] = {self.agent_name(k, path + ("rejected", k), known, key_error=True):
                               self.text(v, path + ("rejected", k)) for k, v in rejected.items()}
        if "gossip_rejected" in data:
            counts = self.mapping(data["gossip_rejected"], path + ("gossip_rejected",))
            out["gossip_rejected"] = {str(k): self.integer(v, path + ("gossip_rejected", k), 1, 10**9)
                                      for k, v in counts.items()}
        for key in ("trained", "not_trained"):
            if key in data:
                out[key] = [self.agent_name(n, path + (key, i), known)
                            for i, n in enumerate(self.sequence(data[key], path + (key,)))]
        return out


_LONG_IDS = re.compile(r"\b(baf[a-z2-7]{40,}|Qm[1-9A-Za-z]{44}|12D3KooW[1-9A-Za-z]{44})\b")


def _brief(text: str, limit: int = 110, around: str | None = None) -> str:
    """``text`` with CIDs and peer IDs cut to 16 characters, at most ``limit`` long (around ``around``)."""
    text = _LONG_IDS.sub(lambda match: match.group(0)[:16] + "…", " ".join(text.split()))
    if len(text) <= limit:
        return text
    at = text.find(around) if around else -1
    if at < 0 or at + len(around) <= limit - 1:
        return text[:limit - 1] + "…"
    start = max(0, at - limit // 2)
    return "…" + text[start:start + limit - 2] + "…"


def _misbehaves(mode: str | None, rnd: int) -> bool:
    """Is a worker in this misbehave ``mode`` Byzantine in round ``rnd``? (``stale_start`` trains
    honestly in round 1, where the seeded init is the right start; ``crash`` is faulty, not Byzantine.)"""
    if mode is None or mode == "crash":
        return False
    return rnd >= 2 if mode == "stale_start" else True


def _kind(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return _short(value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _merge(base: dict, over: dict) -> dict:
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
    return base


def _to_yaml(data: dict) -> str:
    import json

    return json.dumps(data)  # JSON is YAML 1.2


# -- running ---------------------------------------------------------------------------------------


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class Result:
    scenario: Scenario
    seed: int
    ok: bool
    seconds: float
    phase: str
    reason: str
    job_id: str
    checks: list[Check]
    fired: list[tuple[float, str]]  # (seconds after the start, what)
    summary: str = ""
    trace_path: Path | None = None
    facts: dict = field(default_factory=dict)


async def run_scenario(scenario: Scenario, out_dir: Path, *, seed: int | None = None,
                       model_dir: Path | None = None, heartbeats: bool = False) -> Result:
    """Run ``scenario`` with real agents under ``out_dir`` (homes, dataset, ``trace.jsonl``)."""
    from agent.harness.network import network
    from agent.harness.trace import Trace

    seed = scenario.seed if seed is None else seed
    out_dir.mkdir(parents=True, exist_ok=True)
    if model_dir is None:
        from agent.train.tiny import tiny_model

        model_dir = await trio.to_thread.run_sync(tiny_model)
    random.seed(seed)  # the workers' shard choices (one process, shared stream)
    run = _Run(scenario, seed, out_dir)
    trace = Trace(out_dir / "trace.jsonl", heartbeats=heartbeats, names=run.name_of)
    run.trace = trace
    index = {f"w{i}": i for i in range(scenario.workers)}
    common = scenario.agent_config.get("all", {})  # every agent's, the submitter's and mallory's too
    overrides = {i: {**common, **scenario.agent_config.get(n, {})} for n, i in index.items()}
    common = {**common, **scenario.agent_config.get("submitter", {})}
    misbehave = {index[n]: mode for n, mode in scenario.byzantine.items()}
    started = time.monotonic()
    hosts = entered = None
    if scenario.hosts:  # before the trace starts: a machine that cannot make hosts says so and nothing is written
        from agent.harness.hosts import Entered, Hosts

        hosts = await trio.to_thread.run_sync(Hosts(scenario.hosts).create)
        run.hosts = hosts
    trace.write("start", scenario=scenario.name, seed=seed, source=scenario.source, agents=run.ids,
                faults=[f.describe() for f in scenario.faults],
                **({"hosts": {h: {"ns": hosts.ns(h), "ip": hosts.ip(h), "public": hosts.public[h],
                                  "nat": s.nat, "link": s.link.describe()} for h, s in scenario.hosts.items()}}
                   if hosts else {}))
    try:
        if hosts is not None:  # the harness's own agents (the submitter's) live on the submitter's host
            entered = Entered(hosts.ns(scenario.placement["submitter"]))
        async with network(out_dir / "agents", model_dir, scenario.workers, seed=seed, misbehave=misbehave,
                           overrides=overrides, late=tuple(index[n] for n in scenario.late),
                           observer=run.observe, reannounce_seconds=5.0, common=common,
                           processes=tuple(index[n] for n in scenario.processes),
                           hosts=hosts, placement=scenario.placement) as net:
            run.net = net
            if any(f.when == "aggregating" for f in scenario.faults):
                net.submitter.keep.answer_delay = KEEP_ANSWER_DELAY
            if scenario.mallory:
                await run.start_mallory()
            await run.announce(model_dir)
            with trio.move_on_after(scenario.timeout) as waited:
                async with trio.open_nursery() as nursery:
                    for fault in scenario.faults:
                        nursery.start_soon(run.fire, fault)
                    await net.submitter.wait_for(lambda: run.view.state.terminal, timeout=scenario.timeout + 1)
                    nursery.cancel_scope.cancel()
            run.timed_out = waited.cancelled_caught
            await run.settle()
            checks = run.check()
    finally:
        trace.close()
        if entered is not None:
            entered.leave()
        if hosts is not None:
            hosts.close()
    seconds = time.monotonic() - started
    ok = all(c.ok for c in checks)
    view = run.view
    result = Result(scenario, seed, ok, seconds, view.state.phase.value if view else "NONE",
                    view.state.reason if view else "", view.job_id.hex() if view else "", checks, run.fired,
                    trace_path=trace.path, facts=run.facts)
    result.summary = run.summary(result)
    with open(trace.path, "a", encoding="utf-8") as file:  # the checks are in already (run.check)
        import json

        file.write(json.dumps({"t": round(seconds, 3), "kind": "end", "ok": ok, "seconds": round(seconds, 1),
                               "phase": result.phase}) + "\n")
    return result


class _Run:
    """One run's state: the network, the job's view from the submitter, what happened."""

    def __init__(self, scenario: Scenario, seed: int, out_dir: Path) -> None:
        self.scenario = scenario
        self.seed = seed
        self.out_dir = out_dir
        self.net: Any = None
        self.trace: Any = None
        self.view: Any = None
        self.announced_at = 0.0
        self.fired: list[tuple[float, str]] = []
        self.killed: list[str] = []
        self.down: set[str] = set()  # killed and not started again
        self.releases: list[tuple[str, str]] = []  # (worker name, reason)
        self.early_rounds: set[int] = set()  # the rounds the submitter heard announced early
        self.checkpoints = 0
        self.verdict_signers: list[tuple[str, str, int]] = []  # (signer, worker, term) as the submitter heard them
        self.accepted_at: list[tuple[float, str]] = []  # (trace time, worker name) of accepted verdicts heard
        self.circuits_at_kill: int | None = None  # circuits in-process relays had served at the last kill
        self.self_judged: list[str] = []  # verdicts signed by the worker they judge (IPIP-0006 §1.3)
        self.captured: list[bytes] = []  # job-topic envelopes mallory saw (for replays)
        self.timed_out = False
        self.fault_errors: list[str] = []
        self.facts: dict = {}
        self.hosts: Any = None  # agent.harness.hosts.Hosts when the scenario places agents on hosts
        self.mallory_sent: dict[str, int] = {}
        from agent.harness.network import identity_for

        names = ["submitter", *scenario.names()] + (["mallory"] if scenario.mallory else [])
        self.ids = {n: identity_for(seed, n).peer_id for n in names}
        self._names = {p: n for n, p in self.ids.items()}

    def name_of(self, peer_id: str | None) -> str:
        return self._names.get(peer_id or "", (peer_id or "none")[-8:])

    def observe(self, name: str, agent: Any, kind: str, args: tuple) -> None:
        self.trace.observe(name, agent, kind, args)
        if kind == "recv" and name == "submitter":
            msg = args[0].message
            if msg.TYPE == "release":
                self.releases.append((self.name_of(args[0].signer), msg.reason))
            elif msg.TYPE == "ckpt":
                self.checkpoints += 1
            elif msg.TYPE == "early":
                self.early_rounds.add(msg.round)
            elif msg.TYPE == "verdict":
                self.verdict_signers.append((args[0].signer, msg.worker, msg.term))
                if msg.accepted:
                    self.accepted_at.append((self.trace.now(), self.name_of(msg.worker)))
                if args[0].signer == msg.worker and self.name_of(msg.worker) != "mallory":  # an attacker's is refused
                    self.self_judged.append(f"r{msg.round} s{msg.shard} a{msg.attempt} by {self.name_of(msg.worker)}")
        if kind == "recv" and name == "mallory" and not args[0].topic.endswith("/jobs"):
            if len(self.captured) < 1000:
                self.captured.append(args[0].envelope.to_bytes())

    async def start_mallory(self) -> None:
        from agent.harness.network import mallory_config

        bootstrap = (self.net.submitter.addrs()[0],)
        config = mallory_config(self.net.home / "mallory", bootstrap)
        if self.net.hosts is not None:  # on the submitter's host, dialled there
            config = replace(config, listen=self.net.listen_for("mallory"), bootstrap=self.net.submitter.config.bootstrap
                             or (self.net.dial_address("submitter"),))
        common = self.scenario.agent_config.get("all", {})
        await self.net.start("mallory", replace(config, **common) if common else config)

    async def announce(self, model_dir: Path) -> None:
        from agent.train.data import write_chatml
        from agent.train.tiny import demo_records

        dataset = self.out_dir / "dataset.jsonl"
        await trio.to_thread.run_sync(write_chatml, dataset, demo_records(self.scenario.records, seed=self.seed))
        submitter = self.net.submitter.submitter
        # created and deadline pinned: the job ID, hence who is elected, depends on the seed alone
        terms = await submitter.prepare_terms(self.scenario.spec(), dataset, str(model_dir),
                                              created=PINNED_CREATED + self.seed % 1_000_000,
                                              deadline=PINNED_DEADLINE)
        self.view = await submitter.announce(terms)
        self.announced_at = time.monotonic()
        self.trace.write("job", job=self.view.job_id.hex()[:16], name=terms.name, shards=len(terms.shards),
                         rounds=terms.rounds, lease_seconds=terms.lease_seconds, max_retries=terms.max_retries)

    # -- faults -----------------------------------------------------------------------------------

    def triggered(self, when: str) -> bool:
        view = self.view
        if when == "training":
            return bool(self._trainers())
        if when == "all-training":  # every running worker but the coordinator holds a lease
            coordinator = self.name_of(view.coordination.coordinator)
            idle = {n for n in self.net.worker_names() if self.net.running(n)} - {coordinator}
            return bool(idle) and idle <= set(self._trainers())
        if when == "checkpoint":
            return self.checkpoints > 0
        if when == "report":
            return bool(view.reports)
        if when == "accepted":
            return any(v.accepted for v in view.verdicts.values())
        if when == "rejected":
            return any(not v.accepted for v in view.verdicts.values())
        if when == "aggregating":  # the coordinator computed the aggregate and asked the submitter to keep it
            if view.state.phase.value != "AGGREGATING":
                return False
            adapters = {report.adapter_cid for report, _ in view.reports.values()}  # (their keeps come first)
            return any(job == view.job_id and cid not in adapters for job, _, cid in self.net.submitter.keep.asked)
        if when == "aggregate":
            return bool(view.aggregates)
        if when.startswith("aggregate-"):
            return int(when.split("-")[1]) in view.aggregates
        if when.startswith("early-"):
            return int(when.split("-")[1]) in self.early_rounds
        if when.startswith("round-"):
            return view.state.round >= int(when.split("-")[1])
        raise ValueError(when)

    async def fire(self, fault: Fault) -> None:
        if fault.at is not None:
            await trio.sleep(max(0.0, self.announced_at + fault.at - time.monotonic()))
        else:
            while not self.triggered(fault.when):
                await trio.sleep(0.05)
            await trio.sleep(fault.after)
        try:
            what = await self.apply(fault)
        except Exception as exc:  # noqa: BLE001 - a fault that could not be applied fails a check, not the run
            log.exception("harness: fault at line %d failed", fault.line)
            what = f"{fault.action} FAILED: {type(exc).__name__}: {exc}"
            self.fault_errors.append(f"line {fault.line}: {what}")
        self.fired.append((self.trace.now(), what))
        if fault.action == "kill":
            self.circuits_at_kill = self._circuits_served()
        self.trace.write("fault", fault=fault.action, what=what, line=fault.line)
        log.info("harness: %s", what)

    def _trainers(self) -> list[str]:
        """Running workers that hold a lease in the submitter's mirror (not the coordinator), those
        that committed a checkpoint of it first: the harness sees process agents only this way."""
        view, net = self.view, self.net
        coordinator = view.coordination.coordinator
        held = []
        for shard in view.state.shards:
            if shard.phase.value != "LEASED" or shard.worker in (None, coordinator):
                continue
            name = self.name_of(shard.worker)
            if name in net.configs and net.running(name):
                committed = bool(view.commits.get((view.state.round, shard.index, shard.attempt)))
                held.append((not committed, name))
        return [name for _, name in sorted(held)]

    def resolve(self, target: str) -> list[str]:
        net, view = self.net, self.view
        workers = [n for n in net.worker_names() if net.running(n)]
        if target == "coordinator":
            name = self.name_of(view.coordination.coordinator)
            return [name] if name in net.agents or name in net.processes else []  # (a process agent too)
        if target == "trainer":
            return self._trainers()[:1]
        if target == "workers":
            return workers
        if target == "killed":
            return self.killed[-1:]
        return [target]

    async def apply(self, fault: Fault) -> str:
        net = self.net
        action, value = fault.action, fault.value
        if action == "kill":
            names = self.resolve(value)
            for name in names:
                await net.kill(name)
                self.killed.append(name)
                self.down.add(name)
            return f"kill {', '.join(names) or '(nobody matched ' + value + ')'}"
        if action == "restart":
            names = self.resolve(value)
            for name in names:
                agent = await net.restart(name)
                self.down.discard(name)
                if name == "submitter" and agent is not None:  # follow the job in the restarted submitter
                    agent.submitter.reannounce_seconds = 5.0
                    self.view = agent.jobs.get(self.view.job_id, self.view)
            return f"restart {', '.join(names)}"
        if action == "start":
            await net.start(value, net.configs[value])
            return f"start {value}"
        if action == "partition":
            net.partition(value)
            return "partition " + " | ".join(",".join(g) for g in value)
        if action == "cut":
            net.cut(value)
            return "cut " + " ".join("-".join(p) for p in value)
        if action == "heal":
            net.heal()
            return "heal"
        if action == "gossip":
            settings = {k: v for k, v in value.items() if k != "to"}
            net.set_gossip_faults(value["to"], **settings)
            return f"gossip faults {settings or 'cleared'} on {','.join(value['to'])}"
        if action == "attack":
            from agent.harness.attacks import attack

            sent = await attack(self, value["kind"], value["count"])
            self.mallory_sent[value["kind"]] = self.mallory_sent.get(value["kind"], 0) + sent
            return f"attack {value['kind']}: mallory sent {sent}"
        if action == "tamper":
            return self.tamper(value["shard"])
        raise ValueError(action)

    def tamper(self, shard: int) -> str:
        """Flip a byte in every stored block of a shard at the submitter (it serves blocks unchecked, as Kubo does)."""
        from protocol.cid import parse_cid

        store = self.net.submitter.content.store
        cid = parse_cid(self.view.terms.shards[shard].cid)
        path = store.path_for(cid)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
        return f"tamper shard {shard}: one byte of block {str(cid)[:16]}… flipped at the submitter"

    # -- the end ----------------------------------------------------------------------------------

    async def settle(self) -> None:
        """Give the live agents' mirrors a moment to reach the submitter's outcome."""
        if self.view is None or not self.view.state.terminal:
            return
        with trio.move_on_after(15):
            while not all(self._mirror_done(n) for n in self._followers()):
                await trio.sleep(0.2)

    def _followers(self) -> list[str]:
        net = self.net
        return [n for n in sorted(net.agents) if n != "mallory" and net.running(n)
                and self.view.job_id in net.agents[n].jobs]

    def _mirror_done(self, name: str) -> bool:
        mirror = self.net.agents[name].jobs[self.view.job_id]
        return mirror.state.terminal

    def check(self) -> list[Check]:
        view, net, expect = self.view, self.net, self.scenario.expect
        state = view.state
        checks: list[Check] = []
        add = checks.append
        phase = state.phase.value
        add(Check(f"job ended {expect['phase']}", phase == expect["phase"] and not self.timed_out,
                  f"{phase}" + (f" ({state.reason})" if state.reason else "") +
                  (f"; still running after {self.scenario.timeout:g} s" if self.timed_out else "")))
        if self.scenario.faults:
            add(Check("every fault applied", not self.fault_errors and len(self.fired) == len(self.scenario.faults),
                      "; ".join(self.fault_errors) or f"{len(self.fired)} of {len(self.scenario.faults)} fired"))
        if "reason" in expect:
            add(Check(f"reason mentions {expect['reason']!r}", expect["reason"] in state.reason, state.reason))
        modes = {self.ids[n]: mode for n, mode in self.scenario.byzantine.items()}
        if self.scenario.mallory:
            modes[self.ids["mallory"]] = "attacker"
        accepted = [(k, v) for k, v in view.verdicts.items() if v.accepted]
        wrongly = [f"r{k[0]} s{k[1]} by {self.name_of(v.worker)}" for k, v in accepted
                   if _misbehaves(modes.get(v.worker), k[0])]
        add(Check("no Byzantine work accepted", not wrongly, ", ".join(wrongly) or
                  f"{sum(1 for k, v in view.verdicts.items() if _misbehaves(modes.get(v.worker), k[0]) and not v.accepted)}"
                  " rejected"))
        per_shard: dict[tuple, int] = {}
        for k, _ in accepted:
            per_shard[k[:2]] = per_shard.get(k[:2], 0) + 1
        twice = [f"r{r} s{s}" for (r, s), n in per_shard.items() if n > 1]
        add(Check("no peer judged its own work", not self.self_judged, ", ".join(self.self_judged) or
                  f"{len(view.verdicts)} verdicts, none signed by their worker"))
        add(Check("each shard accepted at most once", not twice, ", ".join(twice)))
        lost = [f"r{r} s{s}" for (r, s) in per_shard if r in view.aggregates and s not in view.aggregates[r].shards]
        add(Check("no accepted work lost", not lost, ", ".join(lost) or
                  f"{len(per_shard)} accepted shards, all in their round's aggregate"))
        # the ban on a rejected worker holds in every term (IPIP-0004 §5.1 rule 0): no lease of a later round
        rejected_in = {}
        for (r, _, _), v in view.verdicts.items():
            if not v.accepted:
                rejected_in[v.worker] = min(r, rejected_in.get(v.worker, r))
        again = [f"{self.name_of(lease.worker)} in r{k[0]} s{k[1]} (term {lease.term})" for k, lease in sorted(view.leases.items())
                 if lease.worker in rejected_in and k[0] > rejected_in[lease.worker]]
        add(Check("no rejected worker leased again", not again, ", ".join(again) or
                  f"{len(rejected_in)} rejected worker(s), none leased in a later round"))
        unheld = [f"r{r}" for r, a in view.aggregates.items()
                  if not net.submitter.submitter.kept_path(view, a.adapter_cid).exists()] \
            if net.running("submitter") and "submitter" in net.agents else []
        add(Check("the submitter holds every published aggregate", not unheld, ", ".join(unheld) or
                  f"{len(view.aggregates)} aggregate(s) held"))
        if phase == "DONE":
            rounds = sorted(view.aggregates)
            final = view.aggregates.get(state.round)
            add(Check("an aggregate for every round, the last final",
                      rounds == list(range(1, view.terms.rounds + 1)) and final is not None and final.final,
                      f"rounds {rounds}"))
        disagree = []
        for name in self._followers():
            mirror = net.agents[name].jobs[view.job_id]
            if mirror.state.phase != state.phase or mirror.state.published != state.published:
                disagree.append(f"{name}: {mirror.state.phase.value} round {mirror.state.round}")
        add(Check("live mirrors agree with the submitter", not disagree, "; ".join(disagree) or
                  f"{len(self._followers())} agents"))
        broken = []
        for name in self._followers():
            try:
                net.agents[name].store.verify_ledger(view.job_id)
            except Exception as exc:  # noqa: BLE001 - reported as a failed check
                broken.append(f"{name}: {exc}")
        add(Check("every live agent's signed ledger verifies", not broken, "; ".join(broken)))
        if "min_term" in expect:
            add(Check(f"coordinator term >= {expect['min_term']}", view.coordination.term >= expect["min_term"],
                      f"term {view.coordination.term}, coordinator {self.name_of(view.coordination.coordinator)}"))
        if "max_term" in expect:  # no spurious failover (a slow or lossy link is not a dead coordinator)
            add(Check(f"coordinator term <= {expect['max_term']}", view.coordination.term <= expect["max_term"],
                      f"term {view.coordination.term}, coordinator {self.name_of(view.coordination.coordinator)}"))
        if expect.get("coordinator_judged"):
            coordinator = view.coordination.coordinator
            judged = [f"{self.name_of(w)}'s work judged by {self.name_of(s)} in term {t}"
                      for s, w, t in self.verdict_signers if w == coordinator and s != w and t == view.coordination.term]
            add(Check("the coordinator's own work judged by another peer", bool(judged),
                      (judged or [f"no verdict on {self.name_of(coordinator)}'s work in term {view.coordination.term}"])[0]))
        if "reassigned" in expect:  # false: every shard trained by its first lease (none held unused until it ran out)
            attempts = [k for k in view.leases if k[2] >= 2]
            add(Check("a shard was reassigned" if expect["reassigned"] else "no shard was reassigned",
                      bool(attempts) == expect["reassigned"],
                      ", ".join(f"r{k[0]} s{k[1]} attempt {k[2]}" for k in sorted(attempts)[:6]) or "none"))
        if "revoked" in expect:  # a silent holder's lease ended by the coordinator (IPIP-0004 §5.3)
            revoked = sorted(view.revocations.items())
            add(Check("a silent holder's lease was revoked" if expect["revoked"] else "no lease was revoked",
                      bool(revoked) == expect["revoked"],
                      ", ".join(f"r{k[0]} s{k[1]} attempt {k[2]}: {self.name_of(r.worker)} silent {r.silent_seconds:.0f} s"
                                for k, r in revoked[:4]) or "none"))
        if "released" in expect:
            hits = [f"{n}: {_brief(r, around=expect['released'])}" for n, r in self.releases if expect["released"] in r]
            add(Check(f"a shard given back: {expect['released']!r}", bool(hits),
                      (hits[:1] or [f"{len(self.releases)} releases, none matching"])[0]))
        for name, fragment in expect.get("rejected", {}).items():
            peer = self.ids.get(name)
            mode = self.scenario.byzantine.get(name, "attacker")
            verdicts = [v for k, v in view.verdicts.items() if v.worker == peer and _misbehaves(mode, k[0])]
            ok = bool(verdicts) and all(not v.accepted and fragment in v.reason for v in verdicts)
            add(Check(f"{name} rejected: {fragment!r}", ok,
                      "; ".join(_brief(v.reason, around=fragment) for v in verdicts[:2]) or "no verdict on its work"))
        honest = [n for n in net.agents if n != "mallory" and n not in self.scenario.byzantine]
        reasons: dict[str, int] = {}
        limited = 0
        for name in honest:
            agent = net.agents[name]
            if agent.net is None:
                continue
            for reason, count in agent.net.gossip.reasons.items():
                reasons[reason] = reasons.get(reason, 0) + count
            limited += sum(agent.net.gossip.rate_limited.values())
        self.facts["gossip_rejected"] = reasons
        self.facts["rate_limited"] = limited
        for reason, minimum in expect.get("gossip_rejected", {}).items():
            add(Check(f"gossip rejected >= {minimum} {reason}", reasons.get(reason, 0) >= minimum,
                      f"{reasons.get(reason, 0)} at honest agents"))
        if expect.get("rate_limited"):
            add(Check("flood rate-limited", limited > 0, f"{limited} messages refused by honest agents"))
        if "recovered" in expect:
            add(self._recovered_check(expect["recovered"]))
        if "relayed" in expect:  # the relays the harness can see: agents in its own process
            circuits = {n: a.net.host.reach.protocol.circuits for n, a in net.agents.items() if a.net is not None}
            served = sum(circuits.values())
            add(Check("a relay carried connections" if expect["relayed"] else "no relay carried a connection",
                      (served > 0) == expect["relayed"],
                      ", ".join(f"{n} relayed {c}" for n, c in sorted(circuits.items()) if c) or "no circuits"))
        if "direct" in expect:  # relayed connections upgraded by hole punching (DCUtR), both ends counted
            punched = _hole_punched(net)
            self.facts["hole_punched"] = punched
            total = sum(punched.values())
            add(Check("hole punching made direct connections" if expect["direct"] else "no hole punching",
                      (total > 0) == expect["direct"],
                      ", ".join(f"{n} {c}" for n, c in sorted(punched.items()) if c) or "none"))
        trained = {self.name_of(v.worker) for _, v in accepted}
        for name in expect.get("trained", []):
            add(Check(f"{name} trained accepted work", name in trained, f"accepted from: {sorted(trained)}"))
        for name in expect.get("not_trained", []):
            add(Check(f"{name} trained nothing accepted", name not in trained, f"accepted from: {sorted(trained)}"))
        for c in checks:
            self.trace.write("check", name=c.name, ok=c.ok, detail=c.detail)
        return checks

    def _circuits_served(self) -> int:
        """Circuits relayed so far by the relays the harness can see (agents in its own process)."""
        return sum(a.net.host.reach.protocol.circuits for a in self.net.agents.values() if a.net is not None)

    def _recovered_check(self, expected: bool) -> Check:
        """``recovered``: after the last kill, work of an agent behind a NAT was accepted: its lease,
        report and the coordinator's fetch of its adapter all went over connections that had to
        outlive the dead agent (a relay, in relay-down). The detail also counts what the relays the
        harness sees carried after the kill."""
        kills = [t for t, what in self.fired if what.startswith("kill")]
        nated = {n for n, h in self.scenario.placement.items() if self.scenario.hosts[h].nat}
        if not kills:
            return Check("connections recovered after the kill", not expected, "no kill fired")
        after = sorted({name for t, name in self.accepted_at if t > kills[-1] and name in nated})
        circuits = (self._circuits_served() - self.circuits_at_kill) if self.circuits_at_kill is not None else 0
        ok = bool(after) == expected
        return Check("connections recovered after the kill" if expected else "nothing recovered after the kill", ok,
                     (f"work of {', '.join(after)} (behind NAT) accepted after the kill at {kills[-1]:.1f} s"
                      if after else f"no work of an agent behind NAT ({', '.join(sorted(nated)) or 'none'}) "
                      f"accepted after the kill at {kills[-1]:.1f} s") +
                     f"; {circuits} circuit(s) relayed by in-process relays since")

    def summary(self, result: Result) -> str:
        view, net = self.view, self.net
        s = self.scenario
        lines = [f"scenario {s.name} (seed {result.seed}): {'PASS' if result.ok else 'FAIL'} in {result.seconds:.1f} s"]
        if view is not None:
            state = view.state
            lines.append(f"job {result.job_id[:16]}: {state.phase.value}" + (f" - {state.reason}" if state.reason else "")
                         + f"; round {state.round}/{view.terms.rounds}, term {view.coordination.term} "
                           f"(coordinator {self.name_of(view.coordination.coordinator)})")
            roles = []
            for name in sorted(net.configs):
                tag = s.byzantine.get(name) or ("attacker" if name == "mallory" else "") or (
                    "process" if name in s.processes else "")
                alive = " (down)" if name in self.down else ""
                roles.append(f"{name}{'[' + tag + ']' if tag else ''}{alive}")
            lines.append("agents: " + " ".join(roles))
            for host, spec in s.hosts.items():
                placed = [n for n, h in s.placement.items() if h == host]
                lines.append(f"host {host}{' (NAT)' if spec.nat else ''}: {' '.join(placed)}; {spec.link.describe()}")
            for t, what in result.fired:
                lines.append(f"  {t:7.1f} s  {what}")
            for rnd in range(1, state.round + 1):
                cells = []
                for shard in range(len(view.terms.shards)):
                    keys = sorted(k for k in view.leases if k[:2] == (rnd, shard))
                    verdict = next((view.verdicts[k] for k in keys if k in view.verdicts and view.verdicts[k].accepted),
                                   None)
                    worker = self.name_of(verdict.worker) if verdict else "-"
                    cells.append(f"s{shard}:{worker}" + (f"×{len(keys)}" if len(keys) > 1 else ""))
                aggregate = view.aggregates.get(rnd)
                lines.append(f"round {rnd}: " + " ".join(cells) +
                             (f"  aggregate {aggregate.adapter_cid[:16]}… ({aggregate.method})" if aggregate else ""))
            rejected = [v for v in view.verdicts.values() if not v.accepted]
            accepted = len(view.verdicts) - len(rejected)
            lines.append(f"verdicts: {accepted} accepted, {len(rejected)} rejected")
            for v in rejected[:4]:
                lines.append(f"  r{v.round} s{v.shard} {self.name_of(v.worker)}: {_brief(v.reason)}")
            for name, reason in self.releases[:3]:
                lines.append(f"  released by {name}: {_brief(reason, 100)}")
        received = self.trace.received
        top = ", ".join(f"{t} {n}" for t, n in received.most_common(8))
        lines.append(f"messages delivered: {sum(received.values())} ({top})")
        if self.facts.get("gossip_rejected") or self.facts.get("rate_limited"):
            reasons = ", ".join(f"{r} {n}" for r, n in sorted(self.facts["gossip_rejected"].items()))
            lines.append(f"gossip refused at honest agents: {reasons or 'none'}; rate-limited "
                         f"{self.facts['rate_limited']}")
        lines.append("checks:")
        for c in result.checks:
            lines.append(f"  {'ok  ' if c.ok else 'FAIL'} {c.name}" + (f": {_brief(c.detail, 120)}" if c.detail else ""))
        lines.append(f"trace: {result.trace_path} ({self.trace.lines} lines)")
        return "\n".join(lines)


def shipped() -> list[Path]:
    """The scenario files that ship with the agent."""
    return sorted(SCENARIOS_DIR.glob("*.yml"))


def find_scenario(name: str) -> Path:
    """A scenario by path, or by the name of a shipped one (``worker-crash``)."""
    path = Path(name)
    if path.exists() or path.suffix in (".yml", ".yaml"):
        return path
    candidate = SCENARIOS_DIR / f"{name}.yml"
    if candidate.exists():
        return candidate
    names = ", ".join(p.stem for p in shipped())
    raise SpecError("", f"no scenario file {name!r} and no shipped scenario of that name (shipped: {names})", name)


def _hole_punched(net: Any) -> dict[str, int]:
    """Per agent, relayed connections it upgraded by hole punching: in-process agents from their
    reachability counters, process agents from their log (agent/net/reach.py ``PUNCHED_LOG``)."""
    from agent.net.reach import PUNCHED_LOG

    out = {n: a.net.host.reach.dcutr.upgrades for n, a in net.agents.items() if a.net is not None}
    for name in net.process_names:
        config = net.configs.get(name)
        log_file = config.home / "agent.log" if config is not None else None
        if log_file is not None and log_file.exists():
            out[name] = log_file.read_text(errors="replace").count(PUNCHED_LOG)
    return out
