"""The grid of a sweep: the ``--gpus``, ``--set`` and ``--plan`` flags of ``collsim sweep``
parsed, and crossed into the points :func:`collsim.study.sweep.run_sweep` simulates.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from collsim.core.errors import ConfigError

__all__ = [
    "GROW_AXES",
    "SweepPoint",
    "parse_gpus",
    "parse_set",
    "parse_plan",
    "build_points",
]


GROW_AXES = ("dp", "tp", "pp")


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One point of a sweep: a GPU count (or None to keep the scenario's) and overrides."""

    label: str
    """Series label: the ``--set`` values of the point (``zero=3``), or the plan name."""
    num_gpus: int | None
    overrides: tuple[str, ...] = ()
    """``key.path=value`` strings applied to the scenario (not the GPU-count changes)."""
    values: tuple[tuple[str, Any], ...] = ()
    """The swept keys and their values, for the results frame."""


_INT = re.compile(r"^\s*\d+\s*$")


def parse_gpus(text: str) -> list[int]:
    """Parse a GPU-count list: ``64,128,256`` or with a literal ``...`` meaning doubling:
    ``64,128,...,4096`` = 64, 128, 256, ..., 4096 (the ratio of the two numbers before the
    ``...`` is the step; it must be a whole factor, usually 2, and reach the last number).

    Raises:
        ConfigError: not positive integers, a ``...`` without two numbers before it and one
            after, or a last number the progression does not reach (key path ``--gpus``).
    """
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts:
        raise ConfigError(
            "expected a comma-separated list of GPU counts, e.g. 64,128,...,4096", key_path="--gpus"
        )
    out: list[int] = []
    i = 0
    while i < len(parts):
        part = parts[i]
        if part in ("...", "…"):
            if len(out) < 2 or i + 1 >= len(parts) or not _INT.match(parts[i + 1]):
                raise ConfigError(
                    f"'...' needs two counts before it and one after, got {text!r}",
                    key_path="--gpus",
                )
            first, second, last = out[-2], out[-1], int(parts[i + 1])
            if second % first or second <= first:
                raise ConfigError(
                    f"'...' continues a geometric progression; {first},{second} is "
                    "not one (use e.g. 64,128,...,4096)",
                    key_path="--gpus",
                )
            factor = second // first
            value = second
            while value < last:
                value *= factor
                out.append(value)
            if value != last:
                raise ConfigError(
                    f"{first},{second},...,{last}: {last} is not {first} x {factor}^k",
                    key_path="--gpus",
                )
            i += 2
            continue
        if not _INT.match(part) or int(part) <= 0:
            raise ConfigError(
                f"GPU counts must be positive integers, got {part!r}", key_path="--gpus"
            )
        out.append(int(part))
        i += 1
    return list(dict.fromkeys(out))


def _split_values(raw: str) -> list[str]:
    """Split on commas outside brackets/braces/quotes (``[1,2],[3]`` is two YAML values)."""
    values: list[str] = []
    current: list[str] = []
    depth, quote = 0, ""
    for char in raw:
        if quote:
            if char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            values.append("".join(current).strip())
            current = []
            continue
        current.append(char)
    values.append("".join(current).strip())
    return values


def parse_set(text: str) -> tuple[str, list[str]]:
    """Parse one sweep ``--set key.path=v1,v2,...`` into the key and its value texts.

    Raises:
        ConfigError: no ``=``, an empty key or an empty value (key path: the key).
    """
    key, sep, raw = str(text).partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(
            "expected KEY.PATH=V1,V2,..., e.g. parallel.zero=0,1,2,3", file=f"--set {text}"
        )
    values = _split_values(raw)
    if any(not v for v in values):
        raise ConfigError(f"empty value in {raw!r}", key_path=key, file=f"--set {text}")
    return key, list(dict.fromkeys(values))


def parse_plan(text: str) -> tuple[str, list[str]]:
    """Parse one ``--plan "NAME: key=value, key=value"`` into its name and overrides.

    Raises:
        ConfigError: no ``:``, an empty name, or an override without ``=``.
    """
    name, sep, rest = str(text).partition(":")
    name = name.strip()
    if not sep or not name:
        raise ConfigError(
            "expected NAME: KEY=VALUE, KEY=VALUE, e.g. "
            "'DDP + overlap: parallel.zero=0, parallel.ddp.overlap=true'",
            file=f"--plan {text}",
        )
    overrides = [item for item in _split_values(rest) if item]
    bad = [item for item in overrides if "=" not in item]
    if bad:
        raise ConfigError(f"expected KEY=VALUE, got {bad[0]!r}", file=f"--plan {text}")
    return name, overrides


def _short_keys(keys: Sequence[str]) -> dict[str, str]:
    """Shortest unambiguous suffix of each dotted key (``parallel.zero`` -> ``zero``)."""
    out = {}
    for key in keys:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            short = ".".join(parts[-n:])
            if sum(1 for k in keys if k == short or k.endswith("." + short)) == 1:
                out[key] = short
                break
        else:
            out[key] = key
    return out


def build_points(
    *,
    gpus: Sequence[int] | None = None,
    sets: Sequence[tuple[str, Sequence[str]]] = (),
    plans: Mapping[str, Sequence[str]] | None = None,
) -> list[SweepPoint]:
    """The grid: every plan (or ``--set`` combination) at every GPU count.

    Args:
        gpus: GPU counts; None keeps the scenario's own.
        sets: ``(key, values)`` pairs; the product of their values is taken.
        plans: named override lists (``{"DDP": ["parallel.zero=0"], ...}``), crossed with
            ``sets`` too. The plan name leads the series label.
    """
    keys = [key for key, _ in sets]
    short = _short_keys(keys)
    combos = list(itertools.product(*[values for _, values in sets])) if sets else [()]
    plan_items = list((plans or {"": ()}).items())
    counts: list[int | None] = list(gpus) if gpus else [None]
    points = []
    for plan_name, plan_overrides in plan_items:
        for combo in combos:
            pairs = tuple(zip(keys, combo))
            label_parts = ([plan_name] if plan_name else []) + [f"{short[k]}={v}" for k, v in pairs]
            label = ", ".join(label_parts)
            overrides = tuple(plan_overrides) + tuple(f"{k}={v}" for k, v in pairs)
            for count in counts:
                points.append(
                    SweepPoint(label=label, num_gpus=count, overrides=overrides, values=pairs)
                )
    return points
