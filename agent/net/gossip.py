"""Signed gossip: GossipSub v1.1 topics whose every message is a checked envelope.

Rules of this file:
- Every message on a subscribed topic passes ``Gossip._validate`` at every hop before py-libp2p
  delivers or forwards it. It applies the envelope rules of protocol/envelope.py (size, version,
  signature, skew, replay) with ``expected_signer`` = the libp2p message source (``from``, itself
  covered by py-libp2p's strict message signing), then checks that the message type belongs on the
  topic it came on (``protocol.messages.topic_for``). A message that fails is dropped, never
  forwarded, and counted against the peer that handed it to us (``invalid``, ``reasons``); a peer
  with ``blacklist_after`` invalid messages is blacklisted (py-libp2p drops its traffic). An
  ``expired`` or ``replayed`` envelope is counted in ``reasons`` only (protocol/envelope.blames_forwarder):
  on subscribing, a peer gets each neighbour's recent-message cache, old envelopes included, and
  relays what it gets to peers that may hold it already; a late joiner that blamed them blacklisted the
  whole network, and a network that blamed the newcomer blacklisted it. py-libp2p remembers seen
  messages for ``SEEN_TTL_S`` (the envelope window, not its 120 s default) and its router runs as a
  service, so its heartbeat shifts the recent-message cache (3 heartbeats are offered to a new
  subscriber, not every message since the start). We never hand a peer an envelope our
  clock says is past the window from what py-libp2p keeps for later: its recent-message cache
  (``_FreshMessageCache``: the replay to a new subscriber, IHAVE gossip, IWANT answers) and its queue
  of messages published while a new peer was being identified (``_FreshRouter``). What every
  receiver would drop is not sent at all.
- The validator is synchronous and never raises: py-libp2p checks "seen" and marks "seen" around it
  without a checkpoint in between only when it is synchronous, and an exception escaping it would
  cancel the whole pubsub service.
- Library defaults that would eat our own traffic are off: the heartbeat is ``heartbeat_interval``
  (1 s, not 120 s), and GossipSub's spam protection (10 msg/s per topic and forwarder, counting our
  own publishes) is replaced by our own token bucket per message source (``max_rate``): a peer
  that floods is cut off at the first hop, and the honest peers that relay for it are not
  throttled for what they relay (a per-forwarder limit would make every relay of a flood pay).
- py-libp2p drops an outbound RPC when a peer's 32-slot send queue is full (as go-libp2p-pubsub
  does). Our own publishes wait for room instead (``publish_wait``), but only while the full queue
  drains: a stalled peer (its queue has not moved for ``STALLED_SECONDS``) is never waited for;
  relayed messages can still be dropped under a flood, and GossipSub's gossip (IHAVE/IWANT)
  repairs that within its window.
- Delivery order is not promised: py-libp2p validates each received message in its own task, and
  gossip may bring a message by another path. Consumers order by the messages' own fields.
- ``Gossip.faults`` (the protocol test harness only, never set in production) acts on messages
  *after* validation, as a hostile network would: it may drop, duplicate, delay (and so reorder)
  them, or drop everything signed by peers on the other side of a partition. The roles above must
  cope with all of it; a forged message still never gets past validation.
- py-libp2p attaches the sender's signed peer record to every RPC and, on every receipt, checks its
  Ed25519 signature and clears and re-adds the peer's addresses. A record byte-for-byte the one this
  host last accepted from that peer, less than ``RECORD_RECHECK_SECONDS`` ago, is taken as accepted
  (``_check_each_peer_record_once``): the same bytes verify the same way, and a newer record differs.
- Validated messages go straight into a channel of ours per topic (``delivery_buffer`` slots),
  bypassing py-libp2p's 32-slot subscription channel, which drops silently when a burst outruns
  its reader. When ours fills, the drop is counted (``dropped``) and logged, never silent.
"""

from __future__ import annotations

import logging
import random
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import trio
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID as GOSSIPSUB_V10
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11 as GOSSIPSUB_V11
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.mcache import MessageCache, default_msg_id_fn
from libp2p.pubsub import gossipsub as _gossipsub_module
from libp2p.pubsub import pubsub as _pubsub_module
from libp2p.pubsub.pubsub import Pubsub

from agent.net.host import Host
from protocol.envelope import (
    SEEN_TTL_S, Envelope, ReplayCache, blames_forwarder, envelope_expiry, open_envelope, seal,
)
from protocol.errors import CodecError
from protocol.messages import topic_for

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GossipConfig:
    heartbeat_interval: int = 1  # seconds; py-libp2p's default of 120 s leaves meshes unrepaired for minutes
    degree: int = 6
    degree_low: int = 4
    degree_high: int = 12
    max_rate: float = 200.0  # messages per second accepted from one source (the signing peer) ...
    max_burst: float = 400.0  # ... with this much burst
    blacklist_after: int = 50  # invalid messages before a peer is blacklisted
    delivery_buffer: int = 4096  # our per-topic channel (py-libp2p's holds 32)
    publish_wait: float = 5.0  # longest a publish waits for room in peers' outbound queues


QUEUE_HIGH_WATER = 24  # of py-libp2p's 32 outbound RPCs per peer
STALLED_SECONDS = 0.5  # a full outbound queue that has not shrunk this long belongs to a stalled peer


@dataclass
class GossipFaults:
    """Faults the harness injects into what this agent receives (see the rules above)."""

    drop: float = 0.0  # probability a delivered message is lost
    duplicate: float = 0.0  # probability it is delivered twice
    delay: tuple[float, float] = (0.0, 0.0)  # uniform delay in seconds; a spread reorders messages
    blocked: frozenset[str] = frozenset()  # signers cut off from us (a partition), until healed
    seed: int = 0
    rng: random.Random = field(init=False, repr=False)
    injected: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def plan(self, signer: str) -> list[float]:
        """Delays of the copies to deliver ([] = the message is lost)."""
        if signer in self.blocked:
            self.injected["partitioned"] += 1
            return []
        if self.rng.random() < self.drop:
            self.injected["dropped"] += 1
            return []
        copies = 2 if self.rng.random() < self.duplicate else 1
        self.injected["duplicated"] += copies - 1
        low, high = self.delay
        delays = [self.rng.uniform(low, high) if high > 0 else 0.0 for _ in range(copies)]
        self.injected["delayed"] += sum(1 for d in delays if d > 0)
        return delays


@dataclass(frozen=True)
class Received:
    """A verified message as delivered to a subscriber."""

    topic: str
    message: Any
    envelope: Envelope
    forwarder: str  # the peer that handed it to us

    @property
    def signer(self) -> str:
        return self.envelope.signer


class _TokenBuckets:
    """Per-peer token bucket: ``rate`` tokens per second, at most ``burst`` saved up."""

    MAX_PEERS = 4096

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self._state: dict[str, tuple[float, float]] = {}

    def allow(self, peer: str, now: float) -> bool:
        tokens, last = self._state.get(peer, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        if len(self._state) > self.MAX_PEERS:  # forget idle peers (their bucket is full anyway)
            self._state = {p: s for p, s in self._state.items() if now - s[1] < self.burst / self.rate}
        if tokens < 1.0:
            self._state[peer] = (tokens, now)
            return False
        self._state[peer] = (tokens - 1.0, now)
        return True


class _FreshMessageCache(MessageCache):
    """py-libp2p's recent-message cache, which never offers an envelope past the acceptance window by
    our clock (IPIP-0001 §4): the replay to a new subscriber (``send_recent_messages``), IHAVE gossip
    and IWANT answers all read it through ``window`` and ``get``. Every receiver would drop such an
    envelope as ``expired``; a cache holds one when the heartbeat that shifts it was held up, or when
    our clock stepped forward."""

    def __init__(self, window_size: int, history_size: int, clock: Callable[[], float]) -> None:
        super().__init__(window_size, history_size)
        self._clock = clock
        self._expires: dict[bytes, float] = {}  # message ID -> when its envelope leaves the window

    def put(self, msg: Any) -> None:
        super().put(msg)
        mid = default_msg_id_fn(msg)
        if mid in self.msgs and mid not in self._expires:
            self._expires[mid] = envelope_expiry(msg.data)

    def get(self, mid: bytes) -> Any:
        msg = super().get(mid)
        return None if msg is None or self._expired(mid) else msg

    def window(self, topic: str) -> list[bytes]:
        return [mid for mid in super().window(topic) if not self._expired(mid)]

    def shift(self) -> None:
        dropped = [entry.mid for entry in self.history[-1]]
        super().shift()
        for mid in dropped:
            if mid not in self.msgs:
                self._expires.pop(mid, None)

    def _expired(self, mid: bytes) -> bool:
        return self._clock() > self._expires.get(mid, float("inf"))


class _FreshRouter(GossipSub):
    """GossipSub whose queue of messages published while a new peer was being identified (flushed to
    it once it subscribes, ``flush_pending_messages``) drops envelopes past the window by our clock.
    (py-libp2p 0.8.1 prunes that queue, by its own 30 s TTL, in ``_prune_pending_messages`` before
    every flush; we prune there too.)"""

    clock: Callable[[], float] = time.time

    def _prune_pending_messages(self, peer_id: ID) -> None:
        super()._prune_pending_messages(peer_id)
        queue = self._pending_messages.get(peer_id)
        if queue:
            now = self.clock()
            queue[:] = [(at, rpc) for at, rpc in queue if any(now <= envelope_expiry(p.data) for p in rpc.publish)]
            if not queue:
                self._pending_messages.pop(peer_id, None)


class _GuardedPubsub(Pubsub):
    """Pubsub whose per-message task cannot take the service down, delivering into our channels.

    ``notify_subscriptions`` hands each validated message to ``deliver`` (Gossip._deliver) instead
    of py-libp2p's 32-slot subscription channel, which drops silently when full.

    py-libp2p runs ``push_msg`` for each received message as a service task; an exception there
    (e.g. a malformed ``key`` field in a peer's RPC reaching ``deserialize_public_key``) cancels
    the whole Pubsub service. Errors from remote messages are counted and dropped instead.
    """

    remote_errors: int = 0
    deliver: Callable[[Any], None]

    async def stream_handler(self, stream: Any) -> None:
        # py-libp2p reads each RPC's length prefix one byte per stream read, and every Yamux read
        # may answer with a window update: buffered reads cut the frames per message several-fold
        await super().stream_handler(BufferedReads(stream))

    async def _teardown_if_connected(self, peer_id: ID) -> None:
        # py-libp2p's deletes the peer after an await, and a peer that went away meanwhile made it
        # raise KeyError into the service (seen when a late joiner blacklisted two peers at once)
        stream = self.peers.pop(peer_id, None)
        if stream is not None:
            try:
                await stream.reset()
            except Exception:  # noqa: BLE001 - the stream is gone either way
                pass
        self._forget_all_subscriptions(peer_id)

    def notify_subscriptions(self, publish_message: Any) -> None:
        self.deliver(publish_message)

    async def push_msg(self, msg_forwarder: ID, msg: Any) -> None:
        if msg_forwarder == self.my_id:
            await super().push_msg(msg_forwarder, msg)
            return
        try:
            await super().push_msg(msg_forwarder, msg)
        except Exception as exc:  # noqa: BLE001
            self.remote_errors += 1
            log.debug("dropped a message from %s that broke py-libp2p: %r", msg_forwarder, exc)


RECORD_RECHECK_SECONDS = 600.0  # a peer record seen again is verified and stored anew after this (its TTL is 2 h)


def _check_each_peer_record_once() -> None:
    """Verify a peer's signed peer record (py-libp2p's ``maybe_consume_signed_record``) when its bytes
    change, not on every RPC that carries it. Per host: agents that share a process (the harness)
    keep their own peerstores."""
    consume = _pubsub_module.maybe_consume_signed_record
    if getattr(consume, "infernet_once", False):
        return
    accepted: weakref.WeakKeyDictionary[Any, dict[ID, tuple[bytes, float]]] = weakref.WeakKeyDictionary()

    def consume_once(msg: Any, host: Any, peer_id: ID) -> bool:
        if not msg.HasField("senderRecord"):
            return True
        record, now = msg.senderRecord, time.monotonic()
        known = accepted.setdefault(host, {})
        last = known.get(peer_id)
        if last is not None and last[0] == record and now - last[1] < RECORD_RECHECK_SECONDS:
            return True
        if not consume(msg, host, peer_id):
            return False
        known[peer_id] = (record, now)
        return True

    consume_once.infernet_once = True  # type: ignore[attr-defined]
    consume_once.original = consume  # type: ignore[attr-defined]  (scripts/bench_net.py measures against it)
    for module in (_pubsub_module, _gossipsub_module):
        module.maybe_consume_signed_record = consume_once  # type: ignore[attr-defined]


_check_each_peer_record_once()


class BufferedReads:
    """A libp2p stream whose small reads are served from one larger read; all else delegated."""

    CHUNK = 64 * 1024

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._buffer = b""
        self._pos = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    async def read(self, n: int | None = None) -> bytes:
        if self._pos == len(self._buffer):
            self._buffer, self._pos = await self._stream.read(max(n or 0, self.CHUNK)), 0
        end = len(self._buffer) if n is None else min(len(self._buffer), self._pos + n)
        data = self._buffer[self._pos:end]
        self._pos = end
        return data


class Subscription:
    """Verified messages of one topic, in arrival order."""

    def __init__(self, topic: str, buffer: int) -> None:
        self.topic = topic
        self._send, self._receive = trio.open_memory_channel[Received](buffer)

    async def receive(self) -> Received:
        return await self._receive.receive()

    def receive_nowait(self) -> Received:
        """The next message if one is waiting; trio.WouldBlock otherwise."""
        return self._receive.receive_nowait()

    def __aiter__(self) -> AsyncIterator[Received]:
        return self._receive.__aiter__()


class Gossip:
    """Publish and receive signed messages over ``host`` (register before ``host.run``)."""

    STASH_MAX = 8192

    def __init__(self, host: Host, config: GossipConfig = GossipConfig(), *,
                 clock: Callable[[], float] = time.time) -> None:
        self.host = host
        self.config = config
        self.clock = clock
        self.router = _FreshRouter(
            [GOSSIPSUB_V11, GOSSIPSUB_V10],
            degree=config.degree,
            degree_low=config.degree_low,
            degree_high=config.degree_high,
            heartbeat_interval=config.heartbeat_interval,
            spam_protection_enabled=False,
        )
        self.router.clock = clock
        cache = self.router.mcache
        self.router.mcache = _FreshMessageCache(cache.window_size, cache.history_size, clock)
        # py-libp2p's seen-message cache forgets an ID 120 s after it was last seen by default, while an
        # envelope is valid for MAX_AGE_S (+ skew): a copy arriving in between was validated again and
        # refused as `replayed`. SEEN_TTL_S covers the whole window (IPIP-0001 §4).
        self.pubsub = _GuardedPubsub(host.libp2p, self.router, seen_ttl=int(SEEN_TTL_S))
        # py-libp2p numbers messages from int(time.time()) at start, +1 per message, and names a message
        # by (source, number): an agent that published faster than one message a second and restarted
        # reused numbers its peers still held as seen, and its new messages were dropped unread.
        # Nanoseconds, as go-libp2p does: a restart starts past every number used before.
        self.pubsub.counter = time.time_ns()
        self.pubsub.deliver = self._deliver
        host.add_service(self.pubsub)
        # the router is a service of its own: its heartbeat (every heartbeat_interval) maintains the mesh,
        # sends IHAVE gossip and shifts the recent-message cache. Never started before, the cache kept
        # every message since the agent started and handed all of them (up to the window) to each new
        # subscriber, who forwarded them to peers that had forgotten them: issue 21's blacklisting.
        host.add_service(self.router)
        self._my_id = host.libp2p.get_id()
        self._replay = ReplayCache()
        self._rate = _TokenBuckets(config.max_rate, config.max_burst)
        # verified messages between validation and delivery, by py-libp2p message ID
        self._stash: OrderedDict[bytes, Received] = OrderedDict()
        self._subscriptions: dict[str, Subscription] = {}
        self.invalid: Counter[str] = Counter()  # envelope-rule violations, per forwarding peer
        self.reasons: Counter[str] = Counter()  # ... per reason tag (CodecError.reason)
        self.rate_limited: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()  # per topic: our delivery buffer was full
        self.faults: GossipFaults | None = None  # the test harness's, never set in production
        self._full_since: dict[Any, tuple[int, float]] = {}  # peer -> (queue length, since when) while full

    async def wait_ready(self, timeout: float = 10.0) -> None:
        with trio.fail_after(timeout):
            await self.pubsub.wait_until_ready()

    # -- publishing -------------------------------------------------------------------------------

    async def publish(self, message: Any) -> bytes:
        """Sign ``message``, publish it on its topic, and return its envelope message ID."""
        return await self.publish_sealed(message, self.seal(message))

    def seal(self, message: Any) -> bytes:
        """``message`` signed by us, now: the envelope ``publish_sealed`` sends (a decision is stored
        as this envelope before it is published: agent/evidence.py ``Evidence.commit``)."""
        return seal(self.host.identity, message, now=self.clock())

    async def publish_sealed(self, message: Any, data: bytes) -> bytes:
        """Publish ``data``, our envelope of ``message`` (``seal``), on its topic; its message ID. It is
        opened first, so nothing that breaks the message rules is sent (CodecError)."""
        message_id = open_envelope(data, now=self.clock()).envelope.message_id
        await self._wait_for_queue_room()
        await self.pubsub.publish(topic_for(message), data)
        return message_id

    async def _wait_for_queue_room(self) -> None:
        """Back-pressure instead of loss: wait (bounded) while a peer's outbound queue is nearly full and
        draining. A peer whose full queue has not shrunk for STALLED_SECONDS (a frozen or dead peer) is
        not waited for, now or at later publishes until it drains again: one peer must never hold up
        what everyone else is sent (a frozen peer cost each publish ``publish_wait``)."""
        with trio.move_on_after(self.config.publish_wait):
            while self._draining_full_queues():
                await trio.sleep(0.002)

    def _draining_full_queues(self) -> bool:
        """Is some peer's outbound queue at the high-water mark and not stalled?"""
        now = trio.current_time()
        waiting = False
        full = {peer: len(queue) for peer, queue in self.pubsub.peer_queues.items() if len(queue) >= QUEUE_HIGH_WATER}
        for peer in list(self._full_since):
            if peer not in full:
                del self._full_since[peer]  # it drained (or left)
        for peer, length in full.items():
            last = self._full_since.get(peer)
            if last is None or length < last[0]:
                self._full_since[peer] = (length, now)  # progress: it is draining
                waiting = True
            elif now - last[1] < STALLED_SECONDS:
                waiting = True
        return waiting

    # -- subscribing ------------------------------------------------------------------------------

    async def subscribe(self, topic: str) -> Subscription:
        """Join ``topic``; verified messages arrive on the returned Subscription (one per topic)."""
        if topic in self._subscriptions:
            return self._subscriptions[topic]
        self.pubsub.set_topic_validator(topic, self._validator_for(topic), False)
        sub = Subscription(topic, self.config.delivery_buffer)
        self._subscriptions[topic] = sub
        await self.pubsub.subscribe(topic)
        return sub

    async def unsubscribe(self, topic: str) -> None:
        """Leave ``topic``: its Subscription ends at once (its reader's loop finishes), then we tell
        our peers; the validator goes last, so nothing on the topic is ever relayed unchecked."""
        sub = self._subscriptions.pop(topic, None)
        if sub is not None:
            sub._send.close()
            await self.pubsub.unsubscribe(topic)
            self.pubsub.remove_topic_validator(topic)

    def peers_on(self, topic: str) -> set[str]:
        """Peers we know are subscribed to ``topic``."""
        return {p.to_base58() for p in self.pubsub.peer_topics.get(topic, ())}

    def mesh_peers(self, topic: str) -> set[str]:
        return {p.to_base58() for p in self.router.mesh.get(topic, ())}

    def _deliver(self, msg: Any) -> None:
        """Hand a validated message to its topic's subscriber (called by py-libp2p, synchronously)."""
        received = self._stash.pop(self.pubsub.get_message_id(msg), None)
        if received is None:
            return  # validated before the stash overflowed, or not by us; never unchecked
        sub = self._subscriptions.get(received.topic)
        if sub is None:
            return
        if self.faults is not None and received.signer != self.host.peer_id:
            for delay in self.faults.plan(received.signer):
                if delay > 0:
                    self.host.nursery.start_soon(self._deliver_later, sub, received, delay)
                else:
                    self._hand_over(sub, received)
            return
        self._hand_over(sub, received)

    async def _deliver_later(self, sub: "Subscription", received: Received, delay: float) -> None:
        await trio.sleep(delay)
        self._hand_over(sub, received)

    def _hand_over(self, sub: "Subscription", received: Received) -> None:
        try:
            sub._send.send_nowait(received)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # unsubscribed meanwhile
        except trio.WouldBlock:
            self.dropped[received.topic] += 1
            log.warning("gossip %s: subscriber is %d messages behind; dropped one",
                        received.topic, self.config.delivery_buffer)

    # -- validation -------------------------------------------------------------------------------

    def _validator_for(self, topic: str) -> Callable[[ID, Any], bool]:
        def validate(forwarder: ID, msg: Any) -> bool:
            try:
                return self._validate(topic, forwarder, msg)
            except Exception as exc:  # noqa: BLE001 - see the rules at the top
                log.error("gossip validator failed on a message from %s: %r", forwarder, exc)
                return self._reject(forwarder.to_base58(), "internal-error")

        return validate

    def _validate(self, topic: str, forwarder: ID, msg: Any) -> bool:
        fwd = forwarder.to_base58()
        now = self.clock()
        source = ID(msg.from_id).to_base58()
        if source != self.host.peer_id and not self._rate.allow(source, time.monotonic()):
            self.rate_limited[source] += 1  # by source: a flood is cut at the first hop, its relays unharmed
            return False
        if len(msg.topicIDs) != 1:
            return self._reject(fwd, "multi-topic")
        try:
            opened = open_envelope(msg.data, now=now, replay=self._replay, expected_signer=source)
        except CodecError as exc:
            log.debug("gossip %s: rejected a message from %s: %s", topic, fwd, exc)
            return self._reject(fwd, exc.reason)
        if topic_for(opened.message) != topic:
            return self._reject(fwd, "wrong-topic")
        self._stash[self.pubsub.get_message_id(msg)] = Received(topic, opened.message, opened.envelope, fwd)
        while len(self._stash) > self.STASH_MAX:
            self._stash.popitem(last=False)
        return True

    def _reject(self, peer: str, reason: str) -> bool:
        self.reasons[reason] += 1
        if not blames_forwarder(reason):  # an old or already-seen message relayed in good faith: not held against it
            return False
        self.invalid[peer] += 1
        if peer != self.host.peer_id and self.invalid[peer] == self.config.blacklist_after:
            log.warning("gossip: blacklisting %s after %d invalid messages", peer, self.invalid[peer])
            self.pubsub.add_to_blacklist(ID.from_base58(peer))
        return False
