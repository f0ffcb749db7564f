"""Printing reports on the command line (the library returns renderables; the CLI prints)."""

from __future__ import annotations

from rich.console import Console

from shardkit.report.render import report_renderables
from shardkit.report.report import Report


def print_report(report: Report, console: Console, *, top: int = 12) -> None:
    for renderable in report_renderables(report, top=top):
        console.print(renderable)
