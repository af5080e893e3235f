"""scripts/gpu_check.sh parses, and its Python part runs end to end on the CPU (--cpu-smoke)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_script_parses_and_refuses_without_a_gpu_in_one_line(capsys):
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], check=True)
    import torch

    from scripts.gpu_check import main

    if not torch.cuda.is_available():
        assert main([]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == ["gpu_check: no CUDA GPU here; run with --cpu-smoke to check the script on the CPU"]


@pytest.mark.slow
def test_gpu_check_cpu_smoke_prints_the_bench_lines(tmp_path, capsys):
    from scripts.gpu_check import main

    assert main(["--cpu-smoke", "--work", str(tmp_path), "--only", "peft_bf16"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    figures = {line["bench"]: line for line in lines}
    assert {"gpu_peft_fp32_tokens_per_s", "gpu_peft_fp32_replay_drift", "gpu_peft_fp32_run_to_run_drift"} <= set(figures)
    drift = figures["gpu_peft_fp32_replay_drift"]
    assert drift["accepted"] and drift["exact"] and drift["value"] == 0.0  # CPU float32: the same bits
    for line in figures.values():
        if "ratio" in line:
            assert set(line) >= {"bench", "value", "unit", "reference", "ratio", "goal"}


@pytest.mark.slow
def test_gpu_check_cpu_smoke_runs_the_multi_gpu_case_on_two_gloo_processes(tmp_path, capsys):
    from scripts.gpu_check import main

    assert main(["--cpu-smoke", "--work", str(tmp_path), "--only", "ddp"]) == 0
    figures = {line["bench"]: line for line in map(json.loads, capsys.readouterr().out.splitlines())
               if line.get("bench", "").startswith("gpu_ddp")}
    assert set(figures) == {"gpu_ddp2_scaling", "gpu_ddp2_replay_drift", "gpu_ddp2_vs_one_process_drift"}, figures
    assert figures["gpu_ddp2_replay_drift"]["accepted"] and figures["gpu_ddp2_replay_drift"]["env"]["data_parallel"] == 2
    assert figures["gpu_ddp2_vs_one_process_drift"]["value"] < 1e-5
