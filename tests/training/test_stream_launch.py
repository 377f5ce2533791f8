"""A 2-rank launch that streams its shards from the loopback Hub through the real client: killed
with SIGKILL while a download is in flight, resumed with --resume auto after `main` moved (it
reads the commit it started on), through a 503, a dropped connection, a stalled transfer and a
corrupt body; it ends bit-identical to the same plan read from a local directory. Each shard is
downloaded once per node, the cache never holds more than its bound, and the token is in no file.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time

import pytest

from ds_trhash.data.stream.cache import files as cf
from ds_trhash.data.embedded import build_embedded
from ds_trhash.data.plans.plan import load_plan
from tests.data.hub_corpus import TOKEN, corpus_files
from tests.fail_closed import tree_digest
from tests.release.hub_server import HubServer, seed_dataset
from tests.training import launch_utils as L

pytestmark = pytest.mark.e2e

STEPS = L.REFERENCE_STEPS
REPO = "team/embedded"
STALLED = "topics_a/shard-00001.bin"  # first read at step 5, after the checkpoint of step 3
GIB = 1024**3


def _losses(out):
    return {int(r["step"]): r["train_loss"] for r in L.metrics(out) if r["train_loss"]}


def _sampler(cache_dir, seen, stop):
    while not stop.is_set():
        if cache_dir.exists():
            with cf.evict_lock(cache_dir):  # measure only: a pruning scan would delete the killed run's partial
                seen.append(cf.scan(cache_dir, prune=False)[0])
        time.sleep(0.05)


def _refine_after_main_moved(out, paths, tmp_path, env) -> dict:
    """Refinement from the run's last checkpoint after main moved (losing a shard the plan reads):
    it reads pretraining's commit and says so; on a local copy of the corpus with other bytes under
    one shard's name (its manifest resealed to match), it is refused naming that file, and nothing
    is written. Returns the refinement's trainer_state."""
    init = out / "checkpoints" / f"step_{STEPS:08d}"
    ref_out = tmp_path / "refine"
    base = ["--config", "ds_configs/tiny/refine.yaml", "--max-steps", "2", "--init-checkpoint", str(init),
            "--set", f"data.plan={paths.refine_plan}", "--set", f"data.tokenizer={paths.tokenizer_dir}"]
    refined = L.single(base + ["--output-dir", str(ref_out), "--set", f"data.shards_dir=hf://datasets/{REPO}"],
                       timeout=300, **env)
    said = refined.stdout + refined.stderr
    assert refined.returncode == 0, L.explain(refined)
    assert "has moved to" in said and "since pretraining read it" in said, L.explain(refined)

    copy = tmp_path / "copy"
    shutil.copytree(paths.shards_dir, copy)
    shard = copy / "topics_a" / "shard-00000.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    manifest = json.loads((copy / "topics_a" / "manifest.json").read_text())
    entry = next(s for s in manifest["shards"] if s["file"] == "shard-00000.bin")
    entry["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    (copy / "topics_a" / "manifest.json").write_text(json.dumps(manifest))
    before = tree_digest(tmp_path)
    other = L.single(base + ["--output-dir", str(tmp_path / "refine-other"), "--set", f"data.shards_dir={copy}"],
                     timeout=300, **env)
    said = other.stdout + other.stderr
    assert other.returncode == 2 and "Traceback" not in said, L.explain(other)
    assert "is not the one pretraining read: topics_a/shard-00000.bin has sha256" in said, L.explain(other)
    assert tree_digest(tmp_path) == before
    return json.loads((ref_out / "checkpoints" / f"step_{2:08d}" / "trainer_state.json").read_text())


def test_streamed_launch_killed_mid_download_resumes_bit_identical(shared_launches, tmp_path):
    ref = shared_launches.get(2, lambda o: L.reference_run(o, micro=4))
    paths = build_embedded(ref.parent / "embedded", seq_len=128)  # the reference's corpus (already built)
    plan = load_plan(paths.pretrain_plan)
    planned = {f"{s}/{e['file']}" for ph in plan.doc["phases"] for s, es in ph["sources"].items() for e in es}
    files = corpus_files(paths.shards_dir)
    bound = sum(len(files[p]) for p in planned)  # exactly the planned shards: nothing to spare
    out = tmp_path / "run"
    args = L.reference_run(out, micro=4) + ["--set", f"data.plan={paths.pretrain_plan}", "--set",
                                            f"data.shards_dir=hf://datasets/{REPO}",
                                            "--set", f"data.tokenizer={paths.tokenizer_dir}",
                                            "--set", f"data.cache_dir={out / 'shard_cache'}"]
    seen, stop = [], threading.Event()
    with HubServer(TOKEN, deadline_s=900) as hub:
        first = seed_dataset(hub, REPO, files)
        env = dict(HF_ENDPOINT=hub.url, HF_TOKEN=TOKEN, HF_HUB_DISABLE_XET="1", HF_HUB_DOWNLOAD_TIMEOUT="540",
                   TOKENIZED_CACHE_GB=repr(bound / GIB))
        hub.file_faults.update({"topics_b/shard-00000.bin": ["503"], "topics_a/shard-00004.bin": ["drop"],
                                "topics_b/shard-00001.bin": ["corrupt"], STALLED: ["stall"]})
        # the first run is killed while this transfer hangs: its stall timeout (540 s) outlasts the wait
        # below (400 s), so a slow machine cannot retry the transfer and finish it before the kill
        hub.stall_s = 600
        sampler = threading.Thread(target=_sampler, args=(out / "shard_cache", seen, stop), daemon=True)
        sampler.start()
        port = L.free_port()
        killed = subprocess.Popen([str(L.VENV_BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(port),
                                   str(L.REPO / "launch" / "train.py"), *args], cwd=L.REPO, env=L.base_env(**env),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        partial = []
        try:
            # the kill comes once the step-3 checkpoint is written and the stalled transfer of STALLED
            # has begun (its fault taken, its partial file present, no complete GET of it served)
            deadline = time.monotonic() + 400
            while time.monotonic() < deadline and not (
                    (out / "checkpoints" / "step_00000003").is_dir() and hub.file_faults[STALLED] == []
                    and STALLED not in hub.served and (partial := list(out.glob(f"shard_cache/*/{STALLED}.partial-*")))):
                assert killed.poll() is None, killed.communicate()[0][-5000:]
                time.sleep(0.2)
            os.killpg(killed.pid, signal.SIGKILL)
        finally:
            killed.wait(30)
            for seg in L.shm_segments(port):
                seg.unlink(missing_ok=True)
        assert partial, "the stalled download never began before the wait ended"
        assert L.checkpoint_steps(out) == [3] and all(p.exists() for p in partial)  # killed mid-download
        state = json.loads((out / "checkpoints" / "step_00000003" / "trainer_state.json").read_text())
        source = state["data_source"]
        assert (source["store"], source["commit"], source["revision"]) == (f"hf:{hub.url}/datasets/{REPO}", first, "main")
        assert sorted(source["shards"]) == sorted(planned)  # every planned shard's manifest hash, recorded

        moved = seed_dataset(hub, REPO, {STALLED: None})  # main moves on, without the stalled shard
        hub.stall_s = 5
        hub.file_faults[STALLED] = ["503", "drop", "stall", "corrupt"]
        resumed = L.deepspeed(2, args + ["--resume", "auto"], timeout=600, **{**env, "HF_HUB_DOWNLOAD_TIMEOUT": "2"})
        stop.set()
        assert resumed.returncode == 0, L.explain(resumed)
        served = dict(hub.served)  # the pretraining's downloads (the refinement below downloads its own)
        refined = _refine_after_main_moved(out, paths, tmp_path, env)
    # the resume says that main moved, and reads the commit it started on
    said = resumed.stdout + resumed.stderr
    assert f"'main' of hf:{hub.url}/datasets/{REPO} has moved to {moved[:12]} since this run read it; reading commit " \
           f"{first[:12]}" in said, L.explain(resumed)
    assert refined["data_source"]["commit"] == first
    assert moved != first and "resuming at step 3" in resumed.stdout, L.explain(resumed)
    # a readable console: no line per HTTP request of the Hub client and no progress bar per file,
    # the downloads said in one figure (the end-of-stage data line), the kernels stated once
    console = resumed.stdout + resumed.stderr
    assert "HTTP Request:" not in console and "kernel choice:" not in console, console[-3000:]
    assert "%|" not in console and "it/s]" not in console, console[-3000:]
    assert re.search(r"data wait on rank 0: .* cache hits; downloaded [\d.]+ (GiB|MiB|KiB|B) at [\d.]+ "
                     r"(GiB|MiB|KiB|B)/s\)", console), console[-3000:]
    assert re.search(r"step \d+/\d+ .* cache=.* downloaded=[\d.]+ (GiB|MiB|KiB|B) at ", console), console[-3000:]
    assert len([line for line in console.splitlines() if line.lstrip().startswith("kernels ")]) == 1
    L.assert_identical(L.model_weights(out / "checkpoints" / f"step_{STEPS:08d}"), L.model_weights(
        ref / "checkpoints" / f"step_{STEPS:08d}"))
    assert _losses(out) == _losses(ref)
    # once per node: a complete GET per planned shard, plus one for each corrupt body served
    corrupt = {"topics_b/shard-00001.bin", STALLED}
    assert {p: n for p, n in served.items() if p in planned} == {p: 1 + (p in corrupt) for p in planned}
    assert seen and max(seen) <= bound
    assert not list(out.rglob(f"*{cf.PARTIAL}*")), "the killed run's partial download outlived the resume"
    written = [p for p in out.rglob("*") if p.is_file()]
    assert not [p for p in written if TOKEN.encode() in p.read_bytes()]
