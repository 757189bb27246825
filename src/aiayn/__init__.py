"""aiayn: reproduce "Attention Is All You Need" and its ablations with Lightning and Hydra."""

__version__ = "0.1.0"
