"""Parameter groups, the refusals made before any engine is built, and the distributed start-up."""

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch

from ds_trhash.model import TRHashConfig, TRHashForCausalLM
from ds_trhash.model.loss import IGNORE_INDEX
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


# ----------------------------------------------------------------------------- the engine vs a plain loop
# The engine's step (DeepSpeed ZeRO 1, the client AdamW and schedule, loop.train_step's loss
# normalisation) against a loop written out by hand: fp32 master weights, torch AdamW with the
# contract's no-decay groups, the warmup-stable-decay factor applied per step, clip_grad_norm_,
# the summed loss of every micro-batch over the supervised tokens of the whole step. Ten steps of
# distinct batches, two micro-batches each with unequal ignored labels (a mean of micro-batch means
# would differ), and a clip threshold the gradients exceed (clipping changes every step).
REF_STEPS, REF_SEQ, REF_MICRO = 10, 32, 2
REF_SETS = {"data.seq_len": REF_SEQ, "batch.micro_batch": REF_MICRO, "batch.global_tokens": 2 * REF_MICRO * REF_SEQ,
            "zero.stage": 1, "optimizer.grad_clip": 0.05, "schedule.kind": "wsd", "schedule.warmup_fraction": "null",
            "schedule.warmup_tokens": 3 * 2 * REF_MICRO * REF_SEQ, "schedule.warmup_start_factor": 0.01,
            "schedule.stable_fraction": 0.5, "schedule.floor": 0.1}
REF_WARMUP = 3  # warmup_tokens / tokens per step, written out rather than computed by the code under test


@pytest.fixture
def one_rank_group(monkeypatch):
    """The trainer's process group for one rank in this process (gloo on CPU, NCCL on a GPU)."""
    from ds_trhash.training.engine import init_distributed

    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(key, value)
    init_distributed()


def _reference_batches() -> list[list[dict]]:
    gen = torch.Generator().manual_seed(7)
    steps = []
    for step in range(REF_STEPS):
        micro = []
        for m in range(2):
            ids = torch.randint(0, 64, (REF_MICRO, REF_SEQ), generator=gen)  # 64 of the ids: the loss can fall
            labels = torch.full_like(ids, IGNORE_INDEX)
            labels[:, :-1] = ids[:, 1:]
            labels[0, : 4 + 9 * m] = IGNORE_INDEX  # a prompt: the two micro-batches supervise unequal counts
            micro.append({"input_ids": ids, "labels": labels})
        steps.append(micro)
    return steps


def _reference_model(cfg, device: torch.device, dtype: torch.dtype, **shape):
    """The trainer's build order: seeded init, then the kernels the policy picks here."""
    from ds_trhash.model import backend

    torch.manual_seed(cfg.seed)
    model = TRHashForCausalLM(TRHashConfig.from_preset(cfg.model.preset, loss_chunk_tokens=cfg.kernels.loss_chunk_tokens,
                                                       **shape))
    backend.apply(model, backend.resolve(cfg.kernels.policy, device, model.config, dtype=dtype))
    return model


def _engine_run(cfg, batches, dtype, compile_mode="none", **shape):
    from ds_trhash.model.compile import compile_model
    from ds_trhash.training import config as tcfg
    from ds_trhash.training import loop
    from ds_trhash.training.engine import build_engine

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model = compile_model(_reference_model(cfg, device, dtype, **shape), compile_mode).to(device)  # the trainer's order
    eng = build_engine(model, cfg, tcfg.to_deepspeed_dict(cfg, 1), len(batches))
    rows = []
    for micro in batches:
        lr = eng.optimizer.param_groups[0]["lr"]
        out = loop.train_step(eng.engine, micro, eng.device, 1)
        rows.append((lr, float(out["loss"]), float(out["grad_norm"])))
    eng.engine.destroy()
    torch._dynamo.reset()
    return device, rows


def _plain_run(cfg, batches, device, dtype, warmup=REF_WARMUP, **shape):
    """The hand-written loop (fp32 masters as DeepSpeed keeps them for bf16; in fp32 they are the
    weights' own values, so the two coincide); ``warmup`` in steps, as the test computes it."""
    from ds_trhash.training.schedule import lr_factor

    o, s = cfg.optimizer, cfg.schedule
    model = _reference_model(cfg, device, dtype, **shape).to(device, dtype)
    named = list(model.named_parameters())
    masters = [p.detach().float().clone() for _, p in named]
    decay = [m for (n, p), m in zip(named, masters) if p.ndim >= 2 and "norm" not in n]
    plain = [m for (n, p), m in zip(named, masters) if not (p.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay}, {"params": plain, "weight_decay": 0.0}],
                            lr=o.lr, betas=tuple(o.betas), eps=o.eps, **({"fused": True} if device.type == "cuda" else {}))
    rows = []
    for step, micro in enumerate(batches):
        lr = o.lr * lr_factor(step, len(batches), warmup, s.floor, kind=s.kind, warmup_start=s.warmup_start_factor,
                              stable_fraction=s.stable_fraction)
        for group in opt.param_groups:
            group["lr"] = lr
        supervised = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro)
        total = 0.0
        for mb in micro:
            loss_sum = model(mb["input_ids"].to(device), labels=mb["labels"].to(device), reduction="sum")
            (loss_sum / supervised).backward()
            total += float(loss_sum.detach())
        for (_, p), m in zip(named, masters):
            m.grad = p.grad.float()
        norm = float(torch.nn.utils.clip_grad_norm_(masters, o.grad_clip))
        opt.step()
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for (_, p), m in zip(named, masters):
                p.copy_(m)
        rows.append((lr, total / supervised, norm))
    return rows


def _engine_against_plain_loop(precision: str, policy: str):
    cfg = load_config("ds_configs/tiny/pretrain.yaml", [f"{k}={v}" for k, v in
                                                        {**REF_SETS, "precision": precision, "kernels.policy": policy}.items()])
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    batches = _reference_batches()
    device, engine_rows = _engine_run(cfg, batches, dtype)
    plain_rows = _plain_run(cfg, batches, device, dtype)
    table = "\n".join(f"step {i}: lr {e[0]:.4e} / {p[0]:.4e}  loss {e[1]:.6f} / {p[1]:.6f}  grad norm {e[2]:.4f} / {p[2]:.4f}"
                      for i, (e, p) in enumerate(zip(engine_rows, plain_rows)))
    print(f"engine / plain loop, {precision}, policy {policy} on {device}:\n{table}")
    return engine_rows, plain_rows, table, cfg


@pytest.mark.parametrize("precision, tolerance", [("fp32", 2e-5), ("bf16", 2e-3)])
def test_the_engine_steps_as_a_plain_loop_with_the_same_optimizer_schedule_and_batches(one_rank_group, precision,
                                                                                       tolerance):
    """fp32: the same numbers up to summation order. bf16 (DeepSpeed's bf16 weights, bf16 gradients
    and fp32 masters against the loop's): within bf16 rounding over the ten steps."""
    engine_rows, plain_rows, table, cfg = _engine_against_plain_loop(precision, "pytorch")
    e_lr, e_loss, e_norm = (list(col) for col in zip(*engine_rows))
    p_lr, p_loss, p_norm = (list(col) for col in zip(*plain_rows))
    assert e_lr == pytest.approx(p_lr, rel=1e-12), table  # warmup from 0.01 x peak, stable, cosine to 0.1
    assert p_lr[0] < p_lr[REF_WARMUP - 2] < p_lr[REF_WARMUP - 1] == pytest.approx(cfg.optimizer.lr)
    assert p_lr[-1] == pytest.approx(cfg.optimizer.lr * cfg.schedule.floor)
    assert e_loss == pytest.approx(p_loss, rel=tolerance), table
    assert e_norm == pytest.approx(p_norm, rel=5 * tolerance), table
    assert min(p_norm) > cfg.optimizer.grad_clip  # every step clipped: the clipping is compared too
    assert p_loss[-1] < p_loss[0] - 2  # it trains (the ids come from 64 of the vocabulary)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", ["auto", "pytorch"])
def test_the_engine_steps_as_a_plain_bf16_loop_on_cuda(one_rank_group, policy):
    """bf16 weights with fp32 masters on both sides; auto = Triton experts + Liger loss/norm/RoPE."""
    engine_rows, plain_rows, table, cfg = _engine_against_plain_loop("bf16", policy)
    e_lr, e_loss, e_norm = (list(col) for col in zip(*engine_rows))
    p_lr, p_loss, p_norm = (list(col) for col in zip(*plain_rows))
    assert e_lr == pytest.approx(p_lr, rel=1e-12), table
    assert all(math.isfinite(v) for v in e_loss + e_norm), table
    assert e_loss == pytest.approx(p_loss, rel=1e-2, abs=2e-2), table
    assert e_norm == pytest.approx(p_norm, rel=5e-2), table


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", ["auto", "pytorch"])
@pytest.mark.parametrize("mode", ["none", "layers", "model"])
def test_every_compile_mode_and_kernel_policy_trains_as_eager_pytorch_on_cuda(one_rank_group, mode, policy):
    """kernels.compile none / layers / model with policy auto (Triton experts, Liger) and pytorch:
    ten engine steps in bf16 with finite gradients, the losses those of the eager PyTorch loop."""
    cfg = load_config("ds_configs/tiny/pretrain.yaml", [f"{k}={v}" for k, v in
                                                        {**REF_SETS, "precision": "bf16", "kernels.policy": policy}.items()])
    batches = _reference_batches()
    device, engine_rows = _engine_run(cfg, batches, torch.bfloat16, compile_mode=mode, num_layers=2)  # compiles faster
    eager_cfg = load_config("ds_configs/tiny/pretrain.yaml", [f"{k}={v}" for k, v in
                                                              {**REF_SETS, "precision": "bf16", "kernels.policy": "pytorch"}.items()])
    eager_rows = _plain_run(eager_cfg, batches, device, torch.bfloat16, num_layers=2)
    table = "\n".join(f"step {i}: loss {e[1]:.5f} / eager {p[1]:.5f}  grad norm {e[2]:.4f} / {p[2]:.4f}"
                      for i, (e, p) in enumerate(zip(engine_rows, eager_rows)))
    print(f"compile {mode}, policy {policy}:\n{table}")
    assert all(math.isfinite(v) for row in engine_rows for v in row), table
    assert [e[1] for e in engine_rows] == pytest.approx([p[1] for p in eager_rows], rel=2e-2, abs=3e-2), table


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_engine_steps_as_a_plain_bf16_loop_at_the_bench_shape_on_cuda(one_rank_group):
    """What bench_step.py measured (200m width, seq 2,048, one repeated batch, 13 steps, the 200m
    config's schedule: all warmup from 0.01 x peak, bf16, ZeRO 1, kernels auto) with two layers
    instead of 16, so it takes seconds: the engine (the H200 run: 10.55 -> 5.39) and the plain loop
    (manual and compile there: 9.1-9.2) with the same schedule must take the same steps."""
    steps = 13
    cfg = load_config("ds_configs/200m/pretrain.yaml", ["data.seq_len=2048", "batch.micro_batch=4", "batch.grad_accum=1",
                                                        "batch.global_tokens=null", "zero.stage=1", "precision=bf16"])
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, TRHashConfig.from_preset("200m").vocab_size, (4, 2048), generator=gen)
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, :-1] = ids[:, 1:]
    batches = [[{"input_ids": ids, "labels": labels}]] * steps
    device, engine_rows = _engine_run(cfg, batches, torch.bfloat16, num_layers=2)
    plain_rows = _plain_run(cfg, batches, device, torch.bfloat16, warmup=steps, num_layers=2)
    table = "\n".join(f"step {i}: lr {e[0]:.4e} / {p[0]:.4e}  loss {e[1]:.5f} / {p[1]:.5f}  grad norm {e[2]:.4f} / {p[2]:.4f}"
                      for i, (e, p) in enumerate(zip(engine_rows, plain_rows)))
    print(f"engine / plain loop at the bench's width:\n{table}")
    assert [e[0] for e in engine_rows] == pytest.approx([p[0] for p in plain_rows], rel=1e-12), table
    assert [e[1] for e in engine_rows] == pytest.approx([p[1] for p in plain_rows], rel=1e-2, abs=2e-2), table
