"""Parameter groups, the refusals made before any engine is built, and the distributed start-up."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from ds_trhash.model import TRHashConfig, TRHashForCausalLM
from ds_trhash.training.config import load_config
from ds_trhash.training.engine import EngineError, check_runnable, param_groups
from tests.training.launch_utils import REPO, base_env, explain, free_port


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


# On CPU the trainer starts DeepSpeed without its shared-memory op (engine.without_shared_memory_op):
# that op cost a C++ compile on a fresh environment and left ~64 MiB per rank in /dev/shm for good.
# Every launch of the suite also checks that no segment is left (launch_utils.shm_segments).
PROBE = textwrap.dedent(
    """
    import importlib, json
    import torch
    import deepspeed.comm as ds_comm
    ds_torch_backend = importlib.import_module("deepspeed.comm.torch")
    from ds_trhash.training import engine

    build = ds_torch_backend.build_shm_op
    rank, world = engine.init_distributed()
    t = torch.full((8,), 2.0)
    ds_comm.inference_all_reduce(t, op=torch.distributed.ReduceOp.SUM)
    print(json.dumps({"rank": rank, "world": world, "op": importlib.import_module("deepspeed.comm.comm").cdb.shm_comm_op is not None,
                      "restored": ds_torch_backend.build_shm_op is build, "sum": t.tolist()[:2]}))
    torch.distributed.destroy_process_group()
    """
)


def test_cpu_start_builds_no_shared_memory_op(tmp_path):
    extensions = tmp_path / "torch_extensions"
    extensions.mkdir()
    env = base_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()), TORCH_EXTENSIONS_DIR=str(extensions))
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, explain(proc)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {"rank": 0, "world": 1, "op": False, "restored": True, "sum": [2.0, 2.0]}
    assert list(extensions.iterdir()) == [], "DeepSpeed compiled an op at start-up"
    assert "built successfully" not in proc.stdout + proc.stderr


def test_deepspeeds_gradient_bucket_is_sized_to_the_model_unless_the_config_sets_it():
    """ZeRO 1/2 allocate reduce_bucket_size elements whole (5e8 by default); a model with fewer
    trainable parameters gets a bucket of their number, which holds every gradient as before."""
    from ds_trhash.training.engine import with_bucket_fitting

    model = torch.nn.Linear(4, 3)  # 15 parameters
    model.bias.requires_grad_(False)
    for stage in (1, 2):
        fitted = with_bucket_fitting({"zero_optimization": {"stage": stage}, "bf16": {"enabled": True}}, model)
        assert fitted == {"zero_optimization": {"stage": stage, "reduce_bucket_size": 12}, "bf16": {"enabled": True}}
    chosen = {"zero_optimization": {"stage": 1, "reduce_bucket_size": 1000}}
    assert with_bucket_fitting(chosen, model) is chosen  # the config's own size is kept
    stage0 = {"zero_optimization": {"stage": 0}}
    assert with_bucket_fitting(stage0, model) is stage0  # no bucket without ZeRO 1/2
