"""Progress display: plain lines off a TTY, silence off rank 0, ETA, rich rendering."""
import io

import pytest
from rich.console import Console

from ds_trhash.training.display import Progress, byte_size, eta_seconds, format_duration


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def run(progress, clock, steps, dt=1.0, **kw):
    for step in steps:
        clock.t += dt
        progress.update(step, 5.1234, 3e-4, 12345.4, {"experts": "pytorch", "loss": "chunked"}, kw or None)


def test_plain_lines_every_n_and_last():
    out, clock = io.StringIO(), Clock()
    p = Progress("pretraining", 25, rank=0, stream=out, every=10, clock=clock)
    assert not p.live  # StringIO is not a TTY
    run(p, clock, range(1, 26), dt=2.0, cache="warm")
    p.close()
    lines = out.getvalue().splitlines()
    assert [line.split()[2] for line in lines] == ["10/25", "20/25", "25/25"]
    assert lines[0] == ("[pretraining] step 10/25 loss 5.1234 lr 3.0e-04 tok/s 12,345 elapsed 0:00:20 "
                        "eta 0:00:30 experts=pytorch loss=chunked cache=warm")
    assert "eta 0:00:00" in lines[-1]


def test_other_ranks_print_nothing():
    out, clock = io.StringIO(), Clock()
    p = Progress("supervised-finetuning", 10, rank=3, stream=out, every=1, force_plain=True, clock=clock)
    run(p, clock, range(1, 11))
    p.message("checkpoint written")
    p.close()
    assert out.getvalue() == ""


def test_rank_nonzero_never_starts_rich_even_on_a_terminal():
    console = Console(file=io.StringIO(), force_terminal=True)
    p = Progress("refinement", 10, rank=1, console=console)
    assert not p.live
    p.update(1, 1.0, 1e-4, 10.0, {})
    p.close()
    assert console.file.getvalue() == ""


def test_eta_arithmetic():
    assert eta_seconds(60.0, 20, 180) == pytest.approx(540.0)
    assert eta_seconds(0.0, 0, 100) is None
    assert eta_seconds(10.0, 5, -3) == 0.0
    assert format_duration(62) == "0:01:02"
    assert format_duration(90061) == "1 day, 1:01:01"
    assert format_duration(None) == "?"


def test_eta_counts_only_this_process_steps_after_resume():
    out, clock = io.StringIO(), Clock()
    p = Progress("pretraining", 200, rank=0, stream=out, every=10, start_step=100, clock=clock)
    run(p, clock, range(101, 111), dt=3.0)  # 10 steps, 30 s -> 90 steps left at 3 s
    assert "elapsed 0:00:30 eta 0:04:30" in out.getvalue()


def test_message_and_nan_loss_in_plain_mode():
    out, clock = io.StringIO(), Clock()
    p = Progress("supervised-finetuning", 4, rank=0, stream=out, every=2, clock=clock)
    p.message("held-out loss 1.7226")
    p.update(2, float("nan"), 2e-5, 0.0, None)
    lines = out.getvalue().splitlines()
    assert lines[0] == "[supervised-finetuning] held-out loss 1.7226"
    assert lines[1].startswith("[supervised-finetuning] step 2/4 loss nan lr 2.0e-05 tok/s 0 ")


def test_rich_mode_renders_into_a_terminal_console():
    console = Console(file=io.StringIO(), force_terminal=True, color_system=None, width=100)
    clock = Clock()
    p = Progress("supervised-finetuning", 30, rank=0, console=console, every=10, clock=clock)
    assert p.live
    run(p, clock, range(1, 31), dt=1.0, cache="hit 97%")
    p.message("checkpoint step_30")
    p.close()
    text = console.file.getvalue()
    for needle in ("supervised-finetuning", "30 / 30", "5.1234", "3.000e-04", "12,345", "experts=pytorch",
                   "hit 97%", "checkpoint step_30"):
        assert needle in text, needle
    p.update(31, 1.0, 1e-4, 1.0, {})  # after close: ignored, no error


def test_force_plain_overrides_a_terminal():
    console = Console(file=io.StringIO(), force_terminal=True)
    out, clock = io.StringIO(), Clock()
    p = Progress("pretraining", 1, rank=0, stream=out, force_plain=True, console=console, clock=clock)
    run(p, clock, [1])
    assert not p.live and out.getvalue().startswith("[pretraining] step 1/1 ")


def test_a_lazy_loss_is_read_only_for_the_steps_shown():
    """The loop keeps the loss on the device; the display asks for it only when it prints."""
    stream, asked = io.StringIO(), []

    def loss_of(step):
        return lambda: asked.append(step) or 2.5

    p = Progress("pretrain", total_steps=7, rank=0, stream=stream, force_plain=True, every=3)
    for step in range(1, 8):
        p.update(step, loss_of(step), 1e-3, 100.0)
    p.close()
    assert asked == [3, 6, 7]
    assert stream.getvalue().count("loss 2.5000") == 3


def test_notices_still_print_once_the_display_is_closed():
    """The callbacks close the display when the loop ends; the final checkpoint and the end of the
    stage are reported after that, as plain lines or on the rich console."""
    out, clock = io.StringIO(), Clock()
    p = Progress("pretraining", 2, rank=0, stream=out, every=1, clock=clock)
    run(p, clock, [1, 2])
    p.close()
    run(p, clock, [3])  # no step line after close
    p.message("pretraining finished at step 2/2")
    assert out.getvalue().splitlines()[-1] == "[pretraining] pretraining finished at step 2/2"
    assert "3/2" not in out.getvalue()
    console_out = io.StringIO()
    live = Progress("pretraining", 2, rank=0, every=1, console=Console(file=console_out, force_terminal=True))
    live.close()
    live.message("checkpoint step_00000002 (final, 0.1s)")
    assert not live.live and "checkpoint step_00000002 (final, 0.1s)" in console_out.getvalue()


def test_byte_sizes_are_said_in_the_largest_unit_that_keeps_them_at_least_one():
    assert [byte_size(n) for n in (0, 512, 1536, 3 * 2**20, 2.5 * 2**30)] == [
        "0 B", "512 B", "1.5 KiB", "3.0 MiB", "2.50 GiB"]
