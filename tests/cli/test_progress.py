"""``shardkit run``'s progress where there is no terminal: plain log lines with the step,
the loss, tokens/s and the time left."""

import io
import json
import re

from shardkit.cli import main
from shardkit.cli.progress import StepProgress

LINE = re.compile(
    r"step (\d+)/(\d+)  loss (\d+\.\d{4})  ([\d,]+) tokens/s  (ETA|done in) \d+:\d\d:\d\d"
)


def test_run_without_a_terminal_logs_step_lines(capsys, tmp_path):
    out_json = tmp_path / "run.json"
    args = ["run", "--steps", "7", "--devices", "2", "--seq", "16", "--batch", "2"]
    args += ["--log-every", "2", "--no-report", "--json", str(out_json)]
    assert main(args) == 0  # pytest's capture is not a terminal: the log-lines mode
    err = capsys.readouterr().err
    losses = json.loads(out_json.read_text())["losses"]
    lines = err.splitlines()
    assert lines[0] == "gpt-tiny · fsdp: 7 steps (the first one compiles)"
    assert re.fullmatch(r"step 1/7  loss \d+\.\d{4}  compiled and ran in \d+:\d\d:\d\d", lines[1])
    steps = [LINE.fullmatch(line) for line in lines[2:] if line.startswith("step ")]
    assert all(steps), lines
    # every 2 steps after the first, and the last: 3, 5, 7
    assert [int(m[1]) for m in steps] == [3, 5, 7]
    for m in steps:  # the loss of that step, as the run returned it
        assert float(m[3]) == round(losses[int(m[1]) - 1], 4)
        assert int(m[4].replace(",", "")) > 0
    assert steps[-1][5] == "done in"


def test_log_lines_every_n_steps_or_seconds():
    # A clock by hand: each step takes 1 s; lines every 100 steps or 3 s, whichever first.
    clock = iter(range(100)).__next__
    out = io.StringIO()
    with StepProgress(10, "m", mode="log", every=100, seconds=3, stream=out, clock=clock) as p:
        for step in range(10):
            p.update(step, loss=1.0, tokens_per_s=10.0)
    logged = [int(line.split()[1].split("/")[0]) for line in out.getvalue().splitlines()[1:]]
    assert logged == [1, 4, 7, 10]  # the first, then every 3 s (steps 4, 7), the last
    # ETA at step 4 (time 4): steps 2-4 took 1 s each after the first, 6 steps left: 6 s.
    assert "ETA 0:00:06" in out.getvalue().splitlines()[2]


def test_the_bar_and_none_modes_print_no_log_lines():
    out = io.StringIO()
    with StepProgress(3, "m", mode="none", stream=out) as p:
        for step in range(3):
            p.update(step, loss=1.0, tokens_per_s=1.0)
    assert out.getvalue() == ""
