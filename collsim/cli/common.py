"""Helpers shared by the CLI subcommands: one-line usage errors, output paths checked early.

click prints a usage block, a "Try --help" line and ``Error: ...`` for a usage error; collsim's
rule for bad input is one ``error: ...`` line naming the option, exit 2, so these classes turn
click's usage errors into :class:`OneLineUsageError`, which prints that line alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from collsim.core.errors import ConfigError

if TYPE_CHECKING:
    from collsim.study.limits import Limits

__all__ = [
    "OneLineUsageError",
    "one_line_usage_errors",
    "OneLineCommand",
    "OneLineGroup",
    "check_output_path",
    "check_outputs",
    "limit_options",
    "limits_from_options",
    "FRAME_SUFFIXES",
    "check_frame_path",
    "write_frame",
]

#: What ``-o`` of a table-writing command (sweep, search) may end in.
FRAME_SUFFIXES = (".csv", ".json", ".parquet")


class OneLineUsageError(click.UsageError):
    """A click usage error as collsim prints bad input: ``error: MESSAGE`` on stderr, exit 2."""

    def __init__(self, message: str) -> None:
        super().__init__(message, ctx=None)

    def show(self, file: Any = None) -> None:
        message = " ".join(self.format_message().split())
        # click's messages start with a capital ("Invalid value for ..."); collsim's do not
        if message[:1].isupper() and message[1:2].islower():
            message = message[0].lower() + message[1:]
        click.echo(f"error: {message}", err=True, file=file)


@contextlib.contextmanager
def one_line_usage_errors() -> Iterator[None]:
    """Turn a click usage error raised inside into :class:`OneLineUsageError`."""
    try:
        yield
    except (OneLineUsageError, click.exceptions.NoArgsIsHelpError):
        raise  # the second: a group called bare prints its help, as click does
    except click.UsageError as exc:
        raise OneLineUsageError(exc.format_message()) from None


_usage_error_alone = one_line_usage_errors


class OneLineCommand(click.Command):
    """A command whose usage errors print as one ``error: ...`` line, without the usage block."""

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


def check_output_path(
    path: str | Path | None, key_path: str, *, suffixes: tuple[str, ...] = ()
) -> None:
    """Fail before any work if ``path`` cannot be written as a file.

    The rules: its folder exists (no command creates folders the user did not ask for) and a
    file can be made in it; the path itself is not a folder, and if it exists it can be
    opened for writing; its
    suffix is one of ``suffixes`` when given (``.json.gz`` counts as ``.gz``). Used by every
    command that writes a file (``run --json/--trace/--plot``, ``sweep -o``, ``search -o``,
    ``plot -o``, ``validate bench -o``, ``calibrate -o``, ``compare -o``).

    Raises:
        ConfigError: one of the rules is broken (exit 2), naming the option.
    """
    if path is None:
        return
    target = Path(path)
    if suffixes and target.suffix.lower() not in suffixes:
        raise ConfigError(
            f"must end in {' or '.join(suffixes)}, got {target.name!r}", key_path=key_path
        )
    try:
        _check_writable(target, key_path)
    except OSError as exc:  # a name too long, a loop of links, ... found on the way
        raise ConfigError(
            f"cannot write to {str(target)!r}: {exc.strerror or exc}", key_path=key_path
        ) from None
    except RuntimeError:  # pathlib's resolve() on a loop of symbolic links (Python < 3.13)
        raise ConfigError(
            f"cannot write to {str(target)!r}: a loop of symbolic links", key_path=key_path
        ) from None


def _check_writable(target: Path, key_path: str) -> None:
    # start-up: loaded only when this runs (--help and bad input stay fast)
    import os
    import stat

    parent = target.resolve().parent
    name_max = os.pathconf(parent, "PC_NAME_MAX") if parent.is_dir() else 255
    if len(os.fsencode(target.name)) > name_max:
        raise ConfigError(
            f"the file name is {len(os.fsencode(target.name))} bytes, longer than the "
            f"{name_max} the file system allows",
            key_path=key_path,
        )
    if target.exists() and not target.is_dir():
        mode = target.stat().st_mode
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISBLK(mode):
            # opening a named pipe for writing waits for a reader: never start that
            raise ConfigError(
                f"{str(target)!r} is a pipe, socket or block device, not a file", key_path=key_path
            )
    if not parent.is_dir():
        raise ConfigError(f"folder {str(parent)!r} does not exist", key_path=key_path)
    if target.is_dir():
        raise ConfigError(f"{str(target)!r} is a folder, not a file", key_path=key_path)
    # Permission bits do not tell (root may write anywhere, /proc refuses everyone): try it.
    # An existing file is opened for appending (not truncated); otherwise a scratch file is
    # made in the folder and removed.
    try:
        if target.exists():
            with target.open("a"):
                pass
        else:
            # start-up: loaded only when this runs (--help and bad input stay fast)
            import tempfile

            with tempfile.NamedTemporaryFile(dir=parent, prefix=".collsim-probe-"):
                pass
    except OSError as exc:
        where = str(target) if target.exists() else f"folder {str(parent)!r}"
        raise ConfigError(
            f"cannot write to {where}: {exc.strerror or exc}", key_path=key_path
        ) from None


def check_outputs(
    outputs: dict[str, str | Path | None], *, inputs: tuple[str | Path, ...] | list[Any] = ()
) -> None:
    """Fail before any work if an output of a command is one of its inputs, or two of its
    outputs are the same file (``run s.yaml --json s.yaml``, ``--json x --trace x``).

    Args:
        outputs: option -> path (None: not asked for).
        inputs: the files the command reads.

    Raises:
        ConfigError: naming the option whose file would overwrite an input or another output.
    """
    taken: dict[Path, str] = {}
    for given in inputs:
        if given is not None:
            taken.setdefault(_identity(given), f"the input {str(given)!r}")
    for key_path, path in outputs.items():
        if path is None:
            continue
        ident = _identity(path)
        if ident in taken:
            raise ConfigError(
                f"{str(path)!r} is the same file as {taken[ident]}; writing it would "
                "overwrite that: choose another name",
                key_path=key_path,
            )
        taken[ident] = key_path


def _identity(path: str | Path) -> Path:
    """What names a file, however it is spelled: the real path, with links resolved (and the
    device and inode of an existing file, so that hard links match too)."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    import os

    target = Path(path)
    try:
        info = target.stat()
        return Path(f"/inode/{info.st_dev}/{info.st_ino}")
    except OSError:
        return Path(os.path.realpath(target))


def limit_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Add the ``--max-gpus/--max-layers/--max-microbatches/--max-events/--max-memory-gib``
    options (:class:`collsim.study.limits.Limits`), passed to the command as ``limit_values``."""
    specs: list[tuple[str, type, str]] = [
        ("max_gpus", int, "Refuse clusters of more GPUs (default 262,144)."),
        ("max_layers", int, "Refuse models of more layers (default 10,000)."),
        ("max_microbatches", int, "Refuse more micro-batches per replica (default 1,000,000)."),
        ("max_events", int, "Refuse steps estimated at more simulation events (default 4e6)."),
        ("max_memory_gib", float, "Refuse runs estimated to need more GiB (default 8)."),
    ]

    def collect(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        ctx.meta.setdefault("collsim.study.limits", {})[param.name] = value
        return value

    for name, kind, text in reversed(specs):
        fn = click.option(
            "--" + name.replace("_", "-"),
            name,
            type=click.IntRange(min=1) if kind is int else click.FloatRange(min=0, min_open=True),
            default=None,
            expose_value=False,
            callback=collect,
            help=text,
        )(fn)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx = click.get_current_context()
        kwargs["limit_values"] = dict(ctx.meta.get("collsim.study.limits", {}))
        return fn(*args, **kwargs)

    # start-up: loaded only when this runs (--help and bad input stay fast)
    import functools

    return functools.wraps(fn)(wrapper)


def limits_from_options(values: dict[str, Any] | None) -> Limits:
    """The :class:`~collsim.study.limits.Limits` of the ``--max-*`` options (unset ones default)."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.study.limits import Limits

    given = {k: v for k, v in (values or {}).items() if v is not None}
    return Limits(**given)


def check_frame_path(path: str | Path | None, key_path: str) -> None:
    """:func:`check_output_path` for a table: ``.csv``, ``.json`` or ``.parquet`` (this one
    only where pyarrow is installed).

    Raises:
        ConfigError: another suffix, a missing folder, or parquet without pyarrow (exit 2).
    """
    check_output_path(path, key_path, suffixes=FRAME_SUFFIXES)
    if path is not None and Path(path).suffix.lower() == ".parquet":
        # start-up: loaded only when this runs (--help and bad input stay fast)
        import importlib.util

        if importlib.util.find_spec("pyarrow") is None:
            raise ConfigError(
                "writing .parquet needs pyarrow: pip install pyarrow (or use .csv or .json)",
                key_path=key_path,
            )


def write_frame(frame: Any, path: str | Path) -> None:
    """Write a pandas frame as its suffix says: CSV, JSON (records, one object per row, the
    units of the column names: seconds, bytes) or Parquet.

    Raises:
        ConfigError: the file cannot be written.
    """
    target = Path(path)
    suffix = target.suffix.lower()
    try:
        if suffix == ".json":
            frame.to_json(target, orient="records", indent=1)
        elif suffix == ".parquet":
            frame.to_parquet(target, index=False)
        else:
            frame.to_csv(target, index=False)
    except OSError as exc:
        raise ConfigError(f"cannot write: {exc.strerror}", file=str(target)) from None
