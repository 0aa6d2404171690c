"""Tables written as rows arrive (``-o`` of ``sweep``, ``search``), read back for ``--resume``.

:class:`FrameJournal` rewrites the output file from the rows so far each time a row arrives
(unless the writing would take more than a tenth of the run's time: then after as many rows as
keep it to that) and once more at the end or on Ctrl-C; each write goes to a
temporary file in the same folder that then replaces the output (``os.replace``), so a process
killed at any moment leaves the previous whole table, never a torn one. :func:`read_frame` reads
a table back for ``--resume`` (the suffixes :func:`collsim.cli.common.write_frame` writes).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from collsim.core.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["FrameJournal", "read_frame"]


class FrameJournal:
    """The output table of a run, rewritten from ``build()`` as rows arrive.

    Args:
        path: the output file (None: nothing is written).
        build: the table of the rows so far.
        every_s: the shortest time between two writes while the run goes on (0, the default:
            a write per row; longer when a write takes more than a tenth of it).
    """

    def __init__(
        self, path: Path | None, build: Callable[[], pd.DataFrame], *, every_s: float = 0.0
    ) -> None:
        self.path = path
        self.build = build
        self.every_s = every_s
        self.last = float("-inf")
        self.took_s = 0.0
        self.pending = False

    def update(self) -> None:
        """Rows arrived: write them unless the last write was under ``every_s`` ago."""
        self.pending = True
        # a table that takes long to write is written less often: at most a tenth of the time
        if time.monotonic() - self.last >= max(self.every_s, 10 * self.took_s):
            self.flush()

    def finish(self, *, rows: bool = True) -> None:
        """The last write, whatever the time since the one before (when there are ``rows``)."""
        self.pending = rows
        self.flush()

    def flush(self) -> None:
        """Write the table now (when rows arrived since the last write)."""
        if self.path is None or not self.pending:
            return
        # start-up: loaded only when this runs (--help and bad input stay fast)
        from collsim.cli.common import write_frame

        started = time.monotonic()
        frame = self.build()
        # the temporary file keeps the output's suffix: write_frame picks the format by it
        partial = self.path.with_name(f".{self.path.stem}.{os.getpid()}.part{self.path.suffix}")
        try:
            write_frame(frame, partial)
            os.replace(partial, self.path)
        finally:
            if partial.exists():
                partial.unlink()
        self.last = time.monotonic()
        self.took_s = self.last - started
        self.pending = False


def read_frame(path: Path, key_path: str = "--resume") -> pd.DataFrame | None:
    """The table an earlier run wrote at ``path``; None when there is no file yet.

    Raises:
        ConfigError: the file cannot be read as a table (exit 2).
    """
    # start-up: loaded only when this runs (--help and bad input stay fast)
    import pandas as pd

    if not path.exists():
        return None
    if not path.is_file():
        raise ConfigError("not a regular file", file=str(path), key_path=key_path)
    suffix = path.suffix.lower()
    try:
        if suffix == ".json":
            return pd.read_json(path, orient="records")
        if suffix == ".parquet":
            return pd.read_parquet(path)
        return pd.read_csv(path)
    except (ValueError, OSError) as exc:
        why = " ".join(str(exc).split())[:200]
        raise ConfigError(
            f"cannot read it back: {why}", file=str(path), key_path=key_path
        ) from None
