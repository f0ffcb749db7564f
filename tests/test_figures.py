"""matplotlib is optional: shardkit imports and reports without it, and a figure asked for
without it says how to install it (the one place that imports it, ``figures.matplotlib``)."""

import subprocess
import sys
import textwrap

import pytest

from shardkit.figures import INSTALL, matplotlib


def _without_matplotlib(code: str) -> subprocess.CompletedProcess:
    # A None entry in sys.modules makes every import of matplotlib raise ImportError, as
    # on a machine where it is not installed.
    prelude = "import sys\nsys.modules['matplotlib'] = None\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_shardkit_and_its_plot_modules_import_without_matplotlib():
    done = _without_matplotlib(
        """
        import shardkit, shardkit.report, shardkit.autoplanner
        import shardkit.report.plot, shardkit.parallel.plot, shardkit.autoplanner.plot
        import shardkit.cli
        from shardkit.parallel.schedules import make
        print(make("1f1b", 2, 2).timeline().count("F"))
        """
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["4"]  # the text timeline needs no matplotlib


def test_a_figure_without_matplotlib_says_how_to_install_it():
    done = _without_matplotlib(
        """
        from shardkit.parallel.plot import plot_schedules
        from shardkit.parallel.schedules import make
        try:
            plot_schedules([make("1f1b", 2, 2)])
        except ImportError as e:
            print(e)
        """
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == INSTALL
    assert "pip install 'shardkit[plot]'" in INSTALL


def test_the_command_line_refuses_a_plot_before_any_work(tmp_path):
    done = _without_matplotlib(
        f"""
        from shardkit.cli import main
        raise SystemExit(main(["compare", "--recipes", "dp", "--plot", "{tmp_path / "x.png"}"]))
        """
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--plot" in done.stderr and "pip install 'shardkit[plot]'" in done.stderr
    assert "Traceback" not in done.stderr


def test_with_matplotlib_the_submodules_are_there():
    pytest.importorskip("matplotlib")
    mpl = matplotlib()
    assert all(hasattr(mpl, name) for name in ("pyplot", "ticker", "lines", "patches"))
