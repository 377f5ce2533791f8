"""A Hub that stays away longer than data.hub_wait_minutes in the middle of a streamed run: the
run stops without a traceback, the rank that met it says how long it waited and what to run, the
last checkpoint is kept, and the same command with --resume auto finishes the run once the Hub
answers again.

The corpus is the demo's tokenizer over many small shards (4 rows each), so that the run still
asks the Hub for shards it has not read after its first checkpoint: the demo corpus itself has
so few that the first micro-batches' look-ahead fetches every one of them."""
from __future__ import annotations

import time

import numpy as np
import pytest

from ds_trhash.data.embedded import build_embedded
from ds_trhash.data.formats.shards import load_manifests, write_shards
from ds_trhash.data.formats.tokenizer import tokenizer_sha256
from ds_trhash.data.plans.build import build_plan
from ds_trhash.data.plans.plan import write_plan
from tests.data.hub_corpus import TOKEN, corpus_files
from tests.release.hub_server import HubServer, seed_dataset
from tests.training import launch_utils as L

pytestmark = pytest.mark.launch
REPO = "team/embedded-outage"


def _small_shard_corpus(root, tokenizer_dir):
    """Two sources of 24 shards of 4 rows of 128 tokens (random ids of the demo's vocabulary)
    and a plan over all of them: (corpus root, plan path)."""
    rng = np.random.default_rng(7)
    for source in ("a", "b"):
        stream = rng.integers(1, 4096, size=24 * 4 * 128 + 1)
        write_shards(source, [stream], 128, 4, root / "corpus", vocab_size=4096,
                     tokenizer_hash=tokenizer_sha256(tokenizer_dir))
    doc = build_plan(load_manifests([root / "corpus"]), 2 * 24 * 4 * 128, dataset=f"hf://datasets/{REPO}", revision="main")
    write_plan(doc, root / "plan.json")
    return root / "corpus", root / "plan.json"


def test_an_outage_beyond_the_budget_stops_cleanly_and_resume_auto_finishes(tmp_path):
    tokenizer_dir = build_embedded(tmp_path / "embedded", seq_len=128).tokenizer_dir
    corpus, plan = _small_shard_corpus(tmp_path, tokenizer_dir)
    out = tmp_path / "run"
    args = L.reference_run(out, micro=8, extra=[
        "--set", f"data.plan={plan}", "--set", f"data.shards_dir=hf://datasets/{REPO}",
        "--set", f"data.tokenizer={tokenizer_dir}", "--set", f"data.cache_dir={tmp_path / 'cache'}",
        "--set", "data.hub_wait_minutes=0.05"])  # 3 s of patience
    first_checkpoint = out / "checkpoints" / "step_00000003"
    with HubServer(TOKEN, deadline_s=600) as hub:
        seed_dataset(hub, REPO, corpus_files(corpus))

        def down_after_first_checkpoint(name):  # the first shard request after step 3's checkpoint
            if name == "resolve" and first_checkpoint.is_dir() and not hub.outage_until:
                hub.outage_headers = {"Retry-After": "1"}
                hub.outage_until = time.monotonic() + 3600

        hub.observers.append(down_after_first_checkpoint)
        env = dict(HF_ENDPOINT=hub.url, HF_TOKEN=TOKEN, HF_HUB_DISABLE_XET="1", TOKENIZED_CACHE_GB="1")
        stopped = L.single(args, timeout=300, **env)
        said = stopped.stdout + stopped.stderr
        assert hub.outage_until, "no shard was requested after the first checkpoint"
        assert stopped.returncode == 2 and "Traceback" not in said, L.explain(stopped)
        assert "Hub answers HTTP 503" in said and "retrying in 1 s" in said, L.explain(stopped)
        assert "after" in said and "attempts over" in said and "(last: HTTP 503)" in said, L.explain(stopped)
        kept = L.checkpoint_steps(out)
        assert kept and f"the last complete checkpoint (step_{kept[-1]:08d}) is kept, and the same command with " \
                         "--resume auto continues from it once the Hub answers" in said, L.explain(stopped)
        hub.outage_until = -1.0  # the Hub is back
        resumed = L.single(args + ["--resume", "auto"], timeout=300, **env)
    assert resumed.returncode == 0, L.explain(resumed)
    assert f"resuming at step {kept[-1]}" in resumed.stdout + resumed.stderr
    assert L.checkpoint_steps(out)[-1] == L.REFERENCE_STEPS
