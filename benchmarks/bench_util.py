"""Shared by the benchmark scripts: argument parsing, markdown tables, JSON output.

Every benchmark prints a markdown table and writes the same numbers as JSON, with the
date and the machine they came from.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "results"


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--tiny", action="store_true", help="tiny configs (smoke test, seconds)")
    p.add_argument("--out", type=Path, default=OUT, help="folder for the JSON results")
    return p


def machine() -> dict[str, Any]:
    import flax
    import jax

    import shardkit

    devices = jax.devices()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "flax": flax.__version__,
        "shardkit": shardkit.__version__,
        "backend": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "devices": len(devices),
    }


def markdown(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(x: Any) -> str:
        if isinstance(x, float):
            return f"{x:,.3f}" if abs(x) < 100 else f"{x:,.0f}"
        return str(x)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def emit(
    name: str,
    title: str,
    headers: Sequence[str],
    rows: Sequence[Sequence[Any]],
    out: Path,
    extra: dict[str, Any] | None = None,
) -> str:
    """Print the table (with its provenance) and write ``out/name.json``."""
    info = machine()
    table = markdown(headers, rows)
    text = (
        f"### {title}\n\n{table}\n\n_{info['date']}, {info['backend']} "
        f"({info['device_kind']}), {info['cpu_count']} cores, jax {info['jax']}_\n"
    )
    print(text, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "title": title,
        "headers": list(headers),
        "rows": [list(r) for r in rows],
        "machine": info,
        "markdown": text,
        **(extra or {}),
    }
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2, default=str))
    return text


MIB = 1 / 2**20
