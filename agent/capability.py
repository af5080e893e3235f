"""What this agent offers the network, and telling it: the signed capability and the heartbeats.

Rules of this file:
- ``Capabilities`` holds what goes into our ``cap`` message and nothing else does: the machine (agent/
  hardware.py: measured at start, unless the harness declares one; its GPUs' free memory measured
  again at each capability and before each GPU shard), the base models we hold (hashed once per file
  size and mtime, the hashes kept in our store), and our measured speeds per model (agent/market.py,
  cached in our home). Roles read them here and ask for a change through ``refresh_machine`` and
  ``reload_speeds``; nothing else assigns them.
- ``heartbeats`` is the agent's heartbeat service: a heartbeat every ``heartbeat_seconds`` naming the
  jobs we coordinate, and our capability every 30 s (every ``CAPABILITY_EARLY_GAP`` s in our first
  ``CAPABILITY_EARLY`` s, while the gossip mesh forms: a capability published before a peer joined our
  mesh never reaches it). A capability that breaks the message rules is logged and not published; the
  heartbeats go on (an agent once died of its own measurement: free VRAM above the declared total).
- With a full disk we take no work and coordinate nothing (agent/writer.py ``refuse_work``): the
  capability says so, and ``coordinating`` is None.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable

import trio

from agent import __version__
from protocol import messages as m
from protocol.errors import CodecError

log = logging.getLogger(__name__)

CAPABILITY_TELL_GAP = 2.0  # seconds: at most one capability published for arriving peers per gap
# an arriving peer's gossip mesh forms a GossipSub heartbeat or two after its first heartbeat reached us, so
# what we publish at once may not reach it: we publish again this much later
CAPABILITY_TELL_AGAIN = 3.0
CAPABILITY_EARLY, CAPABILITY_EARLY_GAP = 10.0, 2.0  # our first seconds, when our capability goes out more often


class Capabilities:
    """Our machine, models and speeds, the capability made of them, and the heartbeats that carry it."""

    def __init__(self, config: Any, clock: Callable[[], float], *, machine: Any, trains: bool,
                 store_full: Callable[[], str | None], publish: Callable[[Any], Awaitable[None]],
                 write_soon: Callable[..., None], store: Callable[[], Any]) -> None:
        self.config = config
        self.clock = clock
        self.trains = trains  # we accept training (a worker role): our speeds are advertised
        self._store_full, self._publish, self._write_soon, self._store = store_full, publish, write_soon, store
        # agent/hardware.Machine: measured in ``measure``, unless declared (the harness declares GPUs this
        # machine lacks, so that GPU jobs' decisions run on real agents; training runs on what torch has)
        self.machine: Any = machine
        self.models_held: tuple[m.ModelHeld, ...] = ()
        self.speeds: tuple[m.ModelSpeed, ...] = ()  # measured tokens/s per held model (agent/market.py)
        self.published: m.Capability | None = None
        self._hashes_saved = 0  # position in FILE_HASHES already saved to the store
        self._told = 0.0  # when we last published our capability for a peer that arrived
        self._heartbeat_seq = 0

    async def measure(self) -> None:
        """Measure the hardware and hash the base models we hold (cached by file size and mtime)."""
        from agent import hardware
        from agent.train.model import FILE_HASHES

        FILE_HASHES.load(self._store().file_hashes())
        if self.machine is None:
            self.machine = await trio.to_thread.run_sync(hardware.detect)
        held = []
        for name, path in self.config.models[:m.MAX_MODELS]:
            try:
                digest = await self.base_model_hash(path)
            except Exception as exc:  # noqa: BLE001 - a model we cannot read is not advertised; the agent runs on
                log.warning("model %s at %s: cannot hash it (%s); not advertised", name, path, exc)
                continue
            held.append(m.ModelHeld(name[:m.MAX_STR], bytes.fromhex(digest)))
        self.models_held = tuple(held)
        self.save_file_hashes()
        self.reload_speeds()  # measured before (cached in the home); measure_speeds adds the rest

    def reload_speeds(self) -> None:
        """Our speeds per held model as cached in our home (agent/market.py): a worker that measured one
        saves it there and asks us to read them again; our next capability carries them."""
        from agent.market import advertised_speeds

        self.speeds = advertised_speeds(self)

    async def base_model_hash(self, path: str) -> str:
        """A base model's content hash (agent/train/model.base_model_sha256), each file read once per
        (path, size, mtime) across restarts: the hashes are kept in our store."""
        from agent.train.model import base_model_sha256

        digest = await trio.to_thread.run_sync(base_model_sha256, path)
        self.save_file_hashes()
        return digest

    def save_file_hashes(self) -> None:
        from agent.train.model import FILE_HASHES

        entries, self._hashes_saved = FILE_HASHES.since(self._hashes_saved)
        store = self._store()
        if entries and store is not None:  # a cache: on a full disk they are hashed again after a restart
            self._write_soon(store.save_file_hashes, entries)

    def capability(self) -> m.Capability:
        """Our capability now: measured devices (free memory as last measured), runtimes, models held."""
        from agent import hardware

        machine = self.machine or hardware.Machine(hardware.cpu_model(), _cpu_count(), _ram_gb())
        ok = self._store_full() is None  # with a full disk we take no work and coordinate nothing
        return m.Capability(hardware.summary(machine), hardware.runtimes(machine), self.config.price_per_hour,
                            self.trains and ok, self.config.can_coordinate and ok,
                            self.config.max_concurrent_shards, __version__, machine.cpu_model,
                            tuple(hardware.within_limits(d) for d in machine.devices),
                            self.models_held, self.speeds if self.trains else ())

    def refresh_machine(self) -> Any:
        """Our machine with its GPUs' free memory measured again now (agent/hardware.refresh_free: a few
        ms; call it off the event loop); a machine without CUDA as it was measured."""
        from agent import hardware

        if self.machine is not None and self.machine.cuda:
            self.machine = hardware.refresh_free(self.machine)
        return self.machine

    async def publish(self) -> None:
        """Our capability now, gossiped; with CUDA, the GPUs' free memory measured again first (in a thread:
        without a GPU there is nothing to measure, and no thread is waited for)."""
        if self.machine is not None and self.machine.cuda:
            await trio.to_thread.run_sync(self.refresh_machine)
        cap = self.capability()
        try:  # gossip's publish opens our own envelope first and sends nothing that breaks the rules
            await self._publish(cap)
        except CodecError as exc:  # a measurement outside the rules: say so, keep the heartbeats going
            log.error("capability not published: it breaks the message rules (%s)", exc)
            return
        self.published = cap

    async def tell_peers(self) -> None:
        """Our capability now, for peers that have not heard it (arrived, or what we offer changed); at most 10 s."""
        with trio.move_on_after(10):
            await self.publish()

    async def tell_arrived(self) -> None:
        """``tell_peers`` for a peer that just arrived, and again ``CAPABILITY_TELL_AGAIN`` later: the
        late-joiner scenario saw a capability told at once lost, the newcomer's mesh not formed yet."""
        await self.tell_peers()
        await trio.sleep(CAPABILITY_TELL_AGAIN)
        await self.tell_peers()

    def local_model(self, terms: m.JobTerms) -> str | None:
        """Our local copy of a job's base model (``models`` by name, or the path itself), or None."""
        models = dict(self.config.models)
        if terms.base_model in models:
            return models[terms.base_model]
        return terms.base_model if Path(terms.base_model).is_dir() else None

    def coordinating(self) -> m.Capability | None:
        """Our capability, if we may coordinate now (config, and a store we can write); else None."""
        if self.config.can_coordinate and self._store_full() is None:
            return self.published or self.capability()
        return None

    def tell_arrival(self, now: float) -> bool:
        """A peer new to us (or back) has not heard our capability, published every 30 s: whether to publish it
        now (at most once per ``CAPABILITY_TELL_GAP``), so a restarted submitter need not wait half a minute to
        know who can train a job."""
        if now - self._told <= CAPABILITY_TELL_GAP:
            return False
        self._told = now
        return True

    async def heartbeats(self, coordinating: Callable[[], Iterable[m.CoordinatorTerm]],
                         active_shards: Callable[[], int], muted: Callable[[], bool] = lambda: False) -> None:
        """The heartbeat service (module docstring): ``coordinating`` names the jobs we coordinate now; ``muted``:
        the test harness's (agent/hooks.py), to look gone while working."""
        await self.publish()
        started = last_cap = self.clock()
        while True:
            self._heartbeat_seq += 1
            if not muted():
                await self._publish(m.Heartbeat(self._heartbeat_seq, active_shards(), tuple(coordinating())[:32]))
            gap = CAPABILITY_EARLY_GAP if self.clock() - started < CAPABILITY_EARLY else 30
            if self.clock() - last_cap > gap:
                await self.publish()
                last_cap = self.clock()
            await trio.sleep(self.config.heartbeat_seconds)


def _cpu_count() -> int:
    import os

    return os.cpu_count() or 1


def _ram_gb() -> float:
    try:
        import os

        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return 0.0
