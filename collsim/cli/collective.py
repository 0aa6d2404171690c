"""``collsim collective``: time one collective over a size sweep, nccl-tests style.

Data go to stdout (a table with ``#`` header lines, CSV or JSON), messages to stderr. Sizes on
the command line are binary (``1M`` = 1 MiB) and bandwidths decimal (GB/s = 1e9 B/s), as in
nccl-tests.
"""

from __future__ import annotations

import json
import math
from typing import Any, cast

import click

from collsim.cli.common import OneLineCommand
from collsim.core.units import GB, parse_size
from collsim.core.vocab import NCCL_TESTS_TYPE_BYTES, CollectiveOp, Protocol

__all__ = ["collective", "sweep_sizes", "build_group"]

#: nccl-tests' reduction ops (src/common.cu ``test_opnames``, nccl-tests 2.19.6).
REDOPS = ("sum", "prod", "max", "min", "avg", "mulsum")
_REDUCING = {"all_reduce", "reduce_scatter", "reduce"}
_ROOTED = {"broadcast", "reduce"}
_PER_RANK_COUNT = {"all_gather", "reduce_scatter", "all_to_all"}


#: The most sizes one sweep may time: 10,000, over 300 times nccl-tests' default sweep (-b 8
#: -e 128M -f 2: 25 sizes); a sweep of more is refused before the first is timed.
MAX_SWEEP_SIZES = 10_000


def sweep_sizes(
    begin: int, end: int, factor: float, increment: int, max_sizes: int = MAX_SWEEP_SIZES
) -> list[int]:
    """nccl-tests sizes: begin, then x factor (or + increment when factor is 1) up to end.

    Raises:
        click.BadParameter: the sweep would hold more than ``max_sizes`` sizes (counted before
            the list is made when the step is an increment).
    """
    if factor == 1 and increment > 0 and (end - begin) // increment + 1 > max_sizes:
        raise _too_many_sizes((end - begin) // increment + 1, max_sizes)
    sizes: list[int] = []
    size = begin
    while size <= end:
        if len(sizes) == max_sizes:
            raise _too_many_sizes(None, max_sizes)
        sizes.append(size)
        nxt = size + increment if factor == 1 or size == 0 else int(size * factor)
        if nxt <= size:
            break
        size = nxt
    return sizes


def _too_many_sizes(count: int | None, max_sizes: int) -> click.BadParameter:
    many = f"{count:,} sizes" if count is not None else f"more than {max_sizes:,} sizes"
    return click.BadParameter(
        f"the sweep from -b to -e holds {many}, above the limit of {max_sizes:,} per sweep; "
        "use a larger -f or -i, or a narrower -b/-e",
        param_hint="-b/-e/-f/-i",
    )


def _say_why_the_sweep_stops(
    sizes: list[int], maxbytes: int, factor: float, increment: int
) -> None:
    """A note on stderr when the sizes stop growing before -e (``-f 1.5 -b 1``: 1 x 1.5 rounds
    down to 1 byte), so that a short table is not a surprise."""
    if not sizes or sizes[-1] >= maxbytes:
        return
    last = sizes[-1]
    if factor == 1 or last == 0:
        return
    nxt = int(last * factor)
    if nxt <= last:
        click.echo(
            f"note: the sweep stops at {last} B, before -e {maxbytes}: the next size, "
            f"{last} x {factor:g} = {last * factor:g} B, rounds down to {nxt} B and does not "
            f"grow (use a larger -b, or -f 2)",
            err=True,
        )


def build_group(topology_spec: str, gpus: int | None, nodes: int | None) -> Any:
    """Load the topology for the requested shape and return the group of ranks.

    ``--gpus`` is the number of ranks in the group; ``--nodes`` the number of nodes they span
    (default: as few as hold them). On a loopback topology ``--gpus`` sets the rank count.
    """
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.cluster.topology import load_topology
    from collsim.collectives import Group
    from collsim.core.vocab import Interconnect

    probe = load_topology(topology_spec, nodes=1)
    per_node_max = probe.gpus_per_node
    if probe.intra.interconnect is Interconnect.LOOPBACK and gpus is not None:
        per_node_max = -(-gpus // (nodes or 1))
    if gpus is None:
        num_nodes = nodes or probe.num_nodes
        gpus = num_nodes * per_node_max
    else:
        num_nodes = nodes or -(-gpus // per_node_max)
    if gpus % num_nodes:
        raise click.BadParameter(
            f"{gpus} GPUs do not spread evenly over {num_nodes} nodes", param_hint="--gpus"
        )
    per_node = gpus // num_nodes
    if per_node > per_node_max:
        raise click.BadParameter(
            f"{per_node} GPUs per node asked, a {probe.name} node has {per_node_max}",
            param_hint="--gpus",
        )
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.study.limits import check_ranks

    check_ranks(
        num_nodes * per_node_max, key_path="--nodes/--gpus", option=None
    )  # before building it
    topo = load_topology(topology_spec, nodes=num_nodes, gpus_per_node=per_node_max)
    ranks = tuple(
        node * per_node_max + local for node in range(num_nodes) for local in range(per_node)
    )
    return Group(topo, ranks)


def _size(ctx: click.Context, param: click.Parameter, value: str) -> int:
    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.command(name="collective", cls=OneLineCommand)
@click.option(
    "--topology",
    "topology_spec",
    required=True,
    help="Topology YAML file or name in topologies/ (dgx_h100, localhost, ...).",
)
@click.option(
    "--nodes",
    type=click.IntRange(min=1),
    default=None,
    help="Nodes the group spans (default: as few as hold --gpus).",
)
@click.option(
    "--gpus",
    type=click.IntRange(min=1),
    default=None,
    help="Ranks in the group (default: every GPU of --nodes nodes).",
)
@click.option(
    "--op",
    "op_name",
    default="all_reduce",
    show_default=True,
    type=click.Choice([op.value for op in CollectiveOp]),
)
@click.option(
    "--algo",
    "algo_name",
    default="auto",
    show_default=True,
    type=click.Choice(
        ["auto", "ring", "tree", "halving_doubling", "direct", "hierarchical", "nvls"]
    ),
)
@click.option(
    "--protocol",
    "protocol_name",
    default=None,
    type=click.Choice([p.value for p in Protocol]),
    help="Force a protocol.",
)
@click.option(
    "--dtype",
    "-d",
    default="float",
    show_default=True,
    type=click.Choice(sorted(NCCL_TESTS_TYPE_BYTES)),
)
@click.option(
    "--redop",
    "-o",
    default="sum",
    show_default=True,
    type=click.Choice(list(REDOPS)),
    help="Reduction op, as nccl-tests -o (printed; every reduction costs the same here).",
)
@click.option(
    "--root",
    "-r",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="Root rank of broadcast and reduce, as nccl-tests -r.",
)
@click.option(
    "--minbytes",
    "-b",
    default="8",
    callback=_size,
    show_default=True,
    help="Smallest size (binary K/M/G).",
)
@click.option(
    "--maxbytes",
    "-e",
    default="128M",
    callback=_size,
    show_default=True,
    help="Largest size (binary K/M/G).",
)
@click.option(
    "--stepfactor",
    "-f",
    default=2.0,
    type=click.FloatRange(min=1.0),
    show_default=True,
    help="Multiply the size by this at each step.",
)
@click.option(
    "--stepbytes",
    "-i",
    default="1M",
    callback=_size,
    show_default=True,
    help="Add this at each step when -f is 1.",
)
@click.option(
    "--mode",
    default="closed",
    show_default=True,
    type=click.Choice(["closed", "des"]),
    help="Closed form or discrete-event run.",
)
@click.option(
    "--format",
    "-F",
    "fmt",
    default="table",
    show_default=True,
    type=click.Choice(["table", "csv", "json"]),
)
def collective(
    topology_spec: str,
    nodes: int | None,
    gpus: int | None,
    op_name: str,
    algo_name: str,
    protocol_name: str | None,
    dtype: str,
    redop: str,
    root: int,
    minbytes: int,
    maxbytes: int,
    stepfactor: float,
    stepbytes: int,
    mode: str,
    fmt: str,
) -> None:
    """Time one collective over a size sweep (nccl-tests style)."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    import simpy

    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.cluster.network import FlowNetwork
    from collsim.collectives import CollectiveCost, cost, simulate

    if minbytes > maxbytes:
        raise click.BadParameter(f"-b {minbytes} is larger than -e {maxbytes}", param_hint="-b/-e")
    if not math.isfinite(stepfactor):
        raise click.BadParameter(f"must be a finite number >= 1, got {stepfactor}", param_hint="-f")
    if stepfactor == 1 and stepbytes == 0:
        raise click.BadParameter("must be > 0 when -f is 1", param_hint="-i")
    group = build_group(topology_spec, gpus, nodes)
    topo = group.topology
    n = group.size
    if op_name == "send_recv" and n < 2:
        # nccl-tests' sendrecv sends to the next rank; with one rank there is no link to time
        raise click.BadParameter(
            f"send_recv needs at least 2 ranks (a sender and a receiver), got {n}",
            param_hint="--gpus/--nodes",
        )
    if op_name in _ROOTED and root >= n:
        raise click.BadParameter(f"must be < the {n} ranks, got {root}", param_hint="-r/--root")
    word = NCCL_TESTS_TYPE_BYTES[dtype]
    align = word * (n if op_name in _PER_RANK_COUNT else 1)
    rows = []
    sizes = sweep_sizes(minbytes, maxbytes, stepfactor, stepbytes)
    _say_why_the_sweep_stops(sizes, maxbytes, stepfactor, stepbytes)
    for requested in sizes:
        size = requested // align * align
        if mode == "closed":
            result = cost(op_name, size, group, algo_name, protocol_name)
        else:
            env = simpy.Environment()
            net = FlowNetwork(env, topo)
            proc = simulate(env, net, op_name, size, group, algo_name, protocol=protocol_name)
            env.run(proc)
            result = cast(CollectiveCost, proc.value)  # the process returns its cost
        count = size // word // (n if op_name in _PER_RANK_COUNT else 1)
        rows.append(
            {
                "size_bytes": size,
                "count": count,
                "type": dtype,
                "redop": redop if op_name in _REDUCING else "none",
                "root": root if op_name in _ROOTED else -1,
                "time_us": result.time_s * 1e6,
                "algbw_GBps": result.algbw_bps / GB,
                "busbw_GBps": result.busbw_bps / GB,
                "algorithm": result.label,
                "protocol": result.label.partition("/")[2],
            }
        )
    click.echo(
        f"collsim collective: {op_name}, {n} ranks on {topo.describe()}, "
        f"{'closed form' if mode == 'closed' else 'discrete-event simulation'}",
        err=True,
    )
    if fmt == "csv":
        click.echo(_csv(rows, op_name, n, topo, mode), nl=False)
    elif fmt == "json":
        click.echo(
            json.dumps(
                {
                    "op": op_name,
                    "topology": topo.name,
                    "nodes": topo.num_nodes,
                    "ranks": n,
                    "mode": mode,
                    "algorithm": algo_name,
                    "rows": rows,
                },
                indent=2,
            )
        )
    else:
        click.echo(_table(rows, op_name, n, topo.describe()))


def _csv(rows: list[dict[str, Any]], op_name: str, n: int, topo: Any, mode: str) -> str:
    """The rows in the collective CSV schema (:mod:`collsim.validate.data.dataset`)."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.data.dataset import csv_preamble, csv_row

    metadata = {
        "tool": "collsim collective",
        "topology": topo.name,
        "mode": mode,
        "op": op_name,
        "world_size": n,
        "num_nodes": topo.num_nodes,
        "ranks_per_node": n // topo.num_nodes,
    }
    out = [csv_preamble(metadata)]
    for r in rows:
        out.append(
            csv_row(
                {
                    "op": op_name,
                    "size_bytes": r["size_bytes"],
                    "count": r["count"],
                    "type": r["type"],
                    "redop": r["redop"],
                    "root": r["root"],
                    "world_size": n,
                    "nodes": topo.num_nodes,
                    "algorithm": r["algorithm"].partition("/")[0],
                    "protocol": r["protocol"],
                    "time_us": round(r["time_us"], 3),
                    "algbw_gbps": round(r["algbw_GBps"], 4),
                    "busbw_gbps": round(r["busbw_GBps"], 4),
                }
            )
        )
    return "".join(out)


def _table(rows: list[dict[str, Any]], op_name: str, n: int, where: str) -> str:
    lines = [
        f"# collsim collective: {op_name}, {n} ranks, {where}",
        "#",
        f"# {'size':>12} {'count':>12} {'type':>8} {'redop':>6} {'root':>6} "
        f"{'time':>10} {'algbw':>8} {'busbw':>8}  algorithm",
        f"# {'(B)':>12} {'(elements)':>12} {'':>8} {'':>6} {'':>6} "
        f"{'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8}",
    ]
    for r in rows:
        lines.append(
            f"  {r['size_bytes']:>12} {r['count']:>12} {r['type']:>8} {r['redop']:>6} "
            f"{r['root']:>6} {r['time_us']:>10.2f} {r['algbw_GBps']:>8.2f} "
            f"{r['busbw_GBps']:>8.2f}  {r['algorithm']}"
        )
    avg = sum(r["busbw_GBps"] for r in rows) / len(rows) if rows else 0.0
    lines.append(f"# Avg bus bandwidth    : {avg:.3f}")
    return "\n".join(lines)
