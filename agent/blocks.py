"""Blocks: the content a role fetches and adds, kept from collection and announced in the DHT.

Rules of this file:
- One service with one job (issue 23: the agent as a few services): ``content`` is the agent's
  content service (agent/content/service.py: fetch with bounds, add files), open while the agent
  runs; ``hold`` keeps a block no message names yet from collection (agent/disk.py); ``provide_soon``
  announces that we hold a CID, in the background (at most 30 s, a failure logged): nothing we must
  send waits on one DHT peer, and those who need it first are told our peer ID.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from agent.content.service import ContentService
    from agent.net.stack import Network
    from agent.tasks import Tasks

log = logging.getLogger(__name__)


class Blocks:
    def __init__(self, content: Callable[[], "ContentService | None"], net: Callable[[], "Network | None"],
                 tasks: "Tasks", hold: Callable[[bytes, int, Any], None]) -> None:
        self._content, self._net, self._tasks = content, net, tasks  # getters: both exist once the agent runs
        self.hold = hold

    @property
    def content(self) -> "ContentService":
        return self._content()

    def provide_soon(self, cid: Any) -> None:
        """Announce in the DHT that we hold ``cid`` (a CID or its text), in the background (at most 30 s,
        failures logged)."""
        if isinstance(cid, str):  # an early aggregate's and a converted dataset's come as text
            from protocol.cid import parse_cid

            cid = parse_cid(cid)

        async def provide() -> None:
            try:
                await self._net().discovery.provide(cid)
            except Exception as exc:  # noqa: BLE001 - best effort: the message names us as provider
                log.info("provide %s: %s", cid, exc)

        self._tasks.nursery.start_soon(provide)
