"""Run llama.cpp's own ``convert_hf_to_gguf.py`` on a merged model: ``python -m agent.pipeline.gguf_convert
LLAMA_CPP_DIR convert-args...``.

Rules of this file:
- It writes nothing itself: the GGUF file is written by llama.cpp's converter and its ``gguf``
  library (``LLAMA_CPP_DIR/gguf-py``, the copy that matches the converter), run in this process.
- One change only, and only when the converter would otherwise refuse: the converter names the
  BPE pre-tokenizer by hashing how the tokenizer splits a fixed text, so a tokenizer with a new
  vocabulary but Qwen2's exact pre-tokenizer (Qwen2's split regex, then byte-level; the tiny
  demo model's) is unknown to it. For exactly that pre-tokenizer we name it ``qwen2``, which is
  the pre-tokenizer llama.cpp implements for that regex. Any other unknown tokenizer still fails.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

QWEN2_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def is_qwen2_pretokenizer(model_dir: Path) -> bool:
    """True when tokenizer.json splits with Qwen2's regex and then maps bytes (ByteLevel, no regex)."""
    try:
        pre = json.loads((model_dir / "tokenizer.json").read_text())["pre_tokenizer"]
    except (OSError, ValueError, KeyError):
        return False
    if not pre or pre.get("type") != "Sequence" or len(pre.get("pretokenizers", [])) != 2:
        return False
    split, byte_level = pre["pretokenizers"]
    return (split.get("type") == "Split" and split.get("pattern", {}).get("Regex") == QWEN2_REGEX
            and split.get("behavior") == "Isolated" and not split.get("invert")
            and byte_level.get("type") == "ByteLevel" and byte_level.get("use_regex") is False)


def main(argv: list[str]) -> int:
    llama_dir = Path(argv[0]).resolve()
    model_dir = next((Path(a) for a in argv[1:] if not a.startswith("-") and Path(a).is_dir()), None)
    sys.path[:0] = [str(llama_dir), str(llama_dir / "gguf-py")]
    from conversion import base  # llama.cpp's converter package

    original = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer):  # noqa: ANN001 - the converter's signature
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            if model_dir is not None and is_qwen2_pretokenizer(model_dir):
                return "qwen2"
            raise

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [str(llama_dir / "convert_hf_to_gguf.py"), *argv[1:]]
    runpy.run_path(str(llama_dir / "convert_hf_to_gguf.py"), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
