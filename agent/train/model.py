"""Base model identity and loading, the seeded LoRA, and adapter tensors as proof records.

Rules of this file:
- A base model is a local directory or a hub name; both load through
  ``AutoModelForCausalLM.from_pretrained`` (a hub name only from the local hub cache here).
- ``base_model_sha256`` identifies the weights: SHA-256 over the lines ``"<sha256 hex>  <relative
  path>\\n"`` of ``config.json`` and every ``*.safetensors`` file, sorted by relative path (the
  ``sha256sum`` format, so ``cd model && sha256sum config.json *.safetensors | sort -k2 |
  sha256sum`` reproduces it). The tokenizer is not part of it.
- LoRA A matrices are drawn from the job seed, not from the global RNG: module ``name`` gets
  U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (peft's default range) from a CPU generator seeded with
  SHA-256("infernet/lora-a/v1", seed, name). So every worker starts from the same A whatever else
  it ran first, and with ``freeze_a`` A never moves: averaging B is then the exact average of
  the updates B A. B starts at zero, as in peft.
- Adapter and optimizer tensors are named as in peft's saved adapter files (no ".default"),
  hashed through protocol.proof.tensor_set_hash, and stored as safetensors, never pickle.
"""

from __future__ import annotations

import hashlib
import math
import threading
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from protocol.acceptance import FULL_CONFIG  # what a full fine-tuning's adapter_config.json says (R4)
from protocol.fit import full_size_refusal  # the size rule of method: full
from protocol.proof import TensorRecord, lora_a_seed, tensor_set_hash

ADAPTER_NAME = "default"
SAFETENSORS_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


def resolve_model_dir(path_or_name: str) -> Path:
    """The local directory of a base model: the path itself, or the hub cache's snapshot."""
    path = Path(path_or_name).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(path_or_name, local_files_only=True))


FileKey = tuple[str, int, int]  # (absolute path, size in bytes, mtime in ns)


class FileHashCache:
    """sha256 of files by (absolute path, size, mtime): a 7B model is read once, not per shard,
    report and replayed segment. Thread-safe (training and replay run in worker threads). Entries
    are also kept in order so an agent can persist the new ones in its store (``since``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hashes: dict[FileKey, str] = {}
        self._log: list[tuple[FileKey, str]] = []

    def get(self, key: FileKey) -> str | None:
        with self._lock:
            return self._hashes.get(key)

    def put(self, key: FileKey, digest: str) -> None:
        with self._lock:
            if self._hashes.get(key) != digest:
                self._hashes[key] = digest
                self._log.append((key, digest))

    def load(self, entries: list[tuple[FileKey, str]]) -> None:
        for key, digest in entries:
            self.put(key, digest)

    def since(self, position: int) -> tuple[list[tuple[FileKey, str]], int]:
        """Entries added after ``position`` (0: all), and the position to ask from next time."""
        with self._lock:
            return self._log[position:], len(self._log)

    def under(self, root: Path) -> list[tuple[FileKey, str]]:
        prefix = str(root.resolve()) + "/"
        with self._lock:
            return [(k, v) for k, v in self._hashes.items() if k[0].startswith(prefix)]


FILE_HASHES = FileHashCache()
"""This process's cache; an agent loads it from and saves it to its store (agent/store.py)."""


def _file_key(path: Path) -> FileKey:
    st = path.stat()
    return (str(path.resolve()), st.st_size, st.st_mtime_ns)


def file_sha256(path: Path, cache: FileHashCache | None = FILE_HASHES) -> str:
    """sha256 hex of a file, read only when its (path, size, mtime) is not in ``cache``."""
    key = _file_key(path)
    if cache is not None:
        hit = cache.get(key)
        if hit is not None:
            return hit
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    if cache is not None and _file_key(path) == key:  # not changed while we read it
        cache.put(key, digest.hexdigest())
    return digest.hexdigest()


def base_model_sha256(path_or_name: str, cache: FileHashCache | None = FILE_HASHES) -> str:
    """Content hash of a base model's config.json and *.safetensors (see the module docstring).
    Each file is hashed once per (path, size, mtime) through ``cache``."""
    root = resolve_model_dir(path_or_name)
    files = sorted([root / "config.json", *root.rglob("*.safetensors")], key=lambda p: p.relative_to(root).as_posix())
    listing = hashlib.sha256()
    for file in files:
        listing.update(f"{file_sha256(file, cache)}  {file.relative_to(root).as_posix()}\n".encode())
    return listing.hexdigest()


def pick_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device cuda requested but no CUDA GPU is available")
    return requested


def pick_dtype(requested: str, device: str) -> torch.dtype:
    """float32 on CPU (bf16 there is slow and not reproducible), bf16 on GPUs that support it."""
    if requested == "auto":
        if device == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[requested]


_TOKENIZERS = threading.local()
TOKENIZER_KEY = "_infernet_tokenizer_key"


def load_tokenizer(path_or_name: str) -> Any:
    """The base model's tokenizer, loaded once per thread and kept while its files (every file of the model's
    directory but the weights) keep their sizes and times: a worker used to load it for every shard, replay
    and score. Per thread, because a fast tokenizer's truncation and padding are settings each call writes
    into it; the training and the replays run in threads of their own. Tagged with that key
    (``TOKENIZER_KEY``), which ``agent.train.run.load_shard`` keys its prepared shards by."""
    from transformers import AutoTokenizer

    directory = resolve_model_dir(path_or_name)
    key = (str(directory.resolve()), _tokenizer_files(directory))
    cache = getattr(_TOKENIZERS, "cache", None)
    if cache is None:
        cache = _TOKENIZERS.cache = {}
    tokenizer = cache.get(key)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
        setattr(tokenizer, TOKENIZER_KEY, key)
        if len(cache) >= 4:
            cache.clear()
        cache[key] = tokenizer
    return tokenizer


def _tokenizer_files(directory: Path) -> tuple:
    import os

    with os.scandir(directory) as entries:
        return tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in entries
                            if e.is_file() and not e.name.endswith(BASE_FILES_SKIPPED)))


def load_base_model(path_or_name: str, *, device: str, dtype: torch.dtype, quantize_4bit: bool) -> Any:
    """The base causal LM, frozen; 4-bit NF4 through bitsandbytes when ``quantize_4bit`` (QLoRA)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    kwargs: dict[str, Any] = {"dtype": dtype}
    if quantize_4bit:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
        kwargs["device_map"] = {"": device}
    model = AutoModelForCausalLM.from_pretrained(str(resolve_model_dir(path_or_name)), **kwargs)
    if not quantize_4bit:
        model.to(device)
    else:
        # bitsandbytes repacks 4-bit weights for its AVX512-BF16 CPU kernel at the first forward
        # in eval mode, and a training forward after that takes the inference-only path and fails
        # ("a view of a leaf Variable ... in-place"); the other layout would also change the float
        # results a verifier replays. Only CPUs with that instruction set do it: keep one layout.
        for module in model.modules():
            if hasattr(module, "support_avx512bf16_for_cpu"):
                module.support_avx512bf16_for_cpu = False
    model.requires_grad_(False)
    return model


def add_lora(model: Any, *, rank: int, alpha: float, dropout: float, target_modules: tuple[str, ...],
             seed: int, freeze_a: bool) -> Any:
    """Wrap ``model`` in a peft LoRA whose A comes from ``seed`` (see the module docstring)."""
    from peft import LoraConfig, get_peft_model

    problem = target_modules_refusal(target_modules, linear_module_names(model))
    if problem is not None:
        from agent.train.config import TrainError

        raise TrainError(problem)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules),
        bias="none", task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, config)
    seed_lora_a(model, seed)
    if freeze_a:
        for name, parameter in model.named_parameters():
            if ".lora_A." in name:
                parameter.requires_grad_(False)
    return model


def linear_module_names(model: Any) -> set[str]:
    """The last name component of every linear layer of ``model`` (what ``lora.target_modules`` names)."""
    names = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D":
            names.add(name.rsplit(".", 1)[-1])
    return names


def _safetensors_entries(model_dir: str | Path) -> list[tuple[str, Any]]:
    """(tensor name, header entry) of every tensor in a model directory's safetensors files, read off their
    headers without loading a weight."""
    import json
    import struct

    entries = []
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            if length > 100 << 20:
                continue
            entries += [(k, v) for k, v in json.loads(file.read(length)).items() if k != "__metadata__"]
    return entries


def parameters_on_disk(model_dir: str | Path) -> int:
    """How many parameters a model directory's weights hold (what ``method: full`` trains)."""
    return sum(math.prod(info.get("shape", ())) for _, info in _safetensors_entries(model_dir)
               if isinstance(info, dict))


def model_refusal(method: str, target_modules: Sequence[str], model_dir: str | Path) -> str | None:
    """Why a job's settings do not fit a base model on disk, read off its headers (None: they fit): full
    fine-tuning past the size limit, or LoRA targets the model does not have."""
    if method == "full":
        return full_size_refusal(parameters_on_disk(model_dir))
    return target_modules_refusal(target_modules, linear_names_on_disk(model_dir))


def linear_names_on_disk(model_dir: str | Path) -> set[str]:
    """``linear_module_names`` read off a model directory's safetensors headers (2-D ``*.weight`` tensors),
    without loading a weight: cheap enough for the submitter's check at announce time."""
    names = set()
    for key, info in _safetensors_entries(model_dir):
        if key.endswith(".weight") and isinstance(info, dict) and len(info.get("shape", ())) == 2:
            parts = key.split(".")
            if len(parts) >= 2:
                names.add(parts[-2])
    return names


def target_modules_refusal(target_modules: Sequence[str], linear_names: set[str]) -> str | None:
    """Why ``lora.target_modules`` does not fit a model with these linear layers (None: it does). Every
    name must be one of them: peft silently skipped names that match nothing, and failed with an
    internal error when none matched (issue 25)."""
    unknown = [name for name in target_modules if name not in linear_names]
    if not unknown or not linear_names:
        return None
    return (f"lora.target_modules: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not a linear layer "
            f"of this model; its linear layers are: {', '.join(sorted(linear_names))}")


@torch.no_grad()
def seed_lora_a(model: Any, seed: int) -> None:
    for name, module in model.named_modules():
        if not name.endswith(f"lora_A.{ADAPTER_NAME}"):
            continue
        weight = module.weight
        generator = torch.Generator().manual_seed(lora_a_seed(seed, peft_name(name)))
        bound = 1.0 / math.sqrt(weight.shape[1])
        values = torch.rand(weight.shape, generator=generator, dtype=torch.float32) * (2 * bound) - bound
        weight.copy_(values.to(weight.dtype))


def peft_name(name: str) -> str:
    """A parameter or module name as peft writes it in adapter files (the adapter name removed)."""
    return name.replace(f".{ADAPTER_NAME}.", ".").removesuffix(f".{ADAPTER_NAME}")


FULL_MARK = "infernet_full_fine_tuning"


def full_model(model: Any) -> Any:
    """The base model itself as what trains (``method: full``, IPIP-0007): every parameter trainable. Its
    "adapter" (``adapter_state``) is then every weight, named as in the model's own state dict. TrainError
    for a model past the protocol's size limit."""
    problem = full_size_refusal(sum(p.numel() for p in model.parameters()))
    if problem is not None:
        from agent.train.config import TrainError

        raise TrainError(problem)
    model.requires_grad_(True)
    setattr(model, FULL_MARK, True)
    return model


def is_full(model: Any) -> bool:
    return bool(getattr(model, FULL_MARK, False))


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """The adapter's tensors (A and B, trainable or not), copied to the CPU (never the live parameters, which
    the next step changes: a checkpoint is hashed while training goes on), named as in adapter files. For
    full fine-tuning (``full_model``): every weight of the model, named as in its state dict."""
    if is_full(model):
        return {name: p.detach().to("cpu", copy=True).contiguous() for name, p in model.named_parameters()}
    sources = adapter_sources(model)
    if sources is None:
        from peft import get_peft_model_state_dict

        return {name: t.detach().to("cpu", copy=True).contiguous()
                for name, t in get_peft_model_state_dict(model).items()}
    return {name: tensor.detach().to("cpu", copy=True).contiguous() for name, (_, _, tensor) in sources.items()}


def load_adapter_state(model: Any, tensors: Mapping[str, torch.Tensor]) -> None:
    if is_full(model):
        load_full_weights(model, tensors)
        return
    sources = adapter_sources(model)
    if sources is None:
        from peft import set_peft_model_state_dict

        _check_names(set(adapter_state(model)), tensors)
        set_peft_model_state_dict(model, dict(tensors))
        return
    _check_names(set(sources), tensors)
    for name, (_, _, tensor) in sources.items():  # all checked before any is loaded
        if tuple(tensors[name].shape) != tuple(tensor.shape):
            raise ValueError(f"adapter tensor {name} has shape {tuple(tensors[name].shape)}, the model {tuple(tensor.shape)}")
    with torch.no_grad():  # what load_state_dict does with each entry, less its walk over the whole model
        for name, (_, _, tensor) in sources.items():
            tensor.copy_(tensors[name])


SOURCES_ATTRIBUTE = "_infernet_adapter_sources"


def adapter_sources(model: Any) -> dict[str, tuple[Any, str, torch.Tensor]] | None:
    """peft's adapter state dict (``get_peft_model_state_dict``) as the live tensors behind it: name ->
    (module, attribute, parameter or buffer). peft walks every module and builds the whole model's state dict on
    each call (6 ms for the demo's tiny model, some ten times a shard: a tenth of a 12-step shard's time); this
    works the names out once per model and reads the tensors directly after. The found tensors are checked on
    every call to be still the module's own (a module given a new parameter object, or a new adapter, makes the
    names be worked out again). None when an entry of peft's dict is not a whole parameter or buffer of the
    model: then peft is asked each time."""
    count, cached = getattr(model, SOURCES_ATTRIBUTE, (None, None))
    if cached is not None and count == _adapter_count(model):
        if cached is False:  # (found not to be: peft each time)
            return None
        if all(_owns(module, attribute, tensor) for module, attribute, tensor in cached.values()):
            return cached
    from peft import get_peft_model_state_dict

    owners: dict[tuple, tuple[Any, str, torch.Tensor]] = {}
    for module in model.modules():
        for attribute, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is not None:
                owners.setdefault(_storage_key(tensor), (module, attribute, tensor))
    sources: dict[str, tuple[Any, str, torch.Tensor]] | None = {}
    for name, tensor in get_peft_model_state_dict(model).items():
        owner = owners.get(_storage_key(tensor))
        if owner is None:
            sources = None
            break
        sources[name] = owner
    # (a plain attribute, not registered as a torch.nn.Module's): the adapters it was worked out for, and the map
    object.__setattr__(model, SOURCES_ATTRIBUTE, (_adapter_count(model), sources or False))
    return sources or None


def _storage_key(tensor: torch.Tensor) -> tuple:
    return (tensor.device, tensor.dtype, tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()),
            tensor.storage_offset())


def _owns(module: Any, attribute: str, tensor: torch.Tensor) -> bool:
    return module._parameters.get(attribute) is tensor or module._buffers.get(attribute) is tensor


def _adapter_count(model: Any) -> int:
    return len(getattr(model, "peft_config", {}) or {})


@torch.no_grad()
def load_full_weights(model: Any, tensors: Mapping[str, torch.Tensor]) -> None:
    """Every parameter of ``model`` from ``tensors`` (a full fine-tuning's weights, by state-dict name);
    ValueError when they are not exactly the model's parameters and shapes."""
    parameters = dict(model.named_parameters())
    _check_names(set(parameters), tensors)
    for name, parameter in parameters.items():
        if tuple(tensors[name].shape) != tuple(parameter.shape):
            raise ValueError(f"weight {name} has shape {tuple(tensors[name].shape)}, the model {tuple(parameter.shape)}")
        parameter.copy_(tensors[name].to(parameter.dtype))


def saved_full(directory: Path) -> bool:
    """Whether ``directory`` (save_adapter's two files) holds a full fine-tuning's weights, not an adapter."""
    import json

    try:
        config = json.loads((directory / "adapter_config.json").read_text())
        return all(config.get(key) == value for key, value in FULL_CONFIG.items())
    except (OSError, ValueError, AttributeError):
        return False


def _check_names(expected: set[str], tensors: Mapping[str, torch.Tensor]) -> None:
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise ValueError(f"adapter tensors do not fit the model (missing {missing[:3]}, unexpected {extra[:3]})")


def tensor_records(tensors: Mapping[str, torch.Tensor]) -> list[TensorRecord]:
    records = []
    for name, tensor in tensors.items():
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        records.append(TensorRecord(name, SAFETENSORS_DTYPES[tensor.dtype], tuple(tensor.shape), data))
    return records


def tensors_hash(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """protocol.proof.tensor_set_hash of named torch tensors (host byte order is little-endian)."""
    return tensor_set_hash(tensor_records(tensors))


def save_adapter(directory: Path, model: Any, tensors: Mapping[str, torch.Tensor]) -> None:
    """adapter_config.json + adapter_model.safetensors, the layout peft.PeftModel.from_pretrained reads. For
    full fine-tuning the same two files (the bundles' layout, IPIP-0003): adapter_model.safetensors holds
    every weight under the model's state-dict names (``model.load_state_dict`` takes it), and
    adapter_config.json says so (``FULL_CONFIG``)."""
    import json

    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file(dict(tensors), str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    if is_full(model):
        (directory / "adapter_config.json").write_text(json.dumps(
            {**FULL_CONFIG, "base_model_name_or_path": str(getattr(model, "name_or_path", ""))}, indent=2) + "\n")
        return
    model.peft_config[ADAPTER_NAME].save_pretrained(str(directory))


FULL_MARKER_FILE = "infernet_full.json"
BASE_FILES_SKIPPED = (".safetensors", ".bin", ".pt", ".pth", ".index.json", ".msgpack", ".h5", ".gguf")


def as_model_dir(directory: Path, base_model_dir: str | Path | None) -> None:
    """A full fine-tuning's weights (``save_adapter``'s two files) turned, in place, into a Hugging Face model
    directory that ``AutoModelForCausalLM.from_pretrained`` loads: the weights become model.safetensors, the
    marker infernet_full.json, and the base model's config, generation config and tokenizer files are copied
    beside them (its other weight files are not)."""
    import os
    import shutil

    os.replace(directory / "adapter_model.safetensors", directory / "model.safetensors")
    os.replace(directory / "adapter_config.json", directory / FULL_MARKER_FILE)
    if base_model_dir is None:
        return
    for path in sorted(Path(base_model_dir).iterdir()):
        if path.is_file() and not path.name.endswith(BASE_FILES_SKIPPED) and not path.name.startswith("."):
            shutil.copyfile(path, directory / path.name)
