"""infernet publish: merged model and card, Ollama Modelfile, Hub dry run and errors; GGUF through llama.cpp."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from agent.pipeline import publish as pub
from agent.pipeline.source import PipelineError, resolve_source
from tests.pipeline.conftest import assert_one_line_error, run_cli


@pytest.fixture(scope="module")
def merged(tmp_path_factory, run_dir) -> Path:
    target = tmp_path_factory.mktemp("published") / "tiny-merged"
    result = pub.write_merged(resolve_source(str(run_dir)), target)
    assert result["path"] == str(target)
    return target


def test_merged_model_is_the_base_plus_the_adapter_with_a_card(merged, run_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agent.pipeline.infer import load_model

    names = {p.name for p in merged.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"} <= names
    assert not list(merged.parent.glob(".*partial*"))  # the staging directory was renamed, not left
    plain = AutoModelForCausalLM.from_pretrained(str(merged))
    tokenizer = AutoTokenizer.from_pretrained(str(merged))
    assert "<|im_start|>" in tokenizer.chat_template
    peft_model, _ = load_model(resolve_source(str(run_dir)))
    ids = tokenizer("Translate to French: cat", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, peft_model(ids).logits, rtol=1e-4, atol=1e-4)
    card = (merged / "README.md").read_text()
    result = json.loads((run_dir / "result.json").read_text())
    assert result["head"] in card and "name: pipeline-test" in card
    assert f"{result['validation_loss']:.4f}" in card and "bafkrei" in card
    assert json.loads((merged / "infernet.json").read_text())["proof_head"] == result["head"]


def test_outputs_are_never_overwritten_nor_written_where_they_cannot_be(capsys, tmp_path, merged, run_dir):
    code, _, err = run_cli(capsys, "publish", str(run_dir), "--merged", str(merged))
    assert_one_line_error(code, err, "already exists")
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code, _, err = run_cli(capsys, "publish", str(run_dir), "--merged", str(blocker / "merged"))
    assert_one_line_error(code, err, "not writable")
    code, _, err = run_cli(capsys, "publish", str(run_dir), "--ollama", "tiny")
    assert_one_line_error(code, err, "--ollama needs --gguf")
    code, _, err = run_cli(capsys, "publish", str(run_dir))
    assert_one_line_error(code, err, "at least one of")


def test_missing_llama_cpp_is_one_line_before_any_work(capsys, tmp_path, run_dir):
    code, _, err = run_cli(capsys, "publish", str(run_dir), "--merged", str(tmp_path / "m"), "--gguf",
                           str(tmp_path / "m.gguf"), "--llama-cpp-path", str(tmp_path / "no-llama"))
    assert_one_line_error(code, err, "convert_hf_to_gguf.py not found", "make pipeline")
    assert not (tmp_path / "m").exists() and not (tmp_path / "m.gguf").exists()
    code, _, err = run_cli(capsys, "publish", str(run_dir), "--gguf", str(tmp_path / "m.gguf"), "--quant", "q9_z")
    assert_one_line_error(code, err, "--quant q9_z: unknown")


def test_modelfile_has_the_chatml_template_sampling_and_stops(tmp_path, monkeypatch):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("PATH", str(tmp_path))  # no ollama binary here
    result = pub.write_modelfile(gguf, "tiny-demo")
    text = Path(result["modelfile"]).read_text()
    assert text.startswith(f"FROM {gguf}\n")
    assert "<|im_start|>user\n{{ .Prompt }}<|im_end|>" in text and "<|im_start|>assistant\n" in text
    assert "PARAMETER temperature 0.7" in text and "PARAMETER top_p 0.9" in text
    assert 'PARAMETER stop "<|im_end|>"' in text
    assert result == {"modelfile": str(tmp_path / "Modelfile"), "name": "tiny-demo", "created": False,
                      "command": f"ollama create tiny-demo -f {tmp_path / 'Modelfile'}"}
    with pytest.raises(PipelineError, match="already exists"):
        pub.write_modelfile(gguf, "tiny-demo")
    with pytest.raises(PipelineError, match="not a model name"):
        pub.write_modelfile(gguf, "bad name!")


def test_hf_dry_run_lists_the_exact_folder_and_upload_errors_are_one_line(capsys, monkeypatch, tmp_path, run_dir,
                                                                          merged):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGINGFACE_TOKEN", raising=False)
    code, _, err = run_cli(capsys, "publish", str(run_dir), "--hf", "someone/tiny")
    assert_one_line_error(code, err, "no token", "HF_TOKEN")
    code, out, _ = run_cli(capsys, "publish", str(run_dir), "--merged", str(tmp_path / "m"), "--hf", "someone/tiny",
                           "--private", "--dry-run", "--json")
    assert code == 0
    plan = json.loads(out)["hf"]
    on_disk = sorted(str(p.relative_to(tmp_path / "m")) for p in (tmp_path / "m").rglob("*") if p.is_file())
    assert [f["path"] for f in plan["files"]] == on_disk and plan["private"] and plan["token"] is None
    assert plan["folder"] == str(tmp_path / "m")
    with pytest.raises(PipelineError, match="not a repository ID"):
        pub.hf_plan(merged, "no-slash", False)
    # a token, but the hub cannot be reached (nothing listens on port 9 of this machine)
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(PipelineError, match=r"cannot reach http://127\.0\.0\.1:9"):
        pub.upload_hf(merged, "someone/tiny", private=True)


# -- GGUF: llama.cpp's converter and quantizer, and llama.cpp loading the result --------------------------

def _llama_cpp_ready() -> str | None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama-cpp-python is not installed (make pipeline)"
    try:
        pub.find_llama_cpp()
    except PipelineError as error:
        return str(error)
    return pub.llama_cpp_runs()  # a native build for instructions this CPU lacks: skipped, saying so


def test_a_llama_cpp_that_dies_of_an_illegal_instruction_is_one_clear_line(monkeypatch):
    """Issue 25: a native llama.cpp build on a VM advertising AVX-512/AMX killed `make pipeline` with
    "Fatal Python error: Illegal instruction". Every llama.cpp call of ours runs in a child process now."""
    monkeypatch.setattr(pub, "_PROBE", "import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    assert pub.llama_cpp_runs() == pub.ILLEGAL_INSTRUCTION
    assert "make pipeline" in pub.ILLEGAL_INSTRUCTION and "GGML_NATIVE=OFF" in pub.ILLEGAL_INSTRUCTION
    monkeypatch.setattr(pub, "_PROBE", "import sys; sys.exit('no module named llama_cpp')")
    assert pub.llama_cpp_runs() == "llama-cpp-python is not usable here: no module named llama_cpp"


needs_llama = pytest.mark.skipif(_llama_cpp_ready() is not None, reason=str(_llama_cpp_ready()))


@pytest.mark.llama_cpp
@needs_llama
def test_f32_gguf_gives_llama_cpp_the_merged_models_logits(tmp_path, merged):
    import numpy as np
    from llama_cpp import Llama
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = pub.write_gguf(merged, tmp_path / "tiny-f32.gguf", "f32")
    assert result["bytes"] > 0 and not list(tmp_path.glob(".*partial*"))
    prompt = "<|im_start|>user\nWhat color is the sky?<|im_end|>\n<|im_start|>assistant\n"
    tokenizer = AutoTokenizer.from_pretrained(str(merged))
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(str(merged))(ids).logits[0, -1].numpy()
    llm = Llama(model_path=result["path"], n_ctx=256, verbose=False, logits_all=True)
    tokens = llm.tokenize(prompt.encode(), add_bos=False, special=True)
    assert tokens == ids[0].tolist()  # the same tokenizer: the qwen2 pre-tokenizer and the ChatML specials
    llm.eval(tokens)
    np.testing.assert_allclose(np.array(llm.scores[llm.n_tokens - 1]), expected, atol=5e-3)


@pytest.mark.llama_cpp
@needs_llama
def test_q4_k_m_gguf_and_ollama_modelfile_from_the_cli(capsys, tmp_path, run_dir):
    from llama_cpp import Llama

    gguf = tmp_path / "out" / "tiny.gguf"
    code, out, _ = run_cli(capsys, "publish", str(run_dir), "--gguf", str(gguf), "--quant", "q4_k_m",
                           "--ollama", "tiny-demo", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["gguf"]["quant"] == "q4_k_m" and gguf.is_file()
    assert result["ollama"]["modelfile"] == str(gguf.parent / "Modelfile")
    assert sorted(p.name for p in gguf.parent.iterdir()) == ["Modelfile", "tiny.gguf"]  # no merged leftovers
    llm = Llama(model_path=str(gguf), n_ctx=256, verbose=False, seed=1)
    prompt = "<|im_start|>user\nTranslate to French: cat<|im_end|>\n<|im_start|>assistant\n"
    eot = llm.tokenize(b"<|im_end|>", add_bos=False, special=True)[0]
    text = llm.create_completion(prompt, max_tokens=12, temperature=0.8, logit_bias={eot: -100.0})["choices"][0]["text"]
    assert text.strip()


def test_where_llama_cpp_is_looked_for_and_a_missing_quantizer(tmp_path, monkeypatch):
    import sys

    checkout = tmp_path / "llama.cpp"
    checkout.mkdir()
    (checkout / "convert_hf_to_gguf.py").write_text("")
    monkeypatch.setenv("INFERNET_LLAMA_CPP", str(checkout))
    assert pub.find_llama_cpp() == checkout
    assert pub.find_llama_cpp(checkout) == checkout
    with pytest.raises(PipelineError, match="--llama-cpp-path"):
        pub.find_llama_cpp(tmp_path / "elsewhere")
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as on a machine without llama-cpp-python
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(PipelineError, match="quantizer not found"):
        pub.quantizer(checkout)
    (checkout / "build" / "bin").mkdir(parents=True)
    (checkout / "build" / "bin" / "llama-quantize").write_text("")
    assert callable(pub.quantizer(checkout))  # a llama.cpp build's program is used when the bindings are absent


def test_a_card_for_a_bare_adapter_directory_claims_no_training_it_cannot_show(run_dir):
    """An adapter directory alone (the demo's fetched aggregate, say) has no record of how it was trained:
    its card must not say it was trained locally, and points to what carries the provenance."""
    run_card = pub.model_card(resolve_source(str(run_dir)), "from-run")
    assert "locally (`infernet train run --local`)" in run_card
    card = pub.model_card(resolve_source(str(run_dir / "checkpoint-final")), "from-adapter")
    assert "locally" not in card and "directory `checkpoint-final`" in card and "job ID" in card
