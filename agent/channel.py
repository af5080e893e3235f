"""The control channel's shared half: its error, the client's one request, the job lookup by ID prefix.

agent/control.py is the daemon's side (the socket server and its handlers); it merges the handlers of
agent/jobdata.py. Both raise ``ControlError`` and look a job up with ``find_job``, and the CLI, the demo,
the soak and the pipeline ask the agent with ``request``: those live here, below all of them, so that
no module of the channel imports another back (issue 23). The rules of the channel are agent/control.py's.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent.node import Agent

MAX_RESPONSE = 16 << 20


class ControlError(Exception):
    """The control channel failed or the agent refused a request; ``str()`` is the one line to show."""


# -- the CLI's side ----------------------------------------------------------------------------------

def request(home: Path, cmd: str, timeout: float = 30.0, **args: Any) -> Any:
    """Send one request to the agent in ``home``; its result, or ControlError with the agent's one line."""
    path = home / "control.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            raise ControlError(f"no agent is running in {home} (start one with `infernet agent run --home {home}`)") from None
        except OSError as exc:
            raise ControlError(f"{path}: cannot connect: {exc.strerror or exc}") from None
        sock.sendall(json.dumps({"cmd": cmd, "args": args}).encode() + b"\n")
        data = bytearray()
        while b"\n" not in data:
            chunk = sock.recv(1 << 20)
            if not chunk:
                break
            data += chunk
            if len(data) > MAX_RESPONSE:
                raise ControlError(f"the agent's answer is larger than {MAX_RESPONSE} bytes")
    except socket.timeout:
        raise ControlError(f"the agent in {home} did not answer {cmd!r} within {timeout:.0f} s") from None
    finally:
        sock.close()
    try:
        answer = json.loads(bytes(data).split(b"\n", 1)[0])
    except ValueError:
        raise ControlError(f"the agent in {home} closed the connection without an answer") from None
    if not answer.get("ok"):
        raise ControlError(answer.get("error") or "the agent refused the request")
    return answer["result"]


# -- the handlers' side --------------------------------------------------------------------------------

async def find_job(agent: "Agent", job: str) -> Any:
    """The view of the job whose hex ID starts with ``job`` (live, or rebuilt from the store in a
    worker thread: agent/node.py ``load_job_view``)."""
    text = str(job).lower()
    if len(text) < 4 or any(c not in "0123456789abcdef" for c in text):
        raise ControlError(f"{str(job)[:70]!r} is not a job ID (hex, at least 4 characters; see `infernet job list`)")
    matches = [r.job_id for r in agent.store.jobs() if r.job_id.hex().startswith(text)]
    matches += [j for j in agent.jobs if j.hex().startswith(text) and j not in matches]
    if not matches:
        raise ControlError(f"unknown job {text[:16]} (see `infernet job list`)")
    if len(matches) > 1:
        raise ControlError(f"job ID prefix {text} is ambiguous: {len(matches)} jobs match; give more characters")
    return await agent.load_job_view(matches[0])
