"""Parameter groups, the refusals made before any engine is built, and the distributed start-up."""

import json
import subprocess
import textwrap

import pytest

from ds_trhash.model import TRHashConfig, TRHashForCausalLM
from ds_trhash.training.config import load_config
from ds_trhash.training.engine import EngineError, check_runnable, param_groups
from tests.training.launch_utils import REPO, VENV_BIN, base_env, explain, free_port, shm_segments


def test_no_decay_on_norms_and_vectors_decay_on_matrices():
    model = TRHashForCausalLM(TRHashConfig.from_preset("tiny"))
    groups = {g["name"]: g for g in param_groups(model, 0.1)}
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in groups["decay"]["params"]}
    plain = {names[id(p)] for p in groups["no_decay"]["params"]}
    assert groups["decay"]["weight_decay"] == 0.1 and groups["no_decay"]["weight_decay"] == 0.0
    assert "embed_tokens.weight" in decayed
    assert "layers.0.mlp.engine.expert_gate" in decayed
    assert all("norm" in n for n in plain) and "norm.weight" in plain
    assert "layers.0.self_attn.q_norm.weight" in plain
    assert decayed | plain == set(names.values())


def test_frozen_parameters_are_left_out_and_all_frozen_is_refused():
    model = TRHashForCausalLM(TRHashConfig.from_preset("tiny"))
    for n, p in model.named_parameters():
        p.requires_grad = "q_proj" in n
    groups = param_groups(model, 0.1)
    assert sum(len(g["params"]) for g in groups) == model.config.num_layers
    for p in model.parameters():
        p.requires_grad = False
    with pytest.raises(EngineError, match="no trainable parameters"):
        param_groups(model, 0.1)


def _cfg(tmp_path, **sets):
    return load_config("ds_configs/tiny/pretrain.yaml", [f"{k}={v}" for k, v in sets.items()])


def test_zero3_with_moe_layers_is_refused_before_training(tmp_path):
    from ds_trhash.training.config import ConfigError

    with pytest.raises((EngineError, ConfigError), match="ZeRO-3|zero.stage"):
        check_runnable(_cfg(tmp_path, **{"zero.stage": 3}), world_size=1)


def test_expert_parallel_size_must_divide_world(tmp_path):
    cfg = _cfg(tmp_path, **{"parallel.ep_size": 2})
    with pytest.raises(EngineError, match="does not divide the world size 3"):
        check_runnable(cfg, world_size=3)
    check_runnable(_cfg(tmp_path, **{"parallel.ep_size": 2, "zero.stage": 1}), world_size=2)  # EP needs ZeRO 1/2


# DeepSpeed's CPU shared-memory segments are unlinked right after init (init_distributed): before
# that, every CPU launch left ~64 MiB per rank in /dev/shm for good, and a day of test runs filled
# RAM until the machine swapped to a halt. Two real ranks under the `deepspeed` launcher, which
# sets LOCAL_SIZE, the condition for DeepSpeed to make the segments.
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


@pytest.mark.launch
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
