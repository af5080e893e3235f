"""``infernet publish``: a trained adapter as a model people can run: merged weights, GGUF, Ollama, the Hub.

Rules of this file:
- Every output is written beside its target under a temporary name and renamed into place at the
  end (``os.rename`` of a directory, ``os.replace`` of a file): a failure leaves nothing half
  written. An existing target is refused, never overwritten; an unwritable place fails before any
  work, in one line.
- ``write_merged``: the adapter merged into the base (peft ``merge_and_unload``), saved in the
  Hugging Face layout (config, safetensors, tokenizer with its chat template, generation config)
  with a README.md model card that says where it came from: the spec, dataset CIDs, proof and
  ledger heads, validation losses, whatever the source knows (agent/pipeline/source.py).
- ``write_gguf``: llama.cpp's own converter (convert_hf_to_gguf.py, run by gguf_convert.py) writes
  the GGUF (f32, f16, bf16 and q8_0 directly); other types (q4_k_m, q5_k_m, ...) are made from the
  f16 file by llama.cpp's quantizer: ``llama_model_quantize`` of the llama-cpp-python bindings, or
  the ``llama-quantize`` program of a llama.cpp build. Nothing here writes GGUF bytes itself.
  Where llama.cpp lives: ``--llama-cpp-path``, else ``$INFERNET_LLAMA_CPP``, else
  ``<venv>/share/llama.cpp`` (``make pipeline`` puts the converter there).
- ``write_modelfile``: an Ollama Modelfile (FROM the GGUF, ChatML TEMPLATE, sampling PARAMETERs,
  stop tokens); ``ollama create`` runs only if an ``ollama`` binary is on PATH.
- ``upload_hf``: huggingface_hub's ``upload_folder`` of the merged directory, the token from
  ``HF_TOKEN`` or ``HUGGINGFACE_TOKEN``; ``hf_plan`` lists exactly what would be sent.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from agent.pipeline.source import PipelineError, Provenance, Source

DIRECT_TYPES = ("f32", "f16", "bf16", "q8_0")
QUANT_TYPES = {  # name -> llama.cpp's LLAMA_FTYPE_MOSTLY_* (include/llama.h)
    "q4_0": 2, "q4_1": 3, "q5_0": 8, "q5_1": 9, "q2_k": 10, "q3_k_s": 11, "q3_k_m": 12, "q3_k_l": 13,
    "q4_k_s": 14, "q4_k_m": 15, "q5_k_s": 16, "q5_k_m": 17, "q6_k": 18,
}
OLLAMA_TEMPLATE = """{{ if .System }}<|im_start|>system
{{ .System }}<|im_end|>
{{ end }}{{ if .Prompt }}<|im_start|>user
{{ .Prompt }}<|im_end|>
{{ end }}<|im_start|>assistant
{{ .Response }}<|im_end|>
"""
_HF_REPO = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")


# -- places --------------------------------------------------------------------------------------

def check_target(path: Path, what: str) -> Path:
    """``path`` resolved, if it does not exist yet and its directory can be written."""
    path = path.expanduser().resolve()
    if path.exists() and not (path.is_dir() and not any(path.iterdir())):
        raise PipelineError(f"{what} {path}: already exists; choose a new path")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise PipelineError(f"{what} {path}: {parent} is not writable")
    return path


def _staging_dir(target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))


# -- merged ---------------------------------------------------------------------------------------

def write_merged(source: Source, target: Path) -> dict:
    """The adapter merged into the base, in the Hugging Face layout, with a model card."""
    from agent.pipeline.infer import load_model

    target = check_target(target, "--merged")
    staging = _staging_dir(target)
    try:
        model, tokenizer = load_model(source, merge=True)
        model.save_pretrained(str(staging), safe_serialization=True)
        tokenizer.save_pretrained(str(staging))
        _keep_chat_template(staging, tokenizer)
        (staging / "README.md").write_text(model_card(source, target.name))
        (staging / "infernet.json").write_text(json.dumps(source.provenance.to_json(), indent=2, sort_keys=True) + "\n")
        _publishable(staging)
        if target.exists():
            target.rmdir()  # an empty directory the user made for it
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return {"path": str(target), "files": sorted(p.name for p in target.iterdir())}


def _keep_chat_template(directory: Path, tokenizer: Any) -> None:
    """The chat template in tokenizer_config.json too: llama.cpp's converter and transformers 4 read it there."""
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    if getattr(tokenizer, "chat_template", None) and "chat_template" not in config:
        config["chat_template"] = tokenizer.chat_template
        path.write_text(json.dumps(config, indent=2) + "\n")


def model_card(source: Source, name: str) -> str:
    p: Provenance = source.provenance
    rows = [("Base model", f"`{p.base_model_name or source.base_dir}`"
             + (f" (sha256 `{p.base_model_sha256}`)" if p.base_model_sha256 else ""))]
    if p.job_id:
        rows.append(("Job", f"`{p.job_id}`, round {p.round}"))
        rows.append(("Aggregate adapter CID", f"`{p.aggregate_cid}`"))
    elif p.kind == "run":
        rows.append(("Trained", f"locally (`infernet train run --local`), run `{p.name}`"
                     + (f", {p.steps} steps" if p.steps else "")))
    else:  # an adapter directory alone: nothing beside it says how it was trained
        rows.append(("Adapter", f"directory `{p.name}` (no run or job record with it: publish the run "
                                "directory or the job ID for the training's provenance)"))
    for label, cid in sorted(p.dataset_cids.items()):
        rows.append((f"Dataset {label}", f"`{cid}`"))
    if p.proof_head:
        rows.append(("Proof-of-training chain head", f"`{p.proof_head}`"))
    if p.ledger_head:
        rows.append(("Job ledger head", f"`{p.ledger_head}` ({p.ledger_entries} signed entries)"))
    if p.validation_loss is not None:
        before = f"{p.base_validation_loss:.4f} (base) -> " if p.base_validation_loss is not None else ""
        rows.append(("Validation loss", f"{before}{p.validation_loss:.4f}"))
    if p.final_loss is not None:
        rows.append(("Final training loss", f"{p.final_loss:.4f}"))
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    spec = f"\n## Training spec\n\n```yaml\n{p.spec_text.strip()}\n```\n" if p.spec_text else ""
    base_tag = p.base_model_name if p.base_model_name and "/" in p.base_model_name else None
    front = "---\nlibrary_name: transformers\ntags: [infernet, lora, merged]\n" + \
        (f"base_model: {base_tag}\n" if base_tag else "") + "---\n"
    return f"""{front}
# {name}

A LoRA adapter trained with infernet (peer-to-peer LoRA training), merged into its base model. \
Weights are safetensors; the tokenizer carries the chat template the adapter was trained with.

| | |
|---|---|
{table}
{spec}
## Use

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("{name}")
tokenizer = AutoTokenizer.from_pretrained("{name}")
messages = [{{"role": "user", "content": "Hello"}}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
print(tokenizer.decode(model.generate(**inputs, max_new_tokens=64)[0]))
```

`infernet.json` beside this card holds the same provenance as JSON.
"""


# -- GGUF -----------------------------------------------------------------------------------------

def find_llama_cpp(explicit: Path | None = None) -> Path:
    """The directory holding llama.cpp's convert_hf_to_gguf.py (see the module docstring)."""
    candidates = [explicit] if explicit else []
    if not explicit and os.environ.get("INFERNET_LLAMA_CPP"):
        candidates.append(Path(os.environ["INFERNET_LLAMA_CPP"]))
    if not explicit:
        candidates.append(Path(sys.prefix) / "share" / "llama.cpp")
    for candidate in candidates:
        if (candidate.expanduser() / "convert_hf_to_gguf.py").is_file():
            return candidate.expanduser().resolve()
    where = f"--llama-cpp-path {explicit}" if explicit else \
        f"$INFERNET_LLAMA_CPP or {Path(sys.prefix) / 'share' / 'llama.cpp'}"
    raise PipelineError(f"llama.cpp's convert_hf_to_gguf.py not found in {where}: run `make pipeline` "
                        f"(installs llama.cpp's converter and quantizer), or give --llama-cpp-path to a llama.cpp checkout")


_QUANTIZE = """
import sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype, params.nthread = int(sys.argv[3]), int(sys.argv[4])
sys.exit(0 if llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params) == 0 else 3)
"""
_PROBE = "import llama_cpp; llama_cpp.llama_backend_init(); print(llama_cpp.llama_print_system_info().decode())"
ILLEGAL_INSTRUCTION = ("the local llama.cpp (llama-cpp-python) died on an illegal CPU instruction: it was built for "
                       "instructions this machine does not enable (a native build, e.g. AVX-512 or AMX on a VM that "
                       "advertises them); rebuild it portable with `make pipeline` (CMAKE_ARGS=-DGGML_NATIVE=OFF)")


def _died_of(returncode: int) -> str | None:
    import signal

    if returncode == -signal.SIGILL:
        return ILLEGAL_INSTRUCTION
    if returncode < 0:
        return f"the local llama.cpp (llama-cpp-python) died of signal {-returncode}"
    return None


def llama_cpp_runs() -> str | None:
    """None when llama-cpp-python imports and its CPU backend starts here, else why not (one line).
    Run in a child process: a build for CPU instructions this machine lacks kills its process."""
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "the local llama.cpp (llama-cpp-python) did not start within 120 s"
    if done.returncode == 0:
        return None
    died = _died_of(done.returncode)
    if died:
        return died
    last = [line for line in done.stderr.splitlines() if line.strip()][-1:]
    return "llama-cpp-python is not usable here" + (f": {last[0]}" if last else "")


def quantizer(llama_dir: Path) -> Any:
    """A function (f16 path, out path, ftype) -> None from llama.cpp, or PipelineError."""
    try:
        import importlib.util

        has_bindings = importlib.util.find_spec("llama_cpp") is not None
    except (ImportError, ValueError):
        has_bindings = False
    if has_bindings:
        def quantize_with_bindings(src: Path, dst: Path, ftype: int) -> None:
            # in a child process: a llama.cpp built for instructions this CPU lacks dies of SIGILL there,
            # and we say so in one line, instead of the CLI dying with "Illegal instruction"
            threads = str(max(1, min(os.cpu_count() or 1, 8)))
            done = subprocess.run([sys.executable, "-c", _QUANTIZE, str(src), str(dst), str(ftype), threads],
                                  capture_output=True, text=True)  # llama.cpp logs every tensor to stderr
            died = _died_of(done.returncode)
            if died:
                raise PipelineError(died)
            if done.returncode != 0:
                last = [line for line in done.stderr.splitlines() if line.strip()][-1:]
                raise PipelineError(f"llama.cpp could not quantize {src} (exit {done.returncode}"
                                    f"{': ' + last[0] if last else ''})")
        return quantize_with_bindings
    program = next((p for p in (llama_dir / "build" / "bin" / "llama-quantize", llama_dir / "llama-quantize")
                    if p.is_file()), None) or (Path(shutil.which("llama-quantize")) if shutil.which("llama-quantize") else None)
    if program is None:
        raise PipelineError("llama.cpp's quantizer not found (no llama_cpp module, no llama-quantize): "
                            "`make pipeline` installs llama-cpp-python, or use --quant f16 / q8_0")

    def quantize_with_program(src: Path, dst: Path, ftype: int) -> None:
        name = next(k for k, v in QUANT_TYPES.items() if v == ftype).upper()
        done = subprocess.run([str(program), str(src), str(dst), name], capture_output=True, text=True)
        if done.returncode != 0:
            raise PipelineError(f"llama-quantize failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return quantize_with_program


def _publishable(directory: Path) -> None:
    """Ordinary permissions (mkdtemp made the staging directory 0700): as a plain mkdir and write would."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def write_gguf(merged_dir: Path, target: Path, quant: str = "q4_k_m", llama_cpp_path: Path | None = None) -> dict:
    """``merged_dir`` as one GGUF file of type ``quant``, by llama.cpp's converter (and quantizer)."""
    quant = quant.lower()
    if quant not in DIRECT_TYPES and quant not in QUANT_TYPES:
        raise PipelineError(f"--quant {quant}: unknown (known: {', '.join(DIRECT_TYPES + tuple(QUANT_TYPES))})")
    target = check_target(target, "--gguf")
    llama_dir = find_llama_cpp(llama_cpp_path)
    quantize = quantizer(llama_dir) if quant in QUANT_TYPES else None
    staging = _staging_dir(target)
    try:
        converted = staging / ("model.gguf" if quant in DIRECT_TYPES else "model-f16.gguf")
        env = dict(os.environ, NO_LOCAL_GGUF="1")  # gguf_convert puts llama.cpp's own gguf-py first itself
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
        done = subprocess.run(
            [sys.executable, "-m", "agent.pipeline.gguf_convert", str(llama_dir), str(merged_dir),
             "--outfile", str(converted), "--outtype", quant if quant in DIRECT_TYPES else "f16"],
            capture_output=True, text=True, env=env)
        if done.returncode != 0 or not converted.is_file():
            last = [line for line in (done.stderr or done.stdout).strip().splitlines() if line.strip()][-1:]
            raise PipelineError(f"llama.cpp's converter failed on {merged_dir}: {last[0] if last else done.returncode}")
        if quantize is not None:
            quantized = staging / "model.gguf"
            quantize(converted, quantized, QUANT_TYPES[quant])
            converted = quantized
        _publishable(staging)
        os.replace(converted, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {"path": str(target), "quant": quant, "bytes": target.stat().st_size, "llama_cpp": str(llama_dir)}


# -- Ollama ---------------------------------------------------------------------------------------

def modelfile_text(gguf: Path, *, temperature: float = 0.7, top_p: float = 0.9, system: str | None = None) -> str:
    lines = [f"FROM {gguf.resolve()}", "", f'TEMPLATE """{OLLAMA_TEMPLATE}"""', ""]
    if system:
        lines += [f'SYSTEM """{system}"""', ""]
    lines += [f"PARAMETER temperature {temperature}", f"PARAMETER top_p {top_p}",
              'PARAMETER stop "<|im_end|>"', 'PARAMETER stop "<|im_start|>"', 'PARAMETER stop "<|endoftext|>"']
    return "\n".join(lines) + "\n"


def write_modelfile(gguf: Path, name: str, *, run_ollama: bool = True) -> dict:
    """``Modelfile`` beside the GGUF; ``ollama create NAME`` if ollama is installed, else the command to run."""
    if not re.fullmatch(r"[a-zA-Z0-9][\w.:/-]{0,127}", name):
        raise PipelineError(f"--ollama {name!r}: not a model name (letters, digits, . _ - : /)")
    path = gguf.resolve().parent / "Modelfile"
    check_target(path, "Modelfile")
    staging = path.with_name(".Modelfile.partial")
    staging.write_text(modelfile_text(gguf))
    os.replace(staging, path)
    command = ["ollama", "create", name, "-f", str(path)]
    result = {"modelfile": str(path), "name": name, "command": " ".join(command), "created": False}
    binary = shutil.which("ollama") if run_ollama else None
    if binary:
        done = subprocess.run([binary, *command[1:]], capture_output=True, text=True)
        if done.returncode != 0:
            raise PipelineError(f"`{result['command']}` failed: "
                                f"{((done.stderr or done.stdout).strip().splitlines() or ['exit ' + str(done.returncode)])[-1]}")
        result["created"] = True
    return result


# -- Hugging Face Hub -----------------------------------------------------------------------------

def hf_token() -> str | None:
    return os.environ.get("HF_TOKEN") or os.environ.get("HUGGINGFACE_TOKEN") or None


def hf_plan(folder: Path, repo: str, private: bool) -> dict:
    """Exactly what ``upload_hf`` would send: the files of ``folder`` (relative paths, sizes)."""
    if not _HF_REPO.fullmatch(repo):
        raise PipelineError(f"--hf {repo!r}: not a repository ID (OWNER/NAME)")
    files = [{"path": str(p.relative_to(folder)), "bytes": p.stat().st_size}
             for p in sorted(folder.rglob("*")) if p.is_file()]
    return {"repo": repo, "private": private, "folder": str(folder), "files": files,
            "token": "HF_TOKEN" if os.environ.get("HF_TOKEN") else "HUGGINGFACE_TOKEN" if hf_token() else None}


def upload_hf(folder: Path, repo: str, private: bool) -> dict:
    plan = hf_plan(folder, repo, private)
    token = hf_token()
    if not token:
        raise PipelineError(f"--hf {repo}: no token: set HF_TOKEN (or HUGGINGFACE_TOKEN) to a write token "
                            f"from https://huggingface.co/settings/tokens")
    from huggingface_hub import HfApi

    api = HfApi(token=token, endpoint=os.environ.get("HF_ENDPOINT") or None)  # read now, not at import
    try:
        api.create_repo(repo, private=private, exist_ok=True)
        info = api.upload_folder(repo_id=repo, folder_path=str(folder),
                                 commit_message="Upload model published by infernet")
    except Exception as exc:  # noqa: BLE001 - the hub's errors (HTTP, connection) become one line
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if _is_connection_error(exc):
            raise PipelineError(f"--hf {repo}: cannot reach {api.endpoint} ({type(exc).__name__})") from None
        raise PipelineError(f"--hf {repo}: upload failed: {text[:200]}") from None
    plan["url"] = str(getattr(info, "commit_url", "") or f"https://huggingface.co/{repo}")
    return plan


def _is_connection_error(exc: BaseException) -> bool:
    seen = 0
    while exc is not None and seen < 10:
        name = type(exc).__name__
        if isinstance(exc, (ConnectionError, TimeoutError)) or name in ("ConnectError", "ConnectTimeout",
                                                                        "ConnectionError", "ReadTimeout"):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False
