"""The model pool (agent/train/run.ModelPool): a session on a reused model trains the same bits as
one on a freshly built model, whatever the model's last session did, and two sessions never share one."""

from __future__ import annotations

import torch

from agent.train.model import adapter_state, load_tokenizer, tensors_hash
from agent.train.run import POOL, load_shard, open_session, pad_token_id


def run(config, shard, steps=6, initial=None):
    tokenizer = load_tokenizer(config.base_model)
    session = open_session(config, load_shard(config, tokenizer, shard).examples, pad_id=pad_token_id(tokenizer),
                           initial_adapter=initial)
    try:
        for step in range(steps):
            session.step(step)
        return tensors_hash(session.adapter_tensors()) + tensors_hash(session.optimizer_tensors()), session.model
    finally:
        session.close()


def test_a_reused_model_trains_the_same_bits_as_a_fresh_one(monkeypatch, base_config, demo_files):
    config = base_config.with_(dropout=0.0)
    monkeypatch.setenv("INFERNET_MODEL_POOL", "0")
    fresh, _ = run(config, demo_files["shard0"])
    monkeypatch.setenv("INFERNET_MODEL_POOL", "1")
    built, reused = POOL.built, POOL.reused
    first, model = run(config, demo_files["shard0"])
    # a session that leaves the model elsewhere (another start, other data, gradients) ...
    other = {name: torch.full_like(t, 0.01) for name, t in model.state_dict().items() if "lora_" in name}
    tokenizer = load_tokenizer(config.base_model)
    session = open_session(config, load_shard(config, tokenizer, demo_files["shard1"]).examples,
                           pad_id=pad_token_id(tokenizer))
    assert session.model is model  # taken from the pool
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(session.model, {k.replace(".default", ""): v for k, v in other.items()})
    session.step(0)
    session.close()
    # ... does not change what the next session trains
    again, model_again = run(config, demo_files["shard0"])
    assert fresh == first == again
    assert model_again is model and POOL.reused >= reused + 2 and POOL.built >= built


def test_two_open_sessions_never_share_a_model(base_config, demo_files):
    tokenizer = load_tokenizer(base_config.base_model)
    examples = load_shard(base_config, tokenizer, demo_files["shard0"]).examples
    one = open_session(base_config, examples, pad_id=pad_token_id(tokenizer))
    two = open_session(base_config, examples, pad_id=pad_token_id(tokenizer))
    try:
        assert one.model is not two.model
    finally:
        one.close()
        two.close()


def test_a_warmed_model_is_the_one_the_first_session_takes(base_config, demo_files):
    """warm_model (a job's first shard, replay or score, prepared ahead: issue 24) builds the model once, and
    the first session takes that one; the round-1 start a verifier expects comes from it, bit for bit what a
    fresh build seeds."""
    from agent.train.replay import expected_initial_adapter
    from agent.train.run import build_lora_model, warm_model

    config = base_config.with_(seed=base_config.seed + 101)  # settings no other test left in the pool
    fresh = {name: t.clone() for name, t in adapter_state(build_lora_model(config, "cpu", torch.float32, "peft")).items()}
    POOL.clear()
    assert warm_model(config) is True
    built = POOL.built
    assert warm_model(config) is False  # one is idle already
    assert tensors_hash(expected_initial_adapter(config)) == tensors_hash(fresh)
    _, model = run(config, demo_files["shard0"], steps=1)
    assert POOL.built == built  # the start and the session took the warmed model: nothing built since
    assert model is POOL._idle[0][1]
