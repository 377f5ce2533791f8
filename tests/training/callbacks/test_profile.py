"""ProfileCallback (profile.steps): which steps a trace holds, a stage that ends early, the config key."""
import json

import pytest
import torch

from ds_trhash.training import config as tcfg
from ds_trhash.training.callbacks import ProfileCallback
from ds_trhash.training.config import ConfigError
from ds_trhash.training.loop import TrainState

TINY = "ds_configs/tiny/pretrain.yaml"


def _steps(cb, state, upto):
    pauses = {}
    for n in range(state.step + 1, upto + 1):
        torch.randn(64, 64) @ torch.randn(64, 64)
        state.step = n
        state.pauses.clear()
        cb.on_step_end(state, {})
        pauses[n] = list(state.pauses)
    return pauses


def _trace_steps(path):
    events = json.loads(path.read_text())["traceEvents"]
    return sorted(e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#"))


def test_the_trace_holds_steps_first_to_last_and_they_stay_out_of_the_steady_rate(tmp_path):
    messages = []
    cb = ProfileCallback(3, 4, tmp_path / "profile", 0, "cpu", messages.append)
    state = TrainState(step=0, total_steps=6)
    cb.on_start(state)
    pauses = _steps(cb, state, 6)
    assert pauses == {1: [], 2: ["profile"], 3: ["profile"], 4: ["profile"], 5: [], 6: []}
    assert cb.prof is None and len(cb.written) == 1  # released after step 4, one file for this rank
    assert cb.written[0].name.startswith("rank0.") and cb.written[0].name.endswith(".pt.trace.json")
    assert _trace_steps(cb.written[0]) == ["ProfilerStep#3", "ProfilerStep#4"]
    assert messages == [f"profile of steps 3-4: {cb.written[0]} (one per rank; open with `tensorboard --logdir "
                        f"{tmp_path / 'profile'}` or ui.perfetto.dev)"]


def test_a_stage_that_ends_or_fails_inside_the_window_still_writes_what_was_recorded(tmp_path):
    cb = ProfileCallback(3, 9, tmp_path / "profile", 1, "cpu")
    state = TrainState(step=1, total_steps=4)  # a resume at step 1 of a stage of 4 steps
    cb.on_start(state)
    _steps(cb, state, 4)
    assert cb.prof is None and _trace_steps(cb.written[0]) == ["ProfilerStep#3", "ProfilerStep#4"]
    assert cb.written[0].name.startswith("rank1.")
    failing = ProfileCallback(2, 9, tmp_path / "failing", 0, "cpu")
    state = TrainState(step=0, total_steps=20)
    failing.on_start(state)
    _steps(failing, state, 3)
    failing.on_error(RuntimeError("step 4 failed"))
    failing.close()  # the callback releases the profiler it owns, with the steps it recorded
    assert failing.prof is None and _trace_steps(failing.written[0])[:2] == ["ProfilerStep#2", "ProfilerStep#3"]
    done = ProfileCallback(3, 4, tmp_path / "later", 0, "cpu")
    done.on_start(TrainState(step=4, total_steps=8))  # resumed past the window: nothing to profile
    assert done.prof is None and not (tmp_path / "later").exists()


def test_profile_steps_from_the_command_line_and_what_is_refused():
    assert tcfg.load_config(TINY, ["profile.steps=10,12"]).profile.steps == (10, 12)
    assert tcfg.load_config(TINY, ["profile.steps=[2, 2]"]).profile.steps == (2, 2)
    assert tcfg.load_config(TINY, []).profile.steps is None
    assert ProfileCallback.prepare(tcfg.load_config(TINY, [])) is None  # off: no callback
    with pytest.raises(ConfigError, match=r"profile\.steps: must be \[first, last\] optimizer steps with "
                                          r"2 <= first <= last .*got \[12, 10\]"):
        tcfg.load_config(TINY, ["profile.steps=12,10"])
    with pytest.raises(ConfigError, match=r"--set profile\.steps: profile\.steps: .*got \[1, 3\]"):
        tcfg.load_config(TINY, ["profile.steps=1,3"])
    with pytest.raises(ConfigError, match=r"profile\.steps: expected a list of 2"):
        tcfg.load_config(TINY, ["profile.steps=[5]"])
    with pytest.raises(ConfigError, match=r"profile\.step"):
        tcfg.load_config(TINY, ["profile.step=5,6"])  # unknown key, named
