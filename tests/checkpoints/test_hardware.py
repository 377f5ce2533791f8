"""The hardware a checkpoint and a run record name (checkpoints/hardware.py)."""
from ds_trhash.checkpoints import hardware
from ds_trhash.checkpoints.hardware import describe_hardware


def test_hardware_is_described_from_the_machine():
    text = describe_hardware()
    assert text.startswith("CPU: ") or " x " in text


def test_a_broken_cuda_install_falls_back_to_the_cpu_model(monkeypatch):
    def broken():
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(hardware.torch.cuda, "is_available", broken)
    assert describe_hardware().startswith("CPU: ")
