"""The import graph of agent/ and protocol/ (issue 23): no import circle, no private name of another module.

Every import statement counts, wherever it is: at the top, inside a function, under ``if TYPE_CHECKING:``.
An import inside a function hides a circle from Python (it runs later), not from a reader: each feature
is split into its rule (protocol/), its service (agent/) and its text (the CLI), and a lower module never
imports a higher one. Read off the source with ``ast``; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("agent", "protocol")

# Import edges that would close a circle but live in a file this change could not edit, each named
# precisely (importer, imported). Empty: there is none.
ALLOWED_CIRCLE_EDGES: frozenset[tuple[str, str]] = frozenset()

# Private names of other modules that may be imported, each (importer, module, name).
ALLOWED_PRIVATE: frozenset[tuple[str, str, str]] = frozenset({
    # py-libp2p has no public way to read a host's TCP listen addresses for hole punching
    ("agent.net.reach", "libp2p.relay.circuit_v2.dcutr", "_local_tcp_listen_addrs"),
})


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _ours(name: str, known: dict[str, Path]) -> str | None:
    """The module of ours that importing ``name`` loads (a name inside a module counts as the module)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(known: dict[str, Path]) -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """Each module's imports of our modules, and every ``from X import _name`` of a private name."""
    edges: dict[str, set[str]] = {name: set() for name in known}
    private = []
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{alias.name}" for alias in node.names]
                for alias in node.names:
                    if (alias.name.startswith("_") and not alias.name.startswith("__")
                            and f"{base}.{alias.name}" not in known):
                        private.append((name, base, alias.name))
            else:
                continue
            for target in targets:
                ours = _ours(target, known)
                if ours is not None and ours != name:
                    edges[name].add(ours)
    return edges, private


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_graph_is_read():
    known = modules()
    edges, _ = imports(known)
    assert {"agent.node", "agent.market", "agent.cli", "protocol.state"} <= set(known)
    assert "agent.market" in edges["agent.node"]  # an import at the top
    assert "agent.jobdata" in edges["agent.control"]  # an import inside a function
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_among_our_modules():
    edges, _ = imports(modules())
    for importer, imported in ALLOWED_CIRCLE_EDGES:
        edges[importer].discard(imported)
    found = circles(edges)
    detail = ["; ".join(f"{a} -> {b}" for a in c for b in sorted(edges[a]) if b in c) for c in found]
    assert not found, "import circles (counting imports inside functions): " + " | ".join(detail)


def test_protocol_imports_nothing_of_the_agent():
    edges, _ = imports(modules())
    upward = sorted((a, b) for a, targets in edges.items() if a.startswith("protocol")
                    for b in targets if b.startswith("agent"))
    assert not upward, f"protocol/ must not import agent/: {upward}"


def test_no_private_name_of_another_module_is_imported():
    _, private = imports(modules())
    found = sorted(set(private) - ALLOWED_PRIVATE)
    assert not found, "private names imported from another module (make them public or move them): " + ", ".join(
        f"{importer} imports {module}.{name}" for importer, module, name in found)


def test_no_role_writes_the_agents_state():
    """Issue 23: the roles (and the market functions they call with the agent) read the agent through
    their port and ask it to change (``refresh_machine``, ``reload_speeds``); none assigns an attribute
    of it (the worker set ``agent.machine``, the market ``agent.speeds``)."""
    files = sorted((ROOT / "agent" / "roles").glob("*.py")) + [ROOT / "agent" / "market.py"]
    writes = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:  # (counting a metric, ``agent.counters[...] += 1``, is the port's counters)
                for part in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(part, ast.Attribute) and (
                            isinstance(part.value, ast.Name) and part.value.id == "agent" or
                            isinstance(part.value, ast.Attribute) and part.value.attr == "agent"):
                        writes.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(target)}")
    assert not writes, writes
