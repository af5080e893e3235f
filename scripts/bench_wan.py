"""WAN figures: agents on separate hosts (network namespaces, agent/harness/hosts.py) over shaped links.

Needs root, `ip`, `iptables`; the delay figures need the kernel's sch_netem or, without it, the
harness's userspace delayer (agent/harness/delay.py: iptables NFQUEUE; ``delay_method`` says which,
and every figure names it as ``"shaper"``). A figure that cannot be
measured here is not printed; its reason goes to stderr (``skipped: ...``). Figures (one JSON object
per line, ratio higher is better):

- transfer_over_link: MiB moved by ``ContentService.fetch`` (our block protocol, every block checked
  and stored) from a host whose link is capped at ``--rate`` Mbit/s to an unshaped host, as Mbit/s.
  Reference: the link's rate; goal 0.8 of it.
- gossip_p50_vs_rtt / gossip_p95_vs_rtt: one-hop gossip delivery between two hosts whose links add
  ``--delay`` ms each to a round trip (so one way is ``--delay`` ms, both links together), in ms.
  Reference: that one-way delay; ratio = reference / value (1.0: gossip adds nothing to the link).
- job_wall_time_wan: the wall time of a 1-round, 2-shard job with agents on separate hosts, every
  link adding ``--delay`` ms; reference: the same job on unshaped hosts; ratio = reference / value,
  goal 1 / 1.3 (at most 1.3 times slower). The median of ``--repeat`` runs each, alternated.
- swarm_fetch_over_links: seconds until each of ``--members`` hosts holds a ``--swarm-mib`` MiB file that one
  seed host holds, every host's link capped at ``--rate`` Mbit/s and adding ``--delay`` ms, when the members
  fetch it together (``ContentService.fetch(swarm=...)``, IPIP-0003 §4.2: each takes its share from the seed
  and the rest from each other). Reference: the same members each fetching the whole file from the seed at
  once (the plain fetch); ratio = reference / value (a speedup), goal 2.0 at 3 members. The median of
  ``--repeat`` runs each, alternated, every run with fresh processes and empty blockstores.
- announce_to_all_leased_wan: in the same jobs, seconds from the job's announcement to the
  submitter's mirror holding a lease of every shard (each shard's first lease), read from the run's
  trace (``trace.jsonl``: the ``job`` line, then the ``recv`` lines of type ``lease`` at the
  submitter). Reference: the same at 0 ms; ratio = reference / value; no goal (a lease waits on
  gossip round trips and the claim window, so it is reported, not judged).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.harness.hosts import Hosts, HostSpec, Link, delay_method, unavailable_reason  # noqa: E402

MiB = 1 << 20
PORT = 4101


def emit(bench: str, value: float, unit: str, reference: float, goal: float | None, *,
         lower_is_better: bool = False, **extra: object) -> None:
    ratio = reference / value if lower_is_better else value / reference
    print(json.dumps({"bench": bench, "value": round(value, 2), "unit": unit, "reference": round(reference, 2),
                      "ratio": round(ratio, 3), "goal": goal, **extra}), flush=True)


def skipped(bench: str, reason: str) -> None:
    print(f"skipped: {bench}: {reason}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# -- the two sides, each run in its host's namespace (``--role``) -----------------------------------


async def serve(address: str, mib: int, work: Path, gossip: int) -> None:
    """Add ``mib`` MiB and print our address and its CID; publish ``gossip`` timestamped messages."""
    from agent.content.service import open_content
    from agent.net.host import NetConfig
    from agent.net.stack import open_network
    from protocol.identity import Identity
    from protocol.messages import TOPIC_JOBS, Heartbeat

    identity = Identity.generate()  # noqa: F841 - the network signs with it
    async with open_network(identity, NetConfig(listen=(address,))) as net, \
            open_content(net.host, net.discovery, work / "serve") as content:
        path = work / "data.bin"
        path.write_bytes(os.urandom(mib * MiB))
        cid = await content.add_file(path, provide=False)
        print(json.dumps({"addr": net.host.addrs()[0], "cid": str(cid)}), flush=True)
        await net.gossip.subscribe(TOPIC_JOBS)
        await trio.to_thread.run_sync(sys.stdin.readline)  # the fetcher is subscribed
        sent = {}
        for seq in range(1, gossip + 1):
            sent[seq] = time.time()
            await net.gossip.publish(Heartbeat(seq=seq, active_shards=0, coordinating=()))
            await trio.sleep(0.2)
        print(json.dumps({"sent": sent}), flush=True)
        await trio.to_thread.run_sync(sys.stdin.readline)  # done


async def fetch(address: str, peer: str, cid: str, work: Path, gossip: int) -> None:
    from agent.content.service import open_content
    from agent.net.host import NetConfig
    from agent.net.stack import open_network
    from protocol.identity import Identity
    from protocol.messages import TOPIC_JOBS

    async with open_network(Identity.generate(), NetConfig(listen=(address,), bootstrap=(peer,))) as net, \
            open_content(net.host, net.discovery, work / "fetch", idle_timeout=120) as content:
        started = time.perf_counter()
        await content.fetch(cid, work / "out.bin", providers=[peer], timeout=600)
        seconds = time.perf_counter() - started
        sub = await net.gossip.subscribe(TOPIC_JOBS)
        await trio.sleep(3)  # the mesh forms
        print(json.dumps({"seconds": seconds, "subscribed": True}), flush=True)
        arrived: dict[int, float] = {}
        with trio.move_on_after(gossip * 0.2 + 30):
            async for received in sub:
                arrived.setdefault(received.message.seq, time.time())
                if len(arrived) >= gossip:
                    break
        print(json.dumps({"arrived": arrived}), flush=True)


async def member(address: str, seed: str, cid: str, work: Path) -> None:
    """A swarm member: print our address, read the members' addresses (one JSON line; empty: a plain
    fetch), connect to them, fetch ``cid`` from ``seed`` and print the seconds it took."""
    from agent.content.service import open_content
    from agent.net.host import NetConfig, parse_peer_multiaddr
    from agent.net.stack import open_network
    from protocol.identity import Identity

    async with open_network(Identity.generate(), NetConfig(listen=(address,), bootstrap=(seed,))) as net, \
            open_content(net.host, net.discovery, work / net.host.peer_id / "blocks", idle_timeout=120) as content:
        print(json.dumps({"addr": net.host.addrs()[0], "peer": net.host.peer_id}), flush=True)
        others = json.loads(await trio.to_thread.run_sync(sys.stdin.readline))
        for addr in others:
            if not addr.endswith(net.host.peer_id):
                await net.host.connect(parse_peer_multiaddr(addr, "member"), timeout=30)
        swarm = [addr.rsplit("/", 1)[-1] for addr in others]
        print(json.dumps({"ready": True}), flush=True)
        await trio.to_thread.run_sync(sys.stdin.readline)  # go
        started = time.perf_counter()
        report = await content.fetch(cid, work / net.host.peer_id / "out.bin", providers=[seed], timeout=600,
                                     use_dht=False, swarm=swarm)
        print(json.dumps({"seconds": time.perf_counter() - started, "from_seed":
                          report.swarm.from_seed if report.swarm else None}), flush=True)
        await trio.to_thread.run_sync(sys.stdin.readline)  # done


# -- the driver -------------------------------------------------------------------------------------


def swarm_figure(args: argparse.Namespace) -> None:
    delay = args.delay if delay_method() else 0.0
    link = Link(delay_ms=delay, rate_mbit=args.rate)
    names = ["seed"] + [f"m{i}" for i in range(args.members)]
    hosts = Hosts({name: HostSpec(name, link=link) for name in names}).create()
    me = [sys.executable, str(Path(__file__).resolve())]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    times: dict[bool, list[float]] = {False: [], True: []}
    try:
        for run in range(2 * args.repeat):
            together = run % 2 == 1
            work = Path(tempfile.mkdtemp(prefix="bench-swarm-"))
            processes: list[subprocess.Popen] = []
            try:
                server = subprocess.Popen(hosts.exec_prefix("seed") + me + [
                    "--role", "serve", "--address", f"/ip4/{hosts.ip('seed')}/tcp/{PORT}", "--mib",
                    str(args.swarm_mib), "--work", str(work)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    text=True, env=env)
                processes.append(server)
                hello = json.loads(server.stdout.readline())
                members = []
                for name in names[1:]:
                    process = subprocess.Popen(hosts.exec_prefix(name) + me + [
                        "--role", "member", "--address", f"/ip4/{hosts.ip(name)}/tcp/{PORT}", "--peer",
                        hello["addr"], "--cid", hello["cid"], "--work", str(work)], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, text=True, env=env)
                    processes.append(process)
                    members.append(process)
                addrs = [json.loads(process.stdout.readline())["addr"] for process in members]
                for process in members:
                    process.stdin.write(json.dumps(addrs if together else []) + "\n")
                    process.stdin.flush()
                for process in members:
                    json.loads(process.stdout.readline())  # ready
                for process in members:
                    process.stdin.write("go\n")
                    process.stdin.flush()
                seconds = max(json.loads(process.stdout.readline())["seconds"] for process in members)
                times[together].append(seconds)
                print(f"swarm figure: run {run + 1}: {'together' if together else 'plain'} {seconds:.2f} s",
                      file=sys.stderr, flush=True)
            finally:
                for process in processes:
                    if process.poll() is None:
                        process.kill()
                        process.wait()
                subprocess.run(["rm", "-rf", str(work)])
    finally:
        hosts.close()
    plain, together = sorted(times[False])[len(times[False]) // 2], sorted(times[True])[len(times[True]) // 2]
    emit("swarm_fetch_over_links", together, "s", plain, 2.0, lower_is_better=True, members=args.members,
         mib=args.swarm_mib, delay_ms=delay, rate_mbit=args.rate, runs=args.repeat,
         plain_s=[round(t, 2) for t in times[False]], together_s=[round(t, 2) for t in times[True]],
         shaper=delay_method() or "tbf")



def link_figures(args: argparse.Namespace) -> None:
    delay = args.delay if delay_method() else 0.0
    if not delay_method():
        skipped("gossip_p50_vs_rtt", "no way to delay a link here (no sch_netem, no NFQUEUE delayer); gossip is "
                "measured on rate-shaped links only")
    hosts = Hosts({"src": HostSpec("src", link=Link(delay_ms=delay, rate_mbit=args.rate)),
                   "dst": HostSpec("dst", link=Link(delay_ms=delay))}).create()
    work = Path(tempfile.mkdtemp(prefix="bench-wan-"))
    me = [sys.executable, str(Path(__file__).resolve())]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    server = client = None
    try:
        server = subprocess.Popen(hosts.exec_prefix("src") + me + [
            "--role", "serve", "--address", f"/ip4/{hosts.ip('src')}/tcp/{PORT}", "--mib", str(args.mib),
            "--work", str(work), "--gossip", str(args.messages)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=env)
        hello = json.loads(server.stdout.readline())
        client = subprocess.Popen(hosts.exec_prefix("dst") + me + [
            "--role", "fetch", "--address", f"/ip4/{hosts.ip('dst')}/tcp/{PORT}", "--peer", hello["addr"],
            "--cid", hello["cid"], "--work", str(work), "--gossip", str(args.messages)],
            stdout=subprocess.PIPE, text=True, env=env)
        fetched = json.loads(client.stdout.readline())
        mbit = args.mib * MiB * 8 / 1e6 / fetched["seconds"]
        emit("transfer_over_link", mbit, "Mbit/s", args.rate, 0.8, mib=args.mib, delay_ms=delay,
             shaper="netem" if delay_method() == "netem" else "tbf+nfqueue" if delay else "tbf")
        server.stdin.write("go\n")
        server.stdin.flush()
        arrived = json.loads(client.stdout.readline())["arrived"]
        sent = json.loads(server.stdout.readline())["sent"]
        server.stdin.write("done\n")
        server.stdin.flush()
        delays = [(arrived[seq] - sent[seq]) * 1000 for seq in arrived if seq in sent]
        if delays and delay:
            one_way = delay  # each link adds delay/2 each way; two links
            emit("gossip_p50_vs_rtt", percentile(delays, 0.5), "ms", one_way, None, lower_is_better=True,
                 received=len(delays), shaper=delay_method())
            emit("gossip_p95_vs_rtt", percentile(delays, 0.95), "ms", one_way, None, lower_is_better=True,
                 received=len(delays), shaper=delay_method())
        elif delays:
            print(f"gossip one hop over rate-shaped, undelayed links: p50 {percentile(delays, 0.5):.1f} ms, "
                  f"p95 {percentile(delays, 0.95):.1f} ms ({len(delays)} messages)", file=sys.stderr)
    finally:
        for process in (client, server):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
        hosts.close()
        subprocess.run(["rm", "-rf", str(work)])


def job_figure(args: argparse.Namespace) -> None:
    if not delay_method():
        skipped("job_wall_time_wan", "no way to delay a link here (no sch_netem, no NFQUEUE delayer)")
        return
    from agent.harness.scenario import parse_scenario, run_scenario
    from agent.train.tiny import tiny_model

    model = tiny_model()

    def scenario(delay: float) -> object:
        link = f", link: {{delay: {delay:g}ms}}" if delay else ""
        return parse_scenario(f"""name: bench-wan\ntimeout: 600\nagents: {{workers: 2}}\nhosts:
  a: {{agents: [submitter]{link}}}\n  b: {{agents: [w0]{link}}}\n  c: {{agents: [w1]{link}}}
job: {{shards: 2, rounds: 1}}\n""", "bench-wan")

    times: dict[float, list[float]] = {0.0: [], args.delay: []}
    leased: dict[float, list[float]] = {0.0: [], args.delay: []}
    for _ in range(args.repeat):  # alternate, so a busy spell of the machine hits both alike
        for delay in (0.0, args.delay):
            with tempfile.TemporaryDirectory() as out:
                result = trio.run(lambda: run_scenario(scenario(delay), Path(out), model_dir=model))
                if not result.ok:
                    print(result.summary, file=sys.stderr)
                    return
                times[delay].append(result.seconds)
                if result.trace_path is not None and (seconds := announce_to_all_leased(result.trace_path, 2)) is not None:
                    leased[delay].append(seconds)
    print(f"job wall times (s): unshaped {[round(t, 1) for t in times[0.0]]}, "
          f"{args.delay:g} ms {[round(t, 1) for t in times[args.delay]]}", file=sys.stderr, flush=True)
    emit("job_wall_time_wan", percentile(times[args.delay], 0.5), "s", percentile(times[0.0], 0.5), round(1 / 1.3, 3),
         lower_is_better=True, delay_ms=args.delay, shaper=delay_method(), runs=args.repeat)
    if leased[0.0] and leased[args.delay]:
        print(f"announce to all leased (s): unshaped {[round(t, 2) for t in leased[0.0]]}, "
              f"{args.delay:g} ms {[round(t, 2) for t in leased[args.delay]]}", file=sys.stderr, flush=True)
        emit("announce_to_all_leased_wan", percentile(leased[args.delay], 0.5), "s", percentile(leased[0.0], 0.5),
             None, lower_is_better=True, delay_ms=args.delay, shaper=delay_method(), runs=len(leased[args.delay]))
    else:
        skipped("announce_to_all_leased_wan", "a run's trace lacks the announcement or a shard's lease")


def announce_to_all_leased(trace_path: Path, shards: int) -> float | None:
    """Seconds from the job's announcement to the submitter's mirror holding a lease of every shard of
    round 1 (each shard's first lease), from a harness trace; None if the trace lacks either."""
    from agent.harness.trace import read_trace

    lines = read_trace(trace_path)
    announced = next((line["t"] for line in lines if line["kind"] == "job"), None)
    first: dict[int, float] = {}
    for line in lines:
        if (line["kind"] == "recv" and line.get("agent") == "submitter" and line.get("type") == "lease"
                and line.get("round") == 1):
            first.setdefault(line["shard"], line["t"])
    if announced is None or len(first) < shards:
        return None
    return max(first.values()) - announced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=20.0, help="the serving host's link, Mbit/s")
    parser.add_argument("--delay", type=float, default=80.0, help="ms each link adds to a round trip")
    parser.add_argument("--mib", type=int, default=50)
    parser.add_argument("--messages", type=int, default=50)
    parser.add_argument("--skip-job", action="store_true")
    parser.add_argument("--skip-link", action="store_true", help="only the job's wall time")
    parser.add_argument("--repeat", type=int, default=3, help="jobs run at each delay (the median counts)")
    parser.add_argument("--skip-swarm", action="store_true", help="no swarm_fetch_over_links figure")
    parser.add_argument("--only-swarm", action="store_true", help="only the swarm_fetch_over_links figure")
    parser.add_argument("--members", type=int, default=3, help="hosts fetching together in the swarm figure")
    parser.add_argument("--swarm-mib", type=int, default=8, help="the swarm figure's file, MiB")
    parser.add_argument("--role", choices=("serve", "fetch", "member"), help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    parser.add_argument("--cid", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--gossip", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "serve":
        trio.run(serve, args.address, args.mib, args.work, args.gossip)
        return
    if args.role == "fetch":
        trio.run(fetch, args.address, args.peer, args.cid, args.work, args.gossip)
        return
    if args.role == "member":
        import logging
        logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
        logging.getLogger("agent.content.service").setLevel(logging.INFO)  # the swarm's line: where the parts came from
        trio.run(member, args.address, args.peer, args.cid, args.work)
        return
    reason = unavailable_reason()
    if reason:
        skipped("all", reason)
        sys.exit(0)
    if args.only_swarm:
        swarm_figure(args)
        return
    if not args.skip_link:
        link_figures(args)
    if not args.skip_swarm:
        swarm_figure(args)
    if not args.skip_job:
        job_figure(args)


if __name__ == "__main__":
    main()
