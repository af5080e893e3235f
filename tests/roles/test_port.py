"""Issue 15 (13): the roles reach their agent through one narrow port (agent/roles/port.py RolePort).

Checked two ways: ``Agent`` satisfies the protocol structurally (every member, on a real Agent), and
a static check over the roles' source (AST) finds no member of the agent used outside the port and
no import of agent/node.py. A role that reaches past the port fails here, naming the file and line.
The check follows the agent where a role hands it on: to a function of another agent module (called
with the agent, or started as a task with it, e.g. ``spawn_in_job(job, fn, agent, view)``), whose uses
of it must be the port's too (agent/market.py's helpers the worker calls, the submitter's budget watch)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from agent.node import Agent, AgentConfig
from agent.roles.port import RolePort, members
from protocol.identity import Identity

ROOT = Path(__file__).resolve().parents[2]
ROLES = ROOT / "agent" / "roles"


def _agent_names(tree: ast.AST) -> set[str]:
    """Local names bound to the agent (``agent = self.agent``) besides parameters called ``agent``."""
    names = {"agent"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _is_self_agent(node.value):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _is_self_agent(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "agent" and \
        isinstance(node.value, ast.Name) and node.value.id == "self"


def uses_of_the_agent(path: Path) -> list[tuple[int, str]]:
    """(line, member) for every attribute read or call on the agent in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    names = _agent_names(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if _is_self_agent(owner) or (isinstance(owner, ast.Name) and owner.id in names):
                out.append((node.lineno, node.attr))
    return out


def _is_agent(node: ast.AST, names: set[str]) -> bool:
    return _is_self_agent(node) or (isinstance(node, ast.Name) and node.id in names)


def _imported(tree: ast.AST) -> dict[str, str]:
    """Name -> module for every ``from agent.X import name`` in ``tree`` (module level or in a function)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("agent."):
            for alias in node.names:
                out[alias.asname or alias.name] = node.module
    return out


def _module_file(module: str) -> Path | None:
    path = ROOT / Path(*module.split("."))
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else None


def _agent_param(fn: ast.FunctionDef | ast.AsyncFunctionDef, position: int) -> str | None:
    params = fn.args.posonlyargs + fn.args.args
    return params[position].arg if position < len(params) else None


def handed_on(path: Path) -> list[tuple[int, str, str, int]]:
    """(line, module, function, position) for each function outside agent/roles that ``path`` hands the
    agent to: called with it, or passed beside it to a call (a task started with the agent as argument)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    names, imported = _agent_names(tree), _imported(tree)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        positions = [i for i, arg in enumerate(node.args) if _is_agent(arg, names)]
        if not positions:
            continue
        callee = node.func.id if isinstance(node.func, ast.Name) else None
        if callee in imported and not imported[callee].startswith("agent.roles"):
            out += [(node.lineno, imported[callee], callee, i) for i in positions]
        for i, arg in enumerate(node.args):  # fn(... , agent, ...) handed to a starter: agent is fn's first argument after fn
            if isinstance(arg, ast.Name) and arg.id in imported and not imported[arg.id].startswith("agent.roles"):
                out += [(node.lineno, imported[arg.id], arg.id, p - i - 1) for p in positions if p > i]
    return out


def uses_in_function(module: str, function: str, position: int, seen: set | None = None) -> list[tuple[str, str]]:
    """(where, member) for each use of the agent parameter at ``position`` of ``module.function``,
    following it into the module's other functions it is handed to."""
    seen = set() if seen is None else seen
    if (module, function, position) in seen or (path := _module_file(module)) is None:
        return []
    seen.add((module, function, position))
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    fn = defs.get(function)
    param = _agent_param(fn, position) if fn is not None else None
    if param is None:
        return [(f"{module}.{function}", "<not a function taking the agent>")]
    out = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == param:
            out.append((f"{path.relative_to(ROOT)}:{node.lineno} ({function})", node.attr))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in defs:
            for i, arg in enumerate(node.args):
                if isinstance(arg, ast.Name) and arg.id == param:
                    out += uses_in_function(module, node.func.id, i, seen)
    return out


def test_agent_satisfies_the_role_port(tmp_path):
    agent = Agent(Identity.generate(), AgentConfig(home=tmp_path))
    assert isinstance(agent, RolePort)
    missing = [name for name in members() if not hasattr(agent, name)]
    assert not missing, missing
    for name in members():  # methods of the port are methods of Agent (not data that happens to match)
        declared = getattr(RolePort, name, None)
        if callable(declared) and not isinstance(declared, property):
            assert callable(getattr(agent, name)), name


def test_roles_use_nothing_of_the_agent_outside_the_port():
    allowed = members()
    outside, total = [], 0
    files = sorted(p for p in ROLES.glob("*.py") if p.name != "port.py")
    assert {p.name for p in files} >= {"coordinator.py", "worker.py", "submitter.py", "sync.py"}
    for path in files:
        uses = uses_of_the_agent(path)
        total += len(uses)
        outside += [f"{path.name}:{line}: agent.{attr}" for line, attr in uses if attr not in allowed]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "agent.node":
                outside.append(f"{path.name}:{node.lineno}: imports agent.node")
    assert total > 100  # the check sees the roles' uses (it would pass vacuously otherwise)
    assert not outside, "\n".join(outside)


def test_what_the_roles_hand_the_agent_to_uses_only_the_port():
    """A role may hand its agent to a helper of another module (agent/market.py); the helper then
    reaches only the port too. The submitter's budget watch is the submitter role's own task."""
    allowed = members()
    outside, followed = [], set()
    for path in sorted(p for p in ROLES.glob("*.py") if p.name != "port.py"):
        for line, module, function, position in handed_on(path):
            followed.add((module, function))
            for where, attr in uses_in_function(module, function, position):
                if attr not in allowed:
                    outside.append(f"{path.name}:{line} -> {where}: agent.{attr}")
    # the helpers the worker hands its agent to are followed (the check sees them); record_shard_speed is
    # handed the agent's capabilities (agent/capability.py), not the agent
    assert ("agent.market", "worker_refusal") in followed, followed
    assert not outside, "\n".join(outside)
    submitter = (ROLES / "submitter.py").read_text(encoding="utf-8")
    assert "async def _watch_budget(self" in submitter and "wait_until(" in submitter


def test_the_check_follows_the_agent_into_a_task_it_is_handed_to(tmp_path, monkeypatch):
    """A role starting a task of another module with the agent (as the budget watch once was:
    ``spawn_in_job(job, watch_budget, agent, view)``) is followed into that function."""
    package = tmp_path / "agent"
    package.mkdir()
    (package / "helper.py").write_text(
        "async def watch(agent, view):\n    await agent.job_events.wait()\n    inner(agent)\n\n"
        "def inner(agent):\n    return agent.submitter, agent.peer_id\n")
    role = tmp_path / "role.py"
    role.write_text("from agent.helper import watch\n\nclass R:\n    def f(self, view):\n"
                    "        agent = self.agent\n        agent.spawn_in_job(view.job_id, watch, agent, view)\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    ((line, module, function, position),) = handed_on(role)
    assert (module, function, position) == ("agent.helper", "watch", 0)
    uses = {attr for _, attr in uses_in_function(module, function, position)}
    assert uses == {"job_events", "submitter", "peer_id"}
    assert uses - members() == {"job_events", "submitter"}


def test_the_static_check_catches_a_use_outside_the_port(tmp_path):
    role = tmp_path / "role.py"
    role.write_text("class R:\n    def f(self):\n        agent = self.agent\n        agent.nursery.start_soon(g)\n"
                    "        self.agent.publish(1)\n        return agent.jobs\n")
    assert {attr for _, attr in uses_of_the_agent(role) if attr not in members()} == {"nursery", "jobs"}


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
