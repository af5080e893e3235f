"""Issue 15 (13): the roles reach their agent through one narrow port (agent/roles/port.py RolePort).

Checked two ways: ``Agent`` satisfies the protocol structurally (every member, on a real Agent), and
a static check over the roles' source (AST) finds no member of the agent used outside the port and
no import of agent/node.py. A role that reaches past the port fails here, naming the file and line."""

from __future__ import annotations

import ast
from pathlib import Path

from agent.node import Agent, AgentConfig
from agent.roles.port import RolePort, members
from protocol.identity import Identity

ROLES = Path(__file__).resolve().parents[2] / "agent" / "roles"


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
