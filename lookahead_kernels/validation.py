"""Argument checks shared by the package's public constructors, so every bad value gets the same kind of message."""

from __future__ import annotations


def require_int(name: str, value, minimum: int) -> int:
    """Return ``value`` if it is an ``int`` (not a bool) ``>= minimum``; else raise ``ValueError`` naming ``name``
    (e.g. ``"LookaheadConfig.window"``), what was given and what is allowed."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value
