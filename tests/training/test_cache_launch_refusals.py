"""The node cache's refusals through the real entry point, before anything is written: a bound
below what the plan reads at once (with the node's rank count from LOCAL_SIZE alone, as
DeepSpeed's launcher sets it), and a cache folder that holds a user's files."""
from __future__ import annotations

import json

import pytest

from ds_trhash.data.embedded import build_embedded
from tests.fail_closed import tree_digest
from tests.training import launch_utils as L

pytestmark = pytest.mark.e2e
GIB = 1024**3


def _args(out, *extra):
    return ["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", str(out), "--max-steps", "2",
            "--set", "checkpoint.packs=null", "--set", "batch.micro_batch=2", *extra]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache-refusals")
    paths = build_embedded(root / "embedded", seq_len=128)
    largest = max(s["bytes"] for source in ("topics_a", "topics_b")
                  for s in json.loads((paths.shards_dir / source / "manifest.json").read_text())["shards"])
    return root, paths, largest


def _refused(root, argv, env, *needles):
    before = tree_digest(root)
    proc = L.single(argv, **env)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in said, L.explain(proc)
    for needle in needles:
        assert needle in said, L.explain(proc)
    assert tree_digest(root) == before, "a refused launch changed files"


def test_a_bound_below_the_plans_need_is_refused_naming_the_minimum_with_local_size(corpus):
    root, paths, largest = corpus
    data = ["--set", f"data.plan={paths.pretrain_plan}", "--set", f"data.shards_dir={paths.shards_dir}",
            "--set", f"data.cache_dir={root / 'cache'}"]
    # one process, but the launcher says 8 ranks share this node (LOCAL_SIZE only): 8 + 2 prefetched
    need = largest * (8 + 2)
    _refused(root, _args(root / "run", *data), {"LOCAL_SIZE": "8", "TOKENIZED_CACHE_GB": repr((need - 1) / GIB)},
             "or one per rank: 8 on this node", f"the smallest bound that works is {need} bytes")
    # two sources read at once + 2 prefetched, with the rank alone on its node
    need = largest * (2 + 2)
    _refused(root, _args(root / "run", *data), {"TOKENIZED_CACHE_GB": repr((need - 1) / GIB)},
             "a shard of each of the 2 sources read at once", f"the smallest bound that works is {need} bytes")


def test_a_cache_folder_holding_a_users_file_is_refused_and_the_file_survives(corpus):
    root, paths, largest = corpus
    folder = root / "mine"
    folder.mkdir()
    (folder / "precious.txt").write_text("not the cache's")
    _refused(root, _args(root / "run2", "--set", f"data.plan={paths.pretrain_plan}", "--set",
                         f"data.shards_dir={paths.shards_dir}", "--set", f"data.cache_dir={folder}"), {},
             f"data.cache_dir {folder} already holds files the shard cache did not write",
             str(folder / "precious.txt"))
    assert (folder / "precious.txt").read_text() == "not the cache's"
