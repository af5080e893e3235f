"""Network figures: gossip latency among 10 agents; file transfer over Bitswap, our block protocol
and a raw Noise+Yamux stream. Real py-libp2p hosts on loopback, all in this one process.

Figures (one JSON object per line, each with a reference measured in the same run):
- gossip_latency_p50_to_all / _p95_to_all: for each of ``--messages`` signed messages published by a
  rotating sender, the time until the last of the other 9 agents has it (validated at every hop).
  Reference: one GossipSub heartbeat (1000 ms), ratio = reference / value, goal 1.0 (the p95 to all
  within one heartbeat); ``one_hop_ms`` is the same percentile of a one-hop delivery of a frame
  over an open raw stream between two of the agents, for comparison.
- gossip_cpu_per_delivery_{N}_agents: the process's CPU time (every thread) per message delivered to an
  agent, while every agent publishes a signed heartbeat every ``--cpu-interval`` s. Reference: the same
  agents with py-libp2p 0.8.1's own ways, in alternating phases of the same run (``--cpu-phases`` of
  ``--cpu-seconds`` each): a Yamux window update sent back after every read (agent/net/host.py
  ``_batch_window_updates``) and every RPC's signed peer record verified again (agent/net/gossip.py
  ``_check_each_peer_record_once``).
  Ratio = reference / value (a speedup), goal 1.2.
- transfer_raw_stream / transfer_blocks_protocol / transfer_bitswap: MiB/s moving a ``--mib`` MiB
  file from one agent to another. Raw: the provider writes the bytes in 256 KiB pieces into one
  stream, nothing checked or stored. Ours and Bitswap: a complete ``ContentService.fetch`` into an
  empty blockstore (every block hash-checked, stored, and the file written). Reference: the raw
  stream; goal for ours: 0.8 of it. Each side is the best of ``--repeats`` interleaved runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.content.service import VIA_BITSWAP, VIA_BLOCKS, open_content  # noqa: E402
from libp2p.pubsub import gossipsub, pubsub  # noqa: E402
from libp2p.stream_muxer.yamux.yamux import YamuxStream  # noqa: E402

import agent.net.gossip  # noqa: E402,F401  (its py-libp2p patches: measured against their .original)
from agent.net.host import NetConfig  # noqa: E402
from agent.net.stack import open_network  # noqa: E402
from agent.net.streams import FrameReader, frame  # noqa: E402
from protocol.identity import Identity  # noqa: E402
from protocol.messages import TOPIC_JOBS, Heartbeat  # noqa: E402

MiB = 1 << 20
PIECE = 256 * 1024
GOSSIP_GOAL_MS = 1000.0
CPU_GOAL = 1.2
OUR_RECORD_CHECK = pubsub.maybe_consume_signed_record  # agent/net/gossip.py's; .original is py-libp2p's
OUR_WINDOW_UPDATE = YamuxStream._auto_tune_and_send_window_update  # agent/net/host.py's; .original likewise
TRANSFER_GOAL = 0.8
TRANSFER_TIMEOUT = 300.0  # one transfer; a stalled one fails the bench instead of hanging it


def emit(bench: str, value: float, unit: str, reference: float, goal: float | None, *,
         lower_is_better: bool = False, **extra: float) -> None:
    """One figure; ``ratio`` is always how good against the reference, higher is better (README)."""
    ratio = reference / value if lower_is_better else value / reference
    print(json.dumps({"bench": bench, "value": round(value, 2), "unit": unit, "reference": round(reference, 2),
                      "ratio": round(ratio, 3), "goal": goal, **{k: round(v, 2) for k, v in extra.items()}}),
          flush=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def start_agents(stack: AsyncExitStack, count: int) -> list:
    first = await stack.enter_async_context(open_network(Identity.generate()))
    config = NetConfig(bootstrap=(first.host.addrs()[0],))
    nets = [first]
    for _ in range(count - 1):
        nets.append(await stack.enter_async_context(open_network(Identity.generate(), config)))
    return nets


async def gossiping_agents(stack: AsyncExitStack, count: int) -> list:
    """``count`` agents that found each other through the DHT's workers key, as agents do."""
    nets = await start_agents(stack, count)
    async with trio.open_nursery() as nursery:
        for net in nets:
            nursery.start_soon(net.discovery.advertise_worker)
    async with trio.open_nursery() as nursery:
        for net in nets:
            nursery.start_soon(net.discovery.find_workers)
    return nets


async def meshed(nets: list) -> list:
    """Each agent's subscription to the jobs topic, once every agent has a mesh peer on it."""
    subs = [await net.gossip.subscribe(TOPIC_JOBS) for net in nets]
    with trio.fail_after(30):
        while not all(net.gossip.mesh_peers(TOPIC_JOBS) for net in nets):
            await trio.sleep(0.05)
    return subs


async def bench_gossip(count: int, messages: int) -> None:
    async with AsyncExitStack() as stack:
        nets = await gossiping_agents(stack, count)
        arrivals: dict[int, dict[str, float]] = {}

        async def receive(net, sub) -> None:
            async for received in sub:
                arrivals.setdefault(received.message.seq, {})[net.peer_id] = time.perf_counter()

        subs = await meshed(nets)
        await trio.sleep(2.0)  # let a couple of heartbeats settle the meshes

        to_all: list[float] = []
        async with trio.open_nursery() as nursery:
            for net, sub in zip(nets, subs):
                nursery.start_soon(receive, net, sub)
            for seq in range(messages):
                sender = nets[seq % count]
                others = {n.peer_id for n in nets} - {sender.peer_id}
                sent = time.perf_counter()
                await sender.gossip.publish(Heartbeat(seq=seq, active_shards=0, coordinating=()))
                with trio.fail_after(10):
                    while not others <= arrivals.get(seq, {}).keys():
                        await trio.sleep(0.001)
                to_all.append(max(arrivals[seq][p] for p in others) - sent)
                await trio.sleep(0.05)
            nursery.cancel_scope.cancel()

        one_hop = await one_hop_latencies(nets[0], nets[1], messages)
        for name, q in (("p50", 0.5), ("p95", 0.95)):
            emit(f"gossip_latency_{name}_to_all_{count}_agents", percentile(to_all, q) * 1000, "ms",
                 GOSSIP_GOAL_MS, 1.0, lower_is_better=True, one_hop_ms=percentile(one_hop, q) * 1000)


def libp2p_defaults(on: bool) -> None:
    """Switch py-libp2p's own ways (a window update per read, every peer record verified) on or off."""
    chosen = OUR_RECORD_CHECK.original if on else OUR_RECORD_CHECK
    for module in (pubsub, gossipsub):
        module.maybe_consume_signed_record = chosen
    YamuxStream._auto_tune_and_send_window_update = OUR_WINDOW_UPDATE.original if on else OUR_WINDOW_UPDATE


async def bench_gossip_cpu(count: int, seconds: float, phases: int, interval: float) -> None:
    async with AsyncExitStack() as stack:
        nets = await gossiping_agents(stack, count)
        delivered = 0

        async def receive(sub) -> None:
            nonlocal delivered
            async for _ in sub:
                delivered += 1

        async def beat(net, offset: float) -> None:
            await trio.sleep(offset)
            seq = 0
            while True:
                seq += 1
                await net.gossip.publish(Heartbeat(seq=seq, active_shards=0, coordinating=()))
                await trio.sleep(interval)

        subs = await meshed(nets)
        spent = {True: [0.0, 0], False: [0.0, 0]}  # py-libp2p's ways on: [CPU seconds, deliveries]
        async with trio.open_nursery() as nursery:
            for sub in subs:
                nursery.start_soon(receive, sub)
            for i, net in enumerate(nets):
                nursery.start_soon(beat, net, interval * i / count)
            await trio.sleep(2.0)  # let the meshes settle
            for phase in range(2 * phases):
                defaults = phase % 2 == 0
                libp2p_defaults(defaults)
                await trio.sleep(1.0)  # what the last phase left in flight is not counted
                cpu, before = time.process_time(), delivered
                await trio.sleep(seconds)
                spent[defaults][0] += time.process_time() - cpu
                spent[defaults][1] += delivered - before
            nursery.cancel_scope.cancel()
        libp2p_defaults(False)
        ours, reference = (spent[k][0] / max(1, spent[k][1]) * 1000 for k in (False, True))
        emit(f"gossip_cpu_per_delivery_{count}_agents", ours, "ms", reference, CPU_GOAL, lower_is_better=True,
             deliveries=spent[False][1], reference_deliveries=spent[True][1])


async def one_hop_latencies(a, b, count: int) -> list[float]:
    """Delivery times of small frames over an open raw stream from b to a."""
    arrived: list[float] = []

    async def sink(stream) -> None:
        reader = FrameReader(stream, chunk=4096)
        for _ in range(count):
            await reader.read_frame(1024)
            arrived.append(time.perf_counter())

    a.host.set_handler("/bench/one-hop/1", sink, timeout=60)
    stream = await b.host.open_stream(a.peer_id, ["/bench/one-hop/1"])
    latencies = []
    for i in range(count):
        sent = time.perf_counter()
        await stream.write(frame(b"x" * 200))
        with trio.fail_after(10):
            while len(arrived) <= i:
                await trio.sleep(0.0005)
        latencies.append(arrived[i] - sent)
        await trio.sleep(0.01)
    await stream.close()
    return latencies


async def bench_transfer(mib: int, repeats: int, workdir: Path) -> None:
    data = os.urandom(mib * MiB)
    source = workdir / "source.bin"
    source.write_bytes(data)
    async with AsyncExitStack() as stack:
        provider, fetcher = await start_agents(stack, 2)
        provider_content = await stack.enter_async_context(open_content(provider.host, provider.discovery, workdir / "p"))
        root = await provider_content.add_file(source, provide=False)
        piece = data[:PIECE]

        async def raw_source(stream) -> None:
            await stream.read(16)
            for _ in range(len(data) // PIECE):
                await stream.write(piece)

        provider.host.set_handler("/bench/raw/1", raw_source, timeout=300)

        async def raw() -> float:
            start = time.perf_counter()
            stream = await fetcher.host.open_stream(provider.peer_id, ["/bench/raw/1"])
            received = 0
            with trio.fail_after(TRANSFER_TIMEOUT):  # as a fetch: the whole transfer has a deadline
                await stream.write(b"go")
                while True:
                    try:
                        chunk = await stream.read(1 << 20)
                    except EOFError:
                        break
                    if not chunk:
                        break
                    received += len(chunk)
            await stream.close()
            assert received == len(data), received
            return time.perf_counter() - start

        async def fetch(via: str) -> float:
            # an empty blockstore in a new directory each time, all deleted only when the bench
            # ends: deleting 2 x --mib MiB of files between runs made the file system's deferred
            # work land in whichever run came next (--repeats x 4 x --mib MiB of disk until then)
            store_dir = workdir / f"f-{via}-{time.perf_counter_ns()}"
            async with open_content(fetcher.host, fetcher.discovery, store_dir) as content:
                out = store_dir / "out.bin"
                start = time.perf_counter()
                await content.fetch(root, out, providers=[provider.peer_id], use_dht=False, via=via,
                                    timeout=TRANSFER_TIMEOUT)
                elapsed = time.perf_counter() - start
                assert out.stat().st_size == len(data)
            return elapsed

        best = {"raw": float("inf"), VIA_BLOCKS: float("inf"), VIA_BITSWAP: float("inf")}
        for _ in range(repeats):
            best["raw"] = min(best["raw"], await raw())
            best[VIA_BLOCKS] = min(best[VIA_BLOCKS], await fetch(VIA_BLOCKS))
            best[VIA_BITSWAP] = min(best[VIA_BITSWAP], await fetch(VIA_BITSWAP))
        raw_rate = mib / best["raw"]
        emit("transfer_raw_stream", raw_rate, "MiB/s", raw_rate, None)
        emit("transfer_blocks_protocol", mib / best[VIA_BLOCKS], "MiB/s", raw_rate, TRANSFER_GOAL)
        emit("transfer_bitswap", mib / best[VIA_BITSWAP], "MiB/s", raw_rate, None)


async def main(args: argparse.Namespace) -> None:
    await bench_gossip(args.agents, args.messages)
    await bench_gossip_cpu(args.agents, args.cpu_seconds, args.cpu_phases, args.cpu_interval)
    with tempfile.TemporaryDirectory(prefix="bench_net_") as tmp:
        await bench_transfer(args.mib, args.repeats, Path(tmp))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=10)
    parser.add_argument("--messages", type=int, default=60)
    parser.add_argument("--cpu-seconds", type=float, default=10.0)
    parser.add_argument("--cpu-phases", type=int, default=3)
    parser.add_argument("--cpu-interval", type=float, default=0.5)
    parser.add_argument("--mib", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    logging.basicConfig(level=logging.ERROR)
    trio.run(main, parser.parse_args())
