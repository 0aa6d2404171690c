"""Helpers shared by the CLI subcommands: one-line usage errors, output paths checked early.

click prints a usage block and a "Try --help" line before a usage error; collsim's rule for bad
input at the CLI is one line naming the option, so these classes drop the context from the
error (click then prints the message alone) while keeping click's exit code 2.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from collsim.errors import ConfigError

__all__ = ["OneLineCommand", "OneLineGroup", "check_output_path"]


@contextlib.contextmanager
def _usage_error_alone() -> Iterator[None]:
    """Let a click usage error through without its context, so click prints the message alone."""
    try:
        yield
    except click.UsageError as exc:
        exc.ctx = None
        raise


class OneLineCommand(click.Command):
    """A command whose usage errors print as one ``Error: ...`` line, without the usage block."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        with _usage_error_alone():
            return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        with _usage_error_alone():
            return super().invoke(ctx)


class OneLineGroup(click.Group):
    """A group whose own usage errors and whose subcommands' are one line each."""

    command_class = OneLineCommand

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        with _usage_error_alone():
            return super().parse_args(ctx, args)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        with _usage_error_alone():
            return super().resolve_command(ctx, args)


def check_output_path(path: Path | None, key_path: str) -> None:
    """Fail before any work if ``path`` cannot be written: its folder must exist.

    Raises:
        ConfigError: the parent of ``path`` is not an existing directory.
    """
    if path is None:
        return
    parent = path.resolve().parent
    if not parent.is_dir():
        raise ConfigError(f"folder {str(parent)!r} does not exist", key_path=key_path)
