"""From a trained adapter to something people run: ``infernet infer`` and ``infernet publish``.

source.py (which adapter, which base, what is known about them), infer.py (generation),
publish.py (merged weights and card, GGUF through llama.cpp, Ollama, the Hub), gguf_convert.py
(runs llama.cpp's own converter), progress.py (the ``train run --local`` progress bar).
"""
