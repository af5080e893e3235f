"""An agent's disk: what it uses, what it must keep, what it collects, and its quota (``max_disk_gb``).

Before this, every round's work directory (~5.6 MB a round on the tiny model, gigabytes on a real
one) and every content block stayed forever: an agent filled its own disk (issue 25). The rules:

- **What is kept.** For a job that is still running: the blocks of its terms (dataset shards,
  validation split) and of every message of the current and the previous round (leases' initial
  adapters, checkpoints, reports' adapters and proofs, aggregates): what a lease, a verification, a
  take-over or a rebuild of the round's aggregate can still ask for (IPIP-0004 §4, IPIP-0006 §2.6.1).
  For a job we submitted, finished or not: every block of it (the submitter's results and evidence
  are the operator's; ``job fetch`` reads them). For a finished job of someone else's: nothing.
  Work directories (scratch) of rounds before the previous one go, and the whole directory of a
  finished job of someone else's; a directory an active shard of ours still uses is never touched.
- **Young files are kept.** A block or directory written in the last ``grace`` seconds is kept
  whatever the rules say: a fetch or a checkpoint in flight has blocks no message names yet.
- **Collection** marks every block reachable from a kept root (the UnixFS DAG, through
  ``protocol.unixfs.child_cids``) and deletes the rest; it runs in a worker thread, every
  ``INTERVAL`` seconds, before each claim when a quota is set, and at once with a grace of seconds
  (``FULL_GRACE``) when a claim's probe finds the disk full (agent/writer.py) or fewer than ``LOW_ROOM``
  bytes are free.
- **The quota.** With ``max_disk_gb`` set, the agent claims a shard only if, after a collection, its
  home uses less than the quota minus the most that our work directories and blocks grew between
  two of the last ``RESERVE_OVER`` claims (``reserve``: a file someone else wrote is not our work);
  otherwise it refuses work (``Agent.refuse_work``: the capability says so, no lease
  comes) until collection makes room. ``agent status`` shows the use and the quota.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from agent.store import StoreFullError
from protocol.cid import parse_cid
from protocol.errors import CIDError
from protocol.unixfs import child_cids

if TYPE_CHECKING:
    from agent.content.blockstore import BlockStore
    from protocol.mirror import JobMirror

ActiveShard = tuple[bytes, int, int, int]  # a shard we train now: (job ID, round, shard, attempt)

log = logging.getLogger(__name__)

GRACE = 120.0  # seconds: a file younger than this is never collected
INTERVAL = 60.0  # seconds between collections (and before each claim when a quota is set)
GB = 1_000_000_000
RESERVE_OVER = 8  # claims: the reserve is the most our work directories and blocks grew over this many
LOW_ROOM = 256 * 1024 * 1024  # bytes free under which the disk counts as nearly full (``every_interval``)
LOW_ROOM_CHECK = 5.0  # seconds between two looks at the room left
FULL_GRACE = 10.0  # seconds: on a (nearly) full disk, only files younger than this are kept whatever the rules say

# a round's scratch: verifications (and the round's start they read), aggregates (early ones too, IPIP-0006
# §2.9), fetches, a shard's training (an early start's too)
_ROUND_ENTRY = re.compile(r"^(?:verify-|start-|aggregate-|fetched-|early-)?r(\d+)(?:-s\d+-a\d+(?:-early)?)?(?:\.tar)?$")


class DiskQuotaError(StoreFullError):
    """Our home uses (or would use with the next piece of work) more than ``max_disk_gb``."""


@dataclass
class Usage:
    work: int = 0  # bytes under home/work
    blocks: int = 0  # bytes under home/blocks
    other: int = 0  # the store, its WAL, logs, keys, the rest of home

    @property
    def total(self) -> int:
        return self.work + self.blocks + self.other

    def as_json(self) -> dict:
        return {"work_bytes": self.work, "blocks_bytes": self.blocks, "other_bytes": self.other,
                "total_bytes": self.total}


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass  # removed meanwhile
    return total


def measure(home: Path, work: Path, blocks: Path) -> Usage:
    """What ``home`` uses now, split into work directories, blocks and the rest (the store, logs)."""
    usage = Usage(work=_tree_bytes(work), blocks=_tree_bytes(blocks))
    usage.other = max(0, _tree_bytes(home) - usage.work - usage.blocks) if home not in (work, blocks) else 0
    return usage


def _cids_of(obj: Any) -> Iterator[str]:
    """Every CID a signed message (or its nested records) names: the fields marked ``cid_field``."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if f.metadata.get("kind") == "cid":
                if isinstance(value, str) and value:
                    yield value
            elif isinstance(value, (tuple, list)) or dataclasses.is_dataclass(value):
                yield from _cids_of(value)
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _cids_of(item)


@dataclass
class JobPlan:
    """What the collector may do with one job's blocks and work directory (made on the event loop)."""

    job_id: bytes
    finished: bool
    ours: bool  # we submitted it
    round: int
    oldest: int = 0  # the oldest round whose blocks are kept (a finished job of someone else's: none)
    roots: set[str] = field(default_factory=set)  # CIDs to keep
    busy: set[str] = field(default_factory=set)  # work entries an active shard of ours uses

    @property
    def job16(self) -> str:
        """The job's work directory name (16 hex digits)."""
        return self.job_id.hex()[:16]


def plan_job(view: "JobMirror", me: str, busy: Iterable[tuple[int, int, int]] = (),
             held: dict[int, set[str]] | None = None) -> JobPlan:
    """Decide, from the job's mirror, which of its blocks and work entries are still needed.
    ``held``: CIDs we added for a round that no message may name yet (``Agent.hold``), by round."""
    finished = view.state.terminal
    ours = view.terms.submitter == me
    plan = JobPlan(view.job_id, finished, ours, view.state.round,
                   busy={f"r{r}-s{s}-a{a}" for r, s, a in busy})
    if finished and not ours:
        plan.oldest = 1 << 30
        return plan
    oldest = plan.oldest = 0 if ours else view.state.round - 1
    for rnd, cids in (held or {}).items():
        if rnd >= oldest:
            plan.roots.update(cids)
    plan.roots.update(_cids_of(view.terms))
    messages: list[Any] = list(view.leases.values()) + [c for cs in view.commits.values() for c in cs]
    messages += [report for report, _ in view.reports.values()] + list(view.aggregates.values())
    for msg in messages:
        if msg.round >= oldest:
            plan.roots.update(_cids_of(msg))
    return plan


@dataclass
class Collected:
    blocks: int = 0
    dirs: int = 0
    bytes: int = 0

    def __bool__(self) -> bool:
        return bool(self.blocks or self.dirs)


def _old(path: Path, now: float, grace: float) -> bool:
    try:
        return now - path.lstat().st_mtime >= grace
    except OSError:
        return False


def _remove(path: Path) -> int:
    size = _tree_bytes(path) if path.is_dir() else (path.lstat().st_size if path.exists() else 0)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
    return size


def collect(work: Path, blocks: "BlockStore", plans: list[JobPlan], *, grace: float = GRACE,
            now: float | None = None) -> Collected:
    """Delete what no plan keeps (in a worker thread: it walks directories and reads blocks)."""
    now = time.time() if now is None else now
    out = Collected()
    for plan in plans:
        job_dir = work / plan.job16
        if not job_dir.is_dir():
            continue
        if plan.finished and not plan.ours:
            if not plan.busy and _old(job_dir, now, grace) and \
                    all(_old(p, now, grace) for p in job_dir.iterdir()):
                out.bytes += _remove(job_dir)
                out.dirs += 1
            continue
        for entry in job_dir.iterdir():
            match = _ROUND_ENTRY.match(entry.name)
            if match is None or entry.name in plan.busy:
                continue  # not a round's scratch (accepted/, validation.jsonl), or in use
            old_round = plan.finished or int(match.group(1)) < plan.round - 1
            if old_round and _old(entry, now, grace):
                out.bytes += _remove(entry)
                out.dirs += 1
    keep = _reachable(blocks, (root for plan in plans for root in plan.roots))
    for digest, path in _block_files(blocks.root):
        if digest in keep or not _old(path, now, grace):
            continue
        try:
            size = path.stat().st_size
            path.unlink()
        except OSError:
            continue
        out.blocks += 1
        out.bytes += size
    return out


def _reachable(blocks: "BlockStore", roots: Iterable[str]) -> set[str]:
    """The digests (hex) of every block reachable from ``roots`` that we hold."""
    seen: set[str] = set()
    stack = []
    for text in set(roots):
        try:
            stack.append(parse_cid(text))
        except CIDError:
            continue
    while stack:
        cid = stack.pop()
        digest = cid.digest.hex()
        if digest in seen:
            continue
        seen.add(digest)
        data = blocks.get_unchecked(cid)
        if data is None:
            continue
        try:
            stack.extend(child_cids(cid, data))
        except CIDError:
            continue  # a damaged block: kept, and refused when read (BlockStore.get)
    return seen


def _block_files(root: Path) -> Iterator[tuple[str, Path]]:
    try:
        subdirs = [d for d in root.iterdir() if d.is_dir() and len(d.name) == 2]
    except OSError:
        return
    for sub in subdirs:
        for path in sub.iterdir():
            if not path.name.startswith(".") and len(path.name) == 64:
                yield path.name, path


class Disk:
    """The agent's disk accounting: the last measured use, the quota, the reserve for one piece of work."""

    def __init__(self, home: Path, work: Path, blocks: Path, max_disk_gb: float | None,
                 grace: float = GRACE) -> None:
        self.home, self.work, self.blocks_dir = home, work, blocks
        self.quota = None if not max_disk_gb else int(max_disk_gb * GB)
        self.grace = grace
        self.usage = Usage()
        self.reserve = 0  # the most our work grew between two claims, lately: what one piece of work may need
        self.collected = Collected()  # in all, since the start
        self.collected_at = float("-inf")  # trio time of the last collection
        self._after_last_claim: int | None = None  # our work's use just after the last claim's check
        self._peak = 0  # the most our work used since then (measured before each collection)
        self._growths: deque[int] = deque(maxlen=RESERVE_OVER)  # growth of our work between recent claims
        # blocks we added for a round of a job that no message may name yet (a proof's checkpoints, a
        # report or aggregate not yet published): kept from collection while the round is live
        self.held: dict[bytes, dict[int, set[str]]] = {}
        self._lock = trio.Lock()  # one collection at a time

    def hold(self, job_id: bytes, rnd: int, cid: Any) -> None:
        """Keep ``cid``, added for round ``rnd`` of the job, from collection while that round is live,
        though no message names it."""
        self.held.setdefault(job_id, {}).setdefault(rnd, set()).add(str(cid))

    def forget(self, job_id: bytes) -> None:
        """A job we no longer follow: nothing of it is held (its blocks go by the rules of a finished job)."""
        self.held.pop(job_id, None)

    async def every_interval(self, collect: Callable[..., Awaitable[None]]) -> None:
        """The collection service: ``collect`` now, then every ``INTERVAL`` seconds; and, checked every
        ``LOW_ROOM_CHECK`` seconds, at once with the grace of a full disk (``FULL_GRACE``) while the disk it is on
        has less than ``LOW_ROOM`` bytes free. A coordinator whose disk filled could not aggregate until the next
        collection, a minute on, and then only of files past the usual grace (issue 24: the demo on a 600 MB disk)."""
        while True:
            await collect()
            waited = 0.0
            while waited < INTERVAL:
                await trio.sleep(LOW_ROOM_CHECK)
                waited += LOW_ROOM_CHECK
                if self.low_on_room():
                    await collect(grace=min(self.grace, FULL_GRACE))

    def low_on_room(self) -> bool:
        """Whether the disk the home is on has less than ``LOW_ROOM`` bytes free."""
        try:
            return shutil.disk_usage(self.home).free < LOW_ROOM
        except OSError:
            return False

    async def collect_jobs(self, views: Iterable["JobMirror"], me: str, active: Iterable[ActiveShard],
                           blocks: "BlockStore", grace: float | None = None) -> None:
        """Delete the blocks and work directories none of ``views`` (the jobs we follow) needs any more,
        ``active`` (our shards in training) and what we hold kept, measuring the home's use before and
        after; in a worker thread, one collection at a time. ``grace``: this collection's (default ``self.grace``;
        a full disk collects with a shorter one, agent/writer.py)."""
        # what is written after the plans are made is never collected by them (they could not name it): the scan
        # runs later, in a thread and after any collection before it, and with a grace of 0 it deleted the blocks of
        # a report added meanwhile, before the coordinator fetched them (the disk-quota test's flake: the round waited
        # out its verification window)
        planned_at = time.time()
        busy: dict[bytes, list[tuple[int, int, int]]] = {}
        for job_id, rnd, shard, attempt in active:
            busy.setdefault(job_id, []).append((rnd, shard, attempt))
        plans = [plan_job(view, me, busy.get(view.job_id, ()), self.held.get(view.job_id, {})) for view in views]
        for plan in plans:  # what the plans no longer hold is forgotten
            held = self.held.get(plan.job_id, {})
            for rnd in [r for r in held if r < plan.oldest]:
                del held[rnd]

        def run() -> None:
            self.observe()
            found = collect(self.work, blocks, plans, grace=self.grace if grace is None else grace, now=planned_at)
            self.account(found)
            if found:
                self.observe()
                log.info("disk: collected %d blocks and %d work directories (%.1f MB) no job needs; home uses "
                         "%.1f MB", found.blocks, found.dirs, found.bytes / 1e6, self.usage.total / 1e6)

        async with self._lock:
            await trio.to_thread.run_sync(run)
            self.collected_at = trio.current_time()

    def observe(self) -> Usage:
        """Measure the use now (a worker thread: it walks the home)."""
        self.usage = measure(self.home, self.work, self.blocks_dir)
        self._peak = max(self._peak, self.usage.work + self.usage.blocks)
        return self.usage

    def account(self, found: Collected) -> None:
        self.collected.blocks += found.blocks
        self.collected.dirs += found.dirs
        self.collected.bytes += found.bytes

    def check_claim(self) -> None:
        """Before a claim, after a collection: DiskQuotaError when the next piece of work could take us
        over the quota. The reserve is the most our work directories and blocks grew between two of the
        last ``RESERVE_OVER`` claims that did grow them (their peak, measured before each collection,
        less what they used just after the claim before)."""
        used, ours = self.usage.total, self.usage.work + self.usage.blocks
        if self._after_last_claim is not None and self._peak > self._after_last_claim:
            self._growths.append(self._peak - self._after_last_claim)  # a piece of work since the last claim
            self.reserve = max(self._growths)
        self._after_last_claim = None  # a refused claim is no baseline for the next growth
        if self.quota is not None and used + self.reserve > self.quota:
            raise DiskQuotaError(
                f"{self.home}: disk quota: {used / GB:.3f} GB used (after collecting what no job needs) "
                f"and one piece of work took up to {self.reserve / GB:.3f} GB; max_disk_gb is {self.quota / GB:g}")
        self._after_last_claim = self._peak = ours

    def as_json(self) -> dict:
        return {**self.usage.as_json(), "max_bytes": self.quota, "reserve_bytes": self.reserve,
                "collected_bytes": self.collected.bytes, "collected_blocks": self.collected.blocks,
                "collected_dirs": self.collected.dirs}
