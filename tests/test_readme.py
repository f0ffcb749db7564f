"""The README's code runs, and CI runs the README's test command."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_flow_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert blocks, "README has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    assert "P('fsdp'," in capsys.readouterr().out
    assert float(namespace["loss"]) > 0


def test_ci_runs_the_readme_test_command():
    marker = README.index("<!-- test-command -->")
    command = README[marker:].split("```bash\n", 1)[1].split("\n", 1)[0]
    assert "pytest" in command
    assert "<!-- test-command -->" in (ROOT / ".ci" / "run").read_text()


def test_quick_start_is_two_commands():
    quick = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)```", quick, flags=re.S)
    assert len(commands) == 2 and all(c.count("\n") == 1 for c in commands)
    assert "shardkit run" in commands[0] and "--devices 8" in commands[0]


def test_readme_own_model_example_runs(capsys):
    """The second example continues the first (its plan, init, step and batch)."""
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    capsys.readouterr()
    exec(compile(blocks[1], "README.md", "exec"), namespace)
    out = capsys.readouterr().out
    assert out.startswith("P('fsdp', None)\n") and "memory per device" in out
    assert namespace["report"].to_json()["workload"]["batch"] == 8
