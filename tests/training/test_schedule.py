"""Warmup + cosine + floor schedule (docs/contracts.md §6) at its edges, and its resumability."""
import io
import math
from types import SimpleNamespace

import pytest
import torch

from ds_trhash.training.schedule import build_scheduler, lr_factor, warmup_steps_for


def spec_factor(step, H, W):
    """docs/contracts.md §6 written out literally, with its 0.1 floor."""
    s = step + 1
    return s / W if s <= W else 0.1 + 0.45 * (1 + math.cos(math.pi * (s - W) / (H - W)))


def test_warmup_steps():
    assert warmup_steps_for(5982) == 179          # the released SFT run: int(0.03 * 5982)
    assert warmup_steps_for(10) == 1              # int(0.3) = 0 -> the minimum of 1
    assert warmup_steps_for(100, 0.1) == 10
    assert warmup_steps_for(100, 0.0, minimum=0) == 0
    assert warmup_steps_for(3, 0.03, minimum=5) == 3   # never longer than the run
    with pytest.raises(ValueError):
        warmup_steps_for(0)
    with pytest.raises(ValueError):
        warmup_steps_for(10, 1.0)


def test_edges_of_a_long_run():
    H = 5982
    W = warmup_steps_for(H)
    assert lr_factor(0, H, W) == pytest.approx(1 / W)          # first step
    assert lr_factor(W - 1, H, W) == 1.0                        # end of warmup: s = W
    after = lr_factor(W, H, W)                                   # right after warmup
    assert after < 1.0 and after == pytest.approx(1.0, abs=1e-6)
    assert lr_factor(H - 1, H, W) == 0.1                         # last step: s = H, exactly the floor
    assert lr_factor(H + 5, H, W) == 0.1                         # past the end: stays at the floor
    mid = (H + W) // 2 - 1                                       # s - W = (H - W) / 2 -> cos = 0
    assert lr_factor(mid, H, W) == pytest.approx(0.55, abs=1e-3)


def test_hand_computed_small_run():
    # H = 10, W = 2: s=1 0.5, s=2 1.0, then 0.1 + 0.45 (1 + cos(pi k / 8)), k = s - 2
    expected = [0.5, 1.0, 0.965746, 0.868198, 0.722208, 0.55, 0.377792, 0.231802, 0.134254, 0.1]
    got = [lr_factor(step, 10, 2) for step in range(10)]
    assert got == pytest.approx(expected, abs=1e-6)
    assert got == pytest.approx([spec_factor(step, 10, 2) for step in range(10)], abs=1e-12)
    assert all(a >= b for a, b in zip(got[1:], got[2:]))         # monotone after warmup


def test_floor_is_a_parameter():
    assert lr_factor(9, 10, 2, floor=0.0) == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(5, 10, 2, floor=1.0) == 1.0
    assert lr_factor(4, 10, 2, floor=0.0) == pytest.approx(0.5 * (1 + math.cos(math.pi * 3 / 8)))


def test_degenerate_lengths():
    assert lr_factor(0, 1, 1) == 1.0                  # one-step run: all warmup, no division by H - W
    assert [lr_factor(s, 3, 3) for s in range(3)] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert lr_factor(0, 4, 0) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))  # no warmup
    with pytest.raises(ValueError):
        lr_factor(0, 4, 5)
    with pytest.raises(ValueError):
        lr_factor(-1, 4, 1)


def _opt(lr=2e-5):
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)


SCHED = SimpleNamespace(kind="cosine", warmup_fraction=0.03, min_warmup_steps=1, floor=0.1)


def test_scheduler_follows_the_formula_per_optimizer_step():
    opt = _opt(2e-5)
    sched = build_scheduler(opt, 100, SCHED)
    W = warmup_steps_for(100)
    seen = []
    for _ in range(100):
        seen.append(opt.param_groups[0]["lr"])   # the LR this optimizer step uses
        opt.step()
        sched.step()
    assert seen == pytest.approx([2e-5 * lr_factor(k, 100, W) for k in range(100)], rel=1e-12)
    assert seen[0] == pytest.approx(2e-5 / W) and seen[-1] == pytest.approx(2e-6)


def test_scheduler_resumes_exactly_from_state_dict():
    opt = _opt()
    sched = build_scheduler(opt, 50, SCHED)
    for _ in range(17):
        opt.step()
        sched.step()
    state = sched.state_dict()
    opt2 = _opt()
    sched2 = build_scheduler(opt2, 50, SCHED)
    sched2.load_state_dict(state)
    assert sched2.last_epoch == 17
    for _ in range(10):
        opt.step(); sched.step()
        opt2.step(); sched2.step()
        assert sched2.get_last_lr() == sched.get_last_lr()
    torch.save(state, io.BytesIO())  # picklable: no closure in the state


def test_unknown_kind_refused():
    with pytest.raises(ValueError, match="cosine"):
        build_scheduler(_opt(), 10, SimpleNamespace(kind="linear", warmup_fraction=0.0, min_warmup_steps=1, floor=0.1))
