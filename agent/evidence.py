"""Evidence: what the agent says on a job's topic and keeps as proof of it, in one commit order.

Rules of this file:
- One service with one job (issue 23: the agent as a few services). ``commit`` is the one place where
  what a job's mirror did (protocol/mirror.py ``Outcome``) reaches the world, always in this order:
  store its evidence (one transaction, agent/writer.py), publish what goes out, then carry out its
  actions and the roles' reactions (``changed``, the agent's). A crash at any point leaves nothing
  published that is not stored.
- ``decide``: our own decision as a job's coordinator or judge (a lease, a verdict, an aggregate) is
  signed, applied to our mirror, stored, published, then carried out: stored when we make it, not when
  its gossip echo comes back.
- ``publish``: a message no mirror of ours applies first (a claim, our worker's checkpoint, report or
  release, a cancel); the mirror applies it, and it is stored, when it comes back to us.
- The rest is the store writer's (``ledger``, ``save_job_row``, ``can_take_work``, ``store_full``): a
  role that keeps evidence sees whether it can.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from agent.net.stack import Network
    from agent.writer import StoreWriter
    from protocol.mirror import JobMirror, Outcome


class Evidence:
    def __init__(self, writer: "StoreWriter", clock: Callable[[], float], net: Callable[[], "Network | None"],
                 changed: Callable[["JobMirror", tuple[Any, ...], list[tuple[Any, str]]], None]) -> None:
        self.writer = writer
        self.clock = clock
        self.net = net  # a getter: the network exists once the agent runs
        self.changed = changed  # carry out a mirror's actions and our roles' reactions (agent/node.py)
        self.ledger = writer.ledger
        self.save_job_row = writer.save_job_row
        self.can_take_work = writer.can_take_work

    @property
    def store_full(self) -> str | None:
        """Why we refuse new work (our store or work directory cannot be written), or None."""
        return self.writer.store_full

    async def publish(self, message: Any) -> None:
        await self.net().gossip.publish(message)

    async def decide(self, view: "JobMirror", decision: Any) -> bool:
        """Our own decision as the job's coordinator or judge (a lease, a verdict, an aggregate): signed,
        applied to our mirror, stored, published, then carried out (``commit``). False if the mirror
        refused it (it moved on meanwhile) or the disk is full: then it was not published."""
        gossip = self.net().gossip
        outcome = view.decide(decision, self.clock(), gossip.seal(decision))
        return outcome.changed and await self.commit(view, outcome)

    async def commit(self, view: "JobMirror", outcome: "Outcome", *, act: bool = True) -> bool:
        """Store the outcome's evidence, publish what goes out, then carry out its actions and our
        roles' reactions (``act=False``: history, nothing to carry out). False (we refuse new work;
        nothing published, nothing carried out: the mirror moved, a restart catches up) if the disk is full."""
        if outcome.evidence and not await self.writer.store_evidence(outcome.evidence):
            return False
        if outcome.outgoing is not None:  # our decision: the first message its outcome applied (JobMirror.decide)
            await self.net().gossip.publish_sealed(outcome.applied[0][0], outcome.outgoing)
        if act and outcome.changed:
            self.changed(view, outcome.actions, list(outcome.applied))  # this message and any held one it unblocked
        return True
