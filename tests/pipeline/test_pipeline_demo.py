"""From a topic to an Ollama model: the demo website (scripts/demo_site.py), `infernet demo --dataset`,
and scripts/pipeline_demo.py end to end (slow: a network job, a GGUF, llama.cpp)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agent.demo import DemoOptions, demo_spec
from protocol.jobspec import parse_spec
from scripts.demo_site import ARTICLES, DemoSite
from tests.cli.conftest import REPO, assert_one_line_error, cli
from tests.pipeline.conftest import run_cli
from tests.pipeline.test_publish import _llama_cpp_ready


def test_the_demo_site_becomes_one_record_per_section_and_its_robots_txt_is_obeyed(capsys, tmp_path):
    out = tmp_path / "rivers.jsonl"
    with DemoSite() as site:
        code, stdout, err = run_cli(capsys, "train", "data", "--sitemap", site.url("/sitemap.xml"), "--out", str(out),
                                    "--delay", "0")
        requests = list(site.requests)
    assert code == 0, err
    assert "robots.txt disallows" in stdout and "/drafts/oder.html" not in requests
    records = [json.loads(line) for line in out.read_text().splitlines()]
    sections = {text for _, _, parts in ARTICLES for _, text in parts}
    assert len(records) == len(sections) == 16
    # the passages are the articles' paragraphs, word for word: menus, sidebars and footers left out
    assert {r["messages"][1]["content"] for r in records} == sections
    assert {r["meta"]["source_url"] for r in records} == {site.url(path) for path, _, _ in ARTICLES}
    code, stdout, err = run_cli(capsys, "data", "check", str(out), "--model", "infernet-tiny", "--max-seq-len", "256")
    assert code == 0 and "0 over max_seq_len 256" in stdout, stdout + err


def test_demo_spec_with_a_dataset_of_ones_own(tmp_path):
    spec = parse_spec(demo_spec(DemoOptions(dataset=tmp_path / "rivers.jsonl", shards=3, rounds=2, steps=8)))
    assert spec.input.dataset == "dataset.jsonl" and spec.training.max_seq_len == 256
    assert (spec.shards, spec.rounds, spec.training.max_steps) == (3, 2, 8)
    default = parse_spec(demo_spec(DemoOptions()))
    assert default.input.dataset == "demo.jsonl" and default.training.max_seq_len == 96


def test_demo_refuses_a_missing_or_too_small_dataset_before_starting_agents(tmp_path, tiny_dir):
    done = cli("demo", "--dataset", str(tmp_path / "missing.jsonl"), "--dir", str(tmp_path / "a"))
    assert_one_line_error(done, "missing.jsonl", "no such file")
    small = tmp_path / "small.jsonl"
    small.write_text(json.dumps({"messages": [{"role": "user", "content": "q"},
                                              {"role": "assistant", "content": "a"}]}) + "\n")
    done = cli("demo", "--dataset", str(small), "--shards", "4", "--dir", str(tmp_path / "b"))
    assert_one_line_error(done, "small.jsonl", "every shard needs at least one record")
    assert not (tmp_path / "b" / "submitter").exists()  # no agent was started


@pytest.mark.slow
@pytest.mark.llama_cpp
@pytest.mark.skipif(_llama_cpp_ready() is not None, reason=str(_llama_cpp_ready()))
def test_pipeline_demo_runs_from_a_website_to_a_gguf_that_llama_cpp_generates_from(tmp_path):
    root = tmp_path / "p"  # short: the agents' control sockets live under it
    done = subprocess.run([sys.executable, "scripts/pipeline_demo.py", "--dir", str(root), "--rounds", "1",
                           "--steps", "6", "--max-tokens", "16"], cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    out = done.stdout
    for number in range(1, 6):
        assert f"[{number}/5]" in out
    assert re.search(r"job ID [0-9a-f]{64}", out) and re.search(r"aggregate CID:\s+bafy", out), out
    assert len((root / "rivers.jsonl").read_text().splitlines()) == 16
    gguf = root / "out" / "rivers.gguf"
    assert gguf.read_bytes()[:4] == b"GGUF"
    assert (root / "out" / "Modelfile").read_text().startswith(f"FROM {gguf}\n")
    assert f"ollama create rivers -f {root / 'out' / 'Modelfile'}" in out
    generated = re.search(r"llama\.cpp, rivers\.gguf \(\d+ bytes\), (\d+) tokens:\n    '(.*)'\n", out)
    assert generated and int(generated.group(1)) > 0 and generated.group(2).strip(), out
    assert "> What does \"The Danube\" say about Capitals?" in out  # infernet infer ran on the same adapter
    for home in ("submitter", "worker0", "worker1", "worker2"):  # every agent stopped cleanly
        assert not (root / "net" / home / "control.sock").exists()
        assert '"stopped"' in (root / "net" / home / "agent.log").read_text()


def test_pipeline_demo_refuses_a_directory_in_use_or_too_deep(tmp_path):
    (tmp_path / "x").write_text("x")
    done = subprocess.run([sys.executable, "scripts/pipeline_demo.py", "--dir", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        f"pipeline_demo: {tmp_path}: not empty; give --dir a new directory"], done.stderr
    assert Path(tmp_path / "x").read_text() == "x" and len(list(tmp_path.iterdir())) == 1
    deep = tmp_path / ("d" * 80)
    done = subprocess.run([sys.executable, "scripts/pipeline_demo.py", "--dir", str(deep)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and "give a shorter --dir" in lines[0], done.stderr
    assert not deep.exists()
