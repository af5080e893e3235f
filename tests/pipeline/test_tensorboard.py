"""TensorBoard logs of a local run (issue 27): `train run --local` writes metrics.jsonl's figures as TensorBoard
scalars in RUN_DIR/tensorboard, read back here with tensorboard's own reader, as `tensorboard --logdir` reads them."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tensorboard")


def test_a_local_run_writes_its_curves_for_tensorboard(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert {"train/loss", "train/learning_rate", "train/tokens_per_s", "validation/loss"} <= set(events.Tags()["scalars"])
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = events.Scalars("train/loss")
    assert [s.step for s in logged] == [m["step"] for m in metrics]  # every logged step, once
    assert [round(s.value, 5) for s in logged] == [round(m["loss"], 5) for m in metrics]
    assert [round(s.value, 5) for s in events.Scalars("validation/loss")] == \
        [round(m["validation_loss"], 5) for m in metrics]


def test_job_scalars_count_a_shard_s_steps_on_across_rounds():
    from agent.tblog import job_scalars

    job = {"aggregates": [{"round": 1, "validation_loss": 2.0, "base_validation_loss": 3.0},
                          {"round": 2, "validation_loss": 1.5, "base_validation_loss": 3.0}],
           "curves": [{"round": 1, "shard": 0, "attempt": 1, "worker": "12D3KooWAAAAworker0", "accepted": True,
                       "points": [[4, 2.5], [8, 2.2]]},
                      {"round": 2, "shard": 0, "attempt": 1, "worker": "12D3KooWBBBBworker1", "accepted": True,
                       "points": [[4, 1.9], [8, 1.7]]}],
           "verdicts": {"accepted": 2, "rejected": 0}}
    points = {(tag, step): value for tag, value, step in job_scalars(job) if value is not None}
    assert points[("validation/aggregate", 2)] == 1.5 and points[("validation/base", 1)] == 3.0
    # a worker is named by the last 8 characters of its peer ID
    assert points[("train_loss/shard0/Aworker0", 8)] == 2.2 and points[("train_loss/shard0/Bworker1", 12)] == 1.9
    assert points[("verdicts/accepted", 2)] == 2


def test_a_log_that_cannot_be_written_is_one_note_and_the_command_goes_on(capsys, tmp_path):
    from agent.cli import _open_tensorboard

    (tmp_path / "file").write_text("not a directory")
    assert _open_tensorboard(tmp_path / "file" / "logs") is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("note: TensorBoard log ") and "none written" in err[0]
