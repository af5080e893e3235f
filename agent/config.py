"""An operator's agent home: where its key, config, store and control socket live, and its config file.

Rules of this file:
- One home directory per agent (``--home``, else ``$INFERNET_HOME``, else ``~/.infernet``) holds
  ``identity.key`` (mode 0600, protocol/identity.py), ``config.toml``, the store, the blockstore,
  ``work/`` and, while the daemon runs, ``control.sock`` (agent/control.py).
- ``config.toml`` is read with tomllib. Its keys are the fields of ``agent.node.AgentConfig``
  (``[models]`` is a table of base-model name -> local path); ``CONFIG_TEMPLATE`` is what
  ``infernet agent init`` writes, every key commented with what it means. An unknown key, a value
  of the wrong type or an unreadable file is a ``ConfigError`` naming the file and the key.
- Command-line flags and the environment override the file (``INFERNET_ACCEPT_TRAINING=1``).
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # agent.node pulls in py-libp2p (seconds); commands that only read the home stay fast
    from agent.node import AgentConfig

IDENTITY_FILE = "identity.key"
CONFIG_FILE = "config.toml"
CONTROL_SOCKET = "control.sock"


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

# Opt in to training other people's jobs on this machine (also: INFERNET_ACCEPT_TRAINING=1).
accept_training = false

# Offer to coordinate jobs (hand out leases, verify reports by replay, aggregate adapters).
can_coordinate = true

# Shards this agent trains at the same time.
max_concurrent_shards = 1

# Base models this agent will train, by the name jobs use; empty = any model listed in [models].
allowed_base_models = []

# Refuse jobs that pay less than this per worker-hour; and what this agent advertises it asks.
min_price_per_hour = 0.0
price_per_hour = 0.0

# CPU threads torch may use for one training (recorded in the proof: it changes float results).
threads = 1

# An IPFS daemon's API multiaddr to also fetch from and add to (e.g. "/ip4/127.0.0.1/tcp/5001").
# ipfs_api = "/ip4/127.0.0.1/tcp/5001"

# Seconds a content fetch (dataset shard, adapter, checkpoint) may take before it gives up.
fetch_timeout = 120.0

# Seconds between heartbeats; a peer missing this many heartbeats is considered gone.
heartbeat_seconds = 1.0
missed_heartbeats = 5

# Gossip accepted from one peer (the messages it signs), per second and in a burst; beyond that its
# messages are dropped at the first hop (a flood stops here, and we are not blamed for relaying it).
gossip_max_rate = 200.0
gossip_max_burst = 400.0

# Base models held locally: the name a job's base_model uses = a local Hugging Face directory.
[models]
# "Qwen/Qwen2.5-0.5B-Instruct" = "/srv/models/qwen2.5-0.5b-instruct"
"""

_TYPES: dict[str, type | tuple[type, ...]] = {
    "listen": list, "bootstrap": list, "accept_training": bool, "can_coordinate": bool,
    "max_concurrent_shards": int, "allowed_base_models": list, "min_price_per_hour": (int, float),
    "price_per_hour": (int, float), "threads": int, "ipfs_api": str, "fetch_timeout": (int, float),
    "heartbeat_seconds": (int, float), "missed_heartbeats": int, "grace_seconds": (int, float),
    "claim_interval": (int, float), "models": dict, "gossip_max_rate": (int, float),
    "gossip_max_burst": (int, float),
}


def load_config(home: Path, **overrides: Any) -> "AgentConfig":
    """The AgentConfig of the agent in ``home``: its config.toml (if any), then ``overrides`` (None = unset)."""
    from agent.node import AgentConfig

    path = home / CONFIG_FILE
    values: dict[str, Any] = {}
    if path.exists():
        try:
            with open(path, "rb") as fh:
                values = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{path}: not a readable TOML config: {exc}") from None
    known = {f.name for f in fields(AgentConfig)} - {"home", "misbehave"}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"{path}: unknown key {key!r} (known: {', '.join(sorted(known))})")
        expected = _TYPES.get(key)
        if expected and (not isinstance(value, expected) or isinstance(value, bool) and expected is not bool):
            raise ConfigError(f"{path}: {key}: expected {_type_name(expected)}, got {type(value).__name__}")
        if isinstance(value, list) and not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{path}: {key}: expected a list of strings")
    if "models" in values:
        models = values["models"]
        if not all(isinstance(v, str) for v in models.values()):
            raise ConfigError(f"{path}: models: each value must be a local path (a string)")
        values["models"] = tuple((name, str(Path(p).expanduser())) for name, p in models.items())
    for key in ("listen", "bootstrap", "allowed_base_models"):
        if key in values:
            values[key] = tuple(values[key])
    values.update({k: v for k, v in overrides.items() if v is not None})
    if os.environ.get("INFERNET_ACCEPT_TRAINING") == "1":
        values["accept_training"] = True
    return replace(AgentConfig(home=home), **values)


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
