"""The command line the demo, smoke and the tests start a launch with."""
import socket

from ds_trhash.training.launch.command import LAUNCH, deepspeed_command, free_port


def test_cpu_launch_form_uses_the_deepspeed_launcher():
    cmd = deepspeed_command("ds_configs/tiny/pretrain.yaml", 2, ["--output-dir", "x"])
    assert cmd[0].endswith("deepspeed") and cmd[1:3] == ["--num_gpus", "2"] and "--master_port" in cmd
    assert cmd[cmd.index("--master_port") + 2] == str(LAUNCH) and LAUNCH.is_file()
    assert cmd[-4:] == ["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", "x"]


def test_free_port_is_free_on_loopback():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # nothing holds it: a launch can listen there
