"""``collsim validate compare``: simulate the measured points and report the error of each."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from collsim.cli.common import OneLineCommand, check_output_path
from collsim.cli.validate.shared import _OP_HELP, _SUBSET, _op_option, _read_all, _size, vars_of
from collsim.core.errors import ConfigError

__all__ = ["compare"]


@click.command(cls=OneLineCommand)
@click.argument("measured", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--topology", required=True, help="Topology file or name to simulate on.")
@click.option("--subset", type=_SUBSET, default="all", show_default=True)
@click.option(
    "--min-size",
    "min_size",
    default="0",
    callback=_size,
    show_default=True,
    help="Summarise only sizes >= this.",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the log-log plot here (.png or .svg; default: no plot).",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
@click.option(
    "--csv",
    "csv_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the points in the collective CSV schema, with simulated_us and error.",
)
@click.option("--op", "op", default=None, callback=_op_option, help=_OP_HELP)
def compare(
    measured: tuple[str, ...],
    topology: str,
    subset: str,
    min_size: int,
    plot_path: str | None,
    json_path: str | None,
    csv_path: str | None,
    op: str | None,
) -> None:
    """Simulate exactly the measured points and print the error of each, plus a summary."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.check.compare import compare as run_compare
    from collsim.validate.check.compare import (
        format_comparison,
        plot_comparison,
        summarize,
        topology_for,
    )

    if len(measured) > 1 and (plot_path or json_path or csv_path):
        raise click.BadParameter(
            "give one measurement with --plot, --json or --csv", param_hint="MEASURED"
        )
    check_output_path(csv_path, "--csv", suffixes=(".csv",))
    check_output_path(plot_path, "--plot", suffixes=(".png", ".svg"))
    check_output_path(json_path, "--json", suffixes=(".json",))
    for meas in _read_all(measured, op):
        topo = topology_for(topology, meas)
        points = run_compare(meas, topo, subset=subset, min_bytes=min_size)
        if not points:
            raise ConfigError("no measured points in the selected sizes", file=meas.path)
        summary = summarize(points)
        click.echo(
            format_comparison(
                points,
                summary,
                header=(
                    f"{meas.path} (world size {meas.world_size}, {meas.num_nodes} node(s)) vs "
                    f"{topo.name}, {subset} sizes >= {min_size} B; error = (simulated - "
                    f"measured) / measured"
                ),
            )
        )
        if plot_path:  # only where asked: never beside the measurement, never in the cwd
            plot_comparison(
                points,
                topo,
                plot_path,
                title=f"{Path(meas.path).name} vs {topo.name} (n={meas.world_size})",
            )
            click.echo(f"# wrote {plot_path}", err=True)
        if csv_path:
            _write_compared_csv(csv_path, meas, points, topology)
            click.echo(f"# wrote {csv_path}", err=True)
        if json_path:
            Path(json_path).write_text(
                json.dumps(
                    {
                        "measured": meas.path,
                        "topology": topology,
                        "subset": subset,
                        "min_bytes": min_size,
                        "points": [
                            {
                                "op": p.op,
                                "size_bytes": p.size_bytes,
                                "measured_s": p.measured_s,
                                "simulated_s": p.simulated_s,
                                "error": p.error,
                                "algorithm": p.algorithm,
                            }
                            for p in points
                        ],
                        "summary": [vars_of(s) for s in summary],
                    },
                    indent=1,
                )
                + "\n"
            )
            click.echo(f"# wrote {json_path}", err=True)


def _write_compared_csv(path: str, meas: Any, points: list[Any], topology: str) -> None:
    """The compared points as schema rows: the measured row, the simulator's choice as
    algorithm/protocol, simulated_us and error."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.data.dataset import write_measurements

    rows = []
    by_key: dict[tuple[str, int], dict[str, Any]] = {}
    for row in meas.rows:
        by_key.setdefault((row["op"], int(row["size_bytes"])), row)
    for p in points:
        row = dict(by_key[(p.op, p.size_bytes)])
        row["time_us"] = p.measured_s * 1e6
        row.update(
            algorithm=p.algorithm,
            protocol=p.protocol,
            simulated_us=p.simulated_s * 1e6,
            error=p.error,
        )
        row.setdefault("nodes", meas.num_nodes)
        rows.append(row)
    metadata = {
        "tool": "collsim validate compare",
        "measured": meas.path,
        "topology": topology,
        "world_size": meas.world_size,
        "ranks_per_node": meas.ranks_per_node,
        "num_nodes": meas.num_nodes,
    }
    if not path.endswith(".csv"):
        raise ConfigError(f"must end in .csv, got {Path(path).name!r}", key_path="--csv")
    write_measurements(path, rows, metadata)
