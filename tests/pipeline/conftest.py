"""A trained run of the tiny model, made once by the real `train run --local` code (in process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.cli import main
from agent.train.data import write_chatml
from agent.train.tiny import demo_records, tiny_model

SPEC = """
name: pipeline-test
base_model: infernet-tiny
seed: 5
input: {dataset: data.jsonl, validation_split: 0.1}
training: {batch_size: 8, learning_rate: 0.02, max_steps: 40, max_seq_len: 96}
lora: {rank: 8, alpha: 16, target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}
proof: {checkpoint_every: 20, verify_segments: 1}
"""


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``infernet ARGV`` in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("infernet: "), (code, err)
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return tiny_model()


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory, tiny_dir) -> Path:
    root = tmp_path_factory.mktemp("pipeline")
    (root / "infernet.train.yml").write_text(SPEC)
    write_chatml(root / "data.jsonl", demo_records(160, seed=2))
    code = main(["train", "run", "--local", "--config", str(root / "infernet.train.yml"), "--output",
                 str(root / "run"), "--threads", "1", "--no-progress", "--json"])
    assert code == 0
    assert json.loads((root / "run" / "result.json").read_text())["steps"] == 40
    return root / "run"
