"""Training progress that works anywhere: a bar on a terminal, log lines in a file.

On a terminal ``shardkit run`` draws a rich progress bar. When stderr is not a terminal
(a job log, ``> log 2>&1``, ``shardkit launch``'s processes) it prints plain lines every
``every`` steps or ``seconds`` seconds, whichever comes first, and always the first and
last step:

  step 10/200  loss 5.4257  2,074 tokens/s  ETA 0:01:23

Under ``shardkit launch`` only process 0 reports; the others stay quiet (their errors
still reach stderr).

Example:
  >>> import io
  >>> out = io.StringIO()
  >>> with StepProgress(3, "gpt-tiny · fsdp", mode="log", stream=out, clock=iter(range(9)).__next__) as p:
  ...     for step in range(3):
  ...         p.update(step, loss=5.0 - step, tokens_per_s=1000.0)
  >>> print(out.getvalue(), end="")
  gpt-tiny · fsdp: 3 steps (the first one compiles)
  step 1/3  loss 5.0000  compiled and ran in 0:00:01
  step 2/3  loss 4.0000  1,000 tokens/s  ETA 0:00:01
  step 3/3  loss 3.0000  1,000 tokens/s  done in 0:00:03
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import IO, Literal

from rich.console import Console

__all__ = ["MODES", "StepProgress", "default_every"]

#: ``--progress``: ``auto`` is a bar on a terminal and log lines elsewhere.
MODES = ("auto", "bar", "log", "none")
Mode = Literal["auto", "bar", "log", "none"]


def default_every(steps: int) -> int:
    """Steps between log lines by default: about twenty lines for the run.

    Example:
      >>> default_every(200), default_every(5)
      (10, 1)
    """
    return max(1, round(steps / 20))


def _clock_text(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class StepProgress:
    """Report training steps as a bar (``mode="bar"``), log lines (``"log"``) or not at
    all (``"none"``); ``"auto"`` picks the bar when ``console`` is a terminal."""

    def __init__(
        self,
        steps: int,
        description: str,
        *,
        first_step: int = 0,
        mode: Mode = "auto",
        every: int | None = None,
        seconds: float = 30.0,
        console: Console | None = None,
        stream: IO[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.console = console or Console(stderr=True)
        if mode == "auto":
            mode = "bar" if self.console.is_terminal else "log"
        self.mode = mode
        self.steps, self.first_step, self.description = steps, first_step, description
        self.every = every or default_every(steps - first_step)
        self.seconds = seconds
        self.stream = stream
        self.clock = clock
        self._bar = None
        self._last_logged = (first_step, 0.0)  # (step, time) of the last line
        self._first_done: tuple[int, float] | None = None  # after the compile step

    def __enter__(self) -> StepProgress:
        self._start = self.clock()
        if self.mode == "bar":
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]:.4f}  {task.fields[tps]:,.0f} tok/s"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._bar.__enter__()
            self._task = self._bar.add_task(
                f"{self.description} · compiling",
                total=self.steps,
                completed=self.first_step,
                loss=float("nan"),
                tps=0.0,
            )
        elif self.mode == "log":
            compiles = " (the first one compiles)"
            resumed = f" from step {self.first_step}" if self.first_step else ""
            self._line(
                f"{self.description}: {self.steps - self.first_step} steps{resumed}{compiles}"
            )
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def update(self, step: int, *, loss: float, tokens_per_s: float, note: str = "") -> None:
        """Step ``step`` (counted from 0) ended with ``loss`` at ``tokens_per_s``; ``note``
        (e.g. a packed step's attention balance) goes beside it."""
        done, now = step + 1, self.clock()
        if self._first_done is None:
            self._first_done = (done, now)
        if self._bar is not None:
            self._bar.update(
                self._task,
                completed=done,
                loss=loss,
                tps=tokens_per_s,
                description=f"{self.description} · {note}" if note else self.description,
            )
            return
        if self.mode != "log":
            return
        last_step, last_time = self._last_logged
        due = (
            done in (self.first_step + 1, self.steps)
            or done - last_step >= self.every
            or now - last_time >= self.seconds
        )
        if not due:
            return
        self._last_logged = (done, now)
        if done == self.first_step + 1 and done < self.steps:  # its time is the compile's
            took = _clock_text(now - self._start)
            extra = f"  {note}" if note else ""
            self._line(
                f"step {done}/{self.steps}  loss {loss:.4f}  compiled and ran in {took}{extra}"
            )
            return
        tail = (
            f"done in {_clock_text(now - self._start)}"
            if done == self.steps
            else f"ETA {_clock_text(self._eta(done, now))}"
        )
        extra = f"  {note}" if note else ""
        self._line(
            f"step {done}/{self.steps}  loss {loss:.4f}  {tokens_per_s:,.0f} tokens/s  {tail}"
            f"{extra}"
        )

    def _eta(self, done: int, now: float) -> float:
        """The remaining steps at the pace of those after the compile step (the compile
        step's own time until there are none)."""
        first_steps, first_time = self._first_done
        if done > first_steps:
            per_step = (now - first_time) / (done - first_steps)
        else:
            per_step = (now - self._start) / max(1, done - self.first_step)
        return per_step * (self.steps - done)

    def _line(self, text: str) -> None:
        print(text, file=self.stream or sys.stderr, flush=True)
