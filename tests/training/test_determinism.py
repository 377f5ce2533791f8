"""training.deterministic: what it changes in the process on a GPU, and that it leaves CPU alone."""
import os

import pytest
import torch

from ds_trhash.training.determinism import CUBLAS_WORKSPACE, describe, use_deterministic_kernels


@pytest.fixture
def restored(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def test_on_a_gpu_it_fixes_cublas_and_turns_on_deterministic_algorithms(restored):
    use_deterministic_kernels(True, on_cuda=True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE == ":4096:8"
    assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    assert describe(True, "cuda").startswith("on: torch.use_deterministic_algorithms")
    assert "CUBLAS_WORKSPACE_CONFIG=:4096:8" in describe(True, "cuda")


@pytest.mark.parametrize("enabled, on_cuda", [(False, True), (True, False)])
def test_off_or_on_cpu_nothing_changes(restored, enabled, on_cuda):
    before = torch.are_deterministic_algorithms_enabled()
    use_deterministic_kernels(enabled, on_cuda=on_cuda)
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    assert torch.are_deterministic_algorithms_enabled() == before
    assert describe(False, "cuda").startswith("off (training.deterministic false)")
    assert describe(enabled, "cpu").startswith("on CPU: every kernel already sums in a fixed order")
