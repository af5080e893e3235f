"""The chaos soak: jobs back to back on real agent processes under a seeded schedule of faults, with the
network's invariants checked while it runs (`infernet harness soak`).

Jepsen's shape: a generator of faults, a checker of invariants, a reproducible seed. Scenarios
(agent/harness/scenario.py) test one fault at a chosen moment; the soak finds the fault nobody
thought of by running many, overlapping, at moments nobody chose, for as long as it is given.

Rules of this file:
- Every agent is a real ``infernet agent run`` process with its own home, as an operator runs it:
  a submitter (never trains, never coordinates) and ``agents`` workers; the soak talks to them as
  the CLI does (control sockets) and reads their logs. Where the machine can make harness hosts
  (agent/harness/hosts.py: root, ``ip``, ``iptables``), each agent runs on a host of its own, so a
  partition is real (its link to "the internet" goes down); elsewhere all run on loopback and no
  partition is made (said in the report). One worker's home is a small tmpfs where root may mount
  one, so its disk can be filled for real.
- Jobs run one after another, each a small LoRA job of the demo task, until ``minutes`` pass (counted
  from when every agent is up); the last one is waited for.
- Faults, drawn from ``random.Random(seed)`` every ``fault_every`` seconds (± half), among the kinds
  that can be made at that moment (a second sooner when none can): kill -9 of a
  worker or of the submitter, SIGTERM of a worker, a freeze (SIGSTOP, then SIGCONT), each followed by
  a restart with the same home; a brand-new agent joining; a partition of one or two workers (then
  healed); a full disk (then freed). At most two workers are down, frozen, cut off or full at once,
  so a job can always end.
- Invariants, checked as it runs and at each job's end; each break is a *violation* with a line:
  every job ends DONE, or FAILED with a reason, by its deadline: each job's spec declares
  ``max_runtime_hours`` of ``job_timeout`` seconds, which every mirror enforces (IPIP-0004 §4), and
  the submitter must show the end within ``DEADLINE_GRACE`` seconds after it; no agent exits that was not
  killed or stopped; no verdict signed by the worker it judges; no honest peer's work rejected (all
  peers here are honest) and none blacklisted; no worker leased in a round after its work was
  rejected; no accepted shard missing from its round's aggregate; every job's signed ledger, as the
  submitter holds it after a sync, verifies (IPIP-0008 export); no agent process outlives the soak.
- The result is benchmark lines (README "Benchmarks"): faults injected, jobs, jobs done, violations,
  accepted work lost; and a summary. Exit status 0 when there were no violations.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from agent.config import CONFIG_FILE, IDENTITY_FILE
from agent.channel import ControlError, request
from agent.demo import agent_config
from agent.keyfile import save_identity
from agent.loopwatch import STALL
from protocol.identity import Identity

LISTEN_PORT = 4001  # on each harness host (each its own address); on loopback: any free port
DISK_MB = 256  # the disk worker's tmpfs
DISK_QUOTA = 0.6  # its max_disk_gb, as a share of that (agent/disk.py: it collects and refuses work to stay inside)
MAX_DOWN = 2  # workers down, frozen, cut off or full at once
CHECK_EVERY = 5.0

DEADLINE_GRACE = 60.0  # seconds after a job's deadline for the submitter (maybe down) to show its end

FAULTS = {  # kind -> weight
    "kill9": 3, "term": 2, "freeze": 2, "kill9-submitter": 1, "join": 1, "partition": 2, "disk-full": 1,
}


@dataclass
class SoakOptions:
    minutes: float = 2.0
    agents: int = 6
    seed: int = 1
    directory: Path | None = None
    fault_every: float = 8.0
    job_timeout: float = 300.0
    max_joins: int = 3


@dataclass
class AgentProc:
    name: str
    home: Path
    listen: str
    process: subprocess.Popen | None = None
    down: bool = False  # killed or stopped by us (restarted later)
    frozen: bool = False
    cut: bool = False  # partitioned
    full: bool = False  # its disk filled
    restarts: int = 0

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class SoakReport:
    seconds: float = 0.0
    faults: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # fault kind -> why it cannot be made here
    jobs: list[dict] = field(default_factory=list)  # {id, state, reason, seconds}
    violations: list[str] = field(default_factory=list)
    accepted_lost: int = 0
    service_failures: int = 0  # supervised tasks that failed and were restarted (logged errors)
    loop_stalls: int = 0  # an agent's event loop blocked over agent/loopwatch.py's STALL seconds
    loop_worst: float = 0.0  # the longest of those, seconds
    stream_timeouts: int = 0  # "no stream within" (a stream to a peer not opened in time)
    placement: str = "loopback"

    @property
    def faults_injected(self) -> int:
        return sum(self.faults.values())

    def bench_lines(self) -> list[dict]:
        done = sum(1 for j in self.jobs if j["state"] == "DONE")
        clean = 1.0 if not self.violations else 0.0
        return [
            {"bench": "soak_faults_injected", "value": self.faults_injected, "unit": "faults",
             "reference": max(1, round(self.seconds / 18)), "ratio": round(self.faults_injected / max(1, round(
                 self.seconds / 18)), 3), "goal": 1.0},
            {"bench": "soak_jobs", "value": len(self.jobs), "unit": "jobs", "reference": len(self.jobs),
             "ratio": 1.0, "goal": None},
            {"bench": "soak_jobs_done", "value": done, "unit": "jobs", "reference": max(1, len(self.jobs)),
             "ratio": round(done / max(1, len(self.jobs)), 3), "goal": None},
            {"bench": "soak_violations", "value": len(self.violations), "unit": "violations", "reference": 0,
             "ratio": clean, "goal": 1.0},
            {"bench": "soak_accepted_work_lost", "value": self.accepted_lost, "unit": "shards", "reference": 0,
             "ratio": 1.0 if not self.accepted_lost else 0.0, "goal": 1.0},
        ]

    def summary(self) -> str:
        done = sum(1 for j in self.jobs if j["state"] == "DONE")
        failed = [j for j in self.jobs if j["state"] != "DONE"]
        lines = [f"soak: {len(self.violations)} violations in {self.seconds / 60:.1f} min ({self.placement}): "
                 f"{self.faults_injected} faults, {len(self.jobs)} jobs ({done} DONE, {len(failed)} not)",
                 "faults: " + (", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())) or "none")]
        lines += [f"not made here: {k} ({why})" for k, why in sorted(self.skipped.items())]
        lines += [f"job {j['id'][:16]}: {j['state']} in {j['seconds']:.0f} s"
                  + (f" - {j['reason']}" if j.get("reason") else "") for j in self.jobs]
        lines += [f"service tasks restarted after an error: {self.service_failures}",
                  f"event loops blocked over {STALL:g} s: {self.loop_stalls} (longest {self.loop_worst:.1f} s); "
                  f"streams not opened in time: {self.stream_timeouts}"]
        lines += [f"VIOLATION: {v}" for v in self.violations[:50]]
        return "\n".join(lines)


class Soak:
    """One soak run (``run``): the agents, the fault schedule, the job runner, the checks."""

    def __init__(self, options: SoakOptions, *, say: Callable[[str], None] = lambda line: None) -> None:
        self.options = options
        self.say = say
        self.rng = random.Random(options.seed)
        self.root = options.directory or Path(tempfile.mkdtemp(prefix="infernet-soak-"))
        self.report = SoakReport()
        self.agents: dict[str, AgentProc] = {}
        self.hosts: Any = None
        self.inet: str | None = None
        self.tmpfs: Path | None = None
        self.disk_worker: str | None = None
        self.undo: list[tuple[float, str, Callable[[], None]]] = []  # (when, what, action)
        self.joins = 0
        self.blacklisted_seen: dict[str, int] = {}
        self.failures_seen: dict[str, int] = {}
        self.stalls_seen: dict[str, int] = {}
        self.timeouts_seen: dict[str, int] = {}
        self.started = time.monotonic()

    # -- set-up ------------------------------------------------------------------------------------

    def _prepare(self) -> None:
        from agent.demo import demo_dataset
        from agent.harness import hosts as harness_hosts
        from agent.train.tiny import tiny_model

        self.root.mkdir(parents=True, exist_ok=True)
        if any(self.root.iterdir()):
            raise ValueError(f"{self.root}: not empty; give --out a new directory")
        self.model = tiny_model()
        self.dataset = Path(shutil.copy(demo_dataset(), self.root / "demo.jsonl"))
        names = ["submitter"] + [f"w{i}" for i in range(self.options.agents)] + \
            [f"j{i}" for i in range(self.options.max_joins)]
        reason = harness_hosts.unavailable_reason()
        if reason is None:
            specs = {n: harness_hosts.HostSpec(n) for n in names}
            try:
                self.hosts = harness_hosts.Hosts(specs).create()
                self.inet = self.hosts.ns(harness_hosts.INET)
                self.report.placement = f"{len(names)} harness hosts (network namespaces)"
            except Exception as exc:  # noqa: BLE001 - the soak runs on loopback instead, saying why
                reason = str(exc)
        if self.hosts is None:
            self.report.skipped["partition"] = f"no harness hosts: {reason}"
        self.disk_worker = "w1" if self.options.agents > 2 else None
        if self.disk_worker is not None:
            self.tmpfs = self._mount_tmpfs(self.root / self.disk_worker)
            if self.tmpfs is None:
                self.report.skipped["disk-full"] = "cannot mount a tmpfs here (needs root)"
        for name in names[:1 + self.options.agents]:
            self._create(name)

    def _mount_tmpfs(self, path: Path) -> Path | None:
        path.mkdir(parents=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m,mode=0700", "tmpfs", str(path)],
                              capture_output=True, text=True)
        return path if done.returncode == 0 else None

    def _create(self, name: str) -> AgentProc:
        home = self.root / name
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(home, 0o700)
        save_identity(Identity.generate(), home / IDENTITY_FILE)
        if self.hosts is not None:
            listen = f"/ip4/{self.hosts.ip(name)}/tcp/{LISTEN_PORT}"
        else:
            listen = f"/ip4/127.0.0.1/tcp/{_free_port()}"
        submitter = name == "submitter"
        extra = "fetch_timeout = 30.0\n"
        if name == self.disk_worker and self.tmpfs is not None:
            # the small disk: a quota well inside it, so its own work never fills it (the filler fault does)
            extra += f"max_disk_gb = {DISK_MB * DISK_QUOTA / 1000:g}\n"
        (home / CONFIG_FILE).write_text(agent_config(accept=not submitter, coordinate=not submitter,
                                                     model_path=self.model, listen=listen, writer="harness soak",
                                                     extra=extra))
        agent = AgentProc(name, home, listen)
        self.agents[name] = agent
        return agent

    def _logs(self, agent: AgentProc) -> Path:
        """Where an agent's agent.log and stderr.log go: its home, but the disk worker's beside its small
        disk (a full disk lost the lines that said why it exited)."""
        if agent.name == self.disk_worker and self.tmpfs is not None:
            kept = self.root / f"{agent.name}-logs"
            kept.mkdir(exist_ok=True)
            return kept
        return agent.home

    def _bootstrap(self) -> str:
        submitter = self.agents["submitter"]
        peer = _peer_id_of(submitter.home)
        return f"{submitter.listen}/p2p/{peer}"

    def _start(self, agent: AgentProc) -> None:
        logs = self._logs(agent)
        command = [sys.executable, "-m", "agent.cli", "agent", "run", "--home", str(agent.home),
                   "--log-file", str(logs / "agent.log")]
        if agent.name != "submitter":
            command += ["--bootstrap", self._bootstrap()]
        if self.hosts is not None:
            command = self.hosts.exec_prefix(agent.name) + command
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                   PYTHONUNBUFFERED="1")
        from agent.demo import die_with

        with open(logs / "stderr.log", "ab") as stderr:
            agent.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=env,
                                             start_new_session=True,
                                             preexec_fn=die_with(os.getpid()))  # none outlives a killed soak
        agent.down = agent.frozen = False

    def _wait_ready(self, agent: AgentProc, timeout: float = 90.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not agent.running:
                return False
            try:
                request(agent.home, "status", timeout=5)
                return True
            except ControlError:
                time.sleep(0.3)
        return False

    # -- the run -----------------------------------------------------------------------------------

    def run(self) -> SoakReport:
        """Run the soak; on SIGTERM or Ctrl-C it stops early, and every agent, host and disk it made is
        undone either way."""
        previous = signal.signal(signal.SIGTERM, _interrupt) if threading.current_thread() is threading.main_thread() \
            else None
        try:
            self._prepare()
            self._start(self.agents["submitter"])
            if not self._wait_ready(self.agents["submitter"]):
                raise RuntimeError(f"the submitter did not start: {_last_line(self._logs(self.agents['submitter']))}")
            for agent in list(self.agents.values())[1:]:
                self._start(agent)
            for agent in list(self.agents.values())[1:]:
                if not self._wait_ready(agent):
                    raise RuntimeError(f"agent {agent.name} did not start: {_last_line(self._logs(agent))}")
            self.say(f"soak: {len(self.agents)} agents up ({self.report.placement}); "
                     f"{self.options.minutes:g} min of jobs under faults, seed {self.options.seed}")
            self._loop()
        except KeyboardInterrupt:
            self.report.violations.append("the soak was interrupted before its time was up")
        finally:
            self._stop_all()
            self.report.seconds = time.monotonic() - self.started
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        return self.report

    def _loop(self) -> None:
        """Jobs run in a thread of their own (a control request may wait long on a struggling agent); this
        thread injects the faults, undoes them when due and checks the agents, until the time is up and
        the last job has ended."""
        end = time.monotonic() + self.options.minutes * 60  # the minutes under faults start once all are up
        jobs = threading.Thread(target=self._run_jobs, args=(end,), name="soak-jobs", daemon=True)
        jobs.start()
        next_fault = time.monotonic() + self._interval()
        next_check = time.monotonic() + CHECK_EVERY
        while jobs.is_alive():
            now = time.monotonic()
            for item in sorted((u for u in self.undo if u[0] <= now), key=lambda u: u[0]):
                self.undo.remove(item)
                self._do(item[1], item[2])
            if now >= next_fault and now < end:
                # when no kind of fault can be made now (too many impaired, the submitter down, no join left),
                # one is drawn again soon, not a whole interval later
                next_fault = now + (self._interval() if self._inject() else 1.0)
            if now >= next_check:
                self._check_running()
                next_check = now + CHECK_EVERY
            time.sleep(0.5)
        for when, what, action in sorted(self.undo, key=lambda u: u[0]):  # heal, thaw, free and restart what is still out
            self._do(what, action)
        self.undo.clear()
        self._check_running()

    def _run_jobs(self, end: float) -> None:
        job: dict | None = None
        while True:
            if job is None:
                if time.monotonic() >= end:
                    return
                job = self._announce()
                if job is None:
                    time.sleep(1.0)
                    continue
            if self._job_ended(job):
                job = None
                continue
            time.sleep(1.0)

    def _interval(self) -> float:
        return self.options.fault_every * self.rng.uniform(0.5, 1.5)

    def _do(self, what: str, action: Callable[[], None]) -> None:
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - a failed undo is a violation, not the end of the soak
            self.report.violations.append(f"{what} failed: {type(exc).__name__}: {exc}")

    # -- jobs --------------------------------------------------------------------------------------

    def _announce(self) -> dict | None:
        from agent.demo import DemoOptions, demo_spec

        submitter = self.agents["submitter"]
        if not submitter.running or submitter.down:
            return None
        n = len(self.report.jobs) + 1
        spec = self.root / f"soak-job-{n}.yml"
        text = demo_spec(DemoOptions(workers=3, shards=3, rounds=2, steps=6))
        # the job's own deadline, enforced by every mirror, is what bounds it (not the checker's patience)
        spec.write_text(text.replace("name: infernet-demo", f"name: soak-{n}").replace(
            "lease_seconds: 120", "lease_seconds: 30")
            + f"resources:\n  max_runtime_hours: {self.options.job_timeout / 3600:.6f}\n")
        try:
            answer = request(submitter.home, "job.announce", timeout=120, spec=str(spec), dataset=str(self.dataset))
        except ControlError as exc:
            self.say(f"soak: job {n} not announced yet: {exc}")
            return None
        job = {"id": answer["id"], "started": time.monotonic(), "state": "ANNOUNCED", "reason": ""}
        self.report.jobs.append(job)
        self.say(f"soak: job {n} announced ({answer['id'][:16]})")
        return job

    def _job_ended(self, job: dict) -> bool:
        submitter = self.agents["submitter"]
        elapsed = time.monotonic() - job["started"]
        if submitter.running and not submitter.down and not submitter.frozen:
            try:
                detail = request(submitter.home, "job.show", timeout=10, job=job["id"])
            except ControlError:
                detail = None
            if detail is not None:
                job["state"], job["reason"] = detail["state"], detail.get("reason") or ""
                if detail["state"] in ("DONE", "FAILED", "CANCELLED"):
                    job["seconds"] = elapsed
                    self._check_job(job, detail)
                    self.say(f"soak: job {job['id'][:16]} {job['state']} in {elapsed:.0f} s"
                             + (f" ({job['reason']})" if job["reason"] else ""))
                    return True
        if elapsed > self.options.job_timeout + DEADLINE_GRACE:
            job["seconds"] = elapsed
            self.report.violations.append(f"job {job['id'][:16]} did not end by its deadline "
                                          f"({self.options.job_timeout:.0f} s, + {DEADLINE_GRACE:.0f} s): {job['state']}")
            return True
        return False

    def _wait_for(self, condition: Callable[[], bool], seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.5)

    def _check_job(self, job: dict, detail: dict) -> None:
        from protocol.ledger import verify_export

        short = job["id"][:16]
        if detail["state"] != "DONE" and not job["reason"]:
            self.report.violations.append(f"job {short} ended {detail['state']} without a reason")
        submitter = self.agents["submitter"]
        export = self.root / f"ledger-{short}.json"
        verified = None
        for attempt in range(LEDGER_TRIES):
            # the fault schedule runs meanwhile: a submitter killed or frozen during the request is not
            # a bad ledger; ask again once it is back (a ledger that does not verify is a violation at once)
            self._wait_for(lambda: submitter.running and not submitter.down and not submitter.frozen, 60.0)
            try:
                export.unlink(missing_ok=True)
                request(submitter.home, "job.ledger", timeout=60, job=job["id"], sync=True, export=str(export))
                verified = verify_export(json.loads(export.read_text()))
                break
            except ControlError as exc:
                if attempt == LEDGER_TRIES - 1:
                    self.report.violations.append(f"job {short}: its ledger could not be read in {LEDGER_TRIES} "
                                                  f"tries: {exc}")
                    return
                time.sleep(5.0)
            except Exception as exc:  # noqa: BLE001 - LedgerError and the like: a violation with its line
                self.report.violations.append(f"job {short}: its ledger does not verify: {exc}")
                return
        if verified is None:
            return
        rejected: dict[str, int] = {}
        accepted: set[tuple[int, int]] = set()
        leases: list[tuple[str, int, str]] = []
        for author, chain in verified.chains.items():
            for entry in chain:
                data = entry.data
                if entry.kind == "verdict":
                    if data.get("worker") == author:
                        self.report.violations.append(f"job {short}: {author[-8:]} judged its own work "
                                                      f"(round {data.get('round')} shard {data.get('shard')})")
                    if data.get("accepted"):
                        accepted.add((int(data["round"]), int(data["shard"])))
                    else:
                        worker = str(data.get("worker"))
                        rejected[worker] = min(int(data["round"]), rejected.get(worker, 1 << 30))
                        self.report.violations.append(f"job {short}: honest work of {worker[-8:]} rejected: "
                                                      f"{str(data.get('reason'))[:200]}")
                elif entry.kind == "lease":
                    leases.append((str(data.get("worker")), int(data.get("round", 0)), author))
        for worker, rnd, author in leases:
            if worker in rejected and rnd > rejected[worker]:
                self.report.violations.append(f"job {short}: {worker[-8:]} leased in round {rnd} by {author[-8:]} "
                                              f"after its work was rejected in round {rejected[worker]}")
        aggregates = {a["round"]: set(a["shards"]) for a in detail.get("aggregates", [])}
        lost = sorted((r, s) for r, s in accepted if r in aggregates and s not in aggregates[r])
        if detail["state"] == "DONE":
            lost += sorted((r, s) for r, s in accepted if r not in aggregates)
        if lost:
            self.report.accepted_lost += len(lost)
            self.report.violations.append(f"job {short}: accepted work missing from its aggregates: "
                                          + ", ".join(f"r{r} s{s}" for r, s in lost))

    # -- faults ------------------------------------------------------------------------------------

    def _workers(self) -> list[AgentProc]:
        return [a for n, a in self.agents.items() if n != "submitter"]

    def _healthy(self) -> list[AgentProc]:
        return [a for a in self._workers() if a.running and not (a.down or a.frozen or a.cut or a.full)]

    def _impaired(self) -> int:
        return sum(1 for a in self._workers() if a.down or a.frozen or a.cut or a.full)

    def _possible(self) -> list[str]:
        """The fault kinds that can be made now: at most MAX_DOWN workers impaired and two healthy left, a
        submitter that is up, a join left, the disk worker up and not full already."""
        room = self._impaired() < MAX_DOWN and len(self._healthy()) > 2
        submitter = self.agents["submitter"]
        disk = self.agents.get(self.disk_worker or "")
        ruled_out = {
            "kill9": not room, "term": not room, "freeze": not room, "partition": not room,
            "kill9-submitter": submitter.down or not submitter.running,
            "join": self.joins >= self.options.max_joins,
            "disk-full": disk is None or disk.full or not disk.running or disk.down or not room,
        }
        return [k for k in FAULTS if k not in self.report.skipped and not ruled_out.get(k, False)]

    def _inject(self) -> bool:
        """Inject one fault, drawn by weight among the kinds that can be made now (a draw among all of them
        found no room most of the time with 3 workers, and the short soak made 2 faults in 30 s); False
        when none can."""
        kinds = self._possible()
        if not kinds:
            return False
        kind = self.rng.choices(kinds, weights=[FAULTS[k] for k in kinds])[0]
        victims = self._healthy()
        if kind == "kill9":
            self._kill(self.rng.choice(victims), signal.SIGKILL)
        elif kind == "term":
            self._kill(self.rng.choice(victims), signal.SIGTERM)
        elif kind == "freeze":
            self._freeze(self.rng.choice(victims), self.rng.uniform(3, 12))
        elif kind == "kill9-submitter":
            self._kill(self.agents["submitter"], signal.SIGKILL, restart_after=self.rng.uniform(2, 6))
        elif kind == "join":
            name = f"j{self.joins}"
            self.joins += 1
            agent = self._create(name)
            self._start(agent)
            self._count(kind, f"join {name}")
        elif kind == "partition":
            group = self.rng.sample(victims, k=1 if self._impaired() or len(victims) < 4 else self.rng.choice((1, 2)))
            self._partition(group, self.rng.uniform(5, 20))
        elif kind == "disk-full":
            self._fill(self.agents[self.disk_worker or ""], self.rng.uniform(10, 30))
        return True

    def _count(self, kind: str, what: str) -> None:
        self.report.faults[kind] = self.report.faults.get(kind, 0) + 1
        self.say(f"soak: {time.monotonic() - self.started:6.1f} s  {what}")

    def _kill(self, agent: AgentProc, sig: int, restart_after: float | None = None) -> None:
        agent.down = True
        agent.process.send_signal(sig)
        try:
            agent.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            agent.process.kill()
            agent.process.wait()
        kind = ("kill9" if sig == signal.SIGKILL else "term") + ("-submitter" if agent.name == "submitter" else "")
        self._count(kind, f"{'kill -9' if sig == signal.SIGKILL else 'SIGTERM'} {agent.name}")
        # SIGTERM: a clean stop, exit 0; or, still starting (its handler not yet installed: imports, the
        # store), killed by the signal itself (-15), which releases nothing because it holds nothing yet.
        # Anything else, or no exit within 30 s (then -9), breaks the invariant.
        if sig == signal.SIGTERM and agent.process.returncode not in (0, -signal.SIGTERM):
            self.report.violations.append(f"{agent.name} exited {agent.process.returncode} on SIGTERM "
                                          f"(expected 0): {_last_line(self._logs(agent))}")
        delay = restart_after if restart_after is not None else self.rng.uniform(2, 8)
        self.undo.append((time.monotonic() + delay, f"restart {agent.name}", lambda: self._restart(agent)))

    def _restart(self, agent: AgentProc) -> None:
        agent.restarts += 1
        self._start(agent)
        self.say(f"soak: {time.monotonic() - self.started:6.1f} s  restart {agent.name}")

    def _freeze(self, agent: AgentProc, seconds: float) -> None:
        agent.frozen = True
        os.kill(agent.process.pid, signal.SIGSTOP)
        self._count("freeze", f"freeze {agent.name} for {seconds:.0f} s")

        def thaw() -> None:
            if agent.running:
                os.kill(agent.process.pid, signal.SIGCONT)
            agent.frozen = False

        self.undo.append((time.monotonic() + seconds, f"thaw {agent.name}", thaw))

    def _link(self, agent: AgentProc, state: str) -> None:
        from agent.harness.hosts import run_command

        index = list(self.hosts.specs).index(agent.name) + 1
        run_command(["ip", "-n", self.inet, "link", "set", f"v{index}", state])

    def _partition(self, group: list[AgentProc], seconds: float) -> None:
        for agent in group:
            agent.cut = True
            self._link(agent, "down")
        self._count("partition", f"partition {','.join(a.name for a in group)} for {seconds:.0f} s")

        def heal() -> None:
            for agent in group:
                self._link(agent, "up")
                agent.cut = False

        self.undo.append((time.monotonic() + seconds, "heal", heal))

    def _fill(self, agent: AgentProc, seconds: float) -> None:
        filler = self.tmpfs / "filler.bin"
        agent.full = True
        with open(filler, "wb") as out:
            try:
                while True:
                    out.write(b"\0" * (1 << 20))
            except OSError:
                pass
        self._count("disk-full", f"fill {agent.name}'s disk for {seconds:.0f} s")

        def free() -> None:
            filler.unlink(missing_ok=True)
            agent.full = False

        self.undo.append((time.monotonic() + seconds, f"free {agent.name}'s disk", free))

    # -- checks ------------------------------------------------------------------------------------

    def _check_running(self) -> None:
        for agent in self.agents.values():
            if agent.process is None or agent.down:
                continue
            if agent.process.poll() is not None:
                agent.down = True  # reported once
                self.report.violations.append(f"{agent.name} exited {agent.process.returncode} by itself: "
                                              f"{_last_line(self._logs(agent))}")
            self._scan_log(agent)

    def _scan_log(self, agent: AgentProc) -> None:
        try:
            text = (self._logs(agent) / "agent.log").read_text(errors="replace")
        except OSError:
            return
        blacklisted = [line for line in text.splitlines() if "blacklisting" in line]
        for line in blacklisted[self.blacklisted_seen.get(agent.name, 0):]:
            self.report.violations.append(f"{agent.name}: {_message(line)}")
        self.blacklisted_seen[agent.name] = len(blacklisted)
        failures = len(re.findall(r'"logger": "agent\.supervise"', text))
        self.report.service_failures += failures - self.failures_seen.get(agent.name, 0)
        self.failures_seen[agent.name] = failures
        stalls = [float(x) for x in re.findall(r'"loop_blocked_s": ([0-9.]+)', text)]
        self.report.loop_stalls += len(stalls) - self.stalls_seen.get(agent.name, 0)
        self.report.loop_worst = max([self.report.loop_worst, *stalls])
        self.stalls_seen[agent.name] = len(stalls)
        timeouts = text.count("no stream within")
        self.report.stream_timeouts += timeouts - self.timeouts_seen.get(agent.name, 0)
        self.timeouts_seen[agent.name] = timeouts

    # -- the end -----------------------------------------------------------------------------------

    def _stop_all(self) -> None:
        for agent in self.agents.values():
            if agent.running:
                if agent.frozen:
                    os.kill(agent.process.pid, signal.SIGCONT)
                agent.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for agent in self.agents.values():
            if agent.process is None:
                continue
            try:
                agent.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.report.violations.append(f"{agent.name} did not stop within 20 s of SIGTERM")
                agent.process.kill()
                agent.process.wait()
        for agent in self.agents.values():
            self._scan_log(agent)
        time.sleep(1.0)
        leaked = _processes_under(self.root)
        if leaked:
            self.report.violations.append(f"{len(leaked)} process(es) outlived the soak: " + "; ".join(
                f"{pid} {_cmdline(pid)[:200]}" for pid in leaked[:3]))
            for pid in leaked:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        if self.tmpfs is not None:  # (its logs are kept beside it already)
            subprocess.run(["umount", "-l", str(self.tmpfs)], capture_output=True)
        if self.hosts is not None:
            self.hosts.close()


LEDGER_TRIES = 4  # asks of a finished job's ledger export while the submitter is killed and restarted


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _peer_id_of(home: Path) -> str:
    from agent.keyfile import load_identity

    return load_identity(home / IDENTITY_FILE).peer_id


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _message(line: str) -> str:
    try:
        return str(json.loads(line).get("msg", line))[:300]
    except ValueError:
        return line[:300]


def _last_line(home: Path) -> str:
    for name in ("stderr.log", "agent.log"):
        try:
            lines = [line for line in (home / name).read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            continue
        if lines:
            return _message(lines[-1])
    return "no output"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "(gone)"


def _processes_under(root: Path) -> list[int]:
    """PIDs of live processes whose command line names ``root`` (agents of this soak)."""
    out = []
    needle = str(root).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().split()[2]
        except OSError:
            continue
        if needle in cmdline and b"agent\0run" in cmdline and state != "Z":
            out.append(int(entry.name))
    return out
