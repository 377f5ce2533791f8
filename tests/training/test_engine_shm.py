"""DeepSpeed's CPU shared-memory segments are unlinked right after init (engine.init_distributed).

Before this, every two-rank CPU launch left ~64 MiB per rank in /dev/shm for good; a day of test
runs filled RAM and the machine swapped to a halt. Two real ranks under the `deepspeed` launcher
(which sets LOCAL_SIZE, the condition for DeepSpeed to make the segments).
"""

import json
import subprocess
import textwrap

import pytest

from tests.training.launch_utils import REPO, VENV_BIN, base_env, explain, free_port, shm_segments

PROBE = textwrap.dedent(
    """
    import json, os, sys
    import torch, deepspeed
    import deepspeed.comm as ds_comm
    from ds_trhash.training import engine

    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    path = engine.shm_segment_path(rank)
    made = os.path.exists(path)
    engine.release_shm_segment_name(rank, world)
    gone = not os.path.exists(path)
    # the shared-memory all-reduce still works on the unlinked segments
    t = torch.full((4096,), float(rank + 1))
    ds_comm.inference_all_reduce(t)
    torch.distributed.barrier()
    with open(os.path.join(args[0], f"rank{rank}.json"), "w") as f:
        json.dump({"made": made, "gone": gone, "sum": t.tolist()[:3], "world": world}, f)
    if len(args) > 1 and rank == 1:
        os.kill(os.getpid(), 9)  # a killed rank leaves nothing behind either
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    """
)


@pytest.mark.parametrize("kill", [False, True], ids=["clean-exit", "rank-killed"])
def test_two_rank_launch_leaves_no_shared_memory_segment(tmp_path, kill):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    port = free_port()
    cmd = [str(VENV_BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(port), str(script), str(tmp_path)]
    if kill:
        cmd.append("kill")
    proc = subprocess.run(cmd, cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=300)
    leftover = shm_segments(port)
    for p in leftover:
        p.unlink()
    assert (proc.returncode != 0) == kill, explain(proc)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rep in reports:
        assert rep["world"] == 2
        assert rep["made"], "DeepSpeed made no /dev/shm segment: the launcher no longer sets LOCAL_SIZE?"
        assert rep["gone"]
        assert rep["sum"] == [3.0, 3.0, 3.0]
    assert leftover == [], f"segments left in /dev/shm: {leftover}"
