"""Durable before announced: a round's aggregate is held by the job's submitter before it is published.

Seen by an operator (issue 21 §2): the coordinator was killed just after it published a round's
aggregate. The bytes existed only on the dead coordinator: the submitter could not copy them, the
workers of the next round could not fetch their start, a successor could not fetch the round's
start either, and the job FAILED with all of the round's accepted work lost. Now the coordinator
asks the job's submitter to take a copy of the aggregate, and publishes the ``aggregate`` message
only once the submitter says it holds it (IPIP-0006 §2.6.1); likewise an accepted worker's adapter
before the verdict that accepts it (the soak found a round whose accepted adapter nobody alive held). A coordinator killed before that point
published nothing: its successor aggregates the round again from the accepted adapters (the
submitter, the workers and the verifier each hold a copy); after it, the submitter serves the
aggregate to the workers and to the successor.

Wire, one stream per request on ``/infernet/keep/1.0.0``:
    client → server: job ID (32 bytes) || round (4 bytes, big-endian) || CID (UTF-8, at most 128
                     bytes), then a half-close.
    server → client: one frame ``status (1 byte: 0 held, 1 refused) || reason (UTF-8)``, then ``uvarint(0)``.
The server is the job's submitter. It refuses unless it follows the job as its submitter, the
asking peer is an eligible coordinator of the job in its view, and the round is the one its mirror is
in (or the next, while its mirror lags); then it fetches the CID from the asking peer (every block
hash-checked, bounded as any aggregate bundle) and answers once the copy is on its disk, within
``TIMEOUT``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from agent.net.errors import NetError, PeerProtocolError
from agent.net.streams import FrameReader, frame, remote_peer, request_frames
from protocol.cid import parse_cid, varint_encode

if TYPE_CHECKING:
    from agent.net.stack import Network
    from agent.peers import PeerTable
    from agent.roles.port import Local

log = logging.getLogger(__name__)

PROTOCOL = "/infernet/keep/1.0.0"
MAX_CID = 128
TIMEOUT = 150.0  # the fetch (the agent's fetch_timeout, 120 s by default) and the answer
END = varint_encode(0)


class KeepRefused(Exception):
    """The submitter did not take a copy; ``str()`` says why."""


def encode_request(job_id: bytes, rnd: int, cid: str) -> bytes:
    data = cid.encode()
    if len(job_id) != 32 or not 0 <= rnd < 2**32 or not 0 < len(data) <= MAX_CID:
        raise ValueError("keep request: job ID of 32 bytes, round < 2**32, CID of 1..128 bytes")
    return job_id + rnd.to_bytes(4, "big") + data


def decode_request(data: bytes) -> tuple[bytes, int, str]:
    """PeerProtocolError for anything but a well-formed request naming a valid CID."""
    if not 37 <= len(data) <= 36 + MAX_CID:
        raise PeerProtocolError(f"{PROTOCOL}: request of {len(data)} bytes")
    try:
        cid = data[36:].decode()
        parse_cid(cid)
    except (UnicodeDecodeError, ValueError) as exc:
        raise PeerProtocolError(f"{PROTOCOL}: not a CID: {exc}") from None
    return data[:32], int.from_bytes(data[32:36], "big"), cid


async def ask_to_keep(net: "Network", view: Any, rnd: int, cid: str, timeout: float = TIMEOUT) -> None:
    """Ask the job's submitter to hold aggregate ``cid`` of round ``rnd`` (fetched from us); returns once
    it does. KeepRefused (its reason), NetError, PeerProtocolError or TooSlowError otherwise."""
    submitter = view.terms.submitter
    frames = await request_frames(net.host, submitter, PROTOCOL, encode_request(view.job_id, rnd, cid),
                                  max_frame=1024, max_frames=1, max_bytes=1024, what="answer", timeout=timeout)
    if not frames or frames[0][:1] != b"\x00":
        reason = frames[0][1:].decode(errors="replace") if frames else "no answer"
        raise KeepRefused(f"the submitter {submitter[-8:]} did not keep {cid}: {reason}")


class KeepService:
    """The submitter's side: take a copy of a round's aggregate when the job's coordinator asks.
    ``find_job``: the mirror of a job we follow, by ID (or None); ``keep_once``: the submitter role's
    one try at copying a CID of a job into its kept files (agent/roles/submitter.py)."""

    def __init__(self, local: "Local", peer_table: "PeerTable", find_job: Callable[[bytes], Any],
                 keep_once: Callable[[Any, str, str], Awaitable[None]]) -> None:
        self.local, self.peer_table = local, peer_table
        self.find_job = find_job
        self.keep_once = keep_once
        self.kept = 0
        self.asked: list[tuple[bytes, int, str]] = []  # (job, round, CID) of the requests heard, latest last
        # the test harness's: a submitter slow to answer a keep while the job aggregates (a kill then lands
        # between the aggregate's keep and its publication)
        self.answer_delay = 0.0

    def install(self, host: Any) -> None:
        host.set_handler(PROTOCOL, self.handle, timeout=TIMEOUT)

    async def handle(self, stream: Any) -> None:
        reader = FrameReader(stream, chunk=256)
        data = b""
        while len(data) <= 36 + MAX_CID and not await reader.at_eof():
            data += await reader.read_exactly(1, f"{PROTOCOL} request")
        job_id, rnd, cid = decode_request(data)
        peer = remote_peer(stream)
        self.asked = self.asked[-63:] + [(job_id, rnd, cid)]
        refusal = self.refusal(job_id, rnd, peer)
        if refusal is None:
            try:
                await self.keep_once(self.find_job(job_id), cid, peer)
                self.kept += 1
            except Exception as exc:  # noqa: BLE001 - the answer says why; the coordinator tries again
                refusal = f"the copy failed: {type(exc).__name__}: {str(exc)[:300]}"
        if refusal is not None:
            log.info("job %s: did not keep round %d's aggregate %s for %s: %s", job_id.hex()[:8], rnd, cid,
                     peer[-8:], refusal)
        answer = b"\x00held" if refusal is None else b"\x01" + refusal.encode()[:1000]
        view = self.find_job(job_id)
        if self.answer_delay and view is not None and view.state.phase.value == "AGGREGATING":
            await trio.sleep(self.answer_delay)
        await stream.write(frame(answer) + END)

    def refusal(self, job_id: bytes, rnd: int, peer: str) -> str | None:
        """Why we do not take a copy for ``peer`` (None: we do)."""
        view = self.find_job(job_id)
        if view is None or view.terms.submitter != self.local.peer_id:
            return "this agent is not the submitter of a job it follows with that ID"
        if peer not in self.peer_table.eligible_coordinators(view.terms):
            return "the asking peer is not an eligible coordinator of the job here"
        if view.state.terminal:
            return f"the job has ended ({view.state.phase.value})"
        if rnd not in (view.state.round, view.state.round + 1):
            return f"round {rnd} is not the job's current round ({view.state.round})"
        return None


KEEP_RETRY = 2.0  # seconds between asks while the window lasts


async def keep_within(local: "Local", net: Callable[[], "Network"], view: Any, rnd: int, cid: str, *, still_ours: Callable[[], bool],
                      window_end: float | None) -> None:
    """``keep_before_publishing``, asked again every KEEP_RETRY seconds while ``still_ours()`` and the
    window (ending at ``window_end`` on the agent's clock) lasts; the last KeepRefused otherwise. (A
    submitter back from a restart found its round failed when the next try was 30 s off.)"""
    while True:
        try:
            await keep_before_publishing(local, net(), view, rnd, cid)
            return
        except KeepRefused as exc:
            if not still_ours() or (window_end is not None and local.clock() + KEEP_RETRY >= window_end):
                raise
            local.counters["keeps_retried"] += 1
            log.info("job %s: %s not published yet, asking the submitter again in %.0f s: %s",
                     view.job_id.hex()[:8], cid[:24], KEEP_RETRY, exc)
            await trio.sleep(KEEP_RETRY)


async def keep_before_publishing(local: "Local", net: "Network", view: Any, rnd: int, cid: str) -> None:
    """The coordinator's step before it publishes round ``rnd``'s aggregate, or a verdict accepting an
    adapter, ``cid``: the submitter holds a copy (nothing to ask when we are the submitter). Raises as ``ask_to_keep`` does: the
    caller's retry loop tries again, and nothing is published meanwhile."""
    if view.terms.submitter == local.peer_id:
        return
    try:
        await ask_to_keep(net, view, rnd, cid)
    except (NetError, PeerProtocolError, trio.TooSlowError) as exc:
        raise KeepRefused(f"could not reach the submitter {view.terms.submitter[-8:]} to keep {cid}: {exc}") from None
