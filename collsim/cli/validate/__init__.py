"""``collsim validate``: measure with torch.distributed, calibrate a topology, compare.

Thin wrappers over :mod:`collsim.validate`, one module per command; torch is imported only by
the subcommands that run ranks. A rank that fails ends the command with exit code 1 and a
message naming the rank (:class:`~collsim.validate.measure.launch.RankFailure` carries its
code; ``collsim.cli`` maps it). Every output path is checked before anything is measured; no
command creates a folder it was not given (``holdout --out-dir`` creates that one folder,
inside an existing one).
"""

from __future__ import annotations

import click

from collsim.cli.common import OneLineGroup
from collsim.cli.validate.bench import bench
from collsim.cli.validate.calibrate import calibrate
from collsim.cli.validate.compare import compare
from collsim.cli.validate.compute import compute
from collsim.cli.validate.holdout import holdout
from collsim.cli.validate.kernels import kernels
from collsim.cli.validate.sketch import ddp, fsdp
from collsim.cli.validate.step import step
from collsim.cli.validate.trace import trace_command

__all__ = ["validate"]


@click.group(cls=OneLineGroup)
def validate() -> None:
    """Measure collectives and training steps with torch.distributed and compare with collsim."""


for _command in (
    bench,
    ddp,
    fsdp,
    calibrate,
    compare,
    holdout,
    step,
    compute,
    kernels,
    trace_command,
):
    validate.add_command(_command)
