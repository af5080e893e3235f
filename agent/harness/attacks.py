"""What the harness's attacker (``mallory``) sends. Mallory is a real agent with a valid identity that
publishes whatever it likes: its own validator is set aside for the topic while it sends, so bytes
that honest agents must refuse really leave it (as a modified client's would).

Kinds (``count`` messages each):
- ``replay``: job-topic envelopes signed by others, captured earlier, re-published (the signer is
  not the sender: ``wrong-signer``); and one claim of mallory's own sent again and again
  (``replayed``).
- ``spoof``: leases and verdicts for the job signed by a fresh key (``wrong-signer``), and by
  mallory itself in a made-up term (valid envelopes, refused by every mirror: not the coordinator).
- ``stale``: claims, reports and releases for a round that is over (refused by every mirror).
- ``malformed``: garbage, truncated and non-canonical envelopes, a signed envelope with an extra field.
- ``oversize``: 300 KiB messages (the envelope limit is 256 KiB).
- ``claim_flood``: valid claims for the job's shards as fast as mallory can send (a peer that never
  said it trains gets no lease; the senders' rate limit holds the rest).
- ``flood``: valid heartbeats on the jobs topic as fast as mallory can send.
"""

from __future__ import annotations

import logging
import os
import random
import time
from typing import Any

import trio

from protocol import messages as m
from protocol.codec import canonical_encode, decode_canonical
from protocol.envelope import MAX_ENVELOPE_BYTES, seal
from protocol.identity import Identity

log = logging.getLogger(__name__)


class _RawSender:
    def __init__(self, mallory: Any) -> None:
        self.gossip = mallory.net.gossip
        self.identity = mallory.identity
        self.sent = 0
        self.failed = 0

    async def send(self, topic: str, data: bytes) -> None:
        pubsub = self.gossip.pubsub
        await self.gossip._wait_for_queue_room()  # as fast as the network takes it, not dropped at home
        if topic in pubsub.topic_validators:
            pubsub.remove_topic_validator(topic)
        try:
            await pubsub.publish(topic, data)
            self.sent += 1
        except Exception as exc:  # noqa: BLE001 - a peer went away mid-publish: the attack goes on
            self.failed += 1
            log.debug("mallory: publish failed: %r", exc)
        finally:
            pubsub.set_topic_validator(topic, self.gossip._validator_for(topic), False)
        if self.sent % 20 == 0:
            await trio.sleep(0)  # let the host's tasks run between bursts

    def seal(self, message: Any, identity: Identity | None = None, now: float | None = None) -> bytes:
        return seal(identity or self.identity, message, now=time.time() if now is None else now)


async def attack(run: Any, kind: str, count: int) -> int:
    """Send ``count`` messages of ``kind`` from mallory; the number actually handed to its router."""
    mallory = run.net.agents["mallory"]
    view = run.view
    job_id = view.job_id
    topic = m.job_topic(job_id)
    out = _RawSender(mallory)
    rng = random.Random(run.seed)
    shards = len(view.terms.shards)
    state = view.state
    if kind == "replay":
        captured = [c for c in run.captured]
        for i in range(min(count, len(captured))):
            await out.send(topic, captured[i])
        own = out.seal(m.ShardClaim(job_id, state.round, 0))
        await out.send(topic, own)  # valid once ...
        for _ in range(max(1, count - len(captured))):
            await out.send(topic, own)  # ... then replays
    elif kind == "spoof":
        stranger = Identity(os.urandom(32))
        for i in range(count):
            shard = i % shards
            lease = m.ShardLease(job_id, state.round, shard, 1, mallory.peer_id,
                                 view.coordination.term + 1 + i, time.time() + 3600, None)
            verdict = m.Verdict(job_id, state.round, shard, 1, mallory.peer_id, view.coordination.term + 1,
                                True, "", ())
            await out.send(topic, out.seal(lease, stranger))  # signed by someone else
            await out.send(topic, out.seal(lease))  # signed by mallory, who is nobody's coordinator
            await out.send(topic, out.seal(verdict))
    elif kind == "stale":
        old = max(1, state.round - 1)
        for i in range(count):
            shard = i % shards
            await out.send(topic, out.seal(m.ShardClaim(job_id, old, shard)))
            await out.send(topic, out.seal(m.ShardRelease(job_id, old, shard, 1, "stale")))
            await out.send(topic, out.seal(m.ShardReport(
                job_id, old, shard, 1, view.terms.shards[shard].cid, view.terms.shards[shard].cid, bytes(32),
                1, 1, 1, 0.0, {})))
    elif kind == "malformed":
        valid = decode_canonical(out.seal(m.ShardClaim(job_id, state.round, 0)), max_bytes=MAX_ENVELOPE_BYTES)
        extra = dict(valid, x=1)
        for i in range(count):
            choice = i % 4
            if choice == 0:
                data = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 200)))
            elif choice == 1:
                data = out.seal(m.ShardClaim(job_id, state.round, 0))[: rng.randint(1, 60)]
            elif choice == 2:
                data = canonical_encode(extra)
            else:
                data = b"\xc1" + os.urandom(16)
            await out.send(topic, data)
    elif kind == "oversize":
        for _ in range(count):
            await out.send(topic, b"\x81\xa1v\x01" + os.urandom(300 * 1024))
    elif kind == "claim_flood":
        for i in range(count):
            await out.send(topic, out.seal(m.ShardClaim(job_id, state.round, rng.randrange(shards))))
    elif kind == "flood":
        for i in range(count):
            await out.send(m.TOPIC_JOBS, out.seal(m.Heartbeat(10_000_000 + i, 0, ())))
    else:
        raise ValueError(kind)
    return out.sent
