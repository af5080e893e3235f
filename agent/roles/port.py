"""RolePort: all that the roles (worker, coordinator, submitter, sync) may use of the agent that
runs them. ``agent.node.Agent`` satisfies it structurally; the roles are typed against it and
never import agent/node.py, so a role can be read (and tested) knowing only this port.
tests/roles/test_port.py checks both: ``Agent`` has every member, and the roles reach no other.

Tasks: a role starts a task of a job with ``spawn_in_job`` (owned by the job: ending the job ends
them, agent/node.py ``Agent._own_job_tasks``) and a task of the agent's own with ``spawn`` (keeping
a copy of accepted work outlives the job). Waits on other peers or a job's progress use
``wait_until`` (woken by job changes and heartbeats, with a deadline), not sleeps in a loop.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:
    from agent.capability import Capabilities
    from protocol.mirror import JobMirror, Outcome
    from protocol import messages as m


@runtime_checkable
class RolePort(Protocol):
    # -- identity, settings, time --------------------------------------------------------------------
    peer_id: str
    config: Any  # agent/node.py AgentConfig (read only)
    clock: Callable[[], float]
    counters: Counter[str]  # metrics the roles count

    @property
    def work_dir(self) -> Path: ...

    # what we offer (agent/capability.py): the machine, the base models we hold and our speed on each, our
    # capability now (read only: a worker asks ``refresh_machine``, records a shard's speed with
    # agent/market.record_shard_speed, which saves it and asks ``reload_speeds``, hashes a model with
    # ``base_model_hash``, finds a job's base model with ``local_model``)
    capabilities: "Capabilities"

    # -- peers and election --------------------------------------------------------------------------
    peers: Mapping[str, Any]  # peer ID -> PeerInfo (last heartbeat, capability)
    reputations: Any  # agent/market.Reputations

    def live_peers(self) -> frozenset[str]: ...
    def eligible_coordinators(self, terms: "m.JobTerms | None" = None) -> frozenset[str]: ...
    def is_coordinator(self, view: "JobMirror") -> bool: ...
    def hears_submitter(self, view: "JobMirror", *, settled: bool = False) -> bool: ...

    # -- gossip, decisions, evidence -----------------------------------------------------------------
    async def publish(self, message: Any) -> None: ...
    # what a mirror did reaches the world only here (store the evidence, publish, then act: agent/node.py)
    async def commit(self, view: "JobMirror", outcome: "Outcome", *, act: bool = True) -> bool: ...
    async def decide(self, view: "JobMirror", decision: Any) -> bool: ...  # our own lease, verdict, aggregate
    def followed_view(self, job_id: bytes) -> "JobMirror | None": ...  # our live mirror of a job we follow
    async def follow_job(self, terms: "m.JobTerms", signer: str,
                         envelope: bytes | None = None) -> "JobMirror | None": ...
    def save_job_row(self, view: "JobMirror") -> None: ...
    def unended_jobs(self, submitter: str) -> list[bytes]: ...  # the followed jobs of ``submitter`` not ended
    def ledger(self, job_id: bytes, kind: str, data: dict) -> None: ...
    store: Any  # agent/store.Store: the job's envelopes (sync reads them)
    store_full: str | None  # why we refuse new work, if we do
    async def can_take_work(self) -> bool: ...

    # -- content and network -------------------------------------------------------------------------
    content: Any  # agent/content/service.ContentService: fetch, add_file
    def hold(self, job_id: bytes, rnd: int, cid: Any) -> None: ...  # keep an added block from collection
    net: Any  # agent/net/stack.Network: sync opens streams on its host
    def provide_soon(self, cid: Any) -> None: ...

    # -- tasks and waits -----------------------------------------------------------------------------
    def spawn_in_job(self, job_id: bytes, fn: Callable[..., Awaitable[Any]], *args: Any) -> bool: ...
    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None: ...
    async def wait_until(self, predicate: Callable[[], bool], timeout: float) -> bool: ...


def members() -> frozenset[str]:
    """The names a role may reach on its agent."""
    names = set(getattr(RolePort, "__protocol_attrs__", ()) or ())
    if not names:  # Python < 3.12
        from typing import _get_protocol_attrs  # type: ignore[attr-defined]

        names = set(_get_protocol_attrs(RolePort))
    return frozenset(names)
