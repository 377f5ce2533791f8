"""The command line the demo, smoke and the tests start a launch with."""
import socket

from ds_trhash.deepspeed_command import LAUNCH, deepspeed_command, free_port


def test_cpu_launch_form_uses_the_deepspeed_launcher():
    cmd = deepspeed_command("ds_configs/tiny/pretrain.yaml", 2, ["--output-dir", "x"])
    assert cmd[0].endswith("deepspeed") and cmd[1:3] == ["--num_gpus", "2"] and "--master_port" in cmd
    assert cmd[cmd.index("--master_port") + 2] == str(LAUNCH) and LAUNCH.is_file()
    assert cmd[-4:] == ["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", "x"]


def test_free_port_is_free_on_loopback():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # nothing holds it: a launch can listen there


def test_free_port_lies_below_the_ephemeral_range_so_no_outgoing_connection_takes_it(monkeypatch):
    """Between the choice and the launch's bind (the imports of every
    rank; longer on a loaded machine) a port in the ephemeral range can become an outgoing connection's source port."""
    from ds_trhash import deepspeed_command as command

    low = command._ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(max(1024, low - 16384) <= p < low for p in ports), (low, ports)
    assert len(ports) > 1  # drawn, not one fixed port two launches would share

    # every port of that range taken: the kernel's choice, still a free one
    monkeypatch.setattr(command, "_ephemeral_low", lambda: 1025)
    real_bind = socket.socket.bind

    def bind(self, address):
        if address[1] != 0:
            raise OSError(98, "Address already in use")
        return real_bind(self, address)

    monkeypatch.setattr(socket.socket, "bind", bind)
    port = free_port()
    monkeypatch.setattr(socket.socket, "bind", real_bind)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
