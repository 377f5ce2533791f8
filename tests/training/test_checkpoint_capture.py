"""The capturing checkpoint engine (training/checkpoint_capture.py): DeepSpeed's save hands it each
state file; it keeps a host copy of the step's values and the path, and leaves everything else
(loading, commit, the writer ranks) to the engine it wraps."""
from pathlib import Path
from types import SimpleNamespace

import torch

from ds_trhash.training.checkpoint_capture import CapturingCheckpointEngine, capturing


class TorchEngineLike:
    zipfile_serialization = False

    def load(self, path, map_location=None):
        return ("loaded", path)

    def is_decoupled(self):
        return False


def test_saves_are_captured_as_host_copies_and_the_rest_is_the_wrapped_engines(tmp_path):
    engine = SimpleNamespace(checkpoint_engine=TorchEngineLike())
    capture = capturing(engine)
    assert isinstance(engine.checkpoint_engine, CapturingCheckpointEngine) and capturing(engine) is capture
    weights = torch.zeros(4)
    capture.save({"module": {"w": weights}}, str(tmp_path / "state" / "mp_rank_00_model_states.pt"))
    weights.add_(1.0)  # the optimizer's next step
    assert not (tmp_path / "state").exists()  # nothing written on the training thread
    (pending,) = capture.take()
    assert pending.path == Path(tmp_path / "state" / "mp_rank_00_model_states.pt")
    assert torch.equal(pending.state["module"]["w"], torch.zeros(4)) and pending.zipfile is False
    assert capture.take() == []
    assert engine.checkpoint_engine.load("p") == ("loaded", "p") and not engine.checkpoint_engine.is_decoupled()
    assert capturing(SimpleNamespace()) is None  # a stand-in engine without one writes itself
