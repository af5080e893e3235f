"""A link delayer without ``sch_netem``: holds each packet of a queue for ``delay ± jitter``, then lets it go.

The harness (agent/harness/hosts.py) starts one of these per delayed access link, inside the
namespace that owns the link, as ``ip netns exec NS python delay.py --queue 0:80:20``; once it
prints ``ready`` the harness adds the iptables rule in that namespace that sends the packets coming
in through the link to the queue (``-t mangle -A PREROUTING -i eth0 -j NFQUEUE --queue-num 0``;
hosts.py says why incoming only). The kernel keeps each packet (nfnetlink_queue) and sends us its metadata only
(``NFQNL_COPY_META``, no payload); we give it back (``NF_ACCEPT``) when its time has come.

Rules of this file:
- Standard library only, run as a script (no imports from the package): it talks to the kernel's
  nfnetlink_queue with a raw netlink socket (the message layouts are linux/netfilter/nfnetlink_queue.h).
- Each queue is a FIFO with a monotone schedule: a packet is due at
  ``max(arrival + sample, previous packet's due time)``, ``sample`` drawn from a normal law of mean
  ``delay`` and deviation ``jitter`` (clipped to ``[0, delay + 2 jitter]``). Jitter therefore never
  reorders packets of a queue (TCP sees late packets, never out-of-order ones); a burst leaves
  together. Verdicts are batched (``NFQNL_MSG_VERDICT_BATCH``: every packet up to an id), so a lost
  notification (socket buffer overrun) cannot strand a packet in the kernel.
- It exits when its stdin closes or its parent changes (the harness died, even by SIGKILL), on
  SIGTERM/SIGINT, or on any netlink error binding a queue (message on stderr, exit status 1).
  Packets still held when it exits are dropped by the kernel; no rule sends to a queue with
  ``--queue-bypass``, so a dead delayer shows as a dead link, never as an undelayed one.
"""

from __future__ import annotations

import argparse
import collections
import errno
import os
import random
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
SOL_NETLINK = 270
NETLINK_NO_ENOBUFS = 5
SO_RCVBUFFORCE = 33
NLM_F_REQUEST = 1
NLM_F_ACK = 4
NLMSG_ERROR = 2
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET = 0
NFQNL_MSG_CONFIG = 2
NFQNL_MSG_VERDICT_BATCH = 3
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NFQA_CFG_CMD = 1
NFQA_CFG_PARAMS = 2
NFQA_CFG_QUEUE_MAXLEN = 3
NFQA_CFG_MASK = 4
NFQA_CFG_FLAGS = 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_CFG_F_GSO = 4  # hand us GSO packets whole (one verdict for a 64 KiB burst, no segmentation)
NF_ACCEPT = 1
QUEUE_MAXLEN = 8192  # packets held per queue at most (20 Mbit/s x 40 ms is ~70 full-size packets)


class Delayer:
    """The queues of one link and their schedules; ``run`` until told to stop."""

    def __init__(self, queues: dict[int, tuple[float, float]], seed: int | None = None) -> None:
        self.queues = queues  # queue number -> (delay, jitter) in seconds
        self.pending = {q: collections.deque() for q in queues}  # queue -> deque of (due, packet id)
        self.last_due = {q: 0.0 for q in queues}
        self.random = random.Random(seed)
        self.seq = 0
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.bind((0, 0))
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)
        except OSError:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
        for queue in queues:
            self._config(queue, _attr(NFQA_CFG_CMD, struct.pack("!BBH", NFQNL_CFG_CMD_BIND, 0, 0)))
            self._config(queue, _attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META)))
            self._config(queue, _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", QUEUE_MAXLEN)))
            try:
                self._config(queue, _attr(NFQA_CFG_MASK, struct.pack("!I", NFQA_CFG_F_GSO))
                             + _attr(NFQA_CFG_FLAGS, struct.pack("!I", NFQA_CFG_F_GSO)))
            except OSError:
                pass  # an old kernel: packets come segmented, which only costs more verdicts
        self.sock.setblocking(False)

    def _send(self, kind: int, queue: int, payload: bytes, flags: int = 0) -> int:
        self.seq += 1
        body = struct.pack("!BBH", socket.AF_UNSPEC, 0, queue) + payload
        header = struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind,
                             NLM_F_REQUEST | flags, self.seq, 0)
        self.sock.send(header + body)
        return self.seq

    def _config(self, queue: int, payload: bytes) -> None:
        """Send a config message and wait for the kernel's answer (an OSError if it refused)."""
        seq = self._send(NFQNL_MSG_CONFIG, queue, payload, NLM_F_ACK)
        while True:
            data = self.sock.recv(65536)
            for kind, msg_seq, body in _messages(data):
                if kind == NLMSG_ERROR and msg_seq == seq:
                    code = -struct.unpack_from("=i", body)[0]
                    if code:
                        raise OSError(code, f"nfnetlink_queue config of queue {queue}: {os.strerror(code)}")
                    return

    def _sample(self, queue: int) -> float:
        delay, jitter = self.queues[queue]
        if not jitter:
            return delay
        return min(max(0.0, self.random.gauss(delay, jitter)), delay + 2 * jitter)

    def _receive(self) -> None:
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:  # notifications lost; batch verdicts release those packets
                    continue
                raise
            now = time.monotonic()
            for kind, _seq, body in _messages(data):
                if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET and len(body) >= 4:
                    queue = struct.unpack_from("!H", body, 2)[0]
                    packet = _packet_id(body[4:])
                    if queue in self.pending and packet is not None:
                        due = max(now + self._sample(queue), self.last_due[queue])
                        self.last_due[queue] = due
                        self.pending[queue].append((due, packet))
                elif kind == NLMSG_ERROR and len(body) >= 4 and struct.unpack_from("=i", body)[0]:
                    code = -struct.unpack_from("=i", body)[0]
                    print(f"delay: netlink error: {os.strerror(code)}", file=sys.stderr, flush=True)

    def _release(self) -> float | None:
        """Accept every packet that is due; return the next due time, if any."""
        now = time.monotonic()
        upcoming = None
        for queue, pending in self.pending.items():
            last = None
            while pending and pending[0][0] <= now:
                last = pending.popleft()[1]
            if last is not None:
                self._send(NFQNL_MSG_VERDICT_BATCH, queue, _attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, last)))
            if pending and (upcoming is None or pending[0][0] < upcoming):
                upcoming = pending[0][0]
        return upcoming

    def run(self, parent: int) -> None:
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLIN)
        poller.register(sys.stdin.fileno(), select.POLLIN | select.POLLHUP)
        upcoming = None
        while True:
            wait = 0.5 if upcoming is None else min(0.5, max(0.0, upcoming - time.monotonic()))
            for fd, events in poller.poll(wait * 1000):
                if fd == sys.stdin.fileno() and not os.read(fd, 4096):
                    return  # the harness closed our stdin (or died)
                if fd == self.sock.fileno():
                    self._receive()
            upcoming = self._release()
            if os.getppid() != parent:
                return


def _attr(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def _messages(data: bytes):
    """(type, seq, body) of each netlink message in one datagram."""
    offset = 0
    while offset + 16 <= len(data):
        length, kind, _flags, seq, _pid = struct.unpack_from("=IHHII", data, offset)
        if length < 16:
            return
        yield kind, seq, data[offset + 16: offset + length]
        offset += (length + 3) & ~3


def _packet_id(attrs: bytes) -> int | None:
    offset = 0
    while offset + 4 <= len(attrs):
        length, kind = struct.unpack_from("=HH", attrs, offset)
        if length < 4:
            return None
        if kind & 0x3FFF == NFQA_PACKET_HDR and length >= 8:
            return struct.unpack_from("!I", attrs, offset + 4)[0]
        offset += (length + 3) & ~3
    return None


def _queue_spec(text: str) -> tuple[int, float, float]:
    number, delay, jitter = text.split(":")
    return int(number), float(delay) / 1000, float(jitter) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queue", action="append", type=_queue_spec, required=True,
                        help="NUMBER:DELAY_MS:JITTER_MS (repeat for each queue)")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    parent = os.getppid()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        delayer = Delayer({q: (d, j) for q, d, j in args.queue}, args.seed)
    except OSError as exc:
        print(f"delay: {exc.strerror or exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    print("ready", flush=True)
    try:
        delayer.run(parent)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
