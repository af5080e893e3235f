"""ChatML reading, assistant-only labels, truncation, packing, deterministic splits and order."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from agent.train.data import (
    IGNORE_INDEX, DataError, Record, Split, epoch_order, pack, prepare_examples, read_chatml, split_dataset,
    step_samples, tokenize,
)
from agent.train.model import load_tokenizer
from agent.train.tiny import demo_records
from tests.conftest import REPO_ROOT

GOOD = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sky?"},
                     {"role": "assistant", "content": "The sky is blue."}, {"role": "user", "content": "Snow?"},
                     {"role": "assistant", "content": "The snow is white."}], "meta": {"id": 1}}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.mark.parametrize("line, problem", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"messages": []}', '"messages" must be a non-empty list'),
    ('{"messages": [{"role": "bot", "content": "x"}]}', "messages[0].role must be one of system, user, assistant"),
    ('{"messages": [{"role": "user", "content": 3}]}', "messages[0].content must be a string"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message"),
    ('{"messages": [{"role": "assistant", "content": "hi"}], "meta": []}', '"meta" must be an object'),
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
])
def test_bad_line_names_file_line_and_problem(tmp_path, line, problem):
    path = write_lines(tmp_path / "data.jsonl", [json.dumps(GOOD), "", line, json.dumps(GOOD)])
    with pytest.raises(DataError) as caught:
        read_chatml(path)
    message = str(caught.value)
    assert message.startswith(f"{path}:3: ") and problem in message and "\n" not in message


def test_skip_bad_lines_counts_them(tmp_path):
    path = write_lines(tmp_path / "data.jsonl", [json.dumps(GOOD), "oops", json.dumps(GOOD), '{"messages": 1}'])
    data = read_chatml(path, skip_bad=True)
    assert (len(data.records), data.skipped) == (2, 2)
    assert [r.line for r in data.records] == [1, 3]
    assert data.problems[0].startswith(f"{path}:2: ")


def test_non_utf8_and_missing_file(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n\xff\xfe\n")
    with pytest.raises(DataError, match=":2: not UTF-8"):
        read_chatml(path)
    with pytest.raises(DataError, match="absent.jsonl: no such file"):
        read_chatml(tmp_path / "absent.jsonl")


def test_labels_are_exactly_the_assistant_turns(tokenizer):
    record = Record(1, tuple(GOOD["messages"]))
    [example], dropped = tokenize(tokenizer, [record], max_seq_len=512)
    assert dropped == 0 and len(example.input_ids) == len(example.labels)
    spans, current = [], []
    for label in example.labels:
        if label == IGNORE_INDEX:
            if current:
                spans.append(current)
            current = []
        else:
            current.append(label)
    assert [tokenizer.decode(s) for s in spans] == ["The sky is blue.<|im_end|>", "The snow is white.<|im_end|>"]
    full = tokenizer.decode(list(example.input_ids))
    assert full.startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_prefix_rendering_gives_the_same_labels_without_a_generation_block(tokenizer):
    """Real chat templates rarely have {% generation %}: the fallback labels what the mask labels,
    plus at most the separator the template puts after a turn (here the newline after <|im_end|>)."""
    record = Record(1, tuple(GOOD["messages"]))
    [with_mask], _ = tokenize(tokenizer, [record], max_seq_len=512)
    template = tokenizer.chat_template
    tokenizer.chat_template = template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    try:
        [by_prefix], _ = tokenize(tokenizer, [record], max_seq_len=512)
    finally:
        tokenizer.chat_template = template
    assert by_prefix.input_ids == with_mask.input_ids
    extra = []
    for masked, prefixed in zip(with_mask.labels, by_prefix.labels):
        if masked != IGNORE_INDEX:
            assert prefixed == masked
        elif prefixed != IGNORE_INDEX:
            extra.append(prefixed)
    assert tokenizer.decode(extra) == "\n\n"


def test_truncation_and_dropping(tokenizer):
    record = Record(1, tuple(GOOD["messages"]))
    [full], _ = tokenize(tokenizer, [record], max_seq_len=512)
    [cut], _ = tokenize(tokenizer, [record], max_seq_len=len(full.input_ids) - 3)
    assert cut.input_ids == full.input_ids[:-3] and cut.labels == full.labels[:-3]
    long_prompt = Record(2, ({"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}))
    examples, dropped = tokenize(tokenizer, [long_prompt, record], max_seq_len=64)
    assert (len(examples), dropped) == (1, 1)


def test_packing_keeps_examples_whole_and_in_order(tokenizer):
    records = [Record(i, tuple(r["messages"])) for i, r in enumerate(demo_records(20))]
    examples, _ = tokenize(tokenizer, records, max_seq_len=128)
    packed = pack(examples, 128)
    assert len(packed) < len(examples)
    assert all(len(p.input_ids) <= 128 for p in packed)
    assert sum((p.input_ids for p in packed), ()) == sum((e.input_ids for e in examples), ())
    assert sum((p.labels for p in packed), ()) == sum((e.labels for e in examples), ())


def test_split_is_deterministic_complete_and_disjoint():
    split = split_dataset(103, 4, 0.1, seed=5)
    assert split == split_dataset(103, 4, 0.1, seed=5)
    assert split != split_dataset(103, 4, 0.1, seed=6)
    everything = list(split.validation) + [i for shard in split.shards for i in shard]
    assert sorted(everything) == list(range(103))
    assert len(split.validation) == 10 and sorted(len(s) for s in split.shards) == [23, 23, 23, 24]
    # fixed by SHA-256, so fixed across machines and versions
    assert split_dataset(10, 2, 0.2, seed=0) == Split((7, 8), ((1, 2, 6, 9), (0, 3, 4, 5)))


def test_step_samples_walk_fresh_permutations_per_epoch():
    n, per_step = 10, 4
    steps = [step_samples(n, per_step, seed=3, step=s) for s in range(5)]  # 20 samples = 2 epochs
    flat = [i for step in steps for i in step]
    assert flat[:10] == list(epoch_order(n, 3, 0)) and flat[10:] == list(epoch_order(n, 3, 1))
    assert Counter(flat) == Counter({i: 2 for i in range(n)})
    assert epoch_order(n, 3, 0) != epoch_order(n, 3, 1)


def test_shipped_demo_dataset_is_the_generated_one():
    path = REPO_ROOT / "agent" / "data" / "demo.jsonl"
    data = read_chatml(path)
    assert len(data.records) == 400
    generated = demo_records(400, seed=0)
    assert [{"messages": list(r.messages), "meta": r.meta} for r in data.records] == generated


def test_prepare_examples_reports_what_was_left_out(tmp_path, tokenizer):
    path = write_lines(tmp_path / "data.jsonl", [json.dumps(GOOD), "bad", json.dumps(
        {"messages": [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "ok"}]})])
    shard = prepare_examples(path, tokenizer, max_seq_len=64, skip_bad=True)
    assert (len(shard.examples), shard.records, shard.skipped_lines, shard.dropped_examples) == (1, 2, 1, 1)


def test_a_validation_split_larger_than_the_shards_is_refused_naming_the_file(tmp_path):
    """The coordinator fetches at most the shards' bytes of the validation split (IPIP-0003 §3), so the
    submitter refuses a dataset whose held-out records outweigh its training records."""
    from agent.train.data import check_dataset

    def record(i: int, text: str) -> str:
        return json.dumps({"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": text}]})

    # split_dataset(10, 2, 0.2, seed=0) holds out records 7 and 8
    lines = [record(i, "x" * 20_000 if i in (7, 8) else "short answer") for i in range(10)]
    path = write_lines(tmp_path / "skewed.jsonl", lines)
    with pytest.raises(DataError, match=r"skewed.jsonl: the validation split \(2 records, \d+ bytes\) is larger"):
        check_dataset(path, 2, 0.2, 0)
    small = write_lines(tmp_path / "even.jsonl", [record(i, "short answer") for i in range(10)])
    assert len(check_dataset(small, 2, 0.2, 0).records) == 10
