"""Every plot: labelled axes, one line or bar group per series, reference lines, valid files."""

from __future__ import annotations

import struct
import xml.etree.ElementTree as ET
from pathlib import Path

import pandas as pd
import pytest
from matplotlib.collections import PolyCollection
from matplotlib.container import BarContainer

from collsim.core.errors import ConfigError
from collsim.report.frames import MEMORY_COLUMNS, results_frame
from collsim.report.plots import (
    plot_breakdown,
    plot_collectives,
    plot_memory,
    plot_memory_timeline,
    plot_pipeline,
    plot_scaling,
    save_figure,
    scaling_table,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 200 and height > 150
    return width, height


def assert_svg(path: Path) -> None:
    root = ET.parse(path).getroot()
    assert root.tag.endswith("svg")


def scaling_frame(result_factory) -> pd.DataFrame:
    rows = []
    for plan, loss in (("DDP", 0.10), ("FSDP / ZeRO-3", 0.2), ("DDP + overlap", 0.03)):
        for i, gpus in enumerate((8, 16, 32, 64)):
            # throughput grows with GPUs, efficiency falls by `loss` per doubling
            rate = 1000.0 * gpus * (1 - loss) ** i
            rows.append(
                ({"plan": plan, "num_gpus": gpus}, result_factory(num_gpus=gpus, tokens_per_s=rate))
            )
    return results_frame(rows)


def test_scaling_table_is_relative_to_the_smallest_point(result_factory) -> None:
    table = scaling_table(scaling_frame(result_factory))
    ddp = table[table["series"] == "DDP"].set_index("num_gpus")
    assert ddp.loc[8.0, "speedup"] == pytest.approx(1.0)
    assert ddp.loc[64.0, "ideal"] == pytest.approx(8.0)
    assert ddp.loc[64.0, "speedup"] == pytest.approx(8 * 0.9**3)
    assert ddp.loc[64.0, "efficiency"] == pytest.approx(0.9**3)


def test_scaling_plot(result_factory, tmp_path: Path) -> None:
    frame = scaling_frame(result_factory)
    # a series that only runs from 16 GPUs starts on the ideal line
    frame.loc[(frame["plan"] == "DDP") & (frame["num_gpus"] == 8), "feasible"] = False
    fig = plot_scaling(frame)
    speed, eff = fig.axes[:2]
    assert speed.get_xlabel() == "Number of GPUs"
    assert speed.get_ylabel() == "Speedup (x vs 8 GPUs)"
    assert eff.get_ylabel() == "Scaling efficiency (%)"
    for ax in (speed, eff):
        labels = [line.get_label() for line in ax.get_lines()]
        assert labels[1:] == ["DDP", "FSDP / ZeRO-3", "DDP + overlap"]
        ideal = ax.get_lines()[0]
        assert ideal.get_label().startswith("ideal") and ideal.get_linestyle() == "--"
        assert ax.get_xscale() == "log"
    ddp = speed.get_lines()[1]
    assert list(ddp.get_xdata()) == [16, 32, 64]
    assert ddp.get_ydata()[0] == pytest.approx(2.0)
    assert list(eff.get_lines()[0].get_ydata()) == [100.0] * 4
    overlap = eff.get_lines()[3]
    assert overlap.get_ydata()[-1] == pytest.approx(100 * 0.97**3)
    assert_png(save_figure(fig, tmp_path / "scaling.png"))
    assert_svg(save_figure(fig, tmp_path / "scaling.svg"))


def test_memory_plot(result_factory, tmp_path: Path) -> None:
    rows = [
        ({"plan": f"ZeRO-{z}" if z else "DDP", "num_gpus": g}, result_factory(num_gpus=g, zero=z))
        for z in (0, 1, 2, 3)
        for g in (8, 64)
    ]
    frame = results_frame(rows)
    fig = plot_memory(frame)
    assert len(fig.axes) == 4
    assert [ax.get_title() for ax in fig.axes] == ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    assert fig.axes[0].get_ylabel() == "Peak memory per GPU (GiB)"
    for ax, zero in zip(fig.axes, (0, 1, 2, 3)):
        assert ax.get_xlabel() == "Number of GPUs"
        containers = [c for c in ax.containers if isinstance(c, BarContainer)]
        assert [c.get_label() for c in containers] == list(MEMORY_COLUMNS)
        # stacked bars reach the peak of each point
        tops = [
            containers[-1].patches[i].get_y() + containers[-1].patches[i].get_height()
            for i in range(2)
        ]
        want = frame[frame["plan"] == ax.get_title()]["memory_peak_bytes"] / 2**30
        assert tops == pytest.approx(list(want))
        hbm = [line for line in ax.get_lines() if line.get_label().startswith("HBM")]
        assert len(hbm) == 1 and hbm[0].get_ydata()[0] == pytest.approx(80e9 / 2**30)
        assert hbm[0].get_linestyle() == "--"
    assert_png(save_figure(fig, tmp_path / "memory.png"))


def test_memory_timeline_plot(result_factory, tmp_path: Path) -> None:
    result = result_factory(
        step_time_s=0.1,
        memory_timeline={0: [(0.0, 10e9), (0.05, 30e9)], 5: [(0.0, 2e9), (0.02, 4e9), (0.06, 3e9)]},
    )
    fig = plot_memory_timeline(result, rank=5)
    (ax,) = fig.axes
    assert ax.get_xlabel() == "Time in step (ms)" and ax.get_ylabel() == "Memory in use (GiB)"
    use, hbm = ax.get_lines()
    assert list(use.get_xdata()) == pytest.approx([0.0, 20.0, 60.0, 100.0])
    assert list(use.get_ydata()) == pytest.approx([v / 2**30 for v in (2e9, 4e9, 3e9, 3e9)])
    assert hbm.get_label() == "HBM 74.5 GiB" and hbm.get_linestyle() == "--"
    assert_svg(save_figure(fig, tmp_path / "timeline.svg"))
    with pytest.raises(ConfigError, match="rank 3 has no memory timeline; simulated ranks: 0, 5"):
        plot_memory_timeline(result, rank=3)


def test_pipeline_plot(pipeline, result_factory, tmp_path: Path) -> None:
    results = {
        name: result_factory(events=pipeline(name, stages=4, microbatches=8, p2p_s=0.0))
        for name in ("gpipe", "1f1b")
    }
    fig = plot_pipeline(results)
    assert len(fig.axes) == 2
    for ax, name in zip(fig.axes, results):
        assert ax.get_title(loc="left").startswith(f"{name}: step ")
        assert ax.get_ylabel() == "Pipeline stage"
        assert [t.get_text() for t in ax.get_yticklabels()] == [f"stage {s}" for s in range(4)]
        bars = [c for c in ax.collections if isinstance(c, PolyCollection)]
        labels = [c.get_label() for c in bars if not c.get_label().startswith("_")]
        assert labels == ["bubble (idle)", "forward", "backward"]
        forward = next(c for c in bars if c.get_label() == "forward")
        assert len(forward.get_paths()) == 8  # stage 0's eight forwards carry the legend entry
    assert fig.axes[-1].get_xlabel() == "Time in step (ms)"
    # GPipe and 1F1B have the same bubble with equal op times: (p-1)/(m+p-1) of the step
    # is idle on every stage; 3 / 11 here.
    for ax in fig.axes:
        assert "idle 27 %" in ax.get_title(loc="left")
    assert_png(save_figure(fig, tmp_path / "pipeline.png"))


def test_breakdown_plot(result_factory, tmp_path: Path) -> None:
    frame = results_frame(
        [
            ({"plan": "a"}, result_factory(step_time_s=0.2)),
            ({"plan": "b"}, result_factory(step_time_s=0.3)),
        ]
    )
    fig = plot_breakdown(frame)
    (ax,) = fig.axes
    assert ax.get_xlabel() == "Step time (ms)" and ax.get_ylabel() == "Plan"
    containers = [c for c in ax.containers if isinstance(c, BarContainer)]
    from collsim.step.result import BREAKDOWN_KEYS

    assert len(containers) == len(BREAKDOWN_KEYS) == 10  # one bar per part of the step
    assert all(len(c.patches) == 2 for c in containers)
    last = containers[-1].patches
    assert [p.get_x() + p.get_width() for p in last] == pytest.approx([200.0, 300.0])
    assert_png(save_figure(fig, tmp_path / "breakdown.png"))


def test_collectives_plot(tmp_path: Path) -> None:
    csv = tmp_path / "coll.csv"
    csv.write_text(
        "size_bytes,time_us,algbw_GBps,busbw_GBps,algorithm\n"
        "1024,10,0.1,0.175,ring/ll\n1048576,50,20.9,36.7,ring/simple\n"
        "1024,8,0.128,0.224,tree/ll\n1048576,70,15.0,26.2,tree/ll128\n"
    )
    from collsim.report.frames import read_collective_csv

    frame = read_collective_csv(csv)
    assert list(frame["busbw_bps"]) == pytest.approx([0.175e9, 36.7e9, 0.224e9, 26.2e9])
    assert list(frame["time_s"]) == pytest.approx([10e-6, 50e-6, 8e-6, 70e-6])
    assert list(frame["algorithm"]) == ["ring", "ring", "tree", "tree"]
    assert list(frame["protocol"]) == ["ll", "simple", "ll", "ll128"]
    fig = plot_collectives(frame, reference_bps=50e9)
    (ax,) = fig.axes
    assert ax.get_ylabel() == "Bus bandwidth (GB/s)"
    assert ax.get_xlabel().startswith("Message size")
    lines = ax.get_lines()
    assert [line.get_label() for line in lines] == ["ring", "tree", "link 50 GB/s"]
    assert list(lines[0].get_ydata()) == pytest.approx([0.175, 36.7])
    assert_png(save_figure(fig, tmp_path / "coll.png"))


def test_bad_inputs_are_config_errors(tmp_path: Path, result_factory) -> None:
    frame = results_frame([({"plan": "a", "num_gpus": 8}, result_factory())])
    with pytest.raises(ConfigError, match="must end in .png or .svg"):
        save_figure(plot_breakdown(frame), tmp_path / "x.jpg")
    with pytest.raises(ConfigError, match="cannot write"):
        save_figure(plot_breakdown(frame), tmp_path / "no-such-folder" / "x.png")
    with pytest.raises(ConfigError, match="needs column"):
        plot_scaling(frame.drop(columns=["tokens_per_s"]))
    with pytest.raises(ConfigError, match="missing column"):
        bad = tmp_path / "bad.csv"
        bad.write_text("size_bytes,time_us\n1,2\n")
        from collsim.report.frames import read_collective_csv

        read_collective_csv(bad)
    words = tmp_path / "words.csv"
    words.write_text("size_bytes,time_us,algbw_GBps,busbw_GBps,algorithm\n1,fast,1,1,ring\n")
    with pytest.raises(ConfigError, match="column 'time_us' must hold numbers"):
        read_collective_csv(words)
    binary = tmp_path / "binary.csv"
    binary.write_bytes(b"size_bytes\n\xff\xfe\n")
    with pytest.raises(
        ConfigError, match=r"binary.csv:2: not UTF-8 text \(byte 0xff at offset 11\)"
    ):
        read_collective_csv(binary)


def test_step_plot(pipeline, result_factory, tmp_path: Path) -> None:
    from collsim.report.plots import plot_step

    result = result_factory(
        events=pipeline("1f1b", stages=4, microbatches=4, p2p_s=0.0),
        memory_timeline={0: [(0.0, 10e9), (0.004, 12e9)]},
    )
    for event in result.trace_events:  # like the engine: no stage in args, rank r = stage r
        event.args.pop("stage", None)
    fig = plot_step(result, stage_of=lambda rank: rank)
    gantt, memory = fig.axes
    assert [t.get_text() for t in gantt.get_yticklabels()] == [
        f"stage {s} (rank {s})" for s in range(4)
    ]
    labels = [c.get_label() for c in gantt.collections if not c.get_label().startswith("_")]
    assert labels == ["bubble (idle)", "forward", "backward"]
    # 1F1B, p = 4, m = 4, equal op times: (p-1)/(m+p-1) = 3/7 of the step is idle
    assert "idle 43 %" in gantt.get_title(loc="left")
    assert memory.get_ylabel() == "Memory in use (GiB)"
    assert [line.get_label() for line in memory.get_lines()] == ["rank 0 in use", "HBM 74.5 GiB"]
    assert_svg(save_figure(fig, tmp_path / "step.svg"))


def test_step_plot_has_communication_lanes(pipeline, result_factory, tmp_path: Path) -> None:
    from collsim.report.plots import plot_step

    result = result_factory(
        events=pipeline("1f1b", stages=4, microbatches=4, p2p_s=0.001),
        memory_timeline={0: [(0.0, 10e9), (0.004, 12e9)]},
    )
    for event in result.trace_events:
        event.args.pop("stage", None)
    fig = plot_step(result, stage_of=lambda rank: rank)
    gantt = fig.axes[0]
    ticks = [t.get_text() for t in gantt.get_yticklabels()]
    streams = {(e.rank, e.stream) for e in result.trace_events if e.stream != "compute"}
    assert streams  # the fixture's sends and receives
    # every stage row, then under it one lane per communication stream its rank used
    want = []
    for stage in range(4):
        want.append(f"stage {stage} (rank {stage})")
        want += [
            f"  {s}" for s in ("tp", "pp", "pp recv", "dp", "offload") if (stage, s) in streams
        ]
    assert ticks == want
    labels = [c.get_label() for c in gantt.collections if not c.get_label().startswith("_")]
    assert {"pp comm"} <= set(labels)
    no_lanes = plot_step(result, stage_of=lambda rank: rank, comm=False)
    assert len(no_lanes.axes[0].get_yticklabels()) == 4
    assert_svg(save_figure(fig, tmp_path / "step_lanes.svg"))
