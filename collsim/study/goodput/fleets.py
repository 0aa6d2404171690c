"""Fleet failure rates: the published ones shipped with collsim, or a user's file.

A fleet is a total failure rate per 1,000 node-days with its source. A scenario is put at a
fleet's rate by scaling every failure component of its ``reliability`` section by one factor
(the split by cause, the correlated events and what each takes down kept as written), so that
their sum is the fleet's rate (:func:`at_rate`). The shipped fleets
(``collsim/data/fleet_failure_rates.yaml``, copied from the reliability reference with their
sources) are ordered by rate and named low, central and high (:func:`levels`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from collsim.core.errors import ConfigError
from collsim.core.yamlio import load_yaml

if TYPE_CHECKING:  # pragma: no cover
    from collsim.study.goodput.config import ReliabilityConfig

__all__ = [
    "Fleet",
    "PUBLISHED",
    "published_fleets",
    "read_fleets",
    "find_fleets",
    "at_rate",
    "levels",
]

#: The shipped table of published fleet rates.
PUBLISHED = Path(__file__).resolve().parents[2] / "data" / "fleet_failure_rates.yaml"


@dataclass(frozen=True, slots=True, kw_only=True)
class Fleet:
    """One fleet's failure rate."""

    name: str
    label: str
    per_1000_node_days: float
    source: str = ""
    status: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def published_fleets() -> list[Fleet]:
    """The fleets of :data:`PUBLISHED`, by rate (lowest first)."""
    return read_fleets(PUBLISHED)


def read_fleets(path: str | Path) -> list[Fleet]:
    """The fleets of a YAML file ``fleets: {NAME: {per_1000_node_days: X, label, source}}``,
    by rate (lowest first).

    Raises:
        ConfigError: the file cannot be read, or a fleet's rate is not a number > 0 (file, line,
            key path; exit 2).
    """

    doc = load_yaml(path)
    where = str(path)
    fleets = doc.data.get("fleets") if isinstance(doc.data, dict) else None
    if not isinstance(fleets, dict) or not fleets:
        raise ConfigError(
            "expected a mapping 'fleets' of NAME: {per_1000_node_days: X}",
            file=where,
            line=doc.line_of(("fleets",)),
            key_path="fleets",
        )
    out = []
    for name, entry in fleets.items():
        key = f"fleets.{name}"
        line = doc.line_of(("fleets", name))
        if not isinstance(entry, dict):
            raise ConfigError("expected a mapping", file=where, line=line, key_path=key)
        rate = entry.get("per_1000_node_days")
        if isinstance(rate, bool) or not isinstance(rate, int | float):
            raise ConfigError(
                f"expected a number, got {rate!r}",
                file=where,
                line=doc.line_of(("fleets", name, "per_1000_node_days")) or line,
                key_path=f"{key}.per_1000_node_days",
            )
        if not math.isfinite(rate) or rate <= 0:
            raise ConfigError(
                f"must be a finite number > 0, got {rate!r}",
                file=where,
                line=doc.line_of(("fleets", name, "per_1000_node_days")) or line,
                key_path=f"{key}.per_1000_node_days",
            )
        out.append(
            Fleet(
                name=str(name),
                label=str(entry.get("label", name)),
                per_1000_node_days=float(rate),
                source=" ".join(str(entry.get("source", "")).split()),
                status=str(entry.get("status", "")),
            )
        )
    return sorted(out, key=lambda f: f.per_1000_node_days)


def find_fleets(name_or_file: str) -> list[Fleet]:
    """``--fleet``: a shipped fleet by name, or the fleets of a YAML file.

    Raises:
        ConfigError: neither a shipped name nor a file (naming ``--fleet`` and the names).
    """
    shipped = published_fleets()
    for fleet in shipped:
        if fleet.name == name_or_file:
            return [fleet]
    path = Path(name_or_file)
    if path.suffix.lower() in (".yaml", ".yml") or path.exists():
        return read_fleets(path)
    names = ", ".join(f.name for f in shipped)
    raise ConfigError(
        f"no fleet {name_or_file!r}: give one of {names}, or a YAML file", key_path="--fleet"
    )


def at_rate(reliability: ReliabilityConfig, per_1000_node_days: float) -> ReliabilityConfig:
    """``reliability`` with every component's rate scaled by one factor so that they add up to
    ``per_1000_node_days``.

    Raises:
        ConfigError: the section's components add up to 0 (nothing to scale).
    """
    total = sum(c.per_1000_node_days for c in reliability.components)
    if total <= 0:
        raise ConfigError(
            "the failure rates add up to 0: no split by cause to put at a fleet's rate",
            key_path="reliability.components",
        )
    factor = per_1000_node_days / total
    components = tuple(
        dataclasses.replace(c, per_1000_node_days=c.per_1000_node_days * factor)
        for c in reliability.components
    )
    return dataclasses.replace(reliability, components=components)


def levels(fleets: list[Fleet]) -> list[tuple[str, Fleet]]:
    """The fleets by rate, named ``low``, ``central`` and ``high`` (three fleets); with two,
    low and high; otherwise by name."""
    ordered = sorted(fleets, key=lambda f: f.per_1000_node_days)
    if len(ordered) == 3:
        return list(zip(("low", "central", "high"), ordered, strict=True))
    if len(ordered) == 2:
        return list(zip(("low", "high"), ordered, strict=True))
    return [(f.name, f) for f in ordered]
