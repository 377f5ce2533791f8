"""Training progress on rank 0: a rich live panel in a terminal, plain lines anywhere else.

Long runs are mostly watched through log files (nohup, Slurm, supervisors), where a live
display would write cursor codes into the log; so the live panel is used only when the
stream is a TTY, and the plain mode prints one self-contained grep-able line every N steps
and at the last step. Other ranks print nothing: eight copies of a line help nobody, and
their errors travel through ``logging``. The streamed data's figures are said here too, for the
progress line and the stage's last lines (byte sizes, downloads, the data-wait line).
"""
from __future__ import annotations

import datetime as _dt
import math
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, TextIO

if TYPE_CHECKING:  # type names only (rich is imported where the live display starts)
    from rich.console import Console
    from rich.live import Live
    from rich.panel import Panel

    from ds_trhash.data.stage import DataFigures

__all__ = ["Progress", "byte_size", "data_wait_line", "downloaded", "eta_seconds", "format_duration"]


def format_duration(seconds: float | None) -> str:
    """H:MM:SS (days roll into hours); '?' when not yet known."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    return str(_dt.timedelta(seconds=int(max(0.0, seconds))))


def eta_seconds(elapsed: float, steps_done: int, steps_left: int) -> float | None:
    """Remaining time at the mean pace since this process started; None before the first step.

    The pace is measured from this process's own start, not from step 0, so a resumed run
    does not count the steps it skipped as instantaneous.
    """
    if steps_done <= 0:
        return None
    return elapsed / steps_done * max(0, steps_left)


def _fmt_loss(loss: float | None) -> str:
    return "nan" if loss is None or not math.isfinite(loss) else f"{loss:.4f}"


def _share(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f} %" if whole > 0 else "0.0 %"


def byte_size(n: float) -> str:
    """Bytes for people, in the largest binary unit that keeps them at least 1 ("3.2 GiB", "512 B")."""
    for unit, scale, digits in (("GiB", 2**30, 2), ("MiB", 2**20, 1), ("KiB", 2**10, 1)):
        if n >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return f"{n:.0f} B"


def downloaded(figures: DataFigures, seconds: float) -> str:
    """This process's downloads in one figure: the bytes of the shards it downloaded and verified
    (on demand and prefetched) and their average rate over ``seconds`` ("42.0 MiB at 1.1 MiB/s")."""
    rate = f" at {byte_size(figures.downloaded_bytes / seconds)}/s" if seconds > 0 else ""
    return f"{byte_size(figures.downloaded_bytes)}{rate}"


def data_wait_line(figures: DataFigures | None, step_seconds: float, steps: int) -> str | None:
    """Whether the data keeps up with the model, in parts that add up: of the step time, the
    seconds the training thread waited for its batches; apart from it (in the background, or
    inside that wait when assembling on the training thread), the seconds assembling them took,
    split into reading rows and waiting for shards, with the node cache's counts and the bytes
    downloaded (the one line that reports a streamed stage's downloads). None for batches that
    are not streamed from shards."""
    if figures is None or steps < 1:
        return None
    f, assembly = figures, figures.assembly_s
    where = "in the background" if f.background else "on the training thread, inside that wait"
    line = (f"data wait on rank {f.rank}: {f.queue_wait_s:.3f} s of {step_seconds:.3f} s in {steps} step(s) "
            f"({_share(f.queue_wait_s, step_seconds)}) waiting for batches; assembling them took {assembly:.3f} s "
            f"{where}: {f.read_s:.3f} s reading rows ({_share(f.read_s, assembly)}), {f.shard_wait_s:.3f} s "
            f"waiting for shards ({_share(f.shard_wait_s, assembly)})")
    if f.cached:
        line += (f" ({f.fetched} fetched on demand, {f.prefetched} prefetched, {f.hits} cache hits; "
                 f"downloaded {downloaded(f, step_seconds)})")
    return line


def _value(loss: float | None | Callable[[], float | None]) -> float | None:
    return loss() if callable(loss) else loss


def _pairs(items: Mapping[str, Any] | None) -> str:
    return " ".join(f"{k}={v}" for k, v in (items or {}).items())


class Progress:
    """Reports training progress; ``update`` after each optimizer step, ``close`` at the end.

    ``step`` in :meth:`update` counts completed optimizer steps (1 .. total_steps).
    ``start_step`` is where this process began (the resume step), for the ETA. ``console``
    (a ``rich.console.Console``) replaces ``stream`` for the live mode, mainly for tests;
    ``clock`` too.
    """

    def __init__(
        self,
        stage: str,
        total_steps: int,
        rank: int,
        stream: TextIO | None = None,
        force_plain: bool | None = None,
        every: int = 10,
        *,
        start_step: int = 0,
        console: Console | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.stage = stage
        self.total_steps = total_steps
        self.rank = rank
        self.stream = stream if stream is not None else sys.stdout
        self.every = every
        self.start_step = start_step
        self._clock = clock
        self._t0 = clock()
        self._live: Live | None = None
        self._pending: tuple | None = None
        self._console: Console | None = None
        self._last_refresh = -math.inf
        self._closed = False
        if rank != 0:
            return
        if force_plain is None:
            is_tty = console.is_terminal if console is not None else _isatty(self.stream)
            force_plain = not is_tty
        if not force_plain:
            self._start_live(console)

    # -- public API ----------------------------------------------------------------------
    @property
    def live(self) -> bool:
        return self._live is not None

    def update(
        self,
        step: int,
        loss: float | None | Callable[[], float | None],
        lr: float,
        tokens_per_s: float,
        backends: Mapping[str, object] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        """``loss`` may be a callable: it is called only for a step that is shown (every N steps
        in plain mode, at most 4 redraws a second live), so the training loop's loss, kept on
        the device, reaches the host only then."""
        if self.rank != 0 or self._closed:
            return
        elapsed = self._clock() - self._t0
        eta = eta_seconds(elapsed, step - self.start_step, self.total_steps - step)
        if self._live is not None:
            self._pending = (step, loss, lr, tokens_per_s, elapsed, eta, backends, extra)
            now = self._clock()
            # Redraw at most 4 times a second, but always show the last step.
            if now - self._last_refresh >= 0.25 or step >= self.total_steps:
                self._draw_pending()
                self._last_refresh = now
            return
        if step % self.every == 0 or step == self.total_steps:
            self._write(self.format_line(step, _value(loss), lr, tokens_per_s, elapsed, eta, backends, extra))

    def _draw_pending(self) -> None:
        if self._pending is None:
            return
        step, loss, *rest = self._pending
        self._pending = None
        if self._live is not None:
            self._live.update(self._render(step, _value(loss), *rest))
            self._live.refresh()

    def message(self, text: str) -> None:
        """A one-off rank-0 notice (evaluation result, checkpoint written, cache state); also after
        ``close`` (the stage's last checkpoint and its end are reported once the display stopped)."""
        if self.rank != 0:
            return
        if self._console is not None:
            self._console.print(text, markup=False, highlight=False)
        else:
            self._write(f"[{self.stage}] {text}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._live is not None:
            self._draw_pending()  # the panel left on screen shows the last step, as before
            self._live.stop()
            self._live = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- formatting ----------------------------------------------------------------------
    def format_line(self, step: int, loss: float | None, lr: float, tokens_per_s: float, elapsed: float,
                    eta: float | None, backends: Mapping[str, object] | None = None,
                    extra: Mapping[str, Any] | None = None) -> str:
        parts = [
            f"[{self.stage}] step {step}/{self.total_steps}",
            f"loss {_fmt_loss(loss)}",
            f"lr {lr:.1e}",
            f"tok/s {tokens_per_s:,.0f}",
            f"elapsed {format_duration(elapsed)}",
            f"eta {format_duration(eta)}",
        ]
        tail = " ".join(p for p in (_pairs(backends), _pairs(extra)) if p)
        return " ".join(parts) + (f" {tail}" if tail else "")

    def _render(self, step: int, loss: float | None, lr: float, tokens_per_s: float, elapsed: float, eta: float | None,
                backends: Mapping[str, object] | None, extra: Mapping[str, Any] | None) -> Panel:
        from rich.panel import Panel
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold")
        grid.add_column()
        rows = [
            ("step", f"{step:,} / {self.total_steps:,}"),
            ("loss", _fmt_loss(loss)),
            ("lr", f"{lr:.3e}"),
            ("tokens/s", f"{tokens_per_s:,.0f}"),
            ("elapsed", format_duration(elapsed)),
            ("eta", format_duration(eta)),
        ]
        if backends:
            rows.append(("kernels", _pairs(backends)))
        rows.extend((str(k), str(v)) for k, v in (extra or {}).items())
        for key, value in rows:
            grid.add_row(key, value)
        # A table cell, not a Group line: a bare ProgressBar has no line end and would swallow
        # the row after it.
        grid.add_row("", ProgressBar(total=self.total_steps, completed=min(step, self.total_steps), width=40))
        return Panel(grid, title=f"ds-trhash · {self.stage}", expand=False)

    # -- plumbing ------------------------------------------------------------------------
    def _start_live(self, console: Console | None) -> None:
        from rich.console import Console
        from rich.live import Live
        from rich.text import Text

        self._console = console if console is not None else Console(file=self.stream)
        # Manual refresh: no background thread racing the training loop for the terminal.
        live = Live(Text(f"[{self.stage}] starting"), console=self._console, auto_refresh=False, transient=False)
        self._live = live
        live.start()

    def _write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or not a real file
        return False
