"""Tensors computed from a model's weights alone, kept on disk under what the weights were read from.

The device trees' prior (:func:`lookahead.device_tree.token_prior`) is one decoding step of every token of the
vocabulary: about 80 s for SmolLM2 on this project's 2-core CPU, every process. Its rows depend on the weights
alone, so a model read from a file (a GGUF, keyed by its bytes' SHA-256 as the converted weights are; a Hugging
Face directory, by its config's bytes and its safetensors files' names, sizes, times and inodes) keeps them in
:func:`lookahead.loading.cache_dir` for the next process that reads the same file. Only while the weights are as
read (:func:`lookahead.cpu_linear.weights_signature`: moved, cast or changed in place, nothing is read or kept):
the prior steers guesses and never the output, but a stale one would cost speed silently.

Entries are written as the converted weights are (:func:`lookahead.loading.save_entry`); one that cannot be read,
names another key or fails its caller's check is reported, deleted and computed again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
from pathlib import Path

import torch

from .cpu_linear import weights_signature

VERSION = 1  # of the entries' layout


@dataclasses.dataclass(frozen=True)
class WeightsOrigin:
    """What a model's weights were read from (``key``) and their state just after (``signature``)."""

    key: str
    signature: tuple


def mark_origin(model, key: str):
    """Record on ``model`` that its weights, as they are now, were read from the source ``key``; returns it."""
    model.weights_origin = WeightsOrigin(key, weights_signature(model))
    return model


def entry(model, name: str, signature: tuple | None = None, **fields) -> tuple[Path, str] | None:
    """``(path, key)`` of the entry ``name`` of ``model`` computed with ``fields`` (JSON values), for the model's
    dtype and device type; None where the weights come from no file or changed since they were read.
    ``signature``: :func:`weights_signature` of the model, where the caller has it."""
    from .loading import cache_dir

    origin = getattr(model, "weights_origin", None)
    if origin is None or origin.signature != (signature or weights_signature(model)):
        return None
    weight = model.embed.weight
    key = json.dumps({"name": name, "weights": origin.key, "dtype": str(weight.dtype), "device": weight.device.type,
                      "version": VERSION, **fields}, sort_keys=True)
    return cache_dir() / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:40]}.safetensors", key


def read(path: Path, key: str, check) -> torch.Tensor | None:
    """The tensor kept at ``path`` under ``key`` where ``check(tensor)`` (raising ``ValueError`` on bad contents)
    passes; None where there is none. An entry that fails is reported (``RuntimeWarning``) and deleted."""
    if not path.is_file():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("key") != key:
                raise ValueError("it was kept under another key")
            tensor = f.get_tensor("value")
        check(tensor)
        return tensor
    except Exception as err:  # noqa: BLE001 -- unreadable, truncated, another key, bad contents: computed again
        from .loading import delete_quietly

        warnings.warn(f"the cached {path.name} is unusable ({err}); computing it again", RuntimeWarning, stacklevel=3)
        delete_quietly(path)
        return None


def write(path: Path, key: str, tensor: torch.Tensor) -> None:
    """Keep ``tensor`` at ``path`` under ``key`` (:func:`lookahead.loading.save_entry`, as the converted weights are
    kept); a failure is reported (``RuntimeWarning``), never raised: the caller has its tensor."""
    from .loading import save_entry

    try:
        save_entry(path, {"value": tensor.detach().cpu().contiguous()}, {"key": key})
    except (OSError, RuntimeError) as err:  # RuntimeError: safetensors' own write errors
        warnings.warn(f"could not keep {path.name} in {path.parent} ({err})", RuntimeWarning, stacklevel=3)
