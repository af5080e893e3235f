"""Base model hashes are read once per file (path, size, mtime), and a changed file is read again."""

from __future__ import annotations

import hashlib
import os
import shutil

from agent.train.model import FileHashCache, base_model_sha256


def sha256sum_listing(root) -> str:
    """The IPIP-0005 rule spelled out independently: sha256sum config.json *.safetensors | sort -k2 | sha256sum."""
    files = sorted([root / "config.json", *root.rglob("*.safetensors")], key=lambda p: p.relative_to(root).as_posix())
    text = "".join(f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.relative_to(root).as_posix()}\n" for f in files)
    return hashlib.sha256(text.encode()).hexdigest()


def test_the_cache_is_used_and_a_changed_file_invalidates_it(tmp_path, tiny_model_dir):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    cache = FileHashCache()
    first = base_model_sha256(str(model), cache)
    assert first == sha256sum_listing(model) == base_model_sha256(str(model), None)
    entries, position = cache.since(0)
    assert len(entries) == 2 and position == 2  # config.json and model.safetensors

    # proof that a hit does not read the file: a forged entry for the same (path, size, mtime) is believed
    weights = model / "model.safetensors"
    key = (str(weights.resolve()), weights.stat().st_size, weights.stat().st_mtime_ns)
    cache.put(key, "00" * 32)
    assert base_model_sha256(str(model), cache) != first

    # the file changes (same size, new bytes, new mtime): read again, the forged entry no longer applies
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, key[2] + 1_000_000))
    changed = base_model_sha256(str(model), cache)
    assert changed == sha256sum_listing(model) and changed != first
    assert cache.since(position)[0][-1][0][0] == str(weights.resolve())  # the new entry, to be saved to the store
