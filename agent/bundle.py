"""Directories as single files: deterministic tar bundles of adapters and checkpoints.

UnixFS here moves files, not directories, so a directory that must travel by CID (an adapter:
``adapter_config.json`` + ``adapter_model.safetensors``; a training checkpoint) is packed into an
uncompressed POSIX tar first. Rules of this file:
- Packing is deterministic: entries sorted by name, regular files only, no subdirectories,
  mtime 0, uid/gid 0, mode 0644, no user/group names. The same directory always gives the same
  bytes, so the same CID.
- Unpacking reads UNTRUSTED bytes: only plain regular-file entries (type '0', no links, devices,
  directories, contiguous or sparse files) with plain names (no '/', no '..', no leading '.'),
  no duplicates, only the names the caller allows, at most ``max_bytes`` in total, at least one
  entry, and every entry's bytes all present (a truncated tar is refused, not cut short). It
  extracts into a temporary sibling and renames it into place, so a failed unpack leaves nothing
  behind. ``out_dir`` is REPLACED: an existing directory there (an earlier unpack of the same
  object, say) is removed only once the new contents are complete; a file or a symlink there is
  refused, never followed or removed. Anything wrong raises BundleError naming the bundle (and
  the entry). Our own disk full is not the bundle's fault: an OSError (ENOSPC, EDQUOT), never a
  BundleError, so a verifier whose disk fills does not reject the worker who sent it (issue 24: the demo
  on a 600 MB disk had two honest reports rejected with "No space left on device").
- Tensors inside are safetensors; nothing is unpickled.
- A bundle is up to a few GiB: the agent packs and unpacks from its event loop only through
  ``pack_dir_off_loop``/``unpack_off_loop``, in a worker thread (at most ``BUNDLE_THREADS`` at once
  per trio run), so heartbeats and gossip never wait on the disk.
"""

from __future__ import annotations

import os
import shutil
import tarfile
from functools import partial
from pathlib import Path
from typing import Any

import trio

from agent.store import FULL_ERRNOS

ADAPTER_FILES = frozenset({"adapter_config.json", "adapter_model.safetensors"})
CHECKPOINT_FILES = ADAPTER_FILES | {"optimizer.safetensors", "state.json"}
# a worker's report: the adapter, and its final AdamW state when the job carries it (IPIP-0006 §2.3);
# with report_codec int8 the config and the coded payload instead (§2.8, agent/train/codec.py)
REPORT_FILES = ADAPTER_FILES | {"optimizer.safetensors", "delta.safetensors"}
# a round's aggregate: the adapter, the averaged AdamW state when the job carries it, and the outer
# optimizer's state when the job has one (IPIP-0006 §2.3, §2.4)
AGGREGATE_FILES = ADAPTER_FILES | {"optimizer.safetensors", "outer_state.safetensors"}
DEFAULT_MAX_BYTES = 4 << 30
_PLAIN_FILE_TYPES = (tarfile.REGTYPE, tarfile.AREGTYPE)  # not CONTTYPE, GNUTYPE_SPARSE: tarfile's isreg() takes those


def bundle_size_bound(max_bytes: int, allowed: frozenset[str]) -> int:
    """The largest tar that ``unpack(..., allowed=allowed, max_bytes=max_bytes)`` can accept.

    Each entry adds a 512-byte header and under 512 bytes of padding; the end-of-archive marker
    and the padding to a 10240-byte record add at most 1024 + 10240. A fetch of a bundle is bounded
    by this (IPIP-0003 "Size bounds"), so no peer can make us download more than we would unpack.
    """
    return max_bytes + len(allowed) * 2 * tarfile.BLOCKSIZE + 2 * tarfile.BLOCKSIZE + tarfile.RECORDSIZE


class BundleError(Exception):
    """A bundle could not be packed or is not a safe, well-formed bundle."""


def pack_dir(directory: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Pack the regular files of ``directory`` (no subdirectories) into a deterministic tar at ``out``."""
    directory, out = Path(directory), Path(out)
    files = sorted(p for p in directory.iterdir() if p.is_file() and not p.name.startswith("."))
    if not files:
        raise BundleError(f"{directory}: nothing to pack")
    tmp = out.with_name(f".{out.name}.partial")
    with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
        for path in files:
            info = tarfile.TarInfo(path.name)
            info.size = path.stat().st_size
            info.mtime = 0
            info.mode = 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with open(path, "rb") as fh:
                tar.addfile(info, fh)
    os.replace(tmp, out)
    return out


def unpack(bundle: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
           allowed: frozenset[str] | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> Path:
    """Safely extract ``bundle`` into ``out_dir``, replacing a directory already there once the new one is complete."""
    bundle, out_dir = Path(bundle), Path(out_dir)
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise BundleError(f"{bundle.name}: {out_dir} exists and is not a directory; not replaced")
    staging = out_dir.with_name(f".{out_dir.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        seen: set[str] = set()
        total = 0
        try:
            tar = tarfile.open(bundle, "r:")
        except (tarfile.TarError, OSError) as exc:
            raise BundleError(f"{bundle.name}: not a tar bundle ({exc})") from None
        with tar:
            try:
                members = tar.getmembers()
            except (tarfile.TarError, OSError) as exc:
                raise BundleError(f"{bundle.name}: malformed tar ({exc})") from None
            _check_end_of_archive(tar, bundle)
            for member in members:
                name = member.name
                if member.type not in _PLAIN_FILE_TYPES:
                    raise BundleError(f"{bundle.name}: entry {name[:80]!r} is not a regular file")
                if "/" in name or "\\" in name or name in ("", ".", "..") or name.startswith("."):
                    raise BundleError(f"{bundle.name}: entry {name[:80]!r} is not a plain file name")
                if allowed is not None and name not in allowed:
                    raise BundleError(f"{bundle.name}: unexpected entry {name[:80]!r} "
                                      f"(expected {', '.join(sorted(allowed))})")
                if name in seen:
                    raise BundleError(f"{bundle.name}: entry {name!r} appears twice")
                seen.add(name)
                total += member.size
                if total > max_bytes:
                    raise BundleError(f"{bundle.name}: larger than {max_bytes} bytes")
                _copy_exactly(tar, member, staging / name, bundle.name)
            if not seen:
                raise BundleError(f"{bundle.name}: holds no files")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.rename(staging, out_dir)
        return out_dir
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise



def _copy_exactly(tar: tarfile.TarFile, member: tarfile.TarInfo, dst: Path, bundle_name: str) -> None:
    """Copy the entry's ``member.size`` bytes; a bundle that ends before them is truncated."""
    left = member.size
    try:
        src = tar.extractfile(member)
        with open(dst, "wb") as out:
            while left:
                chunk = src.read(min(left, 1 << 20))
                if not chunk:
                    break
                out.write(chunk)
                left -= len(chunk)
    except OSError as exc:
        if exc.errno in FULL_ERRNOS:  # our disk is full: our failure, not the bundle's
            raise OSError(exc.errno, f"{dst}: cannot write an entry of {bundle_name}: {exc.strerror}") from None
        raise BundleError(f"{bundle_name}: entry {member.name!r} could not be extracted ({exc})") from None
    except tarfile.TarError as exc:
        raise BundleError(f"{bundle_name}: entry {member.name!r} could not be extracted ({exc})") from None
    if left:
        raise BundleError(f"{bundle_name}: truncated in entry {member.name!r} "
                          f"({member.size - left} of {member.size} bytes)")


def _check_end_of_archive(tar: tarfile.TarFile, bundle: Path) -> None:
    """After the last entry comes the end-of-archive marker (two zero blocks), then only zeros.

    tarfile stops silently at a header cut short after the first entry, so without this check a
    bundle truncated between entries would unpack with entries missing.
    """
    with open(bundle, "rb") as fh:
        fh.seek(tar.offset)
        zeros = 0
        while chunk := fh.read(1 << 20):
            if chunk.count(0) != len(chunk):
                raise BundleError(f"{bundle.name}: truncated, or bytes after its last entry (offset {tar.offset})")
            zeros += len(chunk)
    if zeros < 2 * tarfile.BLOCKSIZE:
        raise BundleError(f"{bundle.name}: truncated (no end-of-archive marker after offset {tar.offset})")


# -- off the event loop ------------------------------------------------------------------------------

BUNDLE_THREADS = 2
_LIMITER: trio.lowlevel.RunVar = trio.lowlevel.RunVar("infernet_bundle_limiter")


def bundle_limiter() -> trio.CapacityLimiter:
    """The worker threads packing and unpacking bundles in this trio run (``BUNDLE_THREADS`` at once)."""
    try:
        return _LIMITER.get()
    except LookupError:
        limiter = trio.CapacityLimiter(BUNDLE_THREADS)
        _LIMITER.set(limiter)
        return limiter


async def pack_dir_off_loop(directory: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """``pack_dir`` in a worker thread: the event loop runs on while the bundle is written."""
    return await trio.to_thread.run_sync(pack_dir, directory, out, limiter=bundle_limiter())


async def unpack_off_loop(bundle: str | os.PathLike[str], out_dir: str | os.PathLike[str], **limits: Any) -> Path:
    """``unpack`` in a worker thread (same checks, same errors): the event loop runs on meanwhile."""
    return await trio.to_thread.run_sync(partial(unpack, bundle, out_dir, **limits), limiter=bundle_limiter())
