"""The agent's libp2p host: one identity, TCP, Noise, Yamux, guarded stream handlers, owned tasks.

Rules of this file:
- The host's key is the agent's ``protocol.identity.Identity``: the libp2p peer ID of every
  connection is the peer ID that signs the agent's envelopes (tests/net/test_identity_interop.py).
- Security is Noise only. py-libp2p 0.8.1 offers plaintext, secio and TLS by default when no
  ``sec_opt`` is given; we never offer those. The muxer is Yamux only.
- Addresses come from config as multiaddr text; a bad one is a ``NetConfigError`` naming the field,
  its index and the text (``bootstrap[1]: '/ip4/1.2.3.4/tcp/x': invalid multiaddr (...)``).
- Every inbound stream goes through one ``HandlerGuard`` installed in front of py-libp2p's protocol
  negotiation, so library handlers (pubsub, DHT, identify, Bitswap) are guarded too.
- A Yamux frame, once its write has begun, is written whole: ``_shield_yamux_frame_writes`` (below).
  In py-libp2p 0.8.1 a frame write cancelled half-way (a deadline, a nursery cancelling a task whose
  stream read was sending a window update) leaves half a frame or a skipped Noise nonce on the
  wire, and every later frame on that connection fails authentication: the connection dies.
- A Yamux receiver tells the sender of the room it freed (WINDOW_UPDATE) once half its window is
  free, as go-yamux does (``_batch_window_updates``). py-libp2p 0.8.1 sent one after every read that
  freed any room (its "partial slack" rule, whatever ``PY_YAMUX_RELEASE_ON_READ`` says): one more
  encrypted frame each way per gossip message, written by one side and read by the other.
- py-libp2p logs every stream it fails to open at ERROR, eight lines each; GossipSub tries one to
  every peer it meets, so each IPFS node without GossipSub (Kubo by default, Helia) printed an
  "error". Those records are demoted to DEBUG (``_StreamFailuresAtDebug``): a failure that matters
  reaches its caller as an exception (``open_stream`` raises NetError naming the peer and protocol).
- Every long-running task belongs to ``Host.nursery``, which ``Host.run`` owns. The nursery is the
  innermost layer: leaving ``run`` cancels the agent's tasks first, then stops the py-libp2p services
  (in reverse order of ``add_service``), then closes the listeners and connections.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.protocol_muxer.exceptions import MultiselectCommunicatorError
from libp2p.protocol_muxer.multiselect_client import MULTISELECT_PROTOCOL_ID, PROTOCOL_NOT_FOUND_MSG, \
    MultiselectClient, is_valid_handshake
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.protocol_muxer.exceptions import MultiselectClientError
from libp2p.protocol_muxer.exceptions import ProtocolNotSupportedError as MultiselectProtocolNotSupported
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.exceptions import MuxedConnUnavailable
from libp2p.stream_muxer.yamux.yamux import Yamux, YamuxStream
from libp2p.tools.anyio_service.context import background_trio_service

from agent.net.errors import NetConfigError, NetError, ProtocolNotSupported
from agent.net.streams import HandlerGuard, StreamHandler
from protocol.identity import Identity

DEFAULT_LISTEN = ("/ip4/127.0.0.1/tcp/0",)


@dataclass(frozen=True)
class NetConfig:
    """Network settings of one agent. Addresses are multiaddr text, parsed when the Host is built."""

    listen: tuple[str, ...] = DEFAULT_LISTEN
    announce: tuple[str, ...] = ()
    bootstrap: tuple[str, ...] = ()
    connect_timeout: float = 10.0
    relay: bool | str = False  # serve circuit relay v2 to peers that cannot be dialled: true, false or
    # "auto" (while AutoNAT says this agent is public; agent/net/reach.py)


def parse_multiaddr(text: str, where: str) -> multiaddr.Multiaddr:
    """Parse one multiaddr; ``where`` names the config field (``"listen[0]"``) for the error."""
    if not isinstance(text, str) or not text.startswith("/"):
        raise NetConfigError(f"{where}: {text!r}: invalid multiaddr (must start with '/')")
    try:
        return multiaddr.Multiaddr(text)
    except Exception as exc:  # the multiaddr library raises several unrelated types
        raise NetConfigError(f"{where}: {text!r}: invalid multiaddr ({exc})") from None


def parse_peer_multiaddr(text: str, where: str) -> PeerInfo:
    """Parse a multiaddr that ends in ``/p2p/<peer id>`` (a bootstrap peer) into a PeerInfo."""
    addr = parse_multiaddr(text, where)
    try:
        return info_from_p2p_addr(addr)
    except Exception as exc:
        raise NetConfigError(f"{where}: {text!r}: needs a trailing /p2p/<peer id> ({exc})") from None


def peer_id_text(peer: ID | str) -> str:
    return peer if isinstance(peer, str) else peer.to_base58()


def to_libp2p_id(peer: ID | str) -> ID:
    return peer if isinstance(peer, ID) else ID.from_base58(peer)


async def _close_listeners(network: Any) -> None:
    """Close the swarm's listening sockets, whatever cancellation is under way. py-libp2p's own stop
    path closes the connections first, and when that is cancelled (leaving ``run`` by cancellation)
    never reaches the listeners: the port stayed bound for the life of the process, so an agent
    restarted in the same process could not listen on it again. Bounded: 2 s."""
    with trio.CancelScope(shield=True), trio.move_on_after(2.0):
        for listener in list(getattr(network, "listeners", {}).values()):
            try:
                await listener.close()
            except Exception:  # noqa: BLE001 - closed already, or half-torn down: nothing more to do
                pass


def check_port_free(addr: multiaddr.Multiaddr) -> None:
    """NetError if another process listens on ``addr``'s TCP port. py-libp2p listens with SO_REUSEPORT
    (hole punching dials out from the listen port), and Linux lets a second process that does the same
    bind the very port: two agents then shared one port, each getting some of the inbound connections
    (issue 21 §4). A test bind without SO_REUSEPORT fails while anyone listens there (SO_REUSEADDR
    still lets us re-bind over our own connections in TIME_WAIT after a restart). Port 0: nothing to check."""
    import socket

    protocols = {p.name: addr.value_for_protocol(p.code) for p in addr.protocols()}
    port = int(protocols.get("tcp") or 0)
    host = protocols.get("ip4") or protocols.get("ip6")
    if not port or host is None:
        return
    family = socket.AF_INET6 if "ip6" in protocols else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise NetError(f"listen: {addr} is in use ({exc.strerror or exc}): another agent or program listens "
                           f"on port {port}; stop it or choose another port (tcp/0 = any free one)") from None


class Host:
    """The agent's libp2p host. Build it, let Gossip/Discovery register their services, then ``run``."""

    def __init__(self, identity: Identity, config: NetConfig = NetConfig()) -> None:
        self._listen = [parse_multiaddr(t, f"listen[{i}]") for i, t in enumerate(config.listen)]
        announce = [parse_multiaddr(t, f"announce[{i}]") for i, t in enumerate(config.announce)]
        self.bootstrap_peers = [parse_peer_multiaddr(t, f"bootstrap[{i}]") for i, t in enumerate(config.bootstrap)]
        if not self._listen:
            raise NetConfigError("listen: at least one listen address is needed")
        self.identity = identity
        self.config = config
        self.reach: Any = None  # built below: it needs the libp2p host
        self.libp2p = _build_libp2p_host(identity, self._listen, lambda candidates: list(announce or candidates))
        # py-libp2p's get_addrs cuts every address at its first /p2p/ and appends ours, which turns a
        # relayed address (<relay addr>/p2p/<relay>/p2p-circuit) into the relay's address under our
        # peer ID; the relayed addresses are appended after that step instead.
        self._libp2p_get_addrs = self.libp2p.get_addrs
        self.libp2p.get_addrs = self._advertised
        if self.libp2p.get_id().to_base58() != identity.peer_id:  # a py-libp2p change would show here
            raise NetError("py-libp2p derived a different peer ID from the agent's key")
        self.guard = HandlerGuard()
        self._services: list[Any] = []
        self._nursery: trio.Nursery | None = None
        from agent.net.reach import Reachability

        self.reach = Reachability(self, relay=config.relay)

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    def _advertised(self) -> list[multiaddr.Multiaddr]:
        """What identify tells peers: the announce addresses (else the listen ones), then relayed ones."""
        own = self._libp2p_get_addrs()
        if self.reach is None:
            return own
        me = multiaddr.Multiaddr(f"/p2p/{self.identity.peer_id}")
        return own + [a.encapsulate(me) for a in self.reach.advertised([])]

    @property
    def nursery(self) -> trio.Nursery:
        """The nursery that owns the agent's network tasks; exists while ``run`` is active."""
        if self._nursery is None:
            raise NetError("the host is not running")
        return self._nursery

    def add_service(self, service: Any) -> None:
        """A py-libp2p Service (Pubsub, KadDHT) to run, in registration order, while the host runs."""
        if self._nursery is not None:
            raise NetError("services must be added before the host runs")
        self._services.append(service)

    @asynccontextmanager
    async def run(self) -> AsyncIterator["Host"]:
        """Listen, start the services, open the task nursery; undo all of it, innermost first, on exit."""
        for addr in self._listen:
            check_port_free(addr)
        async with self.libp2p.run(listen_addrs=self._listen):
            network = self.libp2p.get_network()
            network.set_stream_handler(self.guard.wrap(network.common_stream_handler, name="inbound"))
            try:
                async with AsyncExitStack() as services:
                    for service in self._services:
                        await services.enter_async_context(background_trio_service(service))
                    async with trio.open_nursery() as nursery:
                        self._nursery = nursery
                        try:
                            yield self
                        finally:
                            self._nursery = None
                            nursery.cancel_scope.cancel()
            finally:
                await _close_listeners(network)

    def addrs(self) -> list[str]:
        """Dialable addresses of this host, each ending in /p2p/<peer id>."""
        out = []
        for addr in self.libp2p.get_addrs():
            text = str(addr)
            out.append(text if "/p2p/" in text else f"{text}/p2p/{self.peer_id}")
        return out

    def connected_peers(self) -> list[str]:
        return [p.to_base58() for p in self.libp2p.get_connected_peers()]

    def stream_report(self) -> dict:
        """Streams as py-libp2p counts them: open on live connections, and the process-wide budget every
        new stream (ours or a peer's) waits for (its resource manager's stream semaphore), with what
        its resource manager holds as open."""
        network = self.libp2p.get_network()
        conns = [c for cs in getattr(network, "connections", {}).values() for c in (cs if isinstance(cs, list) else [cs])]
        semaphore = getattr(network, "_stream_semaphore", None)
        manager = getattr(network, "_resource_manager", None)
        return {"open": sum(len(c.get_streams()) for c in conns), "connections": len(conns),
                "slots_free": None if semaphore is None else semaphore.value,
                "held": None if manager is None else getattr(manager, "_current_streams", None)}

    def set_handler(self, protocol: str, handler: StreamHandler, *, timeout: float | None) -> None:
        """Register a handler for ``protocol``, guarded (see streams.py) and under ``timeout`` seconds."""
        self.libp2p.set_stream_handler(protocol, self.guard.wrap(handler, name=protocol, timeout=timeout))

    async def connect(self, peer: PeerInfo, *, timeout: float | None = None, direct: bool = True,
                      relay: bool = True) -> None:
        """Dial ``peer`` (no-op when already connected); NetError naming the peer on failure.

        Its own addresses first, then (``relay``) through a relay it may hold a slot on;
        ``direct=False`` goes to the relay at once, ``relay=False`` never does (IPIP-0003 §4.1)."""
        if peer.peer_id == self.libp2p.get_id() or peer.peer_id in self.libp2p.get_connected_peers():
            return
        from agent.net.reach import is_circuit

        self._forget_dial_failure(peer.peer_id)

        limit = timeout or self.config.connect_timeout
        direct_info = PeerInfo(peer.peer_id, [a for a in peer.addrs if not is_circuit(a)])
        relayed = [a for a in peer.addrs if is_circuit(a)]
        direct_failed = ""  # why the direct addresses failed, named if the relay fails too
        relays = False  # a relay to fall back on is known
        try:
            with trio.fail_after(limit):
                if not direct:
                    await self.reach.dial_relayed(peer)
                    return
                relays = bool(relayed or self.reach.relays() or [
                    a for a in self.reach._stored(peer.peer_id) if is_circuit(a)])
                # with a relay to fall back on (now, or the caller's later try with ``relay``), the
                # direct addresses get half the time: a NATed peer's own addresses may drop SYNs
                with trio.move_on_after(limit / 2 if relays else limit + 1):
                    try:
                        await self.libp2p.connect(direct_info)
                        return
                    except Exception as exc:
                        if not (relay and relays):
                            raise
                        direct_failed = f" (direct: {type(exc).__name__}: {exc})"
                if not relay:
                    raise trio.TooSlowError  # the direct addresses' half of the time ran out
                # every direct address failed: through a relay the peer may hold a slot on
                await self.reach.dial_relayed(peer)
        except trio.TooSlowError:
            within = limit / 2 if direct and not relay and relays else limit
            raise NetError(f"connect to {peer.peer_id.to_base58()}: no connection within {within:g} s"
                           f"{direct_failed}") from None
        except Exception as exc:
            raise NetError(f"connect to {peer.peer_id.to_base58()}: {type(exc).__name__}: {exc}{direct_failed}") from None

    def _forget_dial_failure(self, peer_id: ID) -> None:
        """Let the next dial to ``peer_id`` happen. py-libp2p 0.8.1 refuses for 60 s to dial a peer
        one of whose dials failed ("recently failed all addresses (negative cache)"): a peer restarted
        within 5 s was then unreachable from everyone who had tried it meanwhile, for a minute (203
        refusals in the 30-minute soak; tests/net/test_host.py). Our callers retry on their own
        deadlines and intervals, so every dial we ask for is made."""
        unblock = getattr(self.libp2p.get_network(), "unblock_peer", None)
        if unblock is not None:
            unblock(peer_id)

    async def open_stream(self, peer: ID | str, protocols: Sequence[str], *, timeout: float = 10.0) -> Any:
        """Open a stream to a connected or known peer; NetError naming the peer and protocol on failure."""
        peer_id = to_libp2p_id(peer)
        if peer_id not in self.libp2p.get_connected_peers():
            self._forget_dial_failure(peer_id)
        try:
            with trio.fail_after(timeout):
                return await self.libp2p.new_stream(peer_id, list(protocols))
        except trio.TooSlowError:
            raise NetError(f"open {protocols[0]} to {peer_id_text(peer)}: no stream within {timeout:.0f} s") from None
        except Exception as exc:
            if _refused_protocols(exc):
                raise ProtocolNotSupported(f"open {protocols[0]} to {peer_id_text(peer)}: "
                                           f"the peer does not support {' or '.join(protocols)}") from None
            raise NetError(f"open {protocols[0]} to {peer_id_text(peer)}: {type(exc).__name__}: {exc}") from None


def _refused_protocols(exc: BaseException) -> bool:
    """True when py-libp2p's StreamFailure comes from the peer answering "na" to every protocol
    (multistream-select), not from a broken connection or a timeout."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, MultiselectProtocolNotSupported):
            return True
        # py-libp2p 0.8.1 reports "every protocol refused" as a plain MultiselectClientError
        if isinstance(seen, MultiselectClientError) and str(seen).startswith("protocols not supported"):
            return True
        seen = seen.__cause__
    return False


FRAME_WRITE_TIMEOUT = 60.0  # a peer that takes no bytes for this long has a dead connection


def _shield_yamux_frame_writes() -> None:
    """Make every Yamux frame write uncancellable once begun, bounded by FRAME_WRITE_TIMEOUT.

    A frame that cannot be written within the timeout means the connection is beyond saving
    (part of a frame may be on the wire): it is closed, and the writer gets MuxedConnUnavailable.
    """
    write_frame = Yamux._write_frame
    if getattr(write_frame, "infernet_shielded", False):
        return

    async def shielded_write_frame(self: Yamux, data: bytes) -> None:
        with trio.CancelScope(shield=True):
            with trio.move_on_after(FRAME_WRITE_TIMEOUT) as stuck:
                await write_frame(self, data)
            if stuck.cancelled_caught:
                with trio.move_on_after(2):
                    await self.close()
        if stuck.cancelled_caught:
            raise MuxedConnUnavailable(f"yamux frame write to {self.peer_id} stuck for {FRAME_WRITE_TIMEOUT:.0f} s")
        await trio.lowlevel.checkpoint()  # deliver a cancellation that arrived during the write

    shielded_write_frame.infernet_shielded = True  # type: ignore[attr-defined]
    Yamux._write_frame = shielded_write_frame  # type: ignore[method-assign]


_shield_yamux_frame_writes()


def _batch_window_updates() -> None:
    """go-yamux's ``sendWindowUpdate``: send the room freed once it is at least half the window
    (py-libp2p's growth of the window for fast links, its auto-tuning, kept); nothing otherwise."""
    update = YamuxStream._auto_tune_and_send_window_update
    if getattr(update, "infernet_batched", False):
        return

    async def batched_window_update(self: YamuxStream, *, bytes_read: int = 0) -> None:
        async with self.window_lock:
            buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
            if self.target_recv_window - (self.recv_window + buffered) < self.target_recv_window // 2:
                return
            increment = self._grow_to_delta(buffered) + self._apply_autotune_epoch(buffered)
        if increment > 0:
            await self.send_window_update(increment, skip_lock=True)

    batched_window_update.infernet_batched = True  # type: ignore[attr-defined]
    batched_window_update.original = update  # type: ignore[attr-defined]  (scripts/bench_net.py measures against it)
    YamuxStream._auto_tune_and_send_window_update = batched_window_update  # type: ignore[method-assign]


_batch_window_updates()


class PipelinedMultiselectClient(MultiselectClient):
    """multistream-select for the streams we open, with the header and the first protocol sent together.

    py-libp2p's client writes the ``/multistream/1.0.0`` header, waits for the peer's, then proposes the
    protocol and waits for the echo: two round trips before a stream carries a byte, 320 ms on an 80 ms
    link, for every request (a fetch, a keep, a report's adapter). The multistream-select spec lets the
    initiator send the header and its proposal without waiting (go-libp2p does), and every responder reads
    them in order from the stream, so here the header's answer is read just before the proposal's: one round
    trip. The header is still checked; a refusal (``na``) still moves on to the next protocol offered."""

    async def handshake(self, communicator: Any) -> None:
        if getattr(communicator, "infernet_no_pipelining", False):
            return await super().handshake(communicator)
        try:
            await communicator.write(MULTISELECT_PROTOCOL_ID)
        except MultiselectCommunicatorError as error:
            raise MultiselectClientError(f"handshake write failed: {error}") from error
        communicator.infernet_header_pending = True

    async def _read_header(self, communicator: Any) -> None:
        if not getattr(communicator, "infernet_header_pending", False):
            return
        communicator.infernet_header_pending = False
        try:
            contents = await communicator.read()
        except MultiselectCommunicatorError as error:
            raise MultiselectClientError(f"handshake read failed: {error}") from error
        if not is_valid_handshake(contents):
            raise MultiselectClientError(f"multiselect protocol ID mismatch: expected {MULTISELECT_PROTOCOL_ID}, "
                                         f"got {contents!r}")

    async def try_select(self, communicator: Any, protocol: Any) -> Any:
        if not getattr(communicator, "infernet_header_pending", False):
            return await super().try_select(communicator, protocol)
        try:
            await communicator.write(protocol if protocol is not None else "")
        except MultiselectCommunicatorError as error:
            raise MultiselectClientError(f"protocol write failed: {error}, protocol={protocol}") from error
        await self._read_header(communicator)
        try:
            response = await communicator.read()
        except MultiselectCommunicatorError as error:
            raise MultiselectClientError(f"protocol read failed: {error}, protocol={protocol}") from error
        if response == (protocol if protocol is not None else ""):
            return protocol
        if response == PROTOCOL_NOT_FOUND_MSG:
            raise MultiselectProtocolNotSupported(f"protocol not supported: {protocol}, response={response!r}")
        raise MultiselectClientError(f"unexpected response: {response!r}, protocol={protocol}")

    async def query_multistream_command(self, communicator: Any, command: str, *args: Any, **kwargs: Any) -> Any:
        communicator.infernet_no_pipelining = True  # (py-libp2p's ``ls``: its own handshake, then the command)
        return await super().query_multistream_command(communicator, command, *args, **kwargs)


def _build_libp2p_host(identity: Identity, listen: list[multiaddr.Multiaddr], addrs_factory: Any) -> Any:
    key_pair = create_new_key_pair(identity.seed)
    # The Noise static key is a fresh X25519 key per host run; the identity key signs it in the
    # Noise handshake payload, so the remote learns (and checks) our Ed25519 peer ID.
    noise = NoiseTransport(key_pair, noise_privkey=create_x25519_key_pair().private_key)
    host = new_host(
        key_pair=key_pair,
        sec_opt={NOISE_PROTOCOL_ID: noise},
        muxer_opt={YAMUX_PROTOCOL_ID: Yamux},
        listen_addrs=listen,
        addrs_factory=addrs_factory,  # our announce addresses (or the listen ones) and our relayed ones
    )
    host.multiselect_client = PipelinedMultiselectClient()  # one round trip to open a stream, not two
    return host
