"""An operator's agent home: where its key, config, store and control socket live, and its config file.

Rules of this file:
- One home directory per agent (``--home``, else ``$INFERNET_HOME``, else ``~/.infernet``) holds
  ``identity.key`` (mode 0600, protocol/identity.py), ``config.toml``, the store, the blockstore,
  ``work/`` and, while the daemon runs, ``control.sock`` (agent/control.py).
- ``config.toml`` is read with tomllib. Its keys are the fields of ``AgentConfig`` (below)
  (``[models]`` is a table of base-model name -> local path); ``CONFIG_TEMPLATE`` is what
  ``infernet agent init`` writes, every key commented with what it means. An unknown key, a value
  of the wrong type or out of its range (``RANGES``), or an unreadable file is one ``ConfigError``
  line naming the file, the line, the key and what is allowed; flags are checked the same way.
- Command-line flags and the environment override the file (``INFERNET_ACCEPT_TRAINING=1``).
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

IDENTITY_FILE = "identity.key"
CONFIG_FILE = "config.toml"
CONTROL_SOCKET = "control.sock"


@dataclass(frozen=True)
class AgentConfig:
    """How one agent runs. Field names are the keys of the operator's config file."""

    home: Path
    listen: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    bootstrap: tuple[str, ...] = ()
    announce: tuple[str, ...] = ()  # addresses peers should dial instead of the listen ones (a forwarded port)
    relay: bool | str = False  # serve circuit relay v2 (within agent/net/reach.py RELAY_LIMITS) to unreachable
    # peers: true, false, or "auto" (while AutoNAT says we are public; an operator's config default)
    accept_training: bool = False
    can_coordinate: bool = True
    # a coordinator that trains claims one shard a round of the job it coordinates; another peer judges its
    # reports (protocol/leasing.py rule 1, IPIP-0004 §5.1): W machines train, not W - 1. Off by default
    coordinator_trains: bool = False
    # early start (IPIP-0006 §2.9): a coordinator announces a round's aggregate-to-be while the round's last
    # replays run, and a worker it names trains its next shard from it before the lease; both sides
    early_start: bool = True
    max_concurrent_shards: int = 1
    allowed_base_models: tuple[str, ...] = ()  # empty: any base model we have locally
    min_price_per_hour: float = 0.0
    price_per_hour: float = 0.0
    threads: int = 1
    train_processes: int = 0  # processes that train one shard: 0 = one per CUDA device (agent/train/parallel.py)
    models: tuple[tuple[str, str], ...] = ()  # (base_model name in a job, local path)
    heartbeat_seconds: float = 1.0
    missed_heartbeats: int = 5
    grace_seconds: float = 3.0
    # as a coordinator, end the lease of a holder not heard for this long (IPIP-0004 §5.3; at least twice the
    # heartbeat silence); 0: leases end only when they run out (lease_seconds)
    silent_holder_seconds: float = 15.0
    claim_interval: float = 1.0
    fetch_timeout: float = 120.0
    max_disk_gb: float = 0.0  # the most the home may use (agent/disk.py); 0 = no limit
    disk_grace_seconds: float = 120.0  # files younger than this are never collected (agent/disk.py GRACE)
    ipfs_api: str | None = None
    gossip_max_rate: float = 200.0  # messages per second accepted from one peer (its signed messages) ...
    gossip_max_burst: float = 400.0  # ... with this much burst; beyond it they are dropped at the first hop
    measure_speed: bool = False  # measure tokens/s per held model once (agent/market.py); `agent run` turns it on
    # a mirror holding another worker's messages asks their signer for its history (IPIP-0004 §11.1): off by
    # default (the simulator: a third fewer claims, about one job in a hundred less published)
    repair_from_senders: bool = False



class ConfigError(Exception):
    """The agent home or its config file is unusable; the message names the file and the key."""


def default_home() -> Path:
    return Path(os.environ.get("INFERNET_HOME") or Path.home() / ".infernet")


CONFIG_TEMPLATE = """\
# infernet agent configuration (TOML). Every key is optional; shown here at its default.
# Flags of `infernet agent run` override these (e.g. --listen, --bootstrap, --accept-training).

# Multiaddrs this agent listens on. Port 0 picks a free port; use a fixed port for a public node.
listen = ["/ip4/127.0.0.1/tcp/0"]

# Peers to join the network through: multiaddrs ending in /p2p/<peer id>.
bootstrap = []

# Addresses peers should dial to reach this agent, when they differ from `listen`: a router that
# forwards a public port here (e.g. ["/ip4/203.0.113.7/tcp/4001"]). Empty = the listen addresses.
announce = []

# Serve circuit relay v2 to agents behind a NAT: they reserve a slot here and are dialled through
# it, within per-circuit limits of time and bytes (600 s, 64 MiB). "auto": serve while AutoNAT says
# this agent is publicly reachable (peers dialled it back); true: always; false: never.
relay = "auto"

# Opt in to training other people's jobs on this machine (also: INFERNET_ACCEPT_TRAINING=1).
accept_training = false

# Offer to coordinate jobs (hand out leases, verify reports by replay, aggregate adapters).
can_coordinate = true

# While this agent coordinates a job, it also trains one shard a round of it (when it accepts training),
# after every other claimant; another peer judges its reports by replay. For networks where every machine
# should train (one shard per machine). Off: a coordinator only leases, verifies and aggregates.
coordinator_trains = false

# Early start: as a coordinator, announce a round's aggregate-to-be while the round's last replays run;
# as a worker, train the next round's shard it names before the lease comes (the work is announced only
# once the lease is ours and that aggregate is published). Off: rounds run one after the other.
early_start = true

# Shards this agent trains at the same time.
max_concurrent_shards = 1

# Base models this agent will train, by the name jobs use; empty = any model listed in [models].
allowed_base_models = []

# Refuse jobs that pay less than this per worker-hour; and what this agent advertises it asks.
min_price_per_hour = 0.0
price_per_hour = 0.0

# CPU threads torch may use for one training (recorded in the proof: it changes float results).
threads = 1

# Processes that train one shard together, data-parallel (NCCL on GPUs, gloo on the CPU):
# 0 = one per CUDA device this machine has (one without a GPU); 1 = always one process.
train_processes = 0

# An IPFS daemon's API multiaddr to also fetch from and add to (e.g. "/ip4/127.0.0.1/tcp/5001").
# ipfs_api = "/ip4/127.0.0.1/tcp/5001"

# Seconds a content fetch (dataset shard, adapter, checkpoint) may take before it gives up.
fetch_timeout = 120.0

# The most this agent's home (work directories, content blocks, its store) may use, in GB; 0 = no
# limit. What no running job needs any more is collected either way (every minute); with a limit, a
# shard is claimed only when one more piece of work still fits (agent/disk.py).
max_disk_gb = 0

# Seconds between heartbeats; a peer missing this many heartbeats is considered gone.
heartbeat_seconds = 1.0
missed_heartbeats = 5

# As a job's coordinator: end the lease of a worker not heard for this many seconds (no heartbeat, no
# checkpoint) while the other peers are heard, so its shard goes to another worker now instead of when
# the lease runs out (the job's lease_seconds). At least twice the heartbeat silence; 0 = never.
silent_holder_seconds = 15.0

# Gossip accepted from one peer (the messages it signs), per second and in a burst; beyond that its
# messages are dropped at the first hop (a flood stops here, and we are not blamed for relaying it).
gossip_max_rate = 200.0
gossip_max_burst = 400.0

# Measure this machine's training speed (tokens/s) once per held model with a short real training burst
# (cached in speeds.json here) and advertise it, so submitters can estimate a job's hours and cost.
measure_speed = true

# A job's mirror that holds another worker's messages it cannot apply asks their signer for its history
# (IPIP-0004 §11.1). Off: in the simulator it saved a third of the claims but published ~1 % fewer jobs.
repair_from_senders = false

# Base models held locally: the name a job's base_model uses = a local Hugging Face directory.
[models]
# "Qwen/Qwen2.5-0.5B-Instruct" = "/srv/models/qwen2.5-0.5b-instruct"

# Web search for `infernet train data --query` (not used by the agent). VALUESERP_API_KEY overrides it.
# [search]
# valueserp_api_key = "..."
"""

_TYPES: dict[str, type | tuple[type, ...]] = {
    "listen": list, "bootstrap": list, "announce": list, "relay": (bool, str), "accept_training": bool, "can_coordinate": bool, "coordinator_trains": bool,
    "early_start": bool, "max_concurrent_shards": int, "allowed_base_models": list, "min_price_per_hour": (int, float),
    "price_per_hour": (int, float), "threads": int, "train_processes": int, "ipfs_api": str, "fetch_timeout": (int, float),
    "max_disk_gb": (int, float),
    "heartbeat_seconds": (int, float), "missed_heartbeats": int, "grace_seconds": (int, float),
    "silent_holder_seconds": (int, float), "claim_interval": (int, float), "models": dict, "gossip_max_rate": (int, float),
    "gossip_max_burst": (int, float), "measure_speed": bool, "repair_from_senders": bool,
}

RANGES: dict[str, tuple[float, float, str]] = {
    # key: (lowest, highest, unit) -- a value outside is refused at load, naming file:line and key
    "max_concurrent_shards": (1, 64, ""),
    "threads": (1, 1024, ""),
    "train_processes": (0, 64, " (0: one per CUDA device)"),
    "min_price_per_hour": (0, 1e9, ""),
    "price_per_hour": (0, 1e9, ""),
    "fetch_timeout": (1, 86400, " seconds"),
    "max_disk_gb": (0, 1e6, " GB (0: no limit)"),
    "heartbeat_seconds": (0.1, 60, " seconds"),  # 0 was a busy loop flooding every peer
    "missed_heartbeats": (2, 100, ""),
    "grace_seconds": (0, 600, " seconds"),
    "silent_holder_seconds": (0, 86400, " seconds (0: never)"),
    "claim_interval": (0.05, 3600, " seconds"),
    "gossip_max_rate": (1, 1e6, " messages per second"),
    "gossip_max_burst": (1, 1e7, " messages"),
}
"""Every numeric key's allowed range; lists, strings and tables are checked in ``_check_value``."""


def load_config(home: Path, **overrides: Any) -> AgentConfig:
    """The AgentConfig of the agent in ``home``: its config.toml (if any), then ``overrides`` (None = unset).

    Every key is checked at load, file values and overrides alike: its type and its range (``RANGES``);
    a mistake is one ConfigError ``FILE:LINE: KEY: allowed values, got VALUE`` (``--flag`` for an override)."""
    path = home / CONFIG_FILE
    values: dict[str, Any] = {}
    text = ""
    if path.exists():
        try:
            text = path.read_bytes().decode("utf-8")
            values = tomllib.loads(text)
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{path}: not a readable TOML config: {exc}") from None
    known = {f.name for f in fields(AgentConfig)} - {"home"}
    if "search" in values:  # [search]: API keys of `infernet train data` (agent/data/search.py), not the agent's
        if not isinstance(values.pop("search"), dict):
            raise ConfigError(f"{path}:{_line_of(text, 'search')}: search: expected a table")
    for key, value in values.items():
        where = f"{path}:{_line_of(text, key)}" if _line_of(text, key) else str(path)
        if key not in known:
            raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(known))})")
        _check_value(where, key, value)
    for key, value in overrides.items():
        if value is not None and key in _TYPES:
            _check_value(f"--{key.replace('_', '-')}", key, list(value) if isinstance(value, tuple) else value,
                         flag=True)
    if "models" in values:
        values["models"] = tuple((name, str(Path(p).expanduser())) for name, p in values["models"].items())
        for name, model_path in values["models"]:
            if not Path(model_path).is_dir():  # the agent used to start and take the path for a hub name
                raise ConfigError(f"{path}:{_line_of_entry(text, 'models', name) or _line_of(text, 'models')}: "
                                  f"models.{name}: {model_path} is not a directory (a local Hugging Face model "
                                  "directory is expected)")
    for key in ("listen", "bootstrap", "announce", "allowed_base_models"):
        if key in values:
            values[key] = tuple(values[key])
    values.update({k: v for k, v in overrides.items() if v is not None})
    values.setdefault("measure_speed", True)  # an operator's agent measures; tests build AgentConfig without it
    values.setdefault("relay", "auto")  # an operator's agent relays while public; tests choose (AgentConfig: off)
    if os.environ.get("INFERNET_ACCEPT_TRAINING") == "1":
        values["accept_training"] = True
    return replace(AgentConfig(home=home), **values)


def _check_value(where: str, key: str, value: Any, *, flag: bool = False) -> None:
    name = "" if flag else f" {key}:"
    if key == "relay":
        if not (isinstance(value, bool) or value == "auto"):
            raise ConfigError(f"{where}:{name} expected true, false or \"auto\", got {value!r}")
        return
    expected = _TYPES.get(key)
    if expected and (not isinstance(value, expected) or isinstance(value, bool) and expected is not bool):
        raise ConfigError(f"{where}:{name} expected {_type_name(expected)}, got {type(value).__name__}")
    if isinstance(value, list) and not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where}:{name} expected a list of non-empty strings")
    if key == "listen" and not value:
        raise ConfigError(f"{where}:{name} expected at least one multiaddr to listen on, got []")
    if key == "ipfs_api" and not value.strip():
        raise ConfigError(f"{where}:{name} expected a multiaddr such as \"/ip4/127.0.0.1/tcp/5001\", got \"\"")
    if key == "models" and not all(isinstance(v, str) and v for v in value.values()):
        raise ConfigError(f"{where}:{name} each value must be a local path (a non-empty string)")
    if key in RANGES:
        low, high, unit = RANGES[key]
        if not math.isfinite(value) or not low <= value <= high:
            raise ConfigError(f"{where}:{name} must be between {low:g} and {high:g}{unit}, got {value!r}")


def _line_of(text: str, key: str) -> int:
    """The line of ``key = ...`` at the top level of a TOML text, or of its ``[key]`` table (0 if not found)."""
    quoted = rf"(?:{re.escape(key)}|\"{re.escape(key)}\"|'{re.escape(key)}')"
    assign, header = re.compile(rf"\s*{quoted}\s*="), re.compile(rf"\s*\[\s*{quoted}\s*\]")
    top = True
    for number, line in enumerate(text.splitlines(), start=1):
        if header.match(line):
            return number
        if line.lstrip().startswith("["):
            top = False
        elif top and assign.match(line):
            return number
    return 0


def _line_of_entry(text: str, table: str, name: str) -> int:
    """The line of ``name = ...`` (bare or quoted) inside ``[table]`` of a TOML text (0 if not found)."""
    inside = False
    entry = re.compile(rf"\s*(?:{re.escape(name)}|\"{re.escape(name)}\"|'{re.escape(name)}')\s*=")
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("["):
            inside = re.fullmatch(rf"\[\s*{re.escape(table)}\s*\]", stripped) is not None
        elif inside and entry.match(line):
            return number
    return 0


def _type_name(expected: type | tuple[type, ...]) -> str:
    if isinstance(expected, tuple):
        return "a number"
    return {list: "a list", dict: "a table", bool: "true or false", int: "an integer", str: "a string"}[expected]


def write_config(home: Path, text: str = CONFIG_TEMPLATE) -> Path:
    """Write ``config.toml`` into ``home`` unless one exists; return its path."""
    path = home / CONFIG_FILE
    if not path.exists():
        home.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return path
