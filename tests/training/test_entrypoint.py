"""Command-line arguments of launch/train.py turned into a validated config."""

import socket

import pytest

from ds_trhash.training import entrypoint
from ds_trhash.training.config import ConfigError
from ds_trhash.training.entrypoint import build_arg_parser, config_from_args, main


def _cfg(*argv):
    return config_from_args(build_arg_parser().parse_args(["--config", "ds_configs/tiny/sft.yaml", *argv]))


def test_cli_flags_become_validated_overrides():
    cfg = _cfg("--output-dir", "/tmp/x", "--max-steps", "7", "--source-stage", "supervised-finetuning",
               "--lora-rank", "4", "--set", "batch.micro_batch=2")
    assert cfg.output_dir == "/tmp/x" and cfg.training.max_steps == 7
    assert cfg.source_stage == "supervised-finetuning"
    assert cfg.lora.enabled and cfg.lora.rank == 4 and cfg.batch.micro_batch == 2
    assert not _cfg("--full-parameter").lora.enabled


def test_contradicting_or_bad_flags_are_refused():
    with pytest.raises(ConfigError, match="--full-parameter"):
        _cfg("--full-parameter", "--lora-rank", "4")
    with pytest.raises(ConfigError, match="max_steps"):
        _cfg("--max-steps", "0")
    with pytest.raises(ConfigError, match="lora.rank"):
        _cfg("--lora-rank", "0")
    with pytest.raises(ConfigError, match="batch.micro_batc"):
        _cfg("--set", "batch.micro_batc=2")


def test_main_reports_config_errors_in_one_line_and_exits_2(capsys):
    rc = main(["--config", "ds_configs/tiny/pretrain.yaml", "--set", "zero.stage=9"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "zero.stage" in err and err.count("\n") == 1


def test_a_port_held_by_another_process_is_in_use_and_a_free_one_is_not():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert entrypoint.port_in_use("127.0.0.1", port)
    assert not entrypoint.port_in_use("127.0.0.1", port)


def test_errors_of_one_rank_mid_run_are_one_line_per_rank_and_others_rank_0s(capsys, tmp_path):
    """A read's failure is printed by the rank that met it and by each peer naming its node (the
    Hub's with what to run next); a refusal every rank meets alike, by rank 0 alone; unequal
    nodes, by every rank (each node's terminal shows it)."""
    from ds_trhash.data.stream.cache import ShardIntegrityError
    from ds_trhash.data.stream.delivery import NodeLayoutError, PeerReadError, PeerStoreUnavailable
    from ds_trhash.errors import UserError

    own = ShardIntegrityError("shard a/x.bin from here: two downloads hashed 1 and 2")
    own.per_rank = True  # as the exchange marks this rank's own failed read
    for rank in (0, 3):
        for error in (own, PeerReadError("node 1 could not read"), NodeLayoutError("the nodes run 2 + 1 ranks"),
                      UserError("a key is wrong")):
            assert entrypoint._refused(error, rank, str(tmp_path)) == 2
        entrypoint._refused(PeerStoreUnavailable("node 0 could not read"), rank, str(tmp_path))
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "error: rank 0: shard a/x.bin from here: two downloads hashed 1 and 2", "error: rank 0: node 1 could not read",
        "error: rank 0: the nodes run 2 + 1 ranks", "error: a key is wrong",
        "error: rank 0: node 0 could not read; no checkpoint was written: run the same command again once the Hub answers",
        "error: rank 3: shard a/x.bin from here: two downloads hashed 1 and 2", "error: rank 3: node 1 could not read",
        "error: rank 3: the nodes run 2 + 1 ranks",
        "error: rank 3: node 0 could not read; no checkpoint was written: run the same command again once the Hub answers"]


def test_the_default_groups_timeout_outlasts_one_reads_budget():
    """30 minutes at least, and the Hub wait of one read plus ten minutes: the defaults' 30
    minutes of Hub wait make it 40 (a fixed 30 was no longer than the wait it had to outlast)."""
    assert entrypoint.group_timeout_minutes(_cfg().data) == 40.0
    assert entrypoint.group_timeout_minutes(_cfg("--set", "data.hub_wait_minutes=0.05").data) == 30.0
    assert entrypoint.group_timeout_minutes(_cfg("--set", "data.hub_wait_minutes=120").data) == 130.0
