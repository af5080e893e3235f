"""DPO jobs (issue 26 step 2): preference records in the layouts TRL reads, the DPO loss against a hand
computation, training that learns the preference, and a replay of a DPO segment that lands on the same bits."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from agent.train.data import DataError, check_dataset, prepare_examples, write_chatml
from agent.train.loop import DpoObjective
from agent.train.model import load_tokenizer
from agent.train.preference import demo_preferences, read_preferences, tokenize_pairs
from agent.train.replay import verify_segment
from agent.train.run import TrainRequest, open_session, pad_token_id, train_shard, validation_scores
from protocol.proof import Commitment

USER = {"role": "user", "content": "What color is the sky?"}
GOOD = {"role": "assistant", "content": "The sky is blue."}
BAD = {"role": "assistant", "content": "The sky is green."}


def write_lines(path: Path, objects: list) -> Path:
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objects))
    return path


def test_every_layout_reads_to_the_same_canonical_record(tmp_path):
    path = write_lines(tmp_path / "prefs.jsonl", [
        {"prompt": USER["content"], "chosen": GOOD["content"], "rejected": BAD["content"]},
        {"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]},
        {"chosen": [USER, GOOD], "rejected": [USER, BAD]},
    ])
    records = read_preferences(path).records
    assert [r.line for r in records] == [1, 2, 3]
    assert {json.dumps(r.to_json(), sort_keys=True) for r in records} == {json.dumps(
        {"prompt": [USER], "chosen": [GOOD], "rejected": [BAD], "meta": {}}, sort_keys=True)}


@pytest.mark.parametrize("line, problem", [
    ({"prompt": "hi", "chosen": "a"}, 'a preference record needs "rejected"'),
    ({"chosen": "a", "rejected": "b"}, 'without "prompt", "chosen" and "rejected" must be conversations'),
    ({"chosen": [GOOD], "rejected": [BAD]}, "share no prompt turns"),
    ({"prompt": [USER, GOOD], "chosen": [GOOD], "rejected": [BAD]}, "prompt must end with a user or system turn"),
    ({"prompt": "hi", "chosen": [USER], "rejected": "b"}, "chosen[0].role must be assistant"),
    ({"prompt": "hi", "chosen": "   ", "rejected": "b"}, '"chosen" has no assistant text'),
    ({"prompt": "hi", "chosen": "a", "rejected": [{"role": "bot", "content": "b"}]}, "rejected[0].role must be one of"),
    ("[1, 2]", "expected a JSON object"),
])
def test_a_bad_record_is_one_line_naming_file_line_and_field(tmp_path, line, problem):
    path = write_lines(tmp_path / "bad.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}, line])
    with pytest.raises(DataError) as error:
        read_preferences(path)
    assert str(error.value).startswith(f"{path}:2: ") and problem in str(error.value), str(error.value)


def test_check_dataset_reads_preferences_and_a_chatml_file_is_refused_as_one(tmp_path):
    prefs = tmp_path / "prefs.jsonl"
    write_chatml(prefs, demo_preferences(12, seed=3))
    assert len(check_dataset(prefs, 2, 0.0, 0, "preference").records) == 12
    chatml = write_lines(tmp_path / "chat.jsonl", [{"messages": [USER, GOOD]}])
    with pytest.raises(DataError, match=r"chat.jsonl:1: a preference record needs \"chosen\""):
        check_dataset(chatml, 1, 0.0, 0, "preference")


def test_labels_are_the_completion_only_even_after_an_assistant_turn_in_the_prompt(tiny_model_dir, tmp_path):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    path = write_lines(tmp_path / "p.jsonl", [
        {"prompt": [USER, {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Sure?"}],
         "chosen": [GOOD], "rejected": [BAD]}])
    (pair,), dropped = tokenize_pairs(tokenizer, read_preferences(path).records, 256)
    assert dropped == 0
    chosen_text = tokenizer.decode([t for t in pair.chosen.labels if t != -100])
    rejected_text = tokenizer.decode([t for t in pair.rejected.labels if t != -100])
    assert chosen_text.strip().startswith("The sky is blue.") and "Blue." not in chosen_text.replace("blue.", "")
    assert rejected_text.strip().startswith("The sky is green.")
    # cut so short that the completion is gone: dropped, counted
    assert tokenize_pairs(tokenizer, read_preferences(path).records, 8) == ([], 1)


def test_dpo_loss_matches_a_hand_computation_and_starts_at_log_2(tiny_model_dir, base_config, tmp_path):
    config = base_config.with_(objective="dpo", dpo_beta=0.5)
    path = tmp_path / "prefs.jsonl"
    write_chatml(path, demo_preferences(6, seed=1))
    tokenizer = load_tokenizer(config.base_model)
    pairs = prepare_examples(path, tokenizer, max_seq_len=96, objective="dpo").examples
    session = open_session(config, pairs, pad_id=pad_token_id(tokenizer))
    try:
        start = session.score(pairs)  # the seeded adapter has B = 0: the policy is its own reference
        assert start.loss == pytest.approx(math.log(2), abs=1e-6)
        assert start.reward_margin == pytest.approx(0.0, abs=1e-6)
        for name, tensor in session.adapter_tensors().items():  # move the policy off the reference
            if ".lora_B." in name:
                tensor.add_(torch.randn_like(tensor) * 0.05)
        from agent.train.model import load_adapter_state

        load_adapter_state(session.model, {n: t + (torch.randn_like(t) * 0.05 if ".lora_B." in n else 0)
                                           for n, t in session.adapter_tensors().items()})
        session.model.eval()

        def logp(model, example):  # one sequence at a time, straight from the definition
            ids = torch.tensor([example.input_ids])
            labels = torch.tensor(example.labels[1:])
            logits = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
            keep = labels != -100
            return logits[keep].gather(1, labels[keep].unsqueeze(1)).sum()

        expected = []
        with torch.no_grad():
            for pair in pairs:
                policy = logp(session.model, pair.chosen) - logp(session.model, pair.rejected)
                with session.model.disable_adapter():
                    reference = logp(session.model, pair.chosen) - logp(session.model, pair.rejected)
                expected.append(-F.logsigmoid(0.5 * (policy - reference)))
        got = session.score(pairs)
        assert got.loss == pytest.approx(float(torch.stack(expected).mean()), rel=1e-4)
        assert got.loss != pytest.approx(math.log(2), abs=1e-4)
        assert isinstance(session.objective, DpoObjective)
    finally:
        session.close()


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory, base_config):
    root = tmp_path_factory.mktemp("dpo")
    records = demo_preferences(80, seed=2)
    write_chatml(root / "shard.jsonl", records[:64])
    write_chatml(root / "validation.jsonl", records[64:])
    config = base_config.with_(objective="dpo", dpo_beta=0.1, learning_rate=5e-3, dropout=0.0, max_steps=24,
                               checkpoint_every=8, batch_size=8)
    request = TrainRequest(config, root / "shard.jsonl", root / "run", validation=root / "validation.jsonl",
                           job_id=bytes(range(32)), worker="12D3KooWTestWorker")
    return request, train_shard(request)


def test_dpo_training_learns_to_prefer_the_chosen_answer(dpo_run):
    request, result = dpo_run
    assert result.initial_validation_loss == pytest.approx(math.log(2), abs=1e-6)
    assert result.validation_loss < 0.6, result
    before, after = validation_scores(request.config, request.validation,
                                      [None, result.adapter_dir / "adapter_model.safetensors"])
    assert before.reward_accuracy == 0.0 and after.reward_accuracy >= 0.75, (before, after)
    assert after.reward_margin > 0.1
    readme = (request.run_dir / "README.md").read_text()
    assert "DPO (beta 0.1" in readme and "preference pairs" in readme


def test_a_dpo_segment_replays_on_the_same_bits(dpo_run):
    request, result = dpo_run
    commitment = Commitment.from_json(json.loads((request.run_dir / "proof.json").read_text()))
    checkpoints = request.run_dir / "checkpoints"
    verdict = verify_segment(commitment, 1, start=checkpoints / "step-000008", shard=request.shard,
                             config=request.config, claimed_head=result.head)
    assert verdict.accepted and verdict.exact, verdict
    # the same segment replayed as SFT-on-pairs, or with another beta, is not the committed work
    other = verify_segment(commitment, 1, start=checkpoints / "step-000008", shard=request.shard,
                           config=request.config.with_(dpo_beta=0.2))
    assert not other.accepted, other


def test_the_reference_pass_leaves_a_frozen_for_the_next_session(base_config, tmp_path):
    """peft's disable_adapter marks every adapter tensor trainable again when it re-enables it: a pooled
    model then trained A in the next session, and a replay on it disagreed with the worker's run."""
    config = base_config.with_(objective="dpo", freeze_a=True)
    path = tmp_path / "prefs.jsonl"
    write_chatml(path, demo_preferences(8, seed=1))
    tokenizer = load_tokenizer(config.base_model)
    pairs = prepare_examples(path, tokenizer, max_seq_len=96, objective="dpo").examples
    for _ in range(2):  # the second session takes the first one's model from the pool
        session = open_session(config, pairs, pad_id=pad_token_id(tokenizer))
        try:
            assert not any(".lora_A." in name for name in session.parameters)
            session.step(0)
            assert not any(p.requires_grad for n, p in session.model.named_parameters() if ".lora_A." in n)
        finally:
            session.close()


VECTORS = Path(__file__).resolve().parents[2] / "ipips" / "vectors"


def test_the_dpo_loss_vectors():
    from agent.train.loop import dpo_loss

    for case in json.loads((VECTORS / "dpo-loss.json").read_text())["cases"]:
        sides = [torch.tensor([case[k]], dtype=torch.float64) for k in
                 ("policy_chosen", "policy_rejected", "reference_chosen", "reference_rejected")]
        loss, margin = dpo_loss(*sides, case["beta"])
        assert float(loss) == pytest.approx(case["loss"], rel=1e-6), case["name"]
        assert float(margin) == pytest.approx(case["margin"], rel=1e-6, abs=1e-12), case["name"]


def test_the_preference_record_vectors():
    from agent.train.preference import PreferenceRecord, check_preference

    for case in json.loads((VECTORS / "preference-records.json").read_text())["cases"]:
        if case["canonical"] is None:
            with pytest.raises(ValueError):
                check_preference(case["line"])
        else:
            assert PreferenceRecord(1, *check_preference(case["line"])).to_json() == case["canonical"], case["name"]
