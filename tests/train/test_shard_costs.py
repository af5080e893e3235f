"""What a shard costs besides its steps (issue 24: at 12-step rounds it was a fifth of a shard): the adapter read
and loaded through the live tensors instead of peft's walk over the whole model, a shard tokenized once per
content, the tokenizer loaded once per thread, the model put in training mode once a session. Each must give
what the slow way gave."""

from __future__ import annotations

import os
import shutil
import threading

import pytest
import torch

from agent.train.model import adapter_state, load_adapter_state, load_tokenizer, tensors_hash
from agent.train.run import SHARDS, build_lora_model, load_shard, open_session, pad_token_id


def peft_state(model) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {name: tensor.detach().clone() for name, tensor in get_peft_model_state_dict(model).items()}


@pytest.mark.parametrize("freeze_a", [True, False])
def test_the_adapter_is_read_and_loaded_as_peft_reads_and_loads_it(base_config, freeze_a):
    config = base_config.with_(freeze_a=freeze_a, seed=base_config.seed + 301)
    model = build_lora_model(config, "cpu", torch.float32, "peft")
    twin = build_lora_model(config, "cpu", torch.float32, "peft")
    ours = adapter_state(model)
    assert list(ours) == list(peft_state(model)) and all(torch.equal(ours[k], v) for k, v in peft_state(model).items())
    generator = torch.Generator().manual_seed(5)
    other = {name: torch.randn(t.shape, generator=generator) for name, t in ours.items()}
    load_adapter_state(model, other)
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(twin, dict(other))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values()))
    read = adapter_state(model)
    assert all(torch.equal(read[k], other[k]) for k in other)
    next(iter(read.values())).add_(1.0)  # a copy: the model does not change with it
    assert all(torch.equal(adapter_state(model)[k], other[k]) for k in other)


def test_an_adapter_that_does_not_fit_loads_nothing(base_config):
    model = build_lora_model(base_config.with_(seed=base_config.seed + 302), "cpu", torch.float32, "peft")
    before = adapter_state(model)
    wrong = {name: torch.ones(t.shape) for name, t in before.items()}
    name = sorted(wrong)[-1]
    wrong[name] = torch.ones(tuple(d + 1 for d in wrong[name].shape))
    with pytest.raises(ValueError, match=f"adapter tensor {name} has shape"):
        load_adapter_state(model, wrong)
    assert tensors_hash(adapter_state(model)) == tensors_hash(before)  # not half loaded
    with pytest.raises(ValueError, match="do not fit the model"):
        load_adapter_state(model, {k: v for k, v in wrong.items() if k != name})


def test_a_module_given_a_new_parameter_is_read_from_it(base_config):
    model = build_lora_model(base_config.with_(seed=base_config.seed + 303), "cpu", torch.float32, "peft")
    adapter_state(model)  # (the names worked out)
    module_name, module = next((n, m) for n, m in model.named_modules() if n.endswith("lora_B.default"))
    module.weight = torch.nn.Parameter(torch.full_like(module.weight, 3.0))
    read = adapter_state(model)
    assert read.keys() == peft_state(model).keys()
    assert all(torch.equal(read[k], v) for k, v in peft_state(model).items())
    assert any(torch.equal(t, torch.full_like(t, 3.0)) for t in read.values())


def test_a_shard_is_tokenized_once_per_content(base_config, demo_files, tmp_path):
    tokenizer = load_tokenizer(base_config.base_model)
    first = load_shard(base_config, tokenizer, demo_files["shard0"])
    hits = SHARDS.hits
    copy = tmp_path / "elsewhere.jsonl"  # a worker fetches the same shard into a new directory each round
    shutil.copy(demo_files["shard0"], copy)
    again = load_shard(base_config, tokenizer, copy)
    assert SHARDS.hits == hits + 1 and again.examples == first.examples and again.examples is not first.examples
    shorter = load_shard(base_config.with_(max_seq_len=32), tokenizer, copy)  # other settings: tokenized anew
    assert SHARDS.hits == hits + 1 and max(len(e.input_ids) for e in shorter.examples) <= 32
    lines = copy.read_text().splitlines(keepends=True)
    copy.write_text("".join(lines[1:]))  # other bytes: tokenized anew
    changed = load_shard(base_config, tokenizer, copy)
    assert SHARDS.hits == hits + 1 and changed.examples == first.examples[1:]


def test_the_tokenizer_is_kept_per_thread_and_per_its_files(base_config, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(base_config.base_model, model_dir)
    here = load_tokenizer(str(model_dir))
    assert load_tokenizer(str(model_dir)) is here
    there: list = []
    thread = threading.Thread(target=lambda: there.append(load_tokenizer(str(model_dir))))
    thread.start()
    thread.join()
    assert there[0] is not here  # a thread of its own: calls set truncation and padding in it
    config = model_dir / "tokenizer_config.json"
    stat = config.stat()
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert load_tokenizer(str(model_dir)) is not here  # its files changed: loaded again


def test_a_step_after_a_score_trains_with_dropout_on(base_config, demo_files):
    config = base_config.with_(dropout=0.1, seed=base_config.seed + 304)
    tokenizer = load_tokenizer(config.base_model)
    examples = load_shard(config, tokenizer, demo_files["shard0"]).examples

    def trained(score_between: bool) -> bytes:
        session = open_session(config, examples, pad_id=pad_token_id(tokenizer))
        try:
            session.step(0)
            if score_between:
                session.score(examples[:4])  # eval mode: dropout off
                assert not session.model.training
            session.step(1)
            assert session.model.training
            return tensors_hash(session.adapter_tensors())
        finally:
            session.close()

    assert trained(True) == trained(False)
