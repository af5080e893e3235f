"""train init --preset, train run --local --resume through the CLI, and the training progress bar."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from agent.pipeline.progress import TrainProgress
from agent.train.config import TrainConfig
from agent.train.presets import SPEC_PRESETS, preset_spec
from agent.train.run import TrainRequest, train_shard
from protocol.jobspec import TEMPLATE, parse_spec
from tests.pipeline.conftest import assert_one_line_error, run_cli


@pytest.mark.parametrize("preset", sorted(SPEC_PRESETS))
def test_each_preset_writes_a_valid_commented_spec_with_its_values(capsys, tmp_path, preset):
    code, out, _ = run_cli(capsys, "train", "init", "--preset", preset, "--output", str(tmp_path))
    assert code == 0 and f"preset {preset}" in out
    text = (tmp_path / "infernet.train.yml").read_text()
    assert text == preset_spec(TEMPLATE, preset) and text.startswith(f"# preset {preset}: ")
    assert text.count("#") >= TEMPLATE.count("#")  # every comment kept
    spec = parse_spec(text)
    for (section, key), value in SPEC_PRESETS[preset][1].items():
        actual = getattr(getattr(spec, section) if section else spec, key)
        expected = tuple(value.strip("[]").split(", ")) if value.startswith("[") else type(actual)(value)
        assert actual == expected, (section, key)


def test_presets_grow_from_quick_test_to_quality():
    specs = {p: parse_spec(preset_spec(TEMPLATE, p)) for p in SPEC_PRESETS}
    quick, balanced, quality = specs["quick-test"], specs["balanced"], specs["quality"]
    assert quick.training.max_steps == 20 and balanced.training.max_steps == quality.training.max_steps == 0
    assert quick.lora.rank < balanced.lora.rank < quality.lora.rank
    assert len(quick.lora.target_modules) < len(balanced.lora.target_modules) < len(quality.lora.target_modules)
    assert quick.training.max_seq_len < balanced.training.max_seq_len < quality.training.max_seq_len


class Interrupted(Exception):
    pass


def test_train_run_resume_from_the_cli_continues_the_chain(capsys, tmp_path, tiny_dir, run_dir):
    # an interrupted run laid out as `train run --local` writes it: the same data, config and spec
    config = TrainConfig.from_json(json.loads((run_dir / "train_config.json").read_text()))
    cut = tmp_path / "cut"
    (cut / "data").mkdir(parents=True)
    for name in ("train.jsonl", "validation.jsonl"):
        (cut / "data" / name).write_bytes((run_dir / "data" / name).read_bytes())

    def stop(event):
        if event.step == 20:
            raise Interrupted

    request = TrainRequest(config, cut / "data" / "train.jsonl", cut, validation=cut / "data" / "validation.jsonl",
                           spec_text=(run_dir / "infernet.train.yml").read_text())
    with pytest.raises(Interrupted):
        train_shard(request, stop)
    code, out, _ = run_cli(capsys, "train", "run", "--local", "--resume", str(cut), "--json", "--no-progress")
    assert code == 0
    result = json.loads(out)
    finished = json.loads((run_dir / "result.json").read_text())
    assert result["steps"] == 40 and result["head"] == finished["head"]  # the same chain as the uninterrupted run
    code, _, err = run_cli(capsys, "train", "run", "--local", "--resume", str(cut))
    assert_one_line_error(code, err, "already finished")
    code, _, err = run_cli(capsys, "train", "run", "--local", "--resume", str(tmp_path))
    assert_one_line_error(code, err, "no train_config.json")
    code, _, err = run_cli(capsys, "train", "run", "--local", "--resume", str(cut), "--config", "x.yml")
    assert_one_line_error(code, err, "drop --config")
    code, _, err = run_cli(capsys, "train", "run", "--local")
    assert_one_line_error(code, err, "needs --config")


def test_progress_bar_shows_steps_loss_rate_and_eta_on_a_terminal_only():
    screen = io.StringIO()
    with TrainProgress(console=Console(file=screen, force_terminal=True, width=120)) as progress:
        for step in range(5, 11):  # a resumed run: starts at step 5 of 10
            progress.update(step, 10, 1.0 / step, 100 * step, 0.5 * step)
    shown = screen.getvalue()
    assert "10/10" in shown and "loss 0.1000" in shown and "200 tok/s" in shown and "ETA" in shown
    quiet = io.StringIO()
    with TrainProgress(console=Console(file=quiet, force_terminal=False)) as progress:
        progress.update(1, 10, 1.0, 10, 1.0)
    assert quiet.getvalue() == ""


@pytest.mark.slow
def test_ctrl_c_keeps_the_checkpoints_and_says_how_to_resume(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from agent.train.data import write_chatml
    from agent.train.tiny import demo_records
    from tests.pipeline.conftest import SPEC

    (tmp_path / "infernet.train.yml").write_text(SPEC.replace("max_steps: 40", "max_steps: 5000")
                                                 .replace("checkpoint_every: 20", "checkpoint_every: 5"))
    write_chatml(tmp_path / "data.jsonl", demo_records(160, seed=2))
    run = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "train", "run", "--local", "--config", str(tmp_path / "infernet.train.yml"),
         "--output", str(run), "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.monotonic() + 120
    while not (run / "checkpoints" / "step-000010").exists():
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130
    assert f"--resume {run}" in err and (run / "proof.json").exists()
