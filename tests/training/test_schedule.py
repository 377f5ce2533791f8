"""Warmup + cosine + floor schedule (docs/contracts.md §6) and warmup-stable-decay with a warmup in
tokens (§6b) at their edges, and their resumability."""
import io
import math
from types import SimpleNamespace

import pytest
import torch

from ds_trhash.training.schedule import build_scheduler, lr_factor, warmup_steps_for, warmup_steps_from_tokens


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


def sched_cfg(**changes):
    """A ``schedule`` section with the config's defaults (ScheduleSection duck type)."""
    values = dict(kind="cosine", warmup_fraction=0.03, fraction=0.03, warmup_tokens=None, warmup_start_factor=0.0,
                  stable_fraction=0.8, min_warmup_steps=1, floor=0.1)
    values.update(changes)
    return SimpleNamespace(**values)


SCHED = sched_cfg()


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
        build_scheduler(_opt(), 10, sched_cfg(kind="linear"))


# --- the release's recipe (docs/contracts.md §6b) ---------------------------------------------

RELEASE_H, RELEASE_TOKENS_PER_STEP = 165_297, 786_432


def release_factor(step, H, W, start=0.01, floor=0.1):
    """§6b written out: a line from `start` to 1 over W steps, then int(0.8 R) steps at the peak,
    then a cosine over the last R - int(0.8 R) steps to `floor`, R = H - W."""
    s = step + 1
    if s <= W:
        return start + (1 - start) * s / W
    R = H - W
    stable = int(0.8 * R)
    if s - W <= stable:
        return 1.0
    return floor + (1 - floor) / 2 * (1 + math.cos(math.pi * (s - W - stable) / (R - stable)))


def test_warmup_in_tokens_rounds_up_to_whole_steps():
    assert warmup_steps_from_tokens(RELEASE_H, 10**9, RELEASE_TOKENS_PER_STEP) == 1272   # ceil(1271.57)
    assert warmup_steps_from_tokens(89_006, 5 * 10**8, RELEASE_TOKENS_PER_STEP) == 636   # ceil(635.78)
    assert warmup_steps_from_tokens(100, 1000, 100) == 10                                # exact: no extra step
    assert warmup_steps_from_tokens(5, 10**9, 1000) == 5                                 # never past the run
    assert warmup_steps_from_tokens(100, 1, 1000, minimum=3) == 3


def test_wsd_at_its_boundaries_matches_the_release_formula():
    H, W = RELEASE_H, 1272
    R = H - W
    stable = int(0.8 * R)
    f = lambda step: lr_factor(step, H, W, 0.1, kind="wsd", warmup_start=0.01)  # noqa: E731
    assert f(0) == pytest.approx(0.01 + 0.99 / W, rel=1e-12)          # first step, just above the start factor
    assert f(W - 1) == 1.0                                             # last warmup step: the peak
    assert f(W) == 1.0                                                 # first stable step
    assert f(W + stable - 1) == 1.0                                    # last stable step
    first_decay = f(W + stable)
    assert first_decay < 1.0 and first_decay == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / (R - stable))))
    assert f(H - 1) == 0.1                                             # last step: exactly the floor (3e-5 at 3e-4)
    assert f(H + 3) == 0.1
    for step in (0, 1, W // 2, W - 1, W, W + 1, W + stable - 1, W + stable, W + stable + 1,
                 (W + stable + H) // 2, H - 2, H - 1):
        assert f(step) == pytest.approx(release_factor(step, H, W), rel=1e-12, abs=1e-15), step
    decay = [f(k) for k in range(W + stable, H)]
    assert all(a > b for a, b in zip(decay, decay[1:]))                # strictly down to the floor


def test_a_zero_start_factor_keeps_the_existing_warmup():
    for step in range(10):
        assert lr_factor(step, 10, 4, warmup_start=0.0) == lr_factor(step, 10, 4)
    assert lr_factor(0, 10, 4, warmup_start=0.0) == 0.25


def test_wsd_on_short_runs():
    # R = 1: int(0.8) = 0 stable steps, the single post-warmup step is the floor.
    assert [lr_factor(k, 3, 2, kind="wsd") for k in range(3)] == pytest.approx([0.5, 1.0, 0.1])
    # R = 10: 8 stable steps, then 2 decay steps ending on the floor.
    got = [lr_factor(k, 12, 2, kind="wsd") for k in range(12)]
    assert got[:10] == pytest.approx([0.5] + [1.0] * 9)
    assert got[10] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 2))) and got[11] == 0.1
    assert lr_factor(0, 1, 1, kind="wsd") == 1.0                      # one step, all warmup
    with pytest.raises(ValueError, match="cosine, wsd"):
        lr_factor(0, 10, 1, kind="linear")


def test_release_scheduler_sizes_its_warmup_from_tokens_per_step():
    cfg = sched_cfg(kind="wsd", warmup_fraction=None, fraction=None, warmup_tokens=10**9, warmup_start_factor=0.01)
    opt = _opt(3e-4)
    sched = build_scheduler(opt, RELEASE_H, cfg, RELEASE_TOKENS_PER_STEP)
    assert sched.lr_lambdas[0].keywords["warmup_steps"] == 1272
    assert opt.param_groups[0]["lr"] == pytest.approx(3e-4 * (0.01 + 0.99 / 1272))
    with pytest.raises(ValueError, match="tokens per optimizer step"):
        build_scheduler(_opt(), 100, cfg)
