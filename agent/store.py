"""Persistence for one agent: a SQLite file in its data directory, and each job's signed ledger.

Rules of this file:

- One ``Store`` = one SQLite connection. Calls are plain and blocking; each is a small transaction
  whose cost is one fsync (a few ms). The agent makes the frequent ones (recording the evidence of
  every applied gossip message) in a worker thread (``trio.to_thread.run_sync``, one at a time), so
  its event loop keeps running while the disk syncs. Writes the agent makes from its event loop
  whose result it does not wait for (ledger entries, job rows, file hashes) are queued with
  ``later(...)`` and made in order by ``flush()``, which the agent calls in that same worker thread.
  ``flush`` takes the lock for one queued write at a time, so a read from another thread waits for
  at most one commit, never for the whole queue. A read (any query outside a transaction) first
  makes the queued writes, so what was queued is seen, except on the ``loop_thread`` (set by the
  agent while its store writer runs: its event loop thread): there a read never writes and may lag
  the queued writes by a moment; a caller there that must see what it queued awaits
  ``Agent.flush_writes()`` first. ``flush`` returns the errors of the queued writes (StoreFullError
  among them) instead of raising them: the caller decides (the agent refuses new work on a full
  disk). A lock makes each call (and each ``transaction()`` block) whole with respect to the other
  threads.
  ``close()`` when done (or use the Store as a context manager).
- Durability. The database is in WAL mode with ``synchronous=FULL`` on every commit: when a
  method returns, what it wrote is on disk and survives ``kill -9`` of the agent and a power loss.
  (WAL alone makes a commit survive ``kill -9``; FULL adds the fsync that survives power loss.
  Commits are rare enough that every one gets it, not only reports, verdicts, aggregates and the
  ledger.) A crash mid-call leaves the database as it was before the call: each method is one
  transaction, and ``with store.transaction():`` makes several calls one commit (a report and its
  ledger entry, say); inner calls run in savepoints, so a failing one undoes only itself unless
  its error leaves the block, which undoes the whole block.
- What is stored. ``jobs``: the terms as canonical msgpack (``JobTerms.to_wire``), our role, the
  state name, round and coordinator term. ``shards``: the current view of each (job, round, shard).
  ``envelopes``: every signed envelope we accepted, byte for byte as received, keyed by message ID,
  so that a successor coordinator can rebuild a job from its own store. For a job's topic the agent
  records only messages that applied to its mirror, in the order they applied (agent/node.py), so
  the stored order (``envelopes(stored_order=True)``) replays into the same mirror. ``leases``, ``reports``,
  ``verdicts``, ``aggregates``: decoded columns of those envelopes for queries; the bytes stay in
  ``envelopes``. ``ledger``: the per-job event log below. ``schema_version``: one row. ``file_hashes``
  (version 2): the cache of file hashes by (path, size, mtime), so base models are hashed once;
  a version-1 store is migrated on open.
- Evidence is verified on the way in and on the way out. ``record`` checks an envelope's signature
  and body again before storing it (the receive-time rules, clock window and replay, are the
  receiver's business and not a property of stored evidence); every read re-checks the signature
  and the message ID, so the store never hands back a message that does not verify.
- The ledger (ipips/0008-ledger.md). Per job, entries seq 0, 1, 2, ... each the canonical msgpack
  map ``{job_id, seq, prev, time, peer, kind, data, signer}``; ``prev`` is the hash of entry
  seq-1 (32 zero bytes for seq 0); ``hash = sha256(LEDGER_DOMAIN + entry)`` and the signature is
  Ed25519 over the same bytes by ``signer``. ``peer`` is who acted, ``signer`` who wrote it down:
  entries are signed by this agent's identity when appended, by other peers when imported.
  ``verify_ledger`` raises ``LedgerError`` naming the first bad seq (gap, broken chain, bad
  signature, malformed entry, stored columns that disagree with the entry).
- Copies of the other peers' chains of a job (``ledger_copies``, keyed by author) and the conflicts
  found between copies (``ledger_conflicts``; ipips/0008-ledger.md §5) are tables created when
  missing at every open, without a schema version: an older agent opens the store and ignores them.
  A copy only grows (``extend_copy``); it is never shortened or replaced. The entry rules themselves
  live in protocol/ledger.py (re-exported here).
- Only parameterised SQL; table and column names come from constants in this file.
- A database written by a newer schema is refused with an error naming the file and both versions.
- Damage is refused at open, never papered over: an existing store file that is empty (0 bytes:
  truncated; a store we wrote always holds its schema, in the file or in the WAL a crash left beside
  it) or fails ``PRAGMA quick_check`` raises StoreError naming the file, instead of starting a fresh
  store that silently loses every job and ledger. Bytes that changed inside a valid page pass
  quick_check, so every signed record (``envelopes``, ``ledger``, ``ledger_copies``) carries a digest
  (sha256 of its bytes, schema version 3) that every open checks: a hash per record, about 1 ms per
  MB, where a signature check per record would cost ~0.5 ms each. A record with no digest (written
  by version 2, or a copy an older agent added) is verified in full once, then given one. Reads
  still check signatures, so a record rewritten together with its digest is refused when read. A write that fails because the disk is full raises StoreFullError (nothing written);
  the agent then refuses new work and stays up (agent/node.py).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import sqlite3
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from protocol.codec import canonical_encode, decode_canonical
from protocol.envelope import MAX_ENVELOPE_BYTES, Opened, open_envelope
from protocol.errors import CodecError
from protocol.identity import Identity
from protocol.ledger import (  # noqa: F401 - the ledger's rules live in protocol/ledger.py; re-exported here
    LEDGER_DOMAIN, LEDGER_KINDS, MAX_ENTRY_BYTES, ZERO_HASH, ChainConflict, LedgerEntry, LedgerError, compare_chain,
    verify_chain,
)
from protocol.messages import JobTerms

SCHEMA_VERSION = 3
STORE_FILENAME = "agent.sqlite3"
ROLES = ("submitter", "worker", "coordinator", "observer")

_SCHEMA = (
    "CREATE TABLE schema_version (version INTEGER NOT NULL)",
    """CREATE TABLE jobs (
        job_id BLOB PRIMARY KEY, terms BLOB NOT NULL, role TEXT NOT NULL, state TEXT NOT NULL,
        round INTEGER NOT NULL, coordinator_term INTEGER NOT NULL,
        created REAL NOT NULL, updated REAL NOT NULL)""",
    """CREATE TABLE shards (
        job_id BLOB NOT NULL, round INTEGER NOT NULL, shard INTEGER NOT NULL, state TEXT NOT NULL,
        attempt INTEGER NOT NULL, worker TEXT, lease_expires REAL, updated REAL NOT NULL,
        PRIMARY KEY (job_id, round, shard))""",
    """CREATE TABLE envelopes (
        message_id BLOB PRIMARY KEY, type TEXT NOT NULL, signer TEXT NOT NULL, job_id BLOB,
        ts_ms INTEGER NOT NULL, received REAL NOT NULL, data BLOB NOT NULL, digest BLOB)""",
    "CREATE INDEX envelopes_by_job ON envelopes (job_id, ts_ms)",
    """CREATE TABLE leases (
        message_id BLOB PRIMARY KEY REFERENCES envelopes, job_id BLOB NOT NULL, round INTEGER NOT NULL,
        shard INTEGER NOT NULL, attempt INTEGER NOT NULL, worker TEXT NOT NULL, term INTEGER NOT NULL,
        expires_at REAL NOT NULL, coordinator TEXT NOT NULL)""",
    "CREATE INDEX leases_by_shard ON leases (job_id, round, shard, attempt)",
    """CREATE TABLE reports (
        message_id BLOB PRIMARY KEY REFERENCES envelopes, job_id BLOB NOT NULL, round INTEGER NOT NULL,
        shard INTEGER NOT NULL, attempt INTEGER NOT NULL, worker TEXT NOT NULL, adapter_cid TEXT NOT NULL,
        samples INTEGER NOT NULL, final_loss REAL NOT NULL)""",
    "CREATE INDEX reports_by_shard ON reports (job_id, round, shard, attempt)",
    """CREATE TABLE verdicts (
        message_id BLOB PRIMARY KEY REFERENCES envelopes, job_id BLOB NOT NULL, round INTEGER NOT NULL,
        shard INTEGER NOT NULL, attempt INTEGER NOT NULL, worker TEXT NOT NULL, term INTEGER NOT NULL,
        accepted INTEGER NOT NULL, coordinator TEXT NOT NULL)""",
    "CREATE INDEX verdicts_by_shard ON verdicts (job_id, round, shard, attempt)",
    """CREATE TABLE aggregates (
        message_id BLOB PRIMARY KEY REFERENCES envelopes, job_id BLOB NOT NULL, round INTEGER NOT NULL,
        term INTEGER NOT NULL, adapter_cid TEXT NOT NULL, method TEXT NOT NULL, shards BLOB NOT NULL,
        samples INTEGER NOT NULL, final INTEGER NOT NULL, coordinator TEXT NOT NULL)""",
    "CREATE INDEX aggregates_by_round ON aggregates (job_id, round)",
    """CREATE TABLE ledger (
        job_id BLOB NOT NULL, seq INTEGER NOT NULL, kind TEXT NOT NULL, signer BLOB NOT NULL,
        entry BLOB NOT NULL, signature BLOB NOT NULL, hash BLOB NOT NULL, digest BLOB,
        PRIMARY KEY (job_id, seq))""",
) + (
    # version 2: the cache of file hashes (agent/train/model.py FileHashCache); not evidence
    """CREATE TABLE file_hashes (
        path TEXT NOT NULL, size INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, sha256 TEXT NOT NULL,
        PRIMARY KEY (path))""",
)
# Tables added without a schema version: created when missing at every open, so an older agent still
# opens the store (it ignores them). Copies of the other peers' ledger chains of a job and the
# conflicts found between them (ipips/0008-ledger.md §5).
_ADDITIVE = (
    """CREATE TABLE IF NOT EXISTS ledger_copies (
        job_id BLOB NOT NULL, author BLOB NOT NULL, seq INTEGER NOT NULL, entry BLOB NOT NULL,
        signature BLOB NOT NULL, hash BLOB NOT NULL, digest BLOB, PRIMARY KEY (job_id, author, seq))""",
    """CREATE TABLE IF NOT EXISTS ledger_conflicts (
        job_id BLOB NOT NULL, author BLOB NOT NULL, seq INTEGER NOT NULL, kind TEXT NOT NULL, server TEXT NOT NULL,
        detail TEXT NOT NULL, evidence BLOB NOT NULL, found REAL NOT NULL, PRIMARY KEY (job_id, author, seq, kind))""",
)
_MIGRATIONS = {1: ("CREATE TABLE file_hashes (path TEXT NOT NULL, size INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, "
                   "sha256 TEXT NOT NULL, PRIMARY KEY (path))",),
               # version 3: each signed record's digest, checked at every open (NULL: verified in full once, then set)
               2: ("ALTER TABLE envelopes ADD COLUMN digest BLOB", "ALTER TABLE ledger ADD COLUMN digest BLOB")}
"""Statements that take a store from version N to N + 1."""

# The typed tables that envelopes of these message types are also indexed in.
_MESSAGE_TABLES = {"lease": "leases", "report": "reports", "verdict": "verdicts", "aggregate": "aggregates"}


class StoreError(Exception):
    """The store refused an operation or a file; the message names the file, job or record."""


class StoreFullError(StoreError):
    """A write failed because the disk (or the database's size limit) is full; nothing was written."""


FULL_BELOW = 1 << 20  # bytes free under which a failed SQLite write is taken for a full disk
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # an OSError with one of these: our own disk (or quota) is full


def full_disk(exc: BaseException) -> bool:
    """Did ``exc`` (or an exception it was raised from or during) come from our own full disk: an OSError of
    ``FULL_ERRNOS``, a full store or quota (StoreFullError), or a library's error naming the same (safetensors:
    "I/O error: No space left on device")? torch.save's does not (on a full tmpfs: "unexpected pos 576 vs 534"):
    ``disk_is_full`` tells that case. A shard given back for it is excused (IPIP-0004 §5 RETRY, ``cause: local``)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, StoreFullError) or \
                isinstance(current, OSError) and current.errno in FULL_ERRNOS or \
                "No space left on device" in str(current) or "Disk quota exceeded" in str(current):
            return True
        todo += [current.__cause__, current.__context__]
        if isinstance(current, BaseExceptionGroup):
            todo += list(current.exceptions)
    return False


def disk_is_full(path: Path) -> bool:
    """Is the file system holding ``path`` (nearly) out of space? SQLite reports a full disk as
    SQLITE_FULL, but as "disk I/O error" when its WAL or shared-memory file cannot grow."""
    try:
        stat = os.statvfs(path.parent)
    except OSError:
        return False
    return stat.f_bavail * stat.f_frsize < FULL_BELOW


# -- records -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class JobRecord:
    job_id: bytes
    terms: JobTerms
    role: str
    state: str
    round: int
    coordinator_term: int
    created: float
    updated: float


@dataclass(frozen=True)
class ShardRecord:
    job_id: bytes
    round: int
    shard: int
    state: str
    attempt: int
    worker: Optional[str]
    lease_expires: Optional[float]
    updated: float


@dataclass(frozen=True)
class StoredMessage:
    """A verified envelope from the store: ``data`` is the envelope exactly as received."""

    message_id: bytes
    signer: str
    timestamp_ms: int
    received: float
    data: bytes = field(repr=False)
    message: Any = field(repr=False)

    @property
    def type(self) -> str:
        return self.message.TYPE


def announced_data(terms: JobTerms) -> dict:
    """The ``data`` of an "announced" ledger entry: who asked for what model, with which parameters, at what price."""
    return {
        "name": terms.name,
        "submitter": terms.submitter,
        "model": terms.base_model,
        "model_sha256": terms.base_model_sha256,
        "parameters": {
            "method": terms.method, "runtime": terms.runtime, "seed": terms.seed, "rounds": terms.rounds,
            "aggregation": terms.aggregation, "training": terms.training.to_wire(), "lora": terms.lora.to_wire(),
        },
        "shards": len(terms.shards),
        "price_per_hour": terms.price_per_hour,
        "budget": terms.budget,
    }


# -- the store ---------------------------------------------------------------------------------------

class Store:
    """The agent's database. ``identity`` signs the ledger entries this agent appends."""

    def __init__(self, path: str | Path, identity: Identity) -> None:
        self.path = Path(path)
        self.identity = identity
        self._depth = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        existed = self.path.exists()
        self._lock = threading.RLock()  # one thread at a time inside a call or a transaction block
        self._later: deque[tuple[Callable[..., Any], tuple, dict]] = deque()  # queued writes (later/flush)
        self._later_errors: list[Exception] = []  # errors of queued writes made by a read, for flush()
        self._flushing = False  # a queued write is being made (by the thread that holds the lock)
        # the agent's event loop thread while its store writer runs: reads there do not make queued writes
        self.loop_thread: Optional[int] = None
        self._readers_waiting = 0  # reads waiting for the lock: flush() lets them in between two writes
        self._count_lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        try:
            self._open(existed)
        except sqlite3.DatabaseError as exc:
            self._db.close()
            if disk_is_full(self.path):  # SQLite says "disk I/O error" when its WAL cannot grow (the soak)
                raise StoreFullError(f"{self.path}: cannot open the store: the disk is full ({exc}); "
                                     "free some space") from None
            raise StoreError(f"{self.path}: not a usable infernet store: {exc}") from None
        except BaseException:
            self._db.close()
            raise

    @classmethod
    def in_data_dir(cls, data_dir: str | Path, identity: Identity) -> "Store":
        return cls(Path(data_dir) / STORE_FILENAME, identity)

    def _open(self, existed: bool) -> None:
        db = self._db
        size = self.path.stat().st_size if existed else None
        if existed:
            if size == 0 and not Path(f"{self.path}-wal").exists():
                # a store we wrote is never empty (its schema is one commit): truncated, not new
                raise StoreError(f"{self.path}: the store is empty (0 bytes): it was truncated, and its jobs and "
                                 "signed ledgers are gone; restore it from a backup, or move it away to start anew")
            problems = [row[0] for row in db.execute("PRAGMA quick_check(5)").fetchall()]
            if problems != ["ok"]:
                raise StoreError(f"{self.path}: the store is damaged (SQLite quick_check: {'; '.join(problems)[:300]});"
                                 " restore it from a backup, or move it away to start anew")
            if size == 0 and not db.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchone():
                # 0 bytes beside a WAL left by a crash, and the WAL holds no schema either (a store we wrote
                # always has it): the file was truncated. Never start a fresh store over it (nothing written).
                raise StoreError(f"{self.path}: the store is empty (0 bytes; its WAL holds no schema): it was "
                                 "truncated, and its jobs and signed ledgers are gone; restore it from a backup, "
                                 "or move it away to start anew")
        mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise StoreError(f"{self.path}: SQLite refused WAL mode (got {mode!r}); use a local disk")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA foreign_keys=ON")
        db.execute("PRAGMA busy_timeout=5000")  # a CLI reading the store may hold it briefly
        with self.transaction():
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not tables:
                for statement in _SCHEMA:
                    db.execute(statement)
                db.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
                for statement in _ADDITIVE:
                    db.execute(statement)
                return
            if "schema_version" not in tables:
                raise StoreError(f"{self.path}: not an infernet store (a SQLite file without schema_version)")
            row = db.execute("SELECT version FROM schema_version").fetchone()
            version = row[0] if row else None
            if isinstance(version, int) and version > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path}: written by a newer infernet-agent (schema version {version}, this one "
                    f"reads up to {SCHEMA_VERSION}); upgrade the agent or use another data directory")
            while isinstance(version, int) and version in _MIGRATIONS:
                for statement in _MIGRATIONS[version]:
                    words = statement.split()
                    if words[:2] == ["ALTER", "TABLE"] and words[5] in _columns(db, words[2]):
                        continue  # the column is there already (a store relabelled by hand, a retried migration)
                    db.execute(statement)
                version += 1
                db.execute("UPDATE schema_version SET version = ?", (version,))
            if version != SCHEMA_VERSION:
                raise StoreError(f"{self.path}: unknown schema version {version!r}")
            for statement in _ADDITIVE:
                db.execute(statement)
            if "digest" not in _columns(db, "ledger_copies"):
                db.execute("ALTER TABLE ledger_copies ADD COLUMN digest BLOB")  # made by a version-2 agent
            self._check_records()

    def _check_records(self) -> None:
        """Every signed record against its digest (sha256: fast); a record without one (written before
        version 3, or a copy an older agent added) is verified in full once (signature, chain hash) and
        then given one. StoreError names the file, the table and the record: damage is refused at open."""
        db = self._db
        for table, keys, columns in _SIGNED_TABLES:
            for row in db.execute(f"SELECT rowid, {', '.join(keys + columns)}, digest FROM {table}").fetchall():
                rowid, key, parts, digest = row[0], row[1:1 + len(keys)], row[1 + len(keys):-1], row[-1]
                if digest is not None:
                    if _digest(*parts) != digest:
                        raise StoreError(f"{self.path}: the store is damaged: {table} record {_key_text(key)} does "
                                         "not match its digest (its bytes changed on disk); restore the store from a "
                                         "backup, or move it away to start anew")
                    continue
                problem = _verify_record(table, parts)
                if problem:
                    raise StoreError(f"{self.path}: the store is damaged: {table} record {_key_text(key)} does not "
                                     f"verify ({problem}); restore the store from a backup, or move it away to start anew")
                db.execute(f"UPDATE {table} SET digest = ? WHERE rowid = ?", (_digest(*parts), rowid))

    def probe_write(self) -> None:
        """A write that changes nothing but needs a free page: StoreFullError while the disk is full."""
        with self.transaction():
            self._db.execute("CREATE TABLE IF NOT EXISTS probe_write (x BLOB)")
            self._db.execute("INSERT INTO probe_write VALUES (zeroblob(4096))")
            self._db.execute("DROP TABLE probe_write")

    def later(self, write: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Queue ``write(*args, **kwargs)`` (a method of this store) for ``flush()``, after the writes
        queued before it. No I/O here: safe to call from an event loop."""
        self._later.append((write, args, kwargs))

    def pending(self) -> int:
        """How many queued writes ``flush()`` has still to make (one being made included) or report on
        (a read may have made them)."""
        return len(self._later) + len(self._later_errors) + self._flushing

    def flush(self) -> list[Exception]:
        """Make the queued writes in order, each its own commit; return their errors (a StoreFullError
        when the disk is full: that write is lost, the next ones are still tried), including those of
        queued writes a read made since the last flush. The lock is held for one write at a time: a
        read from another thread waits for at most one commit."""
        self._flush_queue()
        with self._lock:
            errors, self._later_errors = self._later_errors, []
        return errors

    def _flush_queue(self) -> None:
        while self._flush_one():
            while self._readers_waiting:  # a lock is not fair: let a waiting read in before the next write
                time.sleep(0.0005)

    def _flush_one(self) -> bool:
        """Make the first queued write, under the lock; False when there is none to make here (the queue
        is empty, or this thread is inside a transaction or already making a queued write)."""
        with self._lock:
            if self._flushing or self._depth or not self._later:
                return False
            write, args, kwargs = self._later.popleft()
            self._flushing = True
            try:
                write(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - returned by flush(); the caller decides
                self._later_errors.append(exc)
            finally:
                self._flushing = False
            return True

    def close(self) -> None:
        self._flush_queue()  # what was queued is written (its errors, unclaimed, are dropped)
        with self._lock:
            self._db.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Make every store call inside the block one commit (fsynced); an error leaving the block undoes all."""
        with self._lock:
            if self._depth == 0:
                with self._full_is_an_error():
                    with self._transaction():
                        yield
                return
            with self._transaction():
                yield

    @contextlib.contextmanager
    def _full_is_an_error(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.OperationalError as exc:
            if getattr(exc, "sqlite_errorname", "") != "SQLITE_FULL" and "full" not in str(exc) and \
                    not disk_is_full(self.path):
                raise
            raise StoreFullError(f"{self.path}: cannot write: the disk is full ({exc}); nothing was stored, "
                                 "free some space") from None

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        savepoint = f"sp{self._depth}"
        if self._depth == 0:
            self._db.execute("BEGIN IMMEDIATE")
        else:
            self._db.execute(f"SAVEPOINT {savepoint}")
        self._depth += 1
        try:
            yield
        except BaseException:
            self._depth -= 1
            if not self._db.in_transaction:
                pass  # SQLite rolled it back itself (SQLITE_FULL, for one)
            elif self._depth == 0:
                self._db.execute("ROLLBACK")
            else:
                self._db.execute(f"ROLLBACK TO {savepoint}")
                self._db.execute(f"RELEASE {savepoint}")
            raise
        self._depth -= 1
        if self._depth > 0:
            self._db.execute(f"RELEASE {savepoint}")
            return
        try:
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:  # a failed COMMIT can leave the transaction open
                self._db.execute("ROLLBACK")
            raise

    def _rows(self, sql: str, params: tuple = ()) -> list[tuple]:
        """Run a query to the end. A half-read cursor (kept alive by an exception's traceback, say) would
        hold an old read snapshot: later reads would not see new commits and WAL checkpoints would stall."""
        if self._later and threading.get_ident() != self.loop_thread:
            self._flush_queue()  # what was queued is seen (not inside a transaction: _flush_one)
        with self._count_lock:
            self._readers_waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._count_lock:
                self._readers_waiting -= 1
        try:
            return self._db.execute(sql, params).fetchall()
        finally:
            self._lock.release()

    def _one(self, sql: str, params: tuple) -> Optional[tuple]:
        rows = self._rows(sql, params)
        return rows[0] if rows else None

    # -- file hashes (a cache: a 7B model is hashed once, not per shard) -------------------------------

    def file_hashes(self) -> list[tuple[tuple[str, int, int], str]]:
        """Every cached ``((path, size, mtime_ns), sha256 hex)``."""
        return [((path, size, mtime), digest)
                for path, size, mtime, digest in self._rows("SELECT path, size, mtime_ns, sha256 FROM file_hashes")]

    def save_file_hashes(self, entries: list[tuple[tuple[str, int, int], str]]) -> None:
        """Remember file hashes; a path's newer (size, mtime) replaces its old entry."""
        if not entries:
            return
        with self.transaction():
            for (path, size, mtime), digest in entries:
                self._db.execute("INSERT OR REPLACE INTO file_hashes (path, size, mtime_ns, sha256) VALUES (?, ?, ?, ?)",
                                 (path, size, mtime, digest))

    # -- jobs ----------------------------------------------------------------------------------------

    def add_job(self, terms: JobTerms, role: str, now: float, *, state: str = "ANNOUNCED", round: int = 1,
                coordinator_term: int = 0) -> JobRecord:
        """Store a job we take part in; a job already stored is returned unchanged."""
        _check_role(role)
        job_id = terms.job_id()
        with self.transaction():
            self._db.execute(
                "INSERT OR IGNORE INTO jobs (job_id, terms, role, state, round, coordinator_term, created, updated)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (job_id, canonical_encode(terms.to_wire()), role, state, round, coordinator_term, now, now))
        return self.job(job_id)

    def update_job(self, job_id: bytes, now: float, *, role: Optional[str] = None, state: Optional[str] = None,
                   round: Optional[int] = None, coordinator_term: Optional[int] = None) -> JobRecord:
        """Change the given fields of a stored job."""
        if role is not None:
            _check_role(role)
        changes = {"role": role, "state": state, "round": round, "coordinator_term": coordinator_term}
        changes = {k: v for k, v in changes.items() if v is not None}
        changes["updated"] = now
        assignments = ", ".join(f"{column} = ?" for column in changes)  # column names from the dict above
        with self.transaction():
            cur = self._db.execute(f"UPDATE jobs SET {assignments} WHERE job_id = ?", (*changes.values(), job_id))
            if cur.rowcount == 0:
                raise StoreError(f"{self.path}: no job {job_id.hex()[:16]} in the store")
        return self.job(job_id)

    def job(self, job_id: bytes) -> Optional[JobRecord]:
        row = self._one(
            "SELECT job_id, terms, role, state, round, coordinator_term, created, updated FROM jobs WHERE job_id = ?",
            (job_id,))
        return None if row is None else self._job_record(row)

    def jobs(self) -> list[JobRecord]:
        rows = self._rows(
            "SELECT job_id, terms, role, state, round, coordinator_term, created, updated FROM jobs"
            " ORDER BY created, rowid")
        return [self._job_record(row) for row in rows]

    def _job_record(self, row: tuple) -> JobRecord:
        job_id, blob, *rest = row
        try:
            terms = JobTerms.from_wire(decode_canonical(blob, max_bytes=MAX_ENVELOPE_BYTES), "terms")
        except CodecError as exc:
            raise StoreError(f"{self.path}: stored terms of job {job_id.hex()[:16]} are corrupt: {exc}") from None
        if terms.job_id() != job_id:
            raise StoreError(f"{self.path}: stored terms of job {job_id.hex()[:16]} do not hash to its ID")
        return JobRecord(job_id, terms, *rest)

    # -- shards --------------------------------------------------------------------------------------

    def set_shard(self, job_id: bytes, round: int, shard: int, state: str, now: float, *, attempt: int = 0,
                  worker: Optional[str] = None, lease_expires: Optional[float] = None) -> ShardRecord:
        """Record the current state of one shard in one round (replacing the previous one)."""
        with self.transaction():
            self._db.execute(
                "INSERT INTO shards (job_id, round, shard, state, attempt, worker, lease_expires, updated)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (job_id, round, shard) DO UPDATE SET"
                " state = excluded.state, attempt = excluded.attempt, worker = excluded.worker,"
                " lease_expires = excluded.lease_expires, updated = excluded.updated",
                (job_id, round, shard, state, attempt, worker, lease_expires, now))
        return ShardRecord(job_id, round, shard, state, attempt, worker, lease_expires, now)

    def shards(self, job_id: bytes, round: Optional[int] = None) -> list[ShardRecord]:
        rows = self._rows(
            "SELECT job_id, round, shard, state, attempt, worker, lease_expires, updated FROM shards"
            " WHERE job_id = ? AND (? IS NULL OR round = ?) ORDER BY round, shard", (job_id, round, round))
        return [ShardRecord(*row) for row in rows]

    # -- signed envelopes ----------------------------------------------------------------------------

    def record(self, data: bytes, now: float) -> StoredMessage:
        """Store an accepted envelope (any type) as received, and index leases, reports, verdicts and
        aggregates in their tables. Its signature and body are checked again; a duplicate is a no-op."""
        try:
            opened = reopen(data)
        except CodecError as exc:
            raise StoreError(f"refusing to store an envelope that does not verify: {exc}") from None
        env, msg = opened.envelope, opened.message
        message_id, signer = env.message_id, env.signer
        with self.transaction():
            cur = self._db.execute(
                "INSERT OR IGNORE INTO envelopes (message_id, type, signer, job_id, ts_ms, received, data, digest)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (message_id, env.type, signer, getattr(msg, "job_id", None), env.timestamp_ms, now, bytes(data),
                 _digest(bytes(data))))
            if cur.rowcount == 0:
                return self._messages("SELECT e.message_id, e.ts_ms, e.received, e.data FROM envelopes e"
                                      " WHERE e.message_id = ?", (message_id,))[0]
            if env.type == "lease":
                self._db.execute(
                    "INSERT INTO leases (message_id, job_id, round, shard, attempt, worker, term, expires_at,"
                    " coordinator) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (message_id, msg.job_id, msg.round, msg.shard, msg.attempt, msg.worker, msg.term,
                     msg.expires_at, signer))
            elif env.type == "report":
                self._db.execute(
                    "INSERT INTO reports (message_id, job_id, round, shard, attempt, worker, adapter_cid, samples,"
                    " final_loss) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (message_id, msg.job_id, msg.round, msg.shard, msg.attempt, signer, msg.adapter_cid,
                     msg.samples, msg.final_loss))
            elif env.type == "verdict":
                self._db.execute(
                    "INSERT INTO verdicts (message_id, job_id, round, shard, attempt, worker, term, accepted,"
                    " coordinator) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (message_id, msg.job_id, msg.round, msg.shard, msg.attempt, msg.worker, msg.term,
                     msg.accepted, signer))
            elif env.type == "aggregate":
                self._db.execute(
                    "INSERT INTO aggregates (message_id, job_id, round, term, adapter_cid, method, shards, samples,"
                    " final, coordinator) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (message_id, msg.job_id, msg.round, msg.term, msg.adapter_cid, msg.method,
                     canonical_encode(list(msg.shards)), msg.samples, msg.final, signer))
        return StoredMessage(message_id, signer, env.timestamp_ms, now, bytes(data), msg)

    def job_signers(self, job_id: bytes) -> list[str]:
        """Peer IDs that signed a stored envelope of the job (who took part in it)."""
        return [row[0] for row in self._rows("SELECT DISTINCT signer FROM envelopes WHERE job_id = ?", (job_id,))]

    def has_envelope(self, message_id: bytes) -> bool:
        return self._one("SELECT 1 FROM envelopes WHERE message_id = ?", (message_id,)) is not None

    def envelopes(self, job_id: Optional[bytes] = None, type: Optional[str] = None, *,
                  stored_order: bool = False) -> list[StoredMessage]:
        """Accepted envelopes, oldest signer timestamp first (``stored_order``: in the order they were
        stored, which for a job's topic is the order our mirror applied them); filtered by job and/or type."""
        order = "e.rowid" if stored_order else "e.ts_ms, e.rowid"
        return self._messages(
            "SELECT e.message_id, e.ts_ms, e.received, e.data FROM envelopes e"
            f" WHERE (? IS NULL OR e.job_id = ?) AND (? IS NULL OR e.type = ?) ORDER BY {order}",
            (job_id, job_id, type, type))

    def leases(self, job_id: bytes, round: Optional[int] = None) -> list[StoredMessage]:
        return self._typed("lease", job_id, round)

    def reports(self, job_id: bytes, round: Optional[int] = None) -> list[StoredMessage]:
        return self._typed("report", job_id, round)

    def verdicts(self, job_id: bytes, round: Optional[int] = None) -> list[StoredMessage]:
        return self._typed("verdict", job_id, round)

    def aggregates(self, job_id: bytes, round: Optional[int] = None) -> list[StoredMessage]:
        return self._typed("aggregate", job_id, round)

    def _typed(self, type_tag: str, job_id: bytes, round: Optional[int]) -> list[StoredMessage]:
        table = _MESSAGE_TABLES[type_tag]
        return self._messages(
            f"SELECT e.message_id, e.ts_ms, e.received, e.data FROM {table} t JOIN envelopes e USING (message_id)"
            " WHERE t.job_id = ? AND (? IS NULL OR t.round = ?) ORDER BY t.rowid", (job_id, round, round))

    def _messages(self, sql: str, params: tuple) -> list[StoredMessage]:
        out = []
        for message_id, ts_ms, received, data in self._rows(sql, params):
            try:
                opened = open_envelope(data, now=ts_ms / 1000.0)
            except CodecError as exc:
                opened, problem = None, str(exc)
            else:
                problem = None if opened.envelope.message_id == message_id else "its message ID changed"
            if problem is not None:
                raise StoreError(f"{self.path}: stored envelope {message_id.hex()[:16]} does not verify: {problem}")
            out.append(StoredMessage(message_id, opened.signer, ts_ms, received, data, opened.message))
        return out

    # -- the ledger ----------------------------------------------------------------------------------

    def append_event(self, job_id: bytes, kind: str, data: dict, now: float, *,
                     peer: Optional[str] = None) -> LedgerEntry:
        """Append an entry signed by this agent; ``peer`` (who acted) defaults to this agent."""
        if not isinstance(job_id, bytes) or len(job_id) != 32:
            raise StoreError(f"append_event: job_id must be 32 bytes, got {job_id!r:.60}")
        with self.transaction():
            seq, prev = self._ledger_head(job_id)
            entry = LedgerEntry.create(self.identity, job_id, seq, prev, now, peer or self.identity.peer_id,
                                       kind, data)
            self._insert_entry(entry)
        return entry

    def import_entry(self, encoded: bytes, signature: bytes) -> LedgerEntry:
        """Append another peer's entry; it must verify and chain onto our last entry of that job.
        An entry already stored (same seq, same hash) is a no-op."""
        entry = LedgerEntry.decode(encoded, signature)
        with self.transaction():
            row = self._one("SELECT hash FROM ledger WHERE job_id = ? AND seq = ?", (entry.job_id, entry.seq))
            if row is not None:
                if row[0] == entry.hash:
                    return entry
                raise LedgerError(entry.job_id, entry.seq, "conflicts with the entry stored at that seq (fork)")
            seq, prev = self._ledger_head(entry.job_id)
            if entry.seq != seq:
                raise LedgerError(entry.job_id, entry.seq, f"cannot import: the next local seq is {seq}")
            if entry.prev != prev:
                raise LedgerError(entry.job_id, entry.seq, f"prev does not match the hash of local seq {seq - 1}")
            self._insert_entry(entry)
        return entry

    def ledger(self, job_id: bytes) -> list[LedgerEntry]:
        """The job's entries in seq order, each checked on its own (signature, shape); see verify_ledger."""
        return [LedgerEntry.decode(entry, signature) for entry, signature in self._rows(
            "SELECT entry, signature FROM ledger WHERE job_id = ? ORDER BY seq", (job_id,))]

    def verify_ledger(self, job_id: bytes) -> int:
        """Check the job's whole ledger; return its length or raise LedgerError naming the first bad seq."""
        prev = ZERO_HASH
        rows = self._rows(
            "SELECT seq, kind, signer, entry, signature, hash FROM ledger WHERE job_id = ? ORDER BY seq", (job_id,))
        count = 0
        for expected, (seq, kind, signer, encoded, signature, stored_hash) in enumerate(rows):
            if seq != expected:
                raise LedgerError(job_id, expected, f"missing (the next stored entry is seq {seq})")
            try:
                entry = LedgerEntry.decode(encoded, signature)
            except LedgerError as exc:
                raise LedgerError(job_id, seq, exc.problem) from None
            if entry.job_id != job_id or entry.seq != seq:
                raise LedgerError(job_id, seq, f"entry names job {entry.job_id.hex()[:16]} seq {entry.seq}")
            if entry.prev != prev:
                raise LedgerError(job_id, seq, "broken chain: prev is not the hash of the entry before")
            if (kind, signer, stored_hash) != (entry.kind, entry.signer, entry.hash):
                raise LedgerError(job_id, seq, "stored kind/signer/hash columns disagree with the entry")
            prev = entry.hash
            count += 1
        return count

    # -- copies of the other peers' chains (ipips/0008-ledger.md §5) --------------------------------

    def chain_rows(self, job_id: bytes, starts: dict[bytes, int] | None = None) -> dict[bytes, list[tuple[bytes, bytes]]]:
        """Every chain of the job we hold as stored ``(entry, signature)`` rows, by author, not decoded
        (what we serve: the receiver checks every entry); with ``starts``, each chain named there from that seq."""
        me = self.identity.public_key
        out: dict[bytes, list[tuple[bytes, bytes]]] = {}
        if starts is not None:
            for author, start in starts.items():
                rows = self._chain_of("entry, signature", job_id, author, "seq >= ?", start)
                if rows:
                    out[author] = rows
            return out
        own = self._rows("SELECT entry, signature FROM ledger WHERE job_id = ? ORDER BY seq", (job_id,))
        if own:
            out[me] = own
        for author, entry, signature in self._rows(
                "SELECT author, entry, signature FROM ledger_copies WHERE job_id = ? ORDER BY author, seq", (job_id,)):
            if author != me:
                out.setdefault(author, []).append((entry, signature))
        return out

    def chains(self, job_id: bytes) -> dict[bytes, list[LedgerEntry]]:
        """Every chain of the job we hold, by author's public key: our own and our copies of the others'.
        Each entry is re-checked (LedgerError names the first that does not verify)."""
        return {author: [LedgerEntry.decode(e, sig) for e, sig in rows]
                for author, rows in self.chain_rows(job_id).items()}

    def chain_heads(self, job_id: bytes) -> dict[bytes, tuple[int, bytes]]:
        """(length, hash of the last entry) of every chain of the job we hold, by author, from the stored hash
        columns, nothing decoded: what a sync request names (IPIP-0008 §5.1)."""
        out = {}
        seq, head = self._ledger_head(job_id)
        if seq:
            out[self.identity.public_key] = (seq, head)
        # (SQLite: with MAX(), the bare column ``hash`` is the max row's)
        for author, last, digest in self._rows(
                "SELECT author, MAX(seq), hash FROM ledger_copies WHERE job_id = ? GROUP BY author", (job_id,)):
            if author != self.identity.public_key:
                out[author] = (last + 1, digest)
        return out

    def chain_hashes(self, job_id: bytes, author: bytes, start: int) -> list[bytes]:
        """The stored hashes of ``author``'s chain of the job (ours for our own key) from seq ``start`` on."""
        return [row[0] for row in self._chain_of("hash", job_id, author, "seq >= ?", start)]

    def ledger_copy_entry(self, job_id: bytes, author: bytes, seq: int) -> LedgerEntry | None:
        """One entry of our copy of ``author``'s chain (our own for our own key), checked; None if not held."""
        rows = self._chain_of("entry, signature", job_id, author, "seq = ?", seq)
        return LedgerEntry.decode(*rows[0]) if rows else None

    def _chain_of(self, columns: str, job_id: bytes, author: bytes, condition: str, value: int) -> list[tuple]:
        """``columns`` of the rows of ``author``'s chain of the job where ``condition`` holds, in seq order: our own
        chain's table for our own key, the copies' for any other."""
        if author == self.identity.public_key:
            return self._rows(f"SELECT {columns} FROM ledger WHERE job_id = ? AND {condition} ORDER BY seq",
                              (job_id, value))
        return self._rows(f"SELECT {columns} FROM ledger_copies WHERE job_id = ? AND author = ? AND {condition} "
                          "ORDER BY seq", (job_id, author, value))

    def ledger_copy(self, job_id: bytes, author: bytes) -> list[LedgerEntry]:
        """Our copy of ``author``'s chain of the job (our own chain for our own key), each entry re-checked."""
        if author == self.identity.public_key:
            return self.ledger(job_id)
        return [LedgerEntry.decode(entry, signature) for entry, signature in self._rows(
            "SELECT entry, signature FROM ledger_copies WHERE job_id = ? AND author = ? ORDER BY seq",
            (job_id, author))]

    def extend_copy(self, job_id: bytes, author: bytes, entries: list[LedgerEntry]) -> int:
        """Append entries that continue our copy of ``author``'s chain (the caller checked them with
        protocol/ledger.compare_chain); LedgerError if one does not. Returns how many were added."""
        if author == self.identity.public_key or not entries:
            return 0
        with self.transaction():
            row = self._one("SELECT seq, hash FROM ledger_copies WHERE job_id = ? AND author = ? "
                            "ORDER BY seq DESC LIMIT 1", (job_id, author))
            seq, prev = (0, ZERO_HASH) if row is None else (row[0] + 1, row[1])
            for entry in entries:
                if entry.job_id != job_id or entry.signer != author or entry.seq != seq or entry.prev != prev:
                    raise LedgerError(job_id, entry.seq, f"does not continue our copy of "
                                                         f"{entry.signer_peer_id}'s chain at seq {seq}")
                self._db.execute(
                    "INSERT INTO ledger_copies (job_id, author, seq, entry, signature, hash, digest)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (job_id, author, entry.seq, entry.encoded, entry.signature, entry.hash,
                     _digest(entry.encoded, entry.signature)))
                seq, prev = seq + 1, entry.hash
        return len(entries)

    def record_conflict(self, job_id: bytes, conflict: ChainConflict, now: float) -> bool:
        """Keep a conflict found between copies of a chain (with the entries that prove a fork);
        False if it was known already."""
        evidence = canonical_encode({
            "held": [conflict.held.encoded, conflict.held.signature] if conflict.held else None,
            "served": [conflict.served.encoded, conflict.served.signature] if conflict.served else None})
        with self.transaction():
            cur = self._db.execute(
                "INSERT OR IGNORE INTO ledger_conflicts (job_id, author, seq, kind, server, detail, evidence, found)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (job_id, conflict.author, conflict.seq, conflict.kind, conflict.server, conflict.describe(),
                 evidence, now))
        return cur.rowcount > 0

    def conflicts(self, job_id: bytes) -> list[dict]:
        """Conflicts found in the job's chains, oldest first: kind, author, seq, who served it, one line."""
        from protocol.identity import peer_id_from_public_key

        return [{"kind": kind, "author": peer_id_from_public_key(author), "seq": seq, "server": server,
                 "detail": detail, "found": found}
                for author, seq, kind, server, detail, found in self._rows(
                    "SELECT author, seq, kind, server, detail, found FROM ledger_conflicts WHERE job_id = ?"
                    " ORDER BY found, rowid", (job_id,))]

    def _ledger_head(self, job_id: bytes) -> tuple[int, bytes]:
        """The next seq of a job's ledger and the hash it must chain to."""
        row = self._one("SELECT seq, hash FROM ledger WHERE job_id = ? ORDER BY seq DESC LIMIT 1", (job_id,))
        return (0, ZERO_HASH) if row is None else (row[0] + 1, row[1])

    def _insert_entry(self, entry: LedgerEntry) -> None:
        self._db.execute(
            "INSERT INTO ledger (job_id, seq, kind, signer, entry, signature, hash, digest) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (entry.job_id, entry.seq, entry.kind, entry.signer, entry.encoded, entry.signature, entry.hash,
             _digest(entry.encoded, entry.signature)))


# (table, key columns, the signed bytes' columns) of the records checked at open
_SIGNED_TABLES = (
    ("envelopes", ("message_id",), ("data",)),
    ("ledger", ("job_id", "seq"), ("entry", "signature")),
    ("ledger_copies", ("job_id", "seq"), ("entry", "signature")),
)


def _columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in db.execute(f"PRAGMA table_info({table})")}


def _digest(*parts: bytes) -> bytes:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return h.digest()


def _key_text(key: tuple) -> str:
    """``message 1a2b...`` or ``job 1a2b... seq 7``."""
    if len(key) == 2:
        return f"job {bytes(key[0]).hex()[:16]} seq {key[1]}"
    return f"message {bytes(key[0]).hex()[:16]}"


def _verify_record(table: str, parts: tuple) -> str | None:
    """Why a stored record without a digest does not verify, or None."""
    try:
        if table == "envelopes":
            reopen(bytes(parts[0]))
        else:
            LedgerEntry.decode(bytes(parts[0]), bytes(parts[1]))
    except (CodecError, LedgerError) as exc:
        return str(exc)[:200]
    return None


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise StoreError(f"role: expected one of {', '.join(ROLES)}, got {role!r:.40}")


def reopen(data: bytes) -> Opened:
    """Verify an envelope's signature and body regardless of the clock: its own timestamp is 'now'."""
    raw = decode_canonical(data, max_bytes=MAX_ENVELOPE_BYTES)
    ts = raw.get("ts") if isinstance(raw, dict) else None
    now = ts / 1000.0 if isinstance(ts, int) and not isinstance(ts, bool) else 0.0
    return open_envelope(data, now=now)
