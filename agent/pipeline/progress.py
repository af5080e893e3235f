"""A progress bar for ``train run --local``: steps, loss, tokens/s and time left, on stderr.

Shown only when stderr is a terminal (and not turned off): a log file or a pipe gets no bar and
no control characters. Fed by train_shard's ``on_step`` callback; knows nothing else.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class TrainProgress:
    def __init__(self, *, enabled: bool = True, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.enabled = enabled and self.console.is_terminal
        self.progress: Progress | None = None
        self.task: Any = None

    def __enter__(self) -> "TrainProgress":
        if self.enabled:
            self.progress = Progress(
                TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]} tok/s"),
                TextColumn("ETA"), TimeRemainingColumn(), console=self.console, transient=False)
            self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.progress is not None:
            self.progress.__exit__(*exc)

    def update(self, step: int, total: int, loss: float, tokens: int, seconds: float) -> None:
        if self.progress is None:
            return
        if self.task is None:  # a resumed run starts part way, with the tokens counted before
            self.task = self.progress.add_task("train", total=total, completed=step - 1, loss="-", rate="-")
            self.first = (tokens, seconds)
        tokens0, seconds0 = self.first
        rate = f"{(tokens - tokens0) / (seconds - seconds0):.0f}" if seconds > seconds0 else "-"
        self.progress.update(self.task, completed=step, loss=f"{loss:.4f}", rate=rate)
