"""argparse types shared by the commands: a bad value exits 2 with the usage line and a message
naming what was expected, before any model loads or benchmark starts."""

from __future__ import annotations

import argparse


def _int(text: str, least: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _int(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """An integer >= 0 (where 0 means "skip")."""
    return _int(text, 0, "an integer >= 0")


def positive_ints(text: str) -> list[int]:
    """A non-empty comma-separated list of integers >= 1."""
    values = [_int(item.strip(), 1, "comma-separated positive integers") for item in text.split(",") if item.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def device(text: str) -> str:
    """A torch device string (``cpu``, ``cuda:0``, ...)."""
    import torch  # (only this type needs it: the commands import torch when they run)

    try:
        torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"expected a torch device (cpu, cuda, cuda:0, ...), got {text!r}") from None
    return text
