"""The ``-o`` journal of sweeps and searches: whole-file writes, throttled, read back."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from collsim.cli.journal import FrameJournal, read_frame
from collsim.core.errors import ConfigError


def test_the_journal_writes_whole_tables_at_most_every_interval(tmp_path: Path) -> None:
    out = tmp_path / "rows.csv"
    rows: list[dict[str, float]] = []
    journal = FrameJournal(out, lambda: pd.DataFrame(rows), every_s=3600.0)
    rows.append({"x": 1.0})
    journal.update()  # the first write goes out at once
    assert len(pd.read_csv(out)) == 1
    rows.append({"x": 2.0})
    journal.update()  # within the interval: not yet
    assert len(pd.read_csv(out)) == 1
    journal.finish()
    pd.testing.assert_frame_equal(read_frame(out), pd.DataFrame(rows))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.csv"]  # no part file left


def test_by_default_each_row_is_written_as_it_arrives(tmp_path: Path) -> None:
    """The default journal (sweep and search ``-o``) writes the table when each row arrives,
    as long as a write takes under a tenth of the time between rows: a run killed between two
    rows keeps every row before."""
    import time

    out = tmp_path / "rows.csv"
    rows: list[dict[str, float]] = []
    journal = FrameJournal(out, lambda: pd.DataFrame(rows))
    for i in range(3):
        rows.append({"x": float(i)})
        journal.update()
        assert len(pd.read_csv(out)) == i + 1
        time.sleep(max(0.05, 10 * journal.took_s))  # rows arriving slower than ten writes


def test_no_output_no_file_and_a_bad_table_is_one_error(tmp_path: Path) -> None:
    journal = FrameJournal(None, lambda: pd.DataFrame({"x": [1]}))
    journal.update()
    journal.finish()
    assert list(tmp_path.iterdir()) == []
    assert read_frame(tmp_path / "missing.csv") is None
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="--resume"):
        read_frame(bad)
