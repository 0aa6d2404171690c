"""What the schedule tests share."""

from __future__ import annotations


def float_bits(x: object) -> object:
    """``x`` (floats in dicts, lists and tuples) with every float as its bits (``float.hex``:
    -0.0 is not 0.0), for results compared bit for bit."""
    if isinstance(x, float):
        return x.hex()
    if isinstance(x, dict):
        return {k: float_bits(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [float_bits(v) for v in x]
    return x
