"""The tiny model: deterministic, hashable the documented way, a real Hugging Face model."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess

import torch

from agent.train.model import base_model_sha256
from agent.train.tiny import build_tiny_model, tiny_model


def test_same_seed_same_files_same_hash(tmp_path, tiny_model_dir):
    first = build_tiny_model(tmp_path / "a", seed=0)
    second = build_tiny_model(tmp_path / "b", seed=0)
    other = build_tiny_model(tmp_path / "c", seed=1)
    names = sorted(p.name for p in first.iterdir())
    assert names == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert base_model_sha256(str(first)) == base_model_sha256(str(second)) == base_model_sha256(str(tiny_model_dir))
    assert base_model_sha256(str(other)) != base_model_sha256(str(first))
    assert "transformers_version" not in json.loads((first / "config.json").read_text())


def test_hash_is_sha256sum_of_the_sorted_listing(tiny_model_dir, tmp_path):
    listing = "".join(
        f"{hashlib.sha256((tiny_model_dir / name).read_bytes()).hexdigest()}  {name}\n"
        for name in sorted(["config.json", "model.safetensors"]))
    assert base_model_sha256(str(tiny_model_dir)) == hashlib.sha256(listing.encode()).hexdigest()
    if shutil.which("sha256sum"):
        shell = subprocess.run("sha256sum config.json *.safetensors | sort -k2 | sha256sum", shell=True,
                               cwd=tiny_model_dir, capture_output=True, text=True, check=True)
        assert shell.stdout.split()[0] == base_model_sha256(str(tiny_model_dir))
    # the tokenizer is not part of the weights' identity; the weights are
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    (copy / "tokenizer_config.json").write_text("{}")
    assert base_model_sha256(str(copy)) == base_model_sha256(str(tiny_model_dir))
    (copy / "config.json").write_text((copy / "config.json").read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    assert base_model_sha256(str(copy)) != base_model_sha256(str(tiny_model_dir))


def test_loads_as_a_standard_causal_lm_with_chatml(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "qwen2"
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 1.5e6
    for name, parameter in model.named_parameters():
        if parameter.dim() == 2:
            assert all(d % 64 == 0 for d in parameter.shape), name  # 4-bit quantization needs this
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    with torch.no_grad():
        out = model.generate(torch.tensor([tokenizer(text)["input_ids"]]), max_new_tokens=3, do_sample=False)
    assert out.shape[1] > len(tokenizer(text)["input_ids"])


def test_cache_builds_once(tmp_path):
    path = tiny_model(tmp_path, seed=0)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert tiny_model(tmp_path, seed=0) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no leftover build directories


def test_tokenizer_matches_its_own_file(tiny_model_dir):
    """transformers loads a qwen2 tokenizer through its own class; it must tokenize as the file does."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    loaded = AutoTokenizer.from_pretrained(tiny_model_dir)
    for text in ["What color is the banana?  Two  spaces", "Count from 12 to 16.\n\n", "<|im_start|>user\né<|im_end|>"]:
        assert loaded(text)["input_ids"] == raw.encode(text).ids
