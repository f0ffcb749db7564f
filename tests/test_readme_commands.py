"""The checkpoint and multi-host guides' commands name real flags; the cheap one runs.

The training commands run in tests/test_checkpoint.py and tests/multiprocess/ (the
launch line is read from docs/howto/many_hosts.md there)."""

import re
import shlex
from pathlib import Path

from shardkit.cli import build_parser, main

HOWTO = Path(__file__).resolve().parents[1] / "docs" / "howto"


def _commands(page: str) -> list[list[str]]:
    body = (HOWTO / page).read_text()
    lines = [
        line.split("  #")[0]
        for block in re.findall(r"```bash\n(.*?)```", body, flags=re.S)
        for line in block.splitlines()
    ]
    return [shlex.split(line)[1:] for line in lines if line.startswith("shardkit ")]


def test_readme_commands_parse_and_reshard_plan_runs(capsys):
    commands = _commands("checkpoints.md") + _commands("many_hosts.md")
    assert len(commands) == 5
    for argv in commands:
        build_parser().parse_args(argv)  # exits on an unknown flag
    (reshard,) = [c for c in commands if c[0] == "reshard-plan"]
    assert main(reshard) == 0
    assert "reads 1.3 MiB to hold 445.1 KiB" in capsys.readouterr().out  # the guide's numbers
