"""`infernet agent run`: one agent, headless, until SIGTERM or SIGINT.

Rules of this file:
- The daemon is an Agent (agent/node.py) plus three small faces served inside the Agent's nursery:
  the control socket (agent/control.py), an optional Prometheus endpoint on 127.0.0.1 only, and
  logs as JSON lines (stdout or a file).
- SIGTERM or SIGINT stops the agent cleanly: active shards are released (ShardRelease), every task
  ends, the control socket file is removed, and the process exits 0.
- When ready, the daemon logs one ``"ready"`` line with its peer ID and addresses; the control
  socket answers from then on.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import trio

from agent.config import CONTROL_SOCKET
from agent.control import bind_control_socket, serve_control

if TYPE_CHECKING:
    from agent.node import Agent, AgentConfig
    from protocol.identity import Identity

log = logging.getLogger("agent.daemon")

METRICS_READ_TIMEOUT = 5.0


class JsonLines(logging.Formatter):
    """One JSON object per log record: time, level, logger, message (and the exception's one line)."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
                "msg": record.getMessage()}
        if record.exc_info and record.exc_info[1] is not None:
            line["error"] = f"{type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
        for key in ("peer_id", "addrs", "loop_blocked_s"):
            if hasattr(record, key):
                line[key] = getattr(record, key)
        return json.dumps(line, default=str)


def setup_logging(stream: TextIO, verbose: bool = False) -> None:
    # py-libp2p's package __init__ resets the "libp2p" logger (no handlers, no propagation) when it
    # is first imported: imported after this setup, its records would go to Python's last-resort
    # stderr handler (plain "Failed to read DHT message from stream" lines on `harness run`'s
    # terminal). Both callers (agent run, harness run) load it anyway, so load it first.
    import libp2p  # noqa: F401

    from agent.net.lognoise import DemoteLibp2pNoise

    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonLines())
    # the handler has the level, so py-libp2p's per-peer failures, demoted to DEBUG by the filter
    # after their logger's level check, stay out of the default log (agent/net/lognoise.py)
    handler.setLevel(logging.DEBUG if verbose else logging.INFO)
    handler.addFilter(DemoteLibp2pNoise(handler))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    # py-libp2p installs its own stderr handler and logs its connection manager's every round at INFO
    libp2p = logging.getLogger("libp2p")
    libp2p.handlers[:] = [handler]
    libp2p.propagate = False
    libp2p.setLevel(logging.DEBUG if verbose else logging.WARNING)
    for name, child in list(logging.root.manager.loggerDict.items()):
        if name.startswith("libp2p.") and isinstance(child, logging.Logger):
            child.handlers.clear()
            child.setLevel(logging.NOTSET)
            child.propagate = True
    logging.getLogger("multiaddr").setLevel(logging.WARNING)
    # bitsandbytes warns on import that its optional CPU kernels are missing; nothing to act on
    logging.getLogger("bitsandbytes").setLevel(logging.DEBUG if verbose else logging.ERROR)


def run_daemon(identity: "Identity", config: "AgentConfig", *, metrics_port: int | None = None) -> int:
    try:
        trio.run(_main, identity, config, metrics_port)
    finally:
        for timer in _exit_timers:  # trio.run returned: the process ends (or goes on) normally
            timer.cancel()
        _exit_timers.clear()
    _end_process()
    return 0  # not reached


def _end_process() -> None:
    """End a stopped agent's process at once, with status 0.

    Everything of ours is closed when trio.run returns (the store too). What can remain is a thread
    still inside torch: training abandoned by the stop's cancellation (``abandon_on_cancel``). Letting
    the interpreter finalize then destroys C++ thread objects still joinable, and the process dies
    with SIGABRT (``terminate called without an active exception``; the 30-minute soak saw it once in
    19 SIGTERMs, exit -6). Logs and standard streams are flushed first."""
    import os

    for handler in logging.getLogger().handlers:
        handler.flush()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


async def _main(identity: "Identity", config: "AgentConfig", metrics_port: int | None) -> None:
    from agent.node import Agent
    from agent.writer import StoreNotOpened

    if config.threads:
        import os

        os.environ.setdefault("OMP_NUM_THREADS", str(config.threads))
    agent = Agent(identity, config)
    socket_path = config.home / CONTROL_SOCKET
    listener = bind_control_socket(socket_path)  # before the network: a second daemon in this home stops here
    try:
        # before the network too: a port in use is one line at once, not after the agent started (~17 s)
        metrics = None if metrics_port is None else await bind_metrics(metrics_port)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                # heard from the start: a SIGTERM while the agent waits to open its store stops it too
                nursery.start_soon(_stop_on_signal, agent, signals)

                async def run_agent(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                    try:
                        await agent.run(task_status=task_status)
                    finally:
                        nursery.cancel_scope.cancel()  # the signal watcher with it

                try:
                    await nursery.start(run_agent)
                except StoreNotOpened:
                    nursery.cancel_scope.cancel()
                else:
                    agent.nursery.start_soon(serve_control, agent, listener)
                    if metrics is not None:
                        agent.nursery.start_soon(serve_metrics, agent, metrics)
                    log.info("ready: %s listening on %s", agent.peer_id, " ".join(agent.addrs()),
                             extra={"peer_id": agent.peer_id, "addrs": agent.addrs()})
        log.info("stopped")
        _exit_if_stuck(EXIT_GRACE)
    finally:
        socket_path.unlink(missing_ok=True)


EXIT_GRACE = 5.0  # seconds from "stopped" to the process's end before it ends itself


def _exit_if_stuck(grace: float) -> None:
    """Everything of ours is stopped and closed (the store too) when "stopped" is logged; what can
    remain is py-libp2p connection tasks that ignore cancellation. The chaos soak saw 4 agents, all
    stopped at once, log "stopped" within 0.4 s of SIGTERM and then run on in trio.run (yamux and
    pubsub stream readers) until they were killed 30 s later. Should trio.run not have returned
    ``grace`` seconds after "stopped", the process ends itself with status 0 (nothing is lost)."""
    import os
    import threading

    def end() -> None:
        log.warning("py-libp2p tasks still running %.0f s after the stop; ending the process", grace)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(0)

    timer = threading.Timer(grace, end)
    timer.daemon = True
    _exit_timers.append(timer)
    timer.start()


_exit_timers: list[Any] = []  # started by _exit_if_stuck, cancelled when trio.run returns


STOP_DIAGNOSE_AFTER = 20.0  # seconds: a stop still not done by then writes every thread's stack to stderr


async def _stop_on_signal(agent: "Agent", signals: Any) -> None:
    async for signum in signals:
        log.info("%s: stopping (active shards are released)", signal.Signals(signum).name)
        # the soak saw one agent in ~30 runs take more than 30 s to stop, cause not yet known: should it
        # happen, every thread's stack goes to stderr, where the operator (and the next fix) can read it
        import faulthandler

        faulthandler.dump_traceback_later(STOP_DIAGNOSE_AFTER, repeat=False, file=sys.stderr)
        agent.stop()
        return


# -- Prometheus text exposition ------------------------------------------------------------------------

def metrics_text(agent: "Agent") -> str:
    """A few gauges and counters in the Prometheus text format (version 0.0.4)."""
    lines = [
        "# HELP infernet_peers Other peers whose heartbeats arrive.", "# TYPE infernet_peers gauge",
        f"infernet_peers {len(agent.live_peers())}",
        "# HELP infernet_jobs Jobs this agent follows, by state.", "# TYPE infernet_jobs gauge",
    ]
    states: dict[str, int] = {}
    for view in agent.jobs.values():
        states[view.state.phase.value] = states.get(view.state.phase.value, 0) + 1
    lines += [f'infernet_jobs{{state="{state}"}} {n}' for state, n in sorted(states.items())]
    lines += ["# HELP infernet_active_shards Shards this agent is training now.", "# TYPE infernet_active_shards gauge",
              f"infernet_active_shards {len(agent.worker.active) if agent.worker else 0}"]
    for name, help_text in (("shards_trained", "Shards trained and reported."),
                            ("verdicts_accepted", "Reports this agent verified and accepted as coordinator."),
                            ("verdicts_rejected", "Reports this agent rejected as coordinator."),
                            ("aggregates_published", "Round aggregates this agent published as coordinator."),
                            ("leases_refused", "Claims this agent refused to lease as coordinator."),
                            ("task_restarts", "Service tasks restarted after a failure (agent/supervise.py)."),
                            ("task_failures", "Job and one-shot tasks that failed (logged; the agent went on).")):
        lines += [f"# HELP infernet_{name}_total {help_text}", f"# TYPE infernet_{name}_total counter",
                  f"infernet_{name}_total {agent.counters[name]}"]
    gossip = agent.net.gossip
    lines += ["# HELP infernet_gossip_invalid_total Gossip messages dropped for breaking the envelope rules.",
              "# TYPE infernet_gossip_invalid_total counter"]
    lines += [f"infernet_gossip_invalid_total {sum(gossip.invalid.values())}",
              "# HELP infernet_gossip_invalid_by_reason_total The same, by reason.",
              "# TYPE infernet_gossip_invalid_by_reason_total counter"]
    lines += [f'infernet_gossip_invalid_by_reason_total{{reason="{reason}"}} {n}'
              for reason, n in sorted(gossip.reasons.items())]
    watch = agent.loopwatch
    lines += ["# HELP infernet_event_loop_lag_seconds_max The longest the event loop was blocked (every network "
              "deadline of that time is missed).", "# TYPE infernet_event_loop_lag_seconds_max gauge",
              f"infernet_event_loop_lag_seconds_max {watch.lag_max:.3f}",
              f"# HELP infernet_event_loop_stalls_total Times the event loop was blocked over {watch.stall:g} s.",
              "# TYPE infernet_event_loop_stalls_total counter", f"infernet_event_loop_stalls_total {watch.stalls}"]
    lines += ["# HELP infernet_store_refusing_work 1 while the store cannot be written (a full disk): no new work.",
              "# TYPE infernet_store_refusing_work gauge",
              f"infernet_store_refusing_work {1 if agent.writer.store_full else 0}"]
    devices = getattr(agent.capabilities.machine, "devices", ()) or ()
    if devices:  # as measured for the last capability (free memory is measured again for each)
        for metric, field_name, help_text in (
                ("infernet_gpu_memory_total_bytes", "vram_total_gb", "Memory of each GPU."),
                ("infernet_gpu_memory_free_bytes", "vram_free_gb", "Free memory of each GPU at the last capability.")):
            lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} gauge"]
            lines += [f'{metric}{{device="{d.kind}:{d.index}",name="{_label(d.name)}"}} '
                      f"{int(getattr(d, field_name) * (1 << 30))}" for d in devices]
    lines += ["# HELP infernet_uptime_seconds Seconds since the agent started.", "# TYPE infernet_uptime_seconds gauge",
              f"infernet_uptime_seconds {time.time() - agent.started_at:.1f}"]
    return "\n".join(lines) + "\n"


def _label(text: str) -> str:
    """A Prometheus label value: backslash, quote and newline escaped."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


async def bind_metrics(port: int) -> list[trio.SocketListener]:
    """The metrics listener on 127.0.0.1:``port`` (never another interface); NetError naming the flag if
    the port is out of range or taken (not to be mistaken for the libp2p listen address)."""
    from agent.net.errors import NetError

    if not 0 <= port <= 65535:  # the OS would take it modulo 65536 and serve somewhere else
        raise NetError(f"--metrics-port: must be between 0 and 65535, got {port}")
    try:
        return await trio.open_tcp_listeners(port, host="127.0.0.1")
    except OSError as exc:
        raise NetError(f"--metrics-port {port}: cannot serve metrics on 127.0.0.1:{port}: "
                       f"{exc.strerror or exc}; choose another port (0 = any free one)") from None


async def serve_metrics(agent: "Agent", listeners: list[trio.SocketListener]) -> None:
    """Serve GET /metrics on ``listeners`` (``bind_metrics``)."""
    log.info("metrics on http://127.0.0.1:%d/metrics", listeners[0].socket.getsockname()[1])

    async def answer(stream: trio.SocketStream) -> None:
        async with stream:
            try:
                await _answer_metrics(agent, stream)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the scraper left
            except Exception:  # noqa: BLE001 - a metrics bug must not stop the agent
                log.exception("metrics request failed")

    await trio.serve_listeners(answer, listeners)


async def _answer_metrics(agent: "Agent", stream: trio.SocketStream) -> None:
    with trio.move_on_after(METRICS_READ_TIMEOUT):
        request = b""
        while b"\r\n\r\n" not in request and len(request) < 8192:
            chunk = await stream.receive_some(4096)
            if not chunk:
                return
            request += chunk
        path = request.split(b" ", 2)[1] if request.count(b" ") >= 2 else b""
        if path.split(b"?")[0] == b"/metrics":
            body, status = metrics_text(agent).encode(), b"200 OK"
        else:
            body, status = b"not found: try /metrics\n", b"404 Not Found"
        await stream.send_all(b"HTTP/1.1 " + status + b"\r\nContent-Type: text/plain; version=0.0.4\r\n"
                              b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)


def default_log_stream(log_file: Path | None) -> TextIO:
    if log_file is None:
        return sys.stdout
    log_file.parent.mkdir(parents=True, exist_ok=True)
    return open(log_file, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - lives as long as the process
