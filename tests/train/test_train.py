"""Training a shard on CPU: the loss falls, outputs are complete and loadable by stock peft."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from agent.train.backends import PeftBackend, UnslothBackend, select_backend
from agent.train.config import TrainConfig, TrainError
from agent.train.model import adapter_state, add_lora, load_base_model, tensors_hash
from agent.train.run import TrainRequest, train_shard
from protocol.proof import Commitment


def test_validation_loss_falls(trained_run):
    _, result, _ = trained_run
    assert result.steps == 30
    assert result.validation_loss < result.initial_validation_loss - 0.5, result


def test_run_directory_layout(trained_run):
    request, result, _ = trained_run
    run = request.run_dir
    for name in ("infernet.train.yml", "train_config.json", "metrics.jsonl", "proof.json", "result.json", "README.md",
                 "checkpoint-final/adapter_config.json", "checkpoint-final/adapter_model.safetensors"):
        assert (run / name).is_file(), name
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [10, 20, 30]
    assert all({"loss", "tokens_per_s", "validation_loss"} <= m.keys() for m in metrics)
    readme = (run / "README.md").read_text()
    assert str(request.shard) in readme and f"{result.final_loss:.4f}" in readme and result.head.hex() in readme
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step-000000", "step-000010", "step-000020", "step-000030"]
    pickles = [p for p in run.rglob("*") if p.suffix in (".bin", ".pt", ".pth", ".pkl", ".ckpt")]
    assert pickles == []


def test_checkpoint_events_match_the_proof_and_the_files(trained_run):
    request, result, events = trained_run
    commitment = Commitment.from_json(json.loads((request.run_dir / "proof.json").read_text()))
    commitment.check(result.head)
    assert [e.step for e in events] == [10, 20, 30]
    assert [e.link for e in events] == list(commitment.links)
    assert events[-1].head == result.head
    assert commitment.header.worker == "12D3KooWTestWorker" and commitment.header.environment["threads"] == 1
    for event in events:
        assert tensors_hash(load_file(str(event.path / "adapter_model.safetensors"))) == event.link.adapter_hash
        assert tensors_hash(load_file(str(event.path / "optimizer.safetensors"))) == event.link.optimizer_hash
    initial = load_file(str(request.run_dir / "checkpoints/step-000000/adapter_model.safetensors"))
    assert tensors_hash(initial) == commitment.header.initial_adapter_hash


def test_final_adapter_loads_with_stock_peft_and_changes_outputs(trained_run, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, result, _ = trained_run
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.tensor([[1, 80, 90, 100, 2, 201, 1]])
    with torch.no_grad():
        before = base(input_ids=ids).logits
        tuned = PeftModel.from_pretrained(base, result.adapter_dir)
        after = tuned(input_ids=ids).logits
    assert (after - before).abs().max() > 1e-2


def test_lora_a_is_seeded_identical_and_stays_frozen(trained_run, base_config):
    _, result, _ = trained_run
    fresh = adapter_state(add_lora(
        load_base_model(base_config.base_model, device="cpu", dtype=torch.float32, quantize_4bit=False),
        rank=8, alpha=16.0, dropout=0.0, target_modules=base_config.target_modules, seed=base_config.seed,
        freeze_a=True))
    torch.manual_seed(12345)  # the global RNG must not matter
    other_seed = adapter_state(add_lora(
        load_base_model(base_config.base_model, device="cpu", dtype=torch.float32, quantize_4bit=False),
        rank=8, alpha=16.0, dropout=0.0, target_modules=base_config.target_modules, seed=base_config.seed + 1,
        freeze_a=True))
    trained = load_file(str(result.adapter_dir / "adapter_model.safetensors"))
    a_names = [n for n in trained if ".lora_A." in n]
    assert len(a_names) == 4 * 7
    for name in a_names:
        assert torch.equal(trained[name], fresh[name])
        assert not torch.equal(fresh[name], other_seed[name])
    assert all(fresh[n].abs().max() == 0 for n in fresh if ".lora_B." in n)


def test_wrong_base_model_hash_is_one_line_error(tmp_path, base_config, demo_files):
    config = base_config.with_(base_model_sha256="ab" * 32, max_steps=1)
    with pytest.raises(TrainError, match="sha256 .* but the job names abababab"):
        train_shard(TrainRequest(config, demo_files["shard1"], tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_backend_selection():
    assert isinstance(select_backend("peft"), PeftBackend)
    if not torch.cuda.is_available():
        with pytest.raises(TrainError) as caught:
            select_backend("unsloth")
        assert str(caught.value) == "runtime unsloth needs a CUDA GPU; none found — use runtime: peft"


def test_unsloth_child_failure_comes_back_as_one_line(tmp_path, base_config, demo_files):
    """The real runner in a child process; without unsloth installed it reports why and exits."""
    try:
        import unsloth  # noqa: F401
        pytest.skip("unsloth is importable here; the failure path is not reachable")
    except (ImportError, NotImplementedError):
        pass
    request = TrainRequest(base_config.with_(runtime="unsloth", max_steps=1), demo_files["shard1"], tmp_path / "run")
    with pytest.raises(TrainError, match="runtime unsloth is not usable here"):
        UnslothBackend().train(request)


def test_config_from_jobspec(tiny_model_dir):
    from protocol.jobspec import parse_spec

    spec = parse_spec(f"""
name: demo
base_model: {tiny_model_dir}
method: qlora
seed: 42
input: {{dataset: data.jsonl, validation_split: 0.1}}
training: {{epochs: 2, learning_rate: 1e-3, batch_size: 2, gradient_accumulation_steps: 3, max_seq_len: 64, max_steps: 0,
            packing: true}}
lora: {{rank: 4, alpha: 8, dropout: 0.1, target_modules: [q_proj, k_proj], freeze_a: true}}
proof: {{checkpoint_every: 5, verify_segments: 3, tolerance: 0.001}}
""", "spec.yml")
    config = TrainConfig.from_spec(spec, threads=3)
    assert (config.method, config.seed, config.validation_split, config.epochs, config.learning_rate) == (
        "qlora", 42, 0.1, 2, 1e-3)
    assert (config.batch_size, config.gradient_accumulation_steps, config.max_seq_len, config.samples_per_step) == (
        2, 3, 64, 6)
    assert (config.rank, config.alpha, config.dropout, config.target_modules, config.freeze_a) == (
        4, 8.0, 0.1, ("q_proj", "k_proj"), True)
    assert (config.checkpoint_every, config.verify_segments, config.tolerance, config.threads) == (5, 3, 0.001, 3)
    assert config.packing  # the job's, so worker and verifier pack alike
    assert config.total_steps(100) == 34  # 2 epochs x 100 examples / 6 per step, rounded up
    # the same mapping a worker trains from (issue 23: spec -> terms -> config, once)
    from protocol.jobspec import to_terms

    from protocol import messages as m

    terms = to_terms(spec, submitter="", base_model_sha256=bytes(32))
    assert m.TrainingTerms.from_wire(terms.training.to_wire()).packing  # the extension field goes on the wire
    from dataclasses import replace

    assert "packing" not in replace(terms.training, packing=False).to_wire()  # and stays off it when false
    worker = TrainConfig.from_terms(terms, str(tiny_model_dir), threads=3)
    assert worker.with_(base_model_sha256=None, validation_split=0.1) == config


def test_checkpoints_written_in_the_background_commit_the_same_chain(trained_run, base_config, demo_files, tmp_path,
                                                                     monkeypatch):
    """On a GPU the recorder hashes and writes checkpoints in a writer thread while training goes on
    (run.writes_in_background). Forced here on the CPU: the same chain, head and files as the inline run, each
    checkpoint announced in order, from the training thread, after its bytes are on disk."""
    import threading

    from agent.train import run as run_module

    request, result, inline_events = trained_run
    monkeypatch.setattr(run_module, "writes_in_background", lambda session: True)
    events, threads, on_disk = [], set(), []

    def on_checkpoint(event):
        events.append(event)
        threads.add(threading.get_ident())
        on_disk.append(tensors_hash(load_file(str(event.path / "optimizer.safetensors"))) == event.link.optimizer_hash)

    background = train_shard(TrainRequest(base_config, request.shard, tmp_path / "run", validation=request.validation,
                                          job_id=request.job_id, round=1, worker=request.worker), on_checkpoint)
    assert background.head == result.head
    assert [(e.index, e.step, e.link, e.head) for e in events] == \
        [(e.index, e.step, e.link, e.head) for e in inline_events]
    assert threads == {threading.get_ident()} and all(on_disk)
    assert not any(t.name.startswith("checkpoint-writer") for t in threading.enumerate())


def test_an_op_strict_mode_refuses_turns_cuda_training_to_warn_only():
    """IPIP-0005 §8.2: CUDA sessions train in strict deterministic mode; an op without a deterministic form
    (torch's RuntimeError) turns the process to warn-only mode, once, and the work runs again. Only that
    error, only on CUDA, only from strict mode."""
    from agent.train.loop import refused_by_strict_mode

    refusal = RuntimeError("foo_cuda does not have a deterministic implementation, but you set "
                           "'torch.use_deterministic_algorithms(True)'")
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        torch.use_deterministic_algorithms(True)
        assert not refused_by_strict_mode(refusal, "cpu")
        assert not refused_by_strict_mode(RuntimeError("CUDA out of memory"), "cuda")
        assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
        assert refused_by_strict_mode(refusal, "cuda")
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert not refused_by_strict_mode(refusal, "cuda")  # already warn-only: a second refusal is a real error
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_a_model_that_computes_its_own_loss_gives_the_same_sum_and_gradients(tiny_model_dir):
    """unsloth's models are marked FUSED_LOSS and given the labels (its chunked cross-entropy never builds the
    logits; measured on an H200, issue 22). The contract token_loss_sum relies on -- labels aligned with
    input_ids, the model shifting them, ``num_items_in_batch=1`` turning its mean into the sum over label
    tokens -- is transformers' too, so a stock model marked the same must give the logits path's sum and
    gradients."""
    from agent.train.loop import FUSED_LOSS, collate, token_loss_sum
    from agent.train.records import Example

    examples = [Example(input_ids=[1, 80, 90, 100, 2, 201], labels=[-100, -100, 90, 100, 2, 201]),
                Example(input_ids=[1, 70, 71, 72], labels=[-100, 70, 71, -100])]
    batch = collate(examples, pad_id=0, device="cpu")
    model = add_lora(load_base_model(str(tiny_model_dir), device="cpu", dtype=torch.float32, quantize_4bit=False),
                     rank=8, alpha=16.0, dropout=0.0, target_modules=("q_proj", "v_proj"), seed=3, freeze_a=False)
    sums, grads = [], []
    for fused in (False, True):
        setattr(model, FUSED_LOSS, fused)
        model.zero_grad()
        loss = token_loss_sum(model, batch)
        loss.backward()
        sums.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert sums[0].dtype == sums[1].dtype == torch.float32
    assert sums[0] > 5.0  # a sum over the 6 label tokens, not their mean
    torch.testing.assert_close(sums[1], sums[0])
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=name)
