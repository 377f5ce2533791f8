"""The node's rank count: one lookup for the cache, the resource checks and the launch plan."""
import pytest

from ds_trhash.ranks import ranks_on_node


@pytest.mark.parametrize("env, expected", [
    ({}, 16),  # a plain process: one node holds the whole world
    ({"LOCAL_WORLD_SIZE": "4"}, 4),  # torchrun
    ({"LOCAL_SIZE": "8"}, 8),  # DeepSpeed's launcher sets only this one
    ({"LOCAL_WORLD_SIZE": "2", "LOCAL_SIZE": "2"}, 2),
    ({"LOCAL_WORLD_SIZE": "", "LOCAL_SIZE": "8"}, 8),
])
def test_ranks_on_node_reads_either_variable(env, expected):
    assert ranks_on_node(16, env) == expected


def test_the_launch_checks_use_the_same_lookup(monkeypatch):
    from ds_trhash.training.launch import resources

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_SIZE", "3")
    assert resources.local_processes(12) == 3
