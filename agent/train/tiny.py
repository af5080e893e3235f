"""A tiny Qwen2 causal LM and ChatML tokenizer, built in code, for tests and the demo.

Rules of this file:
- No model hub is reachable here, so the demo base model is made, not downloaded: a byte-level
  BPE tokenizer trained (tokenizers library) on a fixed corpus, and a Qwen2 model of about 1M
  parameters initialised from ``seed``, its (untied) output matrix drawn wider than the default
  so that an adapter alone can make confident predictions. Same seed and library versions give the same files and so
  the same ``base_model_sha256``.
- The result is a plain Hugging Face directory (config.json, model.safetensors, tokenizer.json,
  tokenizer_config.json with the ChatML ``chat_template``), loaded like any real base model.
  ``transformers_version`` is removed from config.json so the hash does not move with it.
- Every matrix dimension is a multiple of 64 so 4-bit (bitsandbytes) quantization applies.
- The chat template marks assistant turns with ``{% generation %}`` (labels come from it); the
  newline after ``{% endgeneration %}`` is written ``{{ '\\n' }}`` because the template engine
  drops a literal one there.
- ``tiny_model()`` builds once per (seed, version) into a cache directory, atomically (build in a
  temporary directory, then rename), so concurrent tests share it safely.
- ``demo_records()`` generates the demo task: small templated questions (colours, French words,
  counting, spelling) a model this size visibly learns in a few hundred steps.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

TINY_VERSION = 4
VOCAB_SIZE = 1024
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
OUTPUT_EMBEDDING_STD = 0.2
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
MODEL_DIMS = dict(
    vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    tie_word_embeddings=False, rms_norm_eps=1e-6,
)

COLOURS = {
    "banana": "yellow", "sky": "blue", "grass": "green", "snow": "white", "coal": "black",
    "tomato": "red", "orange": "orange", "lemon": "yellow", "cherry": "red", "leaf": "green",
    "sea": "blue", "milk": "white", "crow": "black", "carrot": "orange", "plum": "purple",
    "grape": "purple", "cloud": "grey", "ash": "grey", "rose": "red", "lime": "green",
}
FRENCH = {
    "cat": "chat", "dog": "chien", "house": "maison", "water": "eau", "bread": "pain",
    "apple": "pomme", "book": "livre", "sun": "soleil", "moon": "lune", "tree": "arbre",
    "car": "voiture", "friend": "ami", "school": "ecole", "night": "nuit", "day": "jour",
    "fish": "poisson", "bird": "oiseau", "flower": "fleur", "milk": "lait", "cheese": "fromage",
}
SPELL_WORDS = ("cat", "dog", "sun", "tree", "book", "fish", "moon", "star", "rain", "bird",
               "milk", "door", "hand", "song", "ship", "road")
SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly."


def demo_records(n: int = 400, seed: int = 0) -> list[dict]:
    """``n`` ChatML records of the demo task, the same for the same (n, seed)."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        task = ("colour", "french", "count", "spell")[i % 4]
        if task == "colour":
            thing = rng.choice(sorted(COLOURS))
            question, answer = f"What color is the {thing}?", f"The {thing} is {COLOURS[thing]}."
        elif task == "french":
            word = rng.choice(sorted(FRENCH))
            question, answer = f"Translate to French: {word}", f"{word} in French is {FRENCH[word]}."
        elif task == "count":
            start = rng.randrange(1, 20)
            question = f"Count from {start} to {start + 4}."
            answer = ", ".join(str(k) for k in range(start, start + 5)) + "."
        else:
            word = rng.choice(SPELL_WORDS)
            question, answer = f"Spell the word {word}.", "-".join(word.upper())
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        if rng.random() < 0.5:
            messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
        records.append({"messages": messages, "meta": {"task": task, "id": i}})
    return records


def _tokenizer_corpus() -> list[str]:
    lines = [SYSTEM_PROMPT, "The quick brown fox jumps over the lazy dog.", "user", "assistant", "system"]
    for record in demo_records(400, seed=12345):
        lines.extend(m["content"] for m in record["messages"])
    lines.extend(" ".join(str(k) for k in range(start, start + 30)) for start in range(0, 100, 10))
    return lines


def build_tokenizer():
    """A ByteLevel BPE tokenizer with ChatML specials, trained deterministically on a fixed corpus."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # the Qwen2 pipeline exactly (NFC, Qwen's split regex, byte-level), because transformers 5
    # loads a qwen2 model's tokenizer.json through Qwen2Tokenizer, which imposes it
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(_tokenizer_corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE, model_max_length=MODEL_DIMS["max_position_embeddings"],
    )


def build_tiny_model(directory: str | Path, seed: int = 0) -> Path:
    """Write the tiny model and tokenizer into ``directory`` (which must not exist yet)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    directory = Path(directory)
    tokenizer = build_tokenizer()
    config = Qwen2Config(
        **MODEL_DIMS, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        # wider than the 0.02 default: with an output matrix that small, logits span only about
        # +-2.5 after the final norm, and no adapter could push the loss below ~4.4 nats
        model.get_output_embeddings().weight.normal_(0.0, OUTPUT_EMBEDDING_STD)
    torch.random.set_rng_state(generator_state)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)

    config_path = directory / "config.json"
    config_json = json.loads(config_path.read_text())
    config_json.pop("transformers_version", None)
    config_path.write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    # transformers 4.x reads the template from tokenizer_config.json, 5.x from either file
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE,
        "model_max_length": MODEL_DIMS["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    (directory / "generation_config.json").unlink(missing_ok=True)
    return directory


def default_cache_dir() -> Path:
    return Path(os.environ.get("INFERNET_CACHE", Path.home() / ".cache" / "infernet"))


def tiny_model(cache_dir: str | Path | None = None, seed: int = 0) -> Path:
    """Path of the tiny model for ``seed``, built on first use and cached."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    target = root / f"tiny-qwen2-v{TINY_VERSION}-seed{seed}"
    if (target / "model.safetensors").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    try:
        build_tiny_model(building / "model", seed)
        try:
            os.rename(building / "model", target)
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return target
