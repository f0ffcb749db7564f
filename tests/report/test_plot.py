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
from shardkit.report import plot
from shardkit.report.plot import plot_reports

matplotlib.use("Agg")

SKIPPED = {"pp": "2 layers of gpt-tiny do not split into 8 stages × 1 virtual stages."}


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])  # the IHDR chunk: width, height


@pytest.fixture(scope="module")
def report():
    return models.report(sk.Plan("dp"), models.get("gpt-tiny"), batch=8, seq=16)


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
