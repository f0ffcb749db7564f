"""Figures laid out to be read: rows not a strip, 1:1 to 2:1 whatever the count, a title
that says what is plotted, skipped layouts in a footnote, units on the axes, colours that
differ in greyscale, PNG and SVG."""

import struct

import matplotlib
import pytest
from matplotlib.colors import to_rgb

import shardkit as sk
from shardkit import models
from shardkit.parallel.plot import plot_schedules
from shardkit.parallel.schedules import make
from shardkit.report import build_report, plot
from shardkit.report.plot import plot_reports

matplotlib.use("Agg")

SKIPPED = {"pp": "2 layers of gpt-tiny do not split into 8 stages × 1 virtual stages."}


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])  # the IHDR chunk: width, height


@pytest.fixture(scope="module")
def report():
    return build_report(sk.Plan("dp"), model=models.get("gpt-tiny"), batch=8, seq=16)


@pytest.mark.parametrize("count", [1, 3, 18])
def test_compare_figure_is_between_square_and_two_to_one(report, tmp_path, count):
    path = tmp_path / "compare.png"
    plot_reports({f"recipe_{i}": report for i in range(count)}, path, skipped=SKIPPED)
    width, height = png_size(path)
    assert width >= 1200  # readable on a page: 11 in at 120 dpi
    assert 1.0 <= width / height <= 2.0, (width, height)


def test_compare_figure_says_what_it_plots_and_lists_the_skipped(report, tmp_path):
    path = tmp_path / "compare.svg"
    title = "gpt-tiny on 8 devices: batch 8, seq 16"
    plot_reports({"dp": report, "fsdp": report}, path, title=title, skipped=SKIPPED)
    svg = path.read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    assert "Memory and wire bytes per device, by recipe" in svg and title in svg
    assert "memory per device at its peak (MiB)" in svg
    assert "wire bytes per device per step (MiB)" in svg
    # The skipped recipe's reason once, in the footnote, whole.
    assert svg.count("2 layers of gpt-tiny do not split") == 1
    assert "Not shown, no layout compiled: pp (2 layers" in svg


def luminance(color):
    r, g, b = to_rgb(color)
    return 0.299 * r + 0.587 * g + 0.114 * b


@pytest.mark.parametrize(
    "colors",
    [
        [c for _, _, c, _ in plot._MEMORY],
        [c for c, _ in plot._WIRE.values()],
        [plot_schedules.__globals__["_FORWARD"][0], plot_schedules.__globals__["_BACKWARD"][0]],
    ],
    ids=["memory", "wire", "pipeline"],
)
def test_the_colours_differ_in_greyscale(colors):
    greys = sorted(luminance(c) for c in colors)
    assert all(b - a >= 0.1 for a, b in zip(greys, greys[1:], strict=False)), greys


@pytest.mark.parametrize("count", [1, 2, 5])
def test_pipeline_timelines_are_a_grid_between_square_and_two_to_one(tmp_path, count):
    schedules = [make(name, 4, 8) for name in ("gpipe", "1f1b", "gpipe", "1f1b", "gpipe")]
    path = tmp_path / "schedules.png"
    fig = plot_schedules(schedules[:count], path=str(path))
    width, height = png_size(path)
    assert 1.0 <= width / height <= 2.0, (width, height)
    assert fig.axes[0].get_xlabel().startswith("tick (")
    assert fig.get_suptitle().startswith("Pipeline schedules")


def _most_held(schedule) -> int:
    """By hand from the tables: items a stage has run forward and not yet backward."""
    most = 0
    for s in range(schedule.stages):
        live = 0
        for t in range(schedule.ticks):
            live += schedule.forward[t][s] is not None
            most = max(most, live)
            live -= schedule.backward[t][s] is not None
    return most


@pytest.mark.parametrize("name,virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_a_timelines_title_says_what_a_stage_holds_not_the_engines_ring(name, virtual):
    schedule = make(name, 4, 8, virtual)
    fig = plot_schedules([schedule])
    unit = "micro-batches" if virtual == 1 else "chunks"
    assert f"holds at most {_most_held(schedule)} {unit}" in fig.axes[0].get_title()


GIB = 2**30
#: gpt-7b's planning rows (benchmarks/results/planning.json, fsdp and fsdp_tp total MiB),
#: as (memory bytes, wire bytes) per device; fsdp_tp's wire bytes were not recorded.
DEVICES = {
    "fsdp": {64: (7841.7 * 2**20, 73.2 * GIB), 256: (6660.2 * 2**20, 74.1 * GIB)},
    "fsdp_tp": {64: (9203.1 * 2**20, None), 256: (7910.9 * 2**20, None)},
}


@pytest.fixture
def drawn(monkeypatch):
    """The figures plot_sweep saves, kept open to be read back."""
    figures = []
    real = plot.save_figure

    def keep(fig, path, *, close=True):
        figures.append(fig)
        return real(fig, path, close=False)

    monkeypatch.setattr(plot, "save_figure", keep)
    return figures


def lines_of(ax):
    return {line.get_label(): line for line in ax.get_lines()}


@pytest.mark.parametrize("count", [1, 3, 6])
def test_sweep_figure_is_between_square_and_two_to_one(tmp_path, count):
    path = tmp_path / "sweep.png"
    results = {
        f"recipe_{i}": {2**k: ((i + 1) * GIB, k * GIB) for k in range(9, 17)} for i in range(count)
    }
    notes = ["a note long enough to wrap onto two lines of the footnote " * 4]
    plot.plot_sweep(results, path, x_label="sequence length (tokens)", title="t", notes=notes)
    width, height = png_size(path)
    assert width >= 1200
    assert 1.0 <= width / height <= 2.0, (width, height)


def test_sweep_figure_plots_the_points_in_their_units(tmp_path, drawn):
    path = tmp_path / "devices.svg"
    title = "gpt-7b: memory and wire bytes per device against the number of devices"
    note = "fsdp_tp: wire bytes not recorded."
    plot.plot_sweep(DEVICES, path, x_label="devices", title=title, notes=[note])
    ax_mem, ax_wire = drawn[0].axes
    mem = lines_of(ax_mem)
    # Memory in GiB (largest 9203 MiB = 8.99 GiB >= 2 GiB): the table's MiB / 1024.
    assert list(mem["fsdp"].get_xdata()) == [64, 256]
    assert mem["fsdp"].get_ydata() == pytest.approx([7841.7 / 1024, 6660.2 / 1024])
    assert mem["fsdp_tp"].get_ydata() == pytest.approx([9203.1 / 1024, 7910.9 / 1024])
    # The wire panel draws what was measured only; the legend still lists every line.
    assert set(lines_of(ax_wire)) == {"fsdp"}
    assert lines_of(ax_wire)["fsdp"].get_ydata() == pytest.approx([73.2, 74.1])
    legend = [t.get_text() for t in drawn[0].legends[0].get_texts()]
    assert legend == ["fsdp", "fsdp_tp"]
    # 64 -> 256 is two doublings: a base-2 axis with ticks at the points; the memory
    # spans under 10x, so its axis is linear and starts at 0.
    assert ax_mem.get_xscale() == "log" and list(ax_mem.get_xticks()) == [64, 256]
    assert ax_mem.get_yscale() == "linear" and ax_mem.get_ylim()[0] == 0
    svg = path.read_text()
    assert title in svg and note in svg
    assert "memory per device at its peak (GiB)" in svg
    assert "wire bytes per device per step (GiB)" in svg
    assert "<dc:date>" not in svg  # the same figure saves to the same bytes


def test_sweep_takes_reports_and_spans_decades_on_log_axes(report, tmp_path, drawn):
    small = {"dp": {512: report, 65536: (1000 * report.memory.total, None)}}
    plot.plot_sweep(small, tmp_path / "seq.png", x_label="sequence length (tokens)", title="t")
    ax_mem, ax_wire = drawn[0].axes
    unit = 2**30 if 1000 * report.memory.total >= 2 * 2**30 else 2**20
    assert lines_of(ax_mem)["dp"].get_ydata() == pytest.approx(
        [report.memory.total / unit, 1000 * report.memory.total / unit]
    )
    assert lines_of(ax_wire)["dp"].get_ydata() == pytest.approx([report.wire_bytes / 2**20])
    assert ax_mem.get_yscale() == "log"  # 1000x
    assert [t.get_text() for t in ax_mem.get_xticklabels()] == ["512", "64K"]


def test_sweep_mistakes_name_the_point_and_the_fix(tmp_path):
    with pytest.raises(
        sk.ShardingError, match=r"results\['fsdp'\]\[64\] is 7\.5.*\(memory bytes, wire bytes\)"
    ):
        plot.plot_sweep({"fsdp": {64: 7.5}}, tmp_path / "x.png", x_label="devices", title="t")
    seven = {f"r{i}": {1: (1.0, 1.0)} for i in range(7)}
    with pytest.raises(sk.ShardingError, match="7 lines .*at most 6.*two figures"):
        plot.plot_sweep(seven, tmp_path / "x.png", x_label="devices", title="t")
    with pytest.raises(sk.ShardingError, match="no points"):
        plot.plot_sweep({}, tmp_path / "x.png", x_label="devices", title="t")


def test_sweep_lines_differ_in_greyscale_and_marker():
    test_the_colours_differ_in_greyscale([c for c, _, _ in plot._LINES])
    assert len({m for _, m, _ in plot._LINES}) == len(plot._LINES)
