"""Option callbacks, limits and readers shared by the ``collsim validate`` commands."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from collsim.core.errors import ConfigError


def _size(ctx: click.Context, param: click.Parameter, value: str) -> int:
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.core.units import parse_size

    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


_SUBSET = click.Choice(["all", "even", "odd"])


_FABRIC_KINDS = ("nccl-tests", "nccl-tests-json", "rccl-tests")


def _check_output(path: str | None, hint: str) -> None:
    """An output file's folder must exist (checked before any work; none is created)."""
    if path is not None and not Path(path).resolve().parent.is_dir():
        raise click.BadParameter(
            f"folder {str(Path(path).parent)!r} does not exist", param_hint=hint
        )


#: The most rows one measured file may hold for calibrate, holdout and compare: every row is
#: fitted (a robust line per knee candidate, time linear in the rows) or simulated. A bench of
#: every op and 40 sizes has about 300 rows (the time calibrate took on a large file:
#: docs/derivations.md, Measurements).
MAX_MEASURED_ROWS = 5_000


def _read_all(paths: tuple[str, ...] | list[str], op: str | None = None) -> list[Any]:
    """The measured files, each of at most :data:`MAX_MEASURED_ROWS` rows (ConfigError)."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.data.dataset import read_measurements

    files = [read_measurements(path, op) for path in paths]
    for meas in files:
        if len(meas.rows) > MAX_MEASURED_ROWS:
            raise ConfigError(
                f"{len(meas.rows):,} measured rows, above the limit of {MAX_MEASURED_ROWS:,} "
                "per file (a bench of every op and size has a few hundred); split the file",
                file=meas.path,
            )
    return files


def _op_option(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--op``: collsim's name of the collective (nccl-tests' spellings accepted)."""
    if value is None:
        return None
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.data.dataset import OPS, canonical_op

    op = canonical_op(value)
    if op is None:
        raise click.BadParameter(f"unknown op {value!r} (choose from {', '.join(OPS)})")
    return op


_OP_HELP = (
    "The collective of logs that do not say (rccl-tests and older nccl-tests print no "
    "'Collective test starting' line), e.g. all_reduce."
)


def _is_fabric(files: list[Any], base: str | None) -> bool:
    """An NCCL multi-node fit: nccl-tests input, or an NCCL base topology."""
    if any(m.kind in _FABRIC_KINDS for m in files):
        return True
    if base is None:
        return False
    return _library(base) == "nccl"


def _library(base: str) -> str:
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.cluster.topology import resolve_topology_path
    from collsim.core.yamlio import load_yaml

    doc = load_yaml(resolve_topology_path(base))
    return str((doc.data.get("collectives") or {}).get("library", "nccl"))


def vars_of(obj: Any) -> dict[str, Any]:
    """A slotted dataclass as a dict."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from dataclasses import asdict

    return asdict(obj)
