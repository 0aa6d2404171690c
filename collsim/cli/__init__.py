"""The ``collsim`` command: a thin click group over library calls.

Subcommands live in their own modules under ``collsim.cli`` and are imported only when used, so
that ``collsim run`` does not pay for matplotlib or torch. Errors are mapped to exit codes here,
at the edge, and nowhere else: every :class:`~collsim.core.errors.CollsimError` declares its own
``exit_code`` (ConfigError 2, InfeasibleError 1, UnavailableError 3, ...), which
:class:`LazyGroup` turns into a click exception that prints the error's lines and exits with
that code, whether the group runs from :func:`main` or from click's test runner. Click usage
errors exit 2 with one ``error:`` line too (:class:`collsim.cli.common.OneLineUsageError`).
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
from typing import Any

import click

from collsim import __version__
from collsim.core.errors import CollsimError, SimulationError, UnavailableError

__all__ = ["main", "cli"]

#: subcommand name -> "module:attribute" of its click command.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "collective": (
        "collsim.cli.collective:collective",
        "Time one collective over a size sweep (nccl-tests style).",
    ),
    "run": ("collsim.cli.run:run", "Simulate one training step of a scenario."),
    "sweep": ("collsim.cli.sweep:sweep", "Sweep GPU count or scenario keys."),
    "search": ("collsim.cli.search:search", "Search feasible parallel plans."),
    "goodput": (
        "collsim.cli.goodput:goodput",
        "Goodput of a long run: failures, checkpoints, restarts (closed form + Monte Carlo).",
    ),
    "plot": ("collsim.cli.plot:plot", "Draw scaling, memory, pipeline and collective plots."),
    "schema": (
        "collsim.cli.schema:schema",
        "Print the JSON Schema of scenario, topology or device files.",
    ),
    "validate": (
        "collsim.cli.validate:validate",
        "Measure collectives and steps with torch.distributed and compare.",
    ),
}


class CollsimExit(click.ClickException):
    """A :class:`CollsimError` as click sees it: its lines on stderr, its own exit code."""

    def __init__(self, error: CollsimError) -> None:
        super().__init__(str(error))
        self.error = error
        object.__setattr__(self, "exit_code", error.exit_code)  # click's is a ClassVar

    def show(self, file: Any = None) -> None:
        for line in self.error.lines():
            click.echo(line, err=True, file=file)


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use."""

    def invoke(self, ctx: click.Context) -> Any:
        """Run the subcommand; a CollsimError becomes its exit code (a SimulationError, a bug,
        keeps its traceback)."""
        # start-up: loaded only when this runs (--help and bad input stay fast)
        from collsim.cli.common import one_line_usage_errors

        try:
            with one_line_usage_errors():
                return super().invoke(ctx)
        except SimulationError:
            raise
        except CollsimError as exc:
            raise CollsimExit(exc) from None

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # start-up: loaded only when this runs (--help and bad input stay fast)
        from collsim.cli.common import one_line_usage_errors

        with one_line_usage_errors():
            return super().parse_args(ctx, args)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        # start-up: loaded only when this runs (--help and bad input stay fast)
        from collsim.cli.common import one_line_usage_errors

        with one_line_usage_errors():
            return super().resolve_command(ctx, args)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = SUBCOMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, attr = target[0].split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("collsim"):
                return _not_yet(cmd_name, target[1])
            raise
        command: click.Command = getattr(module, attr)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, SUBCOMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def _not_yet(name: str, help_text: str) -> click.Command:
    @click.command(
        name=name,
        help=help_text,
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    )
    def stub() -> None:
        raise UnavailableError(f"collsim {name}: not yet available in this version")

    return stub


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="collsim")
def cli() -> None:
    """collsim: simulate collectives and training steps on GPU clusters, then check them."""


#: The variables OpenBLAS reads for its thread count, highest precedence first (OpenBLAS
#: README, "Setting the number of threads using environment variables").
BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")


def one_blas_thread() -> None:
    """Ask numpy's OpenBLAS for one thread, unless the user chose a count or numpy is loaded.

    OpenBLAS starts one thread per core when numpy is imported; collsim's numpy work is
    element-wise on small arrays and never reaches a threaded BLAS kernel, while starting those
    threads cost a third of the CPU time of ``import numpy, simpy, click, yaml`` (OpenBLAS
    0.3.31; docs/derivations.md, measurements). Child processes inherit the setting.
    """
    if "numpy" in sys.modules or any(name in os.environ for name in BLAS_THREAD_VARIABLES):
        return
    os.environ["OPENBLAS_NUM_THREADS"] = "1"


def main(argv: list[str] | None = None) -> Any:
    """Console entry point: runs the group; errors leave with their class's exit code.

    Without ``argv`` it is the ``collsim`` process itself (arguments from ``sys.argv``): numpy
    is asked for one BLAS thread (:func:`one_blas_thread`) and, once the command is done, the
    garbage collector is frozen, so that the interpreter's shutdown does not walk every object
    left (the process is ending; the memory goes back with it). ``collsim validate`` runs as
    it is: it times torch, which sets its own thread counts (:mod:`collsim.validate.measure.launch`,
    :mod:`collsim.validate.measure.compute`), and its ranks write files.
    """
    command = next((arg for arg in sys.argv[1:] if not arg.startswith("-")), None)
    if argv is not None or command == "validate":
        return _main(argv)
    one_blas_thread()
    try:
        return _main(None)
    finally:
        gc.freeze()


def _main(argv: list[str] | None) -> Any:
    try:
        return cli.main(args=argv, prog_name="collsim", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except SimulationError:
        raise
    except CollsimError as exc:  # raised outside a subcommand (a library call): the same map
        CollsimExit(exc).show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
