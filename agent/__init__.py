"""infernet agent: one running peer (network, content, training, roles, CLI)."""

__version__ = "0.1.0"
