"""Printing reports on the command line (the library returns renderables; the CLI prints)."""

from __future__ import annotations

from collections.abc import Mapping

from rich.console import Console

from shardkit.report.render import comparison_table, report_renderables
from shardkit.report.report import Report


def print_report(report: Report, console: Console, *, top: int = 12) -> None:
    for renderable in report_renderables(report, top=top):
        console.print(renderable)


def print_comparison(reports: Mapping[str, Report], console: Console) -> None:
    console.print(comparison_table(reports))
