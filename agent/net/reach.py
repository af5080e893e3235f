"""Reachability: is this agent dialable (AutoNAT), relays for those that are not (circuit relay v2).

Rules of this file:
- The protocols are py-libp2p 0.8.1's own: AutoNAT v1 (``libp2p.host.autonat``) and circuit relay
  v2 (``libp2p.relay.circuit_v2``). This file wires them into the agent's host and patches, here and
  nowhere else, what they get wrong for us:
  * AutoNAT's dial-back calls ``host.connect``, which returns at once when the asking peer is already
    connected (it always is: it asked over that connection), so every peer would be told "public".
    Our server dials back on a fresh TCP connection to the address and waits for the libp2p
    listener's multistream-select greeting (``_dial_back``); the existing connection proves nothing.
  * AutoNAT's handler is registered through our ``HandlerGuard`` with a deadline, not raw.
  * The relay transport is not a transport of py-libp2p's swarm: dialing a ``/p2p-circuit`` address
    goes through ``Reachability.dial_relayed`` (``Host.connect`` falls back to it when every direct
    address failed). The relayed addresses we hold a reservation for are added to what identify
    advertises through the host's ``addrs_factory`` (``advertised``).
- Status: ``unknown`` until ``CONFIRMATIONS`` peers agree, then ``public`` or ``private``; each check
  counts only the verdicts of that round's servers (a round nobody answers changes nothing). A private
  agent reserves a slot on up to ``MAX_RELAYS`` connected peers that serve the hop protocol (agents
  with ``relay = true``, or ``"auto"`` and public) and advertises ``<relay addr>/p2p/<relay>/p2p-circuit``.
- ``relay``: ``true`` serves the hop protocol from the start, ``false`` never, ``"auto"`` (an
  operator's default, agent/config.py) from the moment AutoNAT says this agent is public, and no
  longer once it says private (the slots it granted are dropped then: clients' refreshes fail);
  peers learn it at once (identify push) and reserve slots here.
- A relay serves circuits within ``RELAY_LIMITS`` (duration and bytes per circuit, circuits and
  reservations at once): enough for gossip, reports and small adapters, not for datasets; bulk
  content reaches other peers by re-providing (IPIP-0003 §4.1).
- Hole punching: py-libp2p 0.8.1's DCUtR (``libp2p.relay.circuit_v2.dcutr``), patched in ``_DCUtR``.
  Once two agents are connected through a relay, the one that received the relayed connection
  runs a DCUtR session over it (every 2 s while the peer is relay-only; 3 sessions per peer):
  a plain dial to the peer's own addresses (3 s), then CONNECT/SYNC. Each side advertises
  <its NAT's IP, as the relay observed it>:<its listen port>, and at the SYNC time (the initiator
  RTT/2 after sending it, the other side on receiving it) each makes ONE dial to the other's
  address from its listen port (SO_REUSEADDR/SO_REUSEPORT, as py-libp2p's listener) and waits up
  to ``PUNCH_DIAL_TIMEOUT`` (6 s) for it. The first SYN to cross is dropped by the far NAT but
  opens the near one; the other side's SYN then passes and meets a socket in SYN_SENT (TCP
  simultaneous open; the DCUtR initiator upgrades as the security responder, as the spec says).
  The relayed connection is closed 60 s after the direct one verifies (py-libp2p's grace period).
  What we patched, and why the earlier attempt failed: py-libp2p drove sessions from both ends at
  once and retried dials from the same port to the same address while the first socket still held
  the 4-tuple (EADDRNOTAVAIL); it took the peer's own ID for the relay's and filtered out the
  very address it had just been told; it dialed 0.0.0.0 (ourselves) and waited 10 s on private
  addresses. And the harness NAT routers answered an unasked SYN to themselves with a reset,
  which kills a simultaneous open; they drop it now, as home routers do (agent/harness/hosts.py).
  Needs NATs that keep the source port (endpoint-independent mapping, most home routers, Linux
  MASQUERADE while the port is free); symmetric NATs stay relayed. TCP only (no QUIC here).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import multiaddr
import trio
from libp2p.host.autonat.autonat import AUTONAT_PROTOCOL_ID, AutoNATService, AutoNATStatus
from libp2p.host.autonat.pb.autonat_pb2 import Message as AutoNATMessage
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.rcmgr import Direction
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol, _local_tcp_listen_addrs
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL_ID
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport

log = logging.getLogger(__name__)

CONFIRMATIONS = 2  # peers that must agree before the status flips (the spec says more; our networks are small)
MAX_SERVERS = 4  # peers asked per check
FIRST_CHECKS = 3.0  # seconds between checks while unknown (or private without a relay slot)
CHECK_INTERVAL = 30.0  # seconds between checks once known (a slot is renewed 60 s before it ends)
QUERY_TIMEOUT = 10.0
DIAL_BACK_TIMEOUT = 5.0
MAX_RELAYS = 2
RESERVE_TIMEOUT = 10.0
RELAY_LIMITS = RelayLimits(duration=600, data=64 << 20, max_circuit_conns=32, max_reservations=64,
                           reservation_ttl=600)
MULTISTREAM = b"/multistream/1.0.0\n"
UNILATERAL_TIMEOUT = 3.0  # DCUtR's first step: a plain dial to the peer's own addresses
PUNCHED_LOG = "by hole punching"  # ends the info line of each upgrade; the harness counts it in agents' logs
PUNCH_DIAL_TIMEOUT = 6.0  # one hole-punch dial: covers the kernel's SYN retransmits at 1 s and 3 s

RELAY_AUTO = "auto"  # the relay setting that serves circuits while AutoNAT says public

_DIAL_OK = int(AutoNATMessage.OK)  # an AutoNAT server's verdict: it dialled us back
STATUS_TEXT = {AutoNATStatus.UNKNOWN: "unknown", AutoNATStatus.PUBLIC: "public", AutoNATStatus.PRIVATE: "private"}


def is_circuit(addr: multiaddr.Multiaddr | str) -> bool:
    return "/p2p-circuit" in str(addr)


async def _dial_back(addr: multiaddr.Multiaddr, timeout: float = DIAL_BACK_TIMEOUT) -> bool:
    """A fresh TCP connection to ``addr`` answered by a libp2p listener's multistream greeting."""
    try:
        ip = addr.value_for_protocol("ip4")
        port = int(addr.value_for_protocol("tcp"))
    except Exception:  # noqa: BLE001 - not /ip4/.../tcp/...: we dial nothing else
        return False
    with trio.move_on_after(timeout):
        try:
            stream = await trio.open_tcp_stream(ip, port)
        except OSError:
            return False
        try:
            seen = b""
            while len(seen) < 1 + len(MULTISTREAM):
                chunk = await stream.receive_some(64)
                if not chunk:
                    break
                seen += chunk
            return seen[1:1 + len(MULTISTREAM)] == MULTISTREAM
        except (OSError, trio.BrokenResourceError):
            return False
        finally:
            await stream.aclose()
    return False


class _CircuitV2(CircuitV2Protocol):
    """py-libp2p's circuit relay v2, whose STOP handler keeps its stream while the connection on it lives.

    py-libp2p's handler upgrades the relayed stream into a connection and returns; our host's guard
    then closes the stream (streams.py: a handler that returns is done with its stream), which cut
    every relayed connection right after its handshake. Here the handler waits for the connection
    to end, or for the relay's limits to end it.
    """

    circuits = 0  # circuits this agent relayed (as the relay), for status and the harness

    async def _handle_connect(self, stream: Any, msg: Any) -> None:
        self.circuits += 1
        await super()._handle_connect(stream, msg)

    async def handle_incoming_connection(self, stream: Any, remote_peer_id: bytes) -> None:
        await super().handle_incoming_connection(stream, remote_peer_id)
        peer = ID(remote_peer_id)
        relayed = [c for c in _conns(self.host, peer) if _is_relayed_conn(c)]
        muxed = getattr(relayed[-1], "muxed_conn", None) if relayed else None
        closed = getattr(muxed, "event_closed", None)
        if closed is None:
            return
        with trio.move_on_after(RELAY_LIMITS.duration + 60):  # the relay ends it at its duration limit
            await closed.wait()


class _AutoNAT(AutoNATService):
    """py-libp2p's AutoNAT with a dial-back that does not reuse the asker's connection."""

    async def _try_dial(self, peer_id: ID, addrs: list[bytes]) -> bytes | None:
        for raw in addrs:
            try:
                addr = multiaddr.Multiaddr(raw)
            except Exception:  # noqa: BLE001 - an undecodable address is skipped
                continue
            if not is_circuit(addr) and await _dial_back(addr):
                return bytes(raw)
        return None


class _DCUtR(DCUtRProtocol):
    """py-libp2p's DCUtR with one simultaneous-open dial per side and session, and one driver per pair.

    What py-libp2p 0.8.1 does and what we change (everything else is its code):
    * Its auto-drive loop starts a session on every relayed connection, on both ends at once; two
      sessions dial the same 4-tuple twice from the same listen port, and the second socket fails
      with EADDRNOTAVAIL. Here only the end that received the relayed connection drives (the spec's
      "B"; by peer ID when the direction is unknown); the other end answers.
    * Its hole punch runs up to three rounds of 5 s, each with fresh sockets from the same port to
      the same address (and the responder's dial goes through the swarm's retrying dial on top):
      a retry while the first socket still holds the 4-tuple fails with EADDRNOTAVAIL. Here each
      side makes ONE dial per address and session, bound to its listen port (SO_REUSEADDR and
      SO_REUSEPORT, as py-libp2p's TCP listener), and waits ``PUNCH_DIAL_TIMEOUT`` for it. The SYN
      that reaches the other NAT first is dropped (it opened no mapping there yet) but opens ours;
      the peer's SYN then passes and meets our socket in SYN_SENT (TCP simultaneous open), or the
      kernel's retransmit of the first SYN passes through the mapping the peer's SYN opened.
      A new attempt is a new DCUtR session (py-libp2p's budget: 3 per peer), with a new SYNC.
    """

    upgrades = 0  # relayed connections this agent upgraded to direct ones by hole punching

    async def _handle_dcutr_stream(self, stream: Any) -> None:
        """py-libp2p registers this raw (not through our HandlerGuard): give it a deadline and a net."""
        try:
            with trio.move_on_after(2 * self.read_timeout + PUNCH_DIAL_TIMEOUT + 5):
                await super()._handle_dcutr_stream(stream)
        except Exception as exc:  # noqa: BLE001 - an exception escaping a handler would kill the host
            log.debug("dcutr handler: %s: %s", type(exc).__name__, exc)

    async def _auto_drive_loop(self) -> None:
        while True:
            await trio.sleep(2.0)
            try:
                for peer in list(self.host.get_network().connections.keys()):
                    if peer == self.host.get_id() or peer in self._in_progress or peer in self._direct_connections:
                        continue
                    if self._hole_punch_attempts.get(peer, 0) >= 3:
                        continue
                    relayed = [c for c in _conns(self.host, peer) if _is_relayed_conn(c)]
                    if not relayed or len(relayed) < len(_conns(self.host, peer)):
                        continue  # nothing relayed, or already a direct connection too
                    if not self._drives(peer, relayed[0]):
                        continue
                    await self.initiate_hole_punch(peer)
            except trio.Cancelled:
                raise
            except Exception as exc:  # noqa: BLE001 - py-libp2p's code raises freely; next round
                log.debug("dcutr drive: %s", exc)

    async def _try_unilateral_upgrade(self, peer_id: ID) -> bool:
        """The spec's step 0 (dial the peer's own addresses first), within ``UNILATERAL_TIMEOUT``.

        py-libp2p waits its whole dial timeout (10 s) on addresses that cannot answer (a NATed
        peer's private listen address is routed nowhere), and dials 0.0.0.0 and loopback addresses,
        which reach ourselves.
        """
        addrs = [a for a in self.host.get_peerstore().addrs(peer_id) if not is_circuit(a) and _routable(a)]
        if not addrs:
            return False
        with trio.move_on_after(UNILATERAL_TIMEOUT):
            async with trio.open_nursery() as nursery:
                for addr in addrs:
                    nursery.start_soon(self._punch, peer_id, addr, None, False)
        return await self._verify_direct_connection(peer_id)

    def _drives(self, peer: ID, conn: Any) -> bool:
        direction = getattr(conn, "direction", None)
        if direction == Direction.INBOUND:
            return True
        if direction == Direction.OUTBOUND:
            return False
        return self.host.get_id().to_bytes() < peer.to_bytes()

    async def _perform_hole_punch(self, peer_id: ID, addrs: list[multiaddr.Multiaddr],
                                  as_responder: bool = False) -> bool:
        relay_addrs: set[str] = set()
        for conn in _conns(self.host, peer_id):
            for addr in _transport_addrs(conn):
                text = str(addr)
                # <relay addr>/p2p/<relay>/p2p-circuit[/p2p/<peer>]: the relay's own addresses are not the
                # peer's (py-libp2p takes the ID after /p2p-circuit for the relay's: the peer's own)
                before = text.split("/p2p-circuit")[0]
                if is_circuit(text) and "/p2p/" in before:
                    relay = ID.from_base58(before.split("/p2p/")[-1].split("/")[0])
                    relay_addrs |= {str(a) for a in self.host.get_peerstore().addrs(relay)}
        targets: list[multiaddr.Multiaddr] = []
        for addr in list(addrs) + list(self.host.get_peerstore().addrs(peer_id)):
            text = str(addr)
            if is_circuit(addr) or text in relay_addrs or "/tcp/" not in text or any(str(t) == text for t in targets):
                continue
            if not _routable(addr):
                continue  # 0.0.0.0 (a listen address), loopback: that is us
            targets.append(addr)
        if not targets:
            return False
        source = next(((ip, port) for _family, ip, port in _local_tcp_listen_addrs(self.host)), None)
        log.debug("dcutr: punching %s at %s from %s (%s)", peer_id, [str(t) for t in targets], source,
                  "initiator" if as_responder else "responder")
        with trio.move_on_after(PUNCH_DIAL_TIMEOUT + 2):
            async with trio.open_nursery() as nursery:
                for addr in targets:
                    nursery.start_soon(self._punch, peer_id, addr, source, as_responder)
                while not await self._verify_direct_connection(peer_id):
                    await trio.sleep(0.1)
                nursery.cancel_scope.cancel()
        if not await self._verify_direct_connection(peer_id):
            return False
        self._direct_connections.add(peer_id)
        self.upgrades += 1
        self._schedule_relay_close(peer_id)
        log.info("dcutr: direct connection to %s %s", peer_id, PUNCHED_LOG)
        return True

    async def _punch(self, peer_id: ID, addr: multiaddr.Multiaddr, source: tuple[str, int] | None,
                     as_responder: bool) -> None:
        """One dial, no retry: a retry from the same port to the same address needs the 4-tuple free."""
        network = self.host.get_network()
        try:
            with trio.fail_after(PUNCH_DIAL_TIMEOUT):
                if as_responder:
                    await network.dial_addr_as_responder(addr, peer_id, source)
                else:
                    await network._dial_addr_single_attempt(addr, peer_id, source)
        except Exception as exc:  # noqa: BLE001 - the other address, or the peer's dial, may still win
            log.debug("dcutr: dial %s: %s: %s", addr, type(exc).__name__, exc)


@dataclass
class ReachReport:
    status: str
    relay_service: bool  # serving circuit relay v2 now
    reservations: dict[str, float] = field(default_factory=dict)  # relay peer ID -> expiry (unix time)
    relayed_addrs: list[str] = field(default_factory=list)
    direct: list[str] = field(default_factory=list)  # peers connected directly
    relayed: list[str] = field(default_factory=list)  # peers connected over a relay
    circuits_served: int = 0  # circuits relayed for others (relay = true)
    hole_punched: int = 0  # relayed connections upgraded to direct ones by DCUtR
    relay_mode: str = "off"  # the ``relay`` setting: "on", "off" or "auto" (serves while public)


class Reachability:
    """AutoNAT client and server, circuit relay v2 (always the stop side; the hop side with ``relay``)."""

    def __init__(self, host: Any, *, relay: bool | str = False) -> None:
        if relay not in (True, False, RELAY_AUTO):
            raise ValueError(f"relay must be true, false or {RELAY_AUTO!r}, got {relay!r}")
        self.host = host  # agent.net.host.Host
        libp2p = host.libp2p
        self.relay_mode = RELAY_AUTO if relay == RELAY_AUTO else ("on" if relay else "off")
        relay = relay is True
        self.relay_service = relay
        self.protocol = _CircuitV2(libp2p, limits=RELAY_LIMITS, allow_hop=relay)
        roles = RelayRole.STOP | RelayRole.CLIENT | (RelayRole.HOP if relay else RelayRole(0))
        self.transport = CircuitV2Transport(libp2p, self.protocol, RelayConfig(roles=roles, limits=RELAY_LIMITS))
        self.autonat = _AutoNAT(libp2p, serve=False, confirmations=CONFIRMATIONS)
        host.set_handler(AUTONAT_PROTOCOL_ID, self.autonat.handle_stream, timeout=30)
        host.add_service(self.protocol)
        self.dcutr = _DCUtR(libp2p)
        host.add_service(self.dcutr)
        self.reservations: dict[ID, float] = {}
        self.relay_addrs: dict[ID, list[multiaddr.Multiaddr]] = {}
        self.checked = 0

    # -- what we are --------------------------------------------------------------------------------

    @property
    def status(self) -> str:
        return STATUS_TEXT.get(self.autonat.get_status(), "unknown")

    def advertised(self, candidates: list[multiaddr.Multiaddr]) -> list[multiaddr.Multiaddr]:
        """The host's addrs_factory: its own addresses, then the relayed ones it holds a slot for."""
        out = list(candidates)
        now = time.time()
        for relay, addrs in self.relay_addrs.items():
            if self.reservations.get(relay, 0) > now:
                for addr in addrs:
                    out.append(addr.encapsulate(multiaddr.Multiaddr(f"/p2p/{relay.to_base58()}/p2p-circuit")))
        return out

    def report(self) -> ReachReport:
        direct, relayed = [], []
        network = self.host.libp2p.get_network()
        for peer in self.host.libp2p.get_connected_peers():
            conns = network.connections.get(peer, [])
            conns = conns if isinstance(conns, list) else [conns]
            kinds = {_is_relayed_conn(c) for c in conns}
            (direct if False in kinds or not kinds else relayed).append(peer.to_base58())
        now = time.time()
        return ReachReport(self.status, self.relay_service,
                           {r.to_base58(): e for r, e in self.reservations.items() if e > now},
                           [f"{a}/p2p/{self.host.peer_id}" for a in self.advertised([])], direct, relayed,
                           self.protocol.circuits, self.dcutr.upgrades, self.relay_mode)

    async def follow_status(self) -> None:
        """``relay = "auto"``: serve the hop protocol while AutoNAT says public, not otherwise."""
        if self.relay_mode != RELAY_AUTO:
            return
        serve = self.status == "public"
        if serve == self.relay_service:
            return
        libp2p = self.host.libp2p
        if serve:
            libp2p.set_stream_handler(HOP_PROTOCOL_ID, self.protocol._handle_hop_stream)
        else:
            libp2p.remove_stream_handler(HOP_PROTOCOL_ID)
            # the slots we granted go too: a client's next refresh fails, and it stops advertising
            # /p2p-circuit addresses through a relay that no longer serves them
            self.protocol.resource_manager._reservations.clear()
        self.protocol.allow_hop = self.relay_service = serve  # py-libp2p removes the handler at stop if set
        log.info("reachability: %s; %s circuit relay v2 (relay = auto)", self.status,
                 "serving" if serve else "no longer serving")
        from libp2p.identity.identify_push.identify_push import push_identify_to_peers

        with trio.move_on_after(RESERVE_TIMEOUT):  # peers learn the hop protocol now, not at their next identify
            try:
                await push_identify_to_peers(libp2p)
            except Exception as exc:  # noqa: BLE001 - they learn it at their next identify
                log.debug("identify push: %s", exc)

    # -- the loop -----------------------------------------------------------------------------------

    async def maintain(self) -> None:
        """Check reachability now and then; while private, hold reservations on relays."""
        while True:
            try:
                with trio.move_on_after(QUERY_TIMEOUT * MAX_SERVERS + 5):
                    await self.check()
                await self.follow_status()
                if self.status == "private":
                    with trio.move_on_after(RESERVE_TIMEOUT * MAX_RELAYS + 5):
                        await self.keep_reservations()
            except Exception as exc:  # noqa: BLE001 - py-libp2p's relay code raises freely; the agent lives on
                log.warning("reachability check failed: %s: %s", type(exc).__name__, exc)
            unsettled = self.status == "unknown" or (self.status == "private" and not self.reservations)
            await trio.sleep(FIRST_CHECKS if unsettled else CHECK_INTERVAL)

    async def check(self) -> str:
        """Ask up to MAX_SERVERS directly connected peers to dial us back; update the status."""
        servers = [p for p in self.host.libp2p.get_connected_peers() if not self._only_relayed(p)]
        servers = [p for p in servers if self._supports(p, AUTONAT_PROTOCOL_ID)][:MAX_SERVERS]
        verdicts: dict[ID, bool] = {}
        async with trio.open_nursery() as nursery:
            for server in servers:
                nursery.start_soon(self._ask, server, verdicts)
        if verdicts:  # else nobody answered: the last round's verdicts stand
            # this round's verdicts only: py-libp2p keeps those of servers no longer asked (gone, or
            # not answering), and their old successes would keep us "public" after a network change
            self.autonat.dial_results = verdicts
            # a small network may have fewer peers than CONFIRMATIONS: then every peer that answered must agree
            answered = len(verdicts)
            self.autonat.confirmations = max(1, min(CONFIRMATIONS, answered))
            if len(set(verdicts.values())) <= 1 or answered >= CONFIRMATIONS:
                self.autonat.update_status()
        self.checked += 1
        return self.status

    async def _ask(self, server: ID, verdicts: dict[ID, bool]) -> None:
        try:
            with trio.fail_after(QUERY_TIMEOUT):
                status, _ = await self.autonat.query_server(server, addrs=self._own_addrs(), timeout=QUERY_TIMEOUT)
            verdicts[server] = status == _DIAL_OK
        except Exception as exc:  # noqa: BLE001 - a server that cannot answer says nothing about us
            log.debug("autonat query to %s: %s", server, exc)

    def _own_addrs(self) -> list[bytes]:
        return [a.to_bytes() for a in self.host.libp2p.get_addrs() if not is_circuit(a)]

    async def keep_reservations(self) -> None:
        now = time.time()
        for relay in [r for r, e in self.reservations.items() if e - now < 60
                      or r not in self.host.libp2p.get_connected_peers()]:
            self.reservations.pop(relay, None)  # renewed below if it still serves us
        for relay in self.relays():
            if len(self.reservations) >= MAX_RELAYS:
                return
            if relay not in self.reservations:
                await self.reserve(relay)

    async def reserve(self, relay: ID) -> bool:
        stream = None
        try:
            with trio.fail_after(RESERVE_TIMEOUT):
                stream = await self.host.libp2p.new_stream(relay, [HOP_PROTOCOL_ID])
                ok = await self.transport._make_reservation(stream, relay)
        except Exception as exc:  # noqa: BLE001 - the next relay, or the next round
            log.info("relay reservation on %s: %s", relay, exc)
            ok = False
        finally:
            if stream is not None:
                with trio.move_on_after(2):
                    await stream.close()
        if not ok:
            return False
        expire = float(self.transport._reservations.get(relay) or time.time() + 300)
        proof = self.transport._reservation_proofs.get(relay)
        addrs = []
        for raw in getattr(proof, "addrs", []) or []:  # the relay's own addresses, from its answer
            try:
                addrs.append(_without_p2p(multiaddr.Multiaddr(raw)))
            except Exception:  # noqa: BLE001
                continue
        if not addrs:
            addrs = [_without_p2p(a) for a in self.host.libp2p.get_peerstore().addrs(relay) if not is_circuit(a)]
        self.relay_addrs[relay] = addrs
        fresh = relay not in self.reservations
        self.reservations[relay] = expire
        log.info("reachability: private; reserved a slot on relay %s until %s", relay, time.ctime(expire))
        if fresh:  # tell the peers we are connected to our new (relayed) address at once
            from libp2p.identity.identify_push.identify_push import push_identify_to_peers

            with trio.move_on_after(RESERVE_TIMEOUT):
                try:
                    await push_identify_to_peers(self.host.libp2p)
                except Exception as exc:  # noqa: BLE001 - they learn it at their next identify
                    log.debug("identify push: %s", exc)
        return True

    def relays(self) -> list[ID]:
        """Connected peers (directly) that serve circuit relay v2."""
        return [p for p in self.host.libp2p.get_connected_peers()
                if not self._only_relayed(p) and self._supports(p, HOP_PROTOCOL_ID)]

    # -- dialing through a relay --------------------------------------------------------------------

    async def dial_relayed(self, peer: PeerInfo) -> None:
        """Connect to ``peer`` over one of its /p2p-circuit addresses (ConnectionError if none works)."""
        addrs = [a for a in list(peer.addrs) + list(self._stored(peer.peer_id)) if is_circuit(a)]
        for relay in self.relays():  # a relay we know may hold a slot for it although no address says so yet
            if relay != peer.peer_id:
                addrs += [_without_p2p(a).encapsulate(multiaddr.Multiaddr(f"/p2p/{relay.to_base58()}/p2p-circuit"))
                          for a in self._stored(relay) if not is_circuit(a)][:1]
        seen: set[str] = set()
        addrs = [a for a in addrs if not (str(a) in seen or seen.add(str(a)))]
        errors = []
        for addr in addrs:
            full = addr if str(addr).endswith(f"/p2p/{peer.peer_id.to_base58()}") else addr.encapsulate(
                multiaddr.Multiaddr(f"/p2p/{peer.peer_id.to_base58()}"))
            try:
                await self.transport.dial(full)
                return
            except Exception as exc:  # noqa: BLE001 - try the next relay
                errors.append(f"{addr}: {exc}")
        raise ConnectionError("; ".join(errors) or "no relayed address known")

    def _stored(self, peer: ID) -> list[multiaddr.Multiaddr]:
        try:
            return list(self.host.libp2p.get_peerstore().addrs(peer))
        except Exception:  # noqa: BLE001 - unknown peer
            return []

    def _supports(self, peer: ID, protocol: str) -> bool:
        try:
            return bool(self.host.libp2p.get_peerstore().supports_protocols(peer, [protocol]))
        except Exception:  # noqa: BLE001 - identify has not told us yet
            return False

    def _only_relayed(self, peer: ID) -> bool:
        conns = self.host.libp2p.get_network().connections.get(peer, [])
        conns = conns if isinstance(conns, list) else [conns]
        return bool(conns) and all(_is_relayed_conn(c) for c in conns)


def _conns(libp2p: Any, peer: ID) -> list[Any]:
    conns = libp2p.get_network().connections.get(peer, [])
    return conns if isinstance(conns, list) else [conns]


def _routable(addr: multiaddr.Multiaddr) -> bool:
    """Not an unspecified (0.0.0.0, ::) or loopback address: dialing those reaches ourselves."""
    import ipaddress

    for proto in ("ip4", "ip6"):
        try:
            value = addr.value_for_protocol(proto)
        except Exception:  # noqa: BLE001 - not this protocol
            continue
        if value:
            ip = ipaddress.ip_address(value)
            return not (ip.is_unspecified or ip.is_loopback)
    return True


def _transport_addrs(conn: Any) -> list[Any]:
    try:
        return list(conn.get_transport_addresses())
    except Exception:  # noqa: BLE001
        return []


def _is_relayed_conn(conn: Any) -> bool:
    return any(is_circuit(a) for a in _transport_addrs(conn))


def _without_p2p(addr: multiaddr.Multiaddr) -> multiaddr.Multiaddr:
    try:
        value = addr.value_for_protocol("p2p")
    except Exception:  # noqa: BLE001
        return addr
    return addr.decapsulate(multiaddr.Multiaddr(f"/p2p/{value}")) if value else addr
