"""Argument values that cannot be meant end as one argparse usage error (exit 2), through the real
commands, before anything runs: process counts, seeds, temperatures, timeouts."""

import argparse

import pytest

from ds_trhash.argtypes import finite_float, nonnegative_float, nonnegative_int, positive_int, seed
from ds_trhash.cli import main


@pytest.mark.parametrize("fn,text,message", [
    (positive_int, "0", "must be at least 1, got 0"), (positive_int, "-2", "must be at least 1, got -2"),
    (positive_int, "two", "'two' is not an integer"), (seed, str(10**30), "must be an integer from 0 to 2**64 - 1"),
    (seed, "-1", "from 0 to"), (finite_float, "nan", "must be a finite number"),
    (finite_float, "inf", "must be a finite number"), (nonnegative_float, "-5", "must be >= 0, got -5"),
    (nonnegative_int, "-1", "must be at least 0, got -1"), (nonnegative_int, "1.5", "'1.5' is not an integer"),
])
def test_each_type_refuses_with_the_reason(fn, text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message.replace("*", r"\*")):
        fn(text)


def test_accepted_values_come_back_typed():
    assert positive_int("3") == 3 and seed(str(2**64 - 1)) == 2**64 - 1 and nonnegative_float("0") == 0.0
    assert nonnegative_int("0") == 0


@pytest.mark.parametrize("argv,needle", [
    (["preflight", "--config", "ds_configs/tiny/pretrain.yaml", "--nproc", "0"], "argument --nproc: must be at least 1"),
    (["preflight", "--config", "ds_configs/tiny/pretrain.yaml", "--nproc", "-2"], "argument --nproc: must be at least 1"),
    (["generate", "--model", "m", "--prompt", "x", "--seed", str(10**30)], "argument --seed: must be an integer"),
    (["generate", "--model", "m", "--prompt", "x", "--temperature", "nan"], "argument --temperature: must be a finite"),
    (["generate", "--model", "m", "--prompt", "x", "--temperature", "inf"], "argument --temperature: must be a finite"),
    (["sync", "--local", "x", "--repo-id", "a/b", "--lock-timeout", "-5"], "argument --lock-timeout: must be >= 0"),
    (["sync", "--local", "x", "--repo-id", "a/b", "--lock-timeout", "nan"], "argument --lock-timeout: must be a finite"),
])
def test_the_commands_refuse_them_at_parse_time(argv, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and needle in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing written
