"""Issue 23 (step 3): each role is built with the few services it uses (agent/roles/port.py), never
with the agent.

Checked on the source (AST) and on a real Agent:
- each role's constructor takes at most six collaborators, each annotated with a concrete type
  (no ``Any``), and none of them is the agent: no parameter or attribute called ``agent``, no import
  of agent/node.py;
- no role assigns an attribute of a collaborator (``self.local.config = ...``): roles do not write
  the state of the agent's services;
- a real Agent builds its roles with its own services (the same objects), so what a role reads is
  what the agent holds.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from agent.node import Agent, AgentConfig
from agent.roles.coordinator import CoordinatorRole
from agent.roles.keep import KeepService
from agent.roles.submitter import SubmitterRole
from agent.roles.worker import WorkerRole
from protocol.identity import Identity

ROOT = Path(__file__).resolve().parents[2]
ROLES = ROOT / "agent" / "roles"
# the harness's injection (agent/hooks.py): a Byzantine worker's training, the honest one by default
HOOKS = {("WorkerRole", "training")}
BUILT = {"CoordinatorRole": CoordinatorRole, "WorkerRole": WorkerRole, "SubmitterRole": SubmitterRole,
         "KeepService": KeepService}


def collaborators(cls: type) -> list[tuple[str, str]]:
    """(name, annotation) of each parameter of ``cls.__init__`` but ``self`` and the harness's hooks."""
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return [(p.name, str(p.annotation)) for p in params if (cls.__name__, p.name) not in HOOKS]


def test_each_role_takes_at_most_six_typed_collaborators_and_never_the_agent():
    for name, cls in BUILT.items():
        params = collaborators(cls)
        assert 2 <= len(params) <= 6, (name, params)
        for param, annotation in params:
            assert param != "agent" and "Agent" not in annotation and "Port" not in annotation, (name, param)
            assert annotation not in ("", "Any", "<class 'inspect._empty'>") and "Any" != annotation.strip("'\""), \
                (name, param, annotation)


def _assigned_attributes(path: Path) -> list[str]:
    """``file:line: target`` for each assignment to an attribute of an attribute of ``self``
    (``self.local.x = ...``, ``self.peer_table.peers[k] = ...`` is a write into its state too)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            while isinstance(target, ast.Subscript):
                target = target.value
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Attribute) and \
                    isinstance(target.value.value, ast.Name) and target.value.value.id == "self":
                out.append(f"{path.name}:{node.lineno}: self.{target.value.attr}.{target.attr}")
    return out


def test_roles_hold_no_agent_and_write_no_collaborator_state():
    found, writes = [], []
    files = sorted(p for p in ROLES.glob("*.py") if p.name != "__init__.py")
    assert {p.name for p in files} >= {"coordinator.py", "worker.py", "submitter.py", "sync.py", "keep.py"}
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "agent.node":
                found.append(f"{path.name}:{node.lineno}: imports agent.node")
            if isinstance(node, ast.Attribute) and node.attr == "agent" and isinstance(node.value, ast.Name) \
                    and node.value.id == "self":
                found.append(f"{path.name}:{node.lineno}: self.agent")
            if isinstance(node, ast.arg) and node.arg == "agent":
                found.append(f"{path.name}:{node.lineno}: a parameter called agent")
        writes += _assigned_attributes(path)
    assert not found, "\n".join(found)
    # a role's own helpers (``self._prefetch.x``) are its state; the agent's services are not. The one
    # write allowed: counting a metric (``self.local.counters[name] += 1``, what ``counters`` is for)
    services = {"local", "peer_table", "tasks", "blocks", "evidence", "book", "following", "net"}
    writes = [w for w in writes if not w.endswith("self.local.counters")]
    assert not [w for w in writes if w.split(": self.")[1].split(".")[0] in services], writes


def test_the_write_check_sees_a_write_into_a_service(tmp_path):
    role = tmp_path / "role.py"
    role.write_text("class R:\n    def f(self):\n        self.local.config = 1\n        self.peer_table.peers['x'] = 2\n"
                    "        self.own = 3\n")
    assert _assigned_attributes(role) == ["role.py:3: self.local.config", "role.py:4: self.peer_table.peers"]


def test_a_real_agent_builds_its_roles_with_its_own_services(tmp_path):
    agent = Agent(Identity.generate(), AgentConfig(home=tmp_path, accept_training=True))
    for role in (agent.coordinator, agent.worker, agent.submitter):
        assert role.local is agent.local and role.peer_table is agent.peer_table and role.tasks is agent.tasks
        assert role.blocks is agent.blocks and role.evidence is agent.evidence
    assert agent.worker.book is agent.book and agent.submitter.following is agent.following
    assert agent.keep.local is agent.local and agent.keep.peer_table is agent.peer_table
    assert agent.local.counters is agent.counters and agent.local.capabilities is agent.capabilities
    # settings replaced while the agent runs (the tests do) reach the roles and the election
    from dataclasses import replace

    agent.config = replace(agent.config, grace_seconds=7.5, claim_interval=3.0)
    assert agent.worker.local.config.claim_interval == 3.0
    assert agent.peer_table.grace_seconds == agent.jobclock.grace_seconds == 7.5


def test_roles_wait_on_events_not_polling_loops():
    """Waiting for a peer or a job's end is ``wait_until`` (job events and heartbeats, with a deadline):
    no short sleep repeated in a loop is left in the roles (retry back-offs sleep seconds, once per try)."""
    polls = []
    for path in sorted(ROLES.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.While):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute) and \
                            inner.func.attr == "sleep" and inner.args and isinstance(inner.args[0], ast.Constant) and \
                            isinstance(inner.args[0].value, (int, float)) and inner.args[0].value < 1:
                        polls.append(f"{path.name}:{inner.lineno}")
    assert not polls, polls
