"""Sealed bundles: a private job's final aggregate, sealed file by file to its submitter (ipips/0010-sealed-results.md).

Rules of this file:
- ``seal_dir`` writes, for each file ``NAME`` of an aggregate directory, ``NAME.sealed``
  (protocol/sealed.seal to the submitter's peer ID) into a new directory, which is then packed
  like any bundle (agent/bundle.py): the CID the coordinator publishes names the sealed tar.
- ``open_bundle`` unpacks a fetched aggregate bundle into ``out``: a sealed one (only the names
  ``SEALED_AGGREGATE_FILES``) is opened with our identity, each file checked by its Poly1305 tag;
  a plain one is unpacked as before. Nothing half-written is left on failure.
- Only the final aggregate of a job with ``private: true`` is sealed (``must_seal``): the
  intermediate ones are what the next round's workers train from.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from agent.bundle import AGGREGATE_FILES, BundleError, unpack
from protocol.sealed import SEALED_SUFFIX, SealError, seal, sealed_name, unseal

SEALED_AGGREGATE_FILES = frozenset(sealed_name(n) for n in AGGREGATE_FILES)


def must_seal(terms: Any, final: bool) -> bool:
    """Is this aggregate sealed? The final one of a private job, and no other (IPIP-0010 §2)."""
    return bool(getattr(terms, "private", False)) and final


def seal_dir(src: Path, dst: Path, peer_id: str) -> Path:
    """Seal every file of ``src`` to ``peer_id`` into ``dst`` (replaced): ``NAME`` -> ``NAME.sealed``."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    for path in sorted(p for p in src.iterdir() if p.is_file() and not p.name.startswith(".")):
        (dst / sealed_name(path.name)).write_bytes(seal(path.read_bytes(), peer_id))
    return dst


def is_sealed_dir(directory: Path) -> bool:
    names = [p.name for p in directory.iterdir()]
    return bool(names) and all(n.endswith(SEALED_SUFFIX) for n in names)


def open_bundle(bundle: Path, out: Path, identity: Any, *, max_bytes: int = 4 << 30) -> tuple[Path, bool]:
    """Unpack an aggregate bundle into ``out`` (which must not exist or be empty), opening it if sealed.
    Returns (out, was it sealed). BundleError or SealError (one line) on failure, with ``out`` absent."""
    staging = out.with_name(f".{out.name}.unpacked")
    try:
        unpack(bundle, staging, allowed=AGGREGATE_FILES | SEALED_AGGREGATE_FILES, max_bytes=max_bytes)
        sealed = is_sealed_dir(staging)
        if not sealed:
            if any(p.name.endswith(SEALED_SUFFIX) for p in staging.iterdir()):
                raise BundleError(f"{bundle.name}: mixes sealed and plain files")
            if out.exists():
                out.rmdir()
            staging.rename(out)
            return out, False
        opened = out.with_name(f".{out.name}.opened")
        shutil.rmtree(opened, ignore_errors=True)
        opened.mkdir(parents=True)
        try:
            for path in sorted(staging.iterdir()):
                name = path.name[:-len(SEALED_SUFFIX)]
                (opened / name).write_bytes(unseal(path.read_bytes(), identity, f"{bundle.name}: {path.name}"))
            if out.exists():
                out.rmdir()
            opened.rename(out)
        except BaseException:
            shutil.rmtree(opened, ignore_errors=True)
            raise
        return out, True
    finally:
        shutil.rmtree(staging, ignore_errors=True)


__all__ = ["SEALED_AGGREGATE_FILES", "SealError", "must_seal", "seal_dir", "open_bundle", "is_sealed_dir"]
