"""What a checkpoint records besides tensors: the trainer state and the machine it ran on."""
from ds_trhash.checkpoints.state import describe_hardware


def test_hardware_is_described_from_the_machine():
    text = describe_hardware()
    assert text.startswith("CPU: ") or " x " in text
