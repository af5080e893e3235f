"""Issue 25: the probes of a careless user, as a table (command -> exit status -> first line of stderr).
Each was a traceback, an out-of-memory kill, a hang, or a misleading line; each is now one clear line
and a non-zero exit. Add the next regression here as one more row."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.train.data import write_chatml
from agent.train.tiny import demo_records
from tests.cli.conftest import assert_one_line_error, cli

SPEC = """\
name: probe
base_model: infernet-tiny
seed: 1
input: {{dataset: {dataset}, validation_split: 0.1}}
training: {{batch_size: 4, learning_rate: 0.01, max_steps: 2, max_seq_len: 64}}
lora: {{rank: 2, alpha: 4, target_modules: [q_proj]}}
shards: 2
rounds: 1
"""


@pytest.fixture
def probes(tmp_path: Path) -> dict[str, Path]:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "a-directory").mkdir()
    specs = {}
    for name, dataset in (("dir", "a-directory"), ("fifo", "fifo"), ("device", "/dev/zero"),
                          ("mistyped-cid", "bafybeigdyrzt5sfp7udm7hu76uh7y26nf3efuylqabf3oclgtqy55fbzdX"),
                          ("missing", "nowhere.jsonl"), ("targets", "data.jsonl")):
        spec = tmp_path / f"{name}.yml"
        text = SPEC.format(dataset=dataset)
        specs[name] = spec
        spec.write_text(text.replace("[q_proj]", "[q_proj, foo_proj]") if name == "targets" else text)
    write_chatml(tmp_path / "data.jsonl", demo_records(40, seed=3))
    return {"fifo": fifo, **{f"spec_{k.replace('-', '_')}": v for k, v in specs.items()}}


TABLE = [  # (argv with {placeholders}, fragments of the one stderr line)
    (["ledger", "verify", "/dev/zero"], ["ledger export /dev/zero: not a regular file (a device)"]),
    (["ledger", "verify", "{fifo}"], ["not a regular file (a FIFO)"]),
    (["train", "run", "--local", "--config", "{spec_dir}"], ["dataset", "not a regular file (a directory)"]),
    (["train", "run", "--local", "--config", "{spec_fifo}"], ["dataset", "not a regular file (a FIFO)"]),
    (["train", "run", "--local", "--config", "{spec_device}"], ["dataset /dev/zero: not a regular file (a device)"]),
    (["train", "run", "--local", "--config", "{spec_mistyped_cid}"], ["input.dataset", "looks like a CID but is not one"]),
    (["train", "run", "--local", "--config", "{spec_missing}"], ["nowhere.jsonl: no such file"]),
    (["train", "run", "--local", "--config", "{spec_targets}"],
     ["targets.yml: lora.target_modules: foo_proj is not a linear layer of this model", "q_proj"]),
]


@pytest.mark.parametrize("argv, fragments", TABLE, ids=[" ".join(a) for a, _ in TABLE])
def test_a_careless_input_is_one_line_and_a_non_zero_exit(probes, argv, fragments):
    done = cli(*[a.format(**probes) for a in argv], timeout=60)
    assert_one_line_error(done, *fragments)


def test_prompts_from_a_device_or_a_non_utf8_file_say_what_is_wrong(tmp_path):
    """`infer --samples --dataset`: /dev/zero was read into memory (MemoryError); a Latin-1 file said
    'no record with an assistant turn'. Now: not a regular file; and the first refused line's reason."""
    from agent.pipeline.infer import sample_prompts
    from agent.pipeline.source import PipelineError
    from agent.train.data import DataError

    with pytest.raises(DataError, match="not a regular file"):
        sample_prompts(Path("/dev/zero"), 2, 0)
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes('{"messages": [{"role": "user", "content": "café?"}, {"role": "assistant", "content": "oui"}]}\n'
                      .encode("latin-1"))
    with pytest.raises(PipelineError, match="not UTF-8 text"):
        sample_prompts(latin, 2, 0)
    long_line = tmp_path / "long.jsonl"
    from agent.train.records import MAX_LINE_BYTES

    with open(long_line, "wb") as out:  # one line past the bound, then a good record: read within bounds
        out.write(b"x" * (MAX_LINE_BYTES + 10) + b"\n")
    write_chatml(tmp_path / "good.jsonl", demo_records(1, seed=2))
    long_line.write_bytes(long_line.read_bytes() + (tmp_path / "good.jsonl").read_bytes())
    assert len(sample_prompts(long_line, 1, 0)) == 1


def test_a_model_path_that_is_no_directory_stops_the_agent_at_start_naming_the_line(tmp_path):
    """`[models] mymodel = "/srv/nope"`: the agent used to start and log a Hugging Face repo-id message."""
    home = tmp_path / "home"
    cli("agent", "init", "--home", str(home), check=True)
    config = home / "config.toml"
    config.write_text(config.read_text() + '\n"mymodel" = "/srv/nope"\n')
    line = len(config.read_text().splitlines())
    assert_one_line_error(cli("agent", "run", "--home", str(home), timeout=60),
                          f"config.toml:{line}: models.mymodel: /srv/nope is not a directory")


def test_data_check_refuses_what_training_refuses(tmp_path):
    """`data check` said ok for a dataset whose assistant messages are all empty; `train run` refused it."""
    empty = tmp_path / "empty-answers.jsonl"
    empty.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]}\n' * 3)
    done = cli("data", "check", str(empty))
    assert done.returncode == 1 and "no assistant text to learn from" in done.stdout + done.stderr, done.stdout
