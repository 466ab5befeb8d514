"""Lookahead decoding for Llama-family models: several tokens per forward pass, output exactly the model's."""

from .config import LookaheadConfig

__all__ = ["LookaheadConfig"]
