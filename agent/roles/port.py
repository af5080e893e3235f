"""What the roles are built with: each role gets the few services it uses, typed, never the agent.

Issue 23: a role is built with the 3-6 collaborators it uses, each a service of the agent with one job
(agent/node.py builds them and the roles), and no role writes the state of another:

| role | collaborators |
|---|---|
| coordinator (agent/roles/coordinator.py) | ``Local``, ``PeerTable``, ``Tasks``, ``Blocks``, ``Evidence``, the network |
| worker (agent/roles/worker.py) | ``Local``, ``PeerTable``, ``Tasks``, ``Blocks``, ``Evidence``, ``JobBook`` (+ the harness's training hook) |
| submitter (agent/roles/submitter.py) | ``Local``, ``PeerTable``, ``Tasks``, ``Blocks``, ``Evidence``, ``Following`` |
| keep (agent/roles/keep.py) | ``Local``, ``PeerTable``, the job book's lookup, the submitter's copy (the coordinator's side, ``keep_within``, takes the network) |
| history sync (agent/roles/sync.py ``JobSync``) | ``PeerTable``, ``Tasks``, ``StoreWriter``, the network, ``Evidence.commit`` |

- ``Local`` (below): who we are and what we run with: peer ID, settings, clock, counters, what we offer.
- ``PeerTable`` (agent/peers.py): the peers we hear, who is live, who may coordinate a job, whether we
  act as its coordinator now, the workers' reputations.
- ``Tasks`` (agent/tasks.py): a job's tasks (``spawn_in_job``: ending the job ends them), the agent's
  own (``spawn``: keeping a copy of accepted work outlives the job), and waits on other peers or a
  job's progress (``wait_until``: woken by job changes and heartbeats, with a deadline), not sleeps.
- ``Blocks`` (agent/blocks.py): content fetched and added, held from collection, announced.
- ``Evidence`` (agent/evidence.py): what we publish and keep, in the one commit order; the ledger.
- ``JobBook`` (agent/jobbook.py): our live mirror of a followed job; ``Following`` (agent/following.py):
  following a job we announce, and our unended jobs.
tests/roles/test_port.py checks it: each role's constructor takes at most six collaborators, each
typed, none the agent, and no role assigns an attribute of one of them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from agent.capability import Capabilities
    from agent.config import AgentConfig


@dataclass
class Local:
    """Who we are and what we run with. ``config`` is read, never written by a role (the agent replaces
    it whole: agent/node.py ``Agent.config``); ``counters`` are the metrics the roles count."""

    peer_id: str
    config: "AgentConfig"
    clock: Callable[[], float]
    capabilities: "Capabilities"
    counters: Counter[str] = field(default_factory=Counter)

    @property
    def work_dir(self) -> Path:
        return self.config.home / "work"
