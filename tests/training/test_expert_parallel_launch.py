"""Expert parallelism in real launches: two CPU processes, parallel.ep_size 2, ZeRO 1.

The session's 2-process reference (ep_size 1, shared with the exact-resume tests) is the
reference; the ep_size 2 run with the same arguments is killed after step 5 (last checkpoint:
step 3) and resumed to the end. Its per-expert DeepSpeed files consolidate to the
released-layout state dict, and it trains like the ep_size 1 run. Its step-3 checkpoint also
reshards onto ep_size 1 on 1 rank, and the session's 1-process reference onto ep_size 2 on 2
ranks (--reshard), each continuing like the uninterrupted run. A shape of the config's own
trains at ep_size 2 and exports a transformers model."""

from __future__ import annotations

import pytest
import torch

from ds_trhash.model import TRHashConfig, TRHashForCausalLM
from ds_trhash.training import config as tcfg
from ds_trhash.training.engine import EngineError, check_runnable
from tests.training import launch_utils as L

STEPS = L.REFERENCE_STEPS
KILL_AFTER, SAVED = 5, 3  # checkpoints every 3 steps: the resume recomputes step 4


def _args(out, *sets):
    """The 2-process reference's arguments (12 steps, a checkpoint every 3, ZeRO 1, micro_batch 4)
    plus ``sets``; with none, they are the session's shared reference launch."""
    return L.reference_run(out, micro=4, extra=[a for s in sets for a in ("--set", s)])


def _state(out, step):
    return out / "checkpoints" / f"step_{step:08d}" / "state"


def _consolidated_matches(out, ref, step):
    """The ep_size 2 checkpoint's per-expert files consolidate to the released names and to the
    ep_size 1 run's weights (fp32; only the reduction order differs)."""
    from ds_trhash.model.expert_parallel import consolidate_checkpoint, expert_files

    tag = _state(out, step)
    cfg = TRHashConfig.from_preset("tiny")
    assert len(expert_files(tag)) == cfg.num_layers * cfg.num_experts  # layer_<l>_expert_<e>_...
    full = consolidate_checkpoint(tag)
    model = TRHashForCausalLM(cfg)
    assert list(full) == list(model.state_dict())
    model.load_checkpoint_state(full)
    want = L.model_weights(ref / "checkpoints" / f"step_{step:08d}")
    for key, value in full.items():
        assert value.shape == want[key].shape, key
        if value.is_floating_point():
            diff = (value - want[key]).abs().max().item()
            assert diff < 2e-5, f"{key}: max |diff| {diff:.3e} from the ep_size 1 run"
        else:
            assert torch.equal(value, want[key]), key


def _continues(out, ref_losses, start):
    """The resumed run's losses from ``start`` on: the uninterrupted run's, within float noise (the
    gradients are reduced over another layout, the RNG is re-seeded: nothing random is drawn)."""
    losses = L.train_losses(out)
    assert len(losses) == STEPS
    for step in range(start, STEPS):
        assert losses[step] == pytest.approx(ref_losses[step], rel=1e-4), (step + 1, losses, ref_losses)


def _resharded_onto_one_rank(killed, out, ref_losses, ref):
    """ep_size 2 on 2 ranks, killed after its step-3 checkpoint, resumed at ep_size 1 on 1 rank."""
    import shutil

    from ds_trhash.checkpoints import CheckpointError
    from ds_trhash.checkpoints.expert_reshard import saved_parameter_states

    # the saved partitions, read whole: a routed expert's Adam moments under its global id
    tag = _state(killed, SAVED)
    states, step = saved_parameter_states(tag.parent)
    assert float(step) == SAVED and states["layers.0.mlp.engine.expert_gate"]["exp_avg"].shape == (4, 128, 16)
    rank1 = torch.load(tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt", weights_only=False)["optimizer_state_dict"]
    moe = next(g for g, m in enumerate(rank1["param_slice_mappings"]) if any(".ep." in n for n in m))
    local0 = rank1["param_slice_mappings"][moe]["layers.0.mlp.engine.ep.deepspeed_moe.experts.deepspeed_experts.0.gate"]
    assert torch.equal(states["layers.0.mlp.engine.expert_gate"]["exp_avg"][2].flatten(),  # rank 1's expert 0 is 2
                       rank1["base_optimizer_state"]["state"][moe]["exp_avg"].narrow(0, local0.start, local0.numel))
    # a partition missing is refused, naming it, and nothing is written
    broken = out.parent / "broken" / "step"
    shutil.copytree(tag.parent, broken)
    (broken / "state" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    before = sorted(p.name for p in (broken / "state").iterdir())
    with pytest.raises(CheckpointError, match="partition file of rank 1"):
        saved_parameter_states(broken)
    assert sorted(p.name for p in (broken / "state").iterdir()) == before

    shutil.copytree(killed, out)
    proc = L.single(L.reference_run(out, micro=8, extra=["--resume", "auto", "--reshard"]))
    assert proc.returncode == 0, L.explain(proc)
    log = proc.stdout + proc.stderr
    assert f"resuming at step {SAVED}" in log and "ep_size 2 -> 1" in log, L.explain(proc)
    _continues(out, ref_losses, SAVED)
    final, want = L.model_weights(out / "checkpoints" / f"step_{STEPS:08d}"), L.model_weights(
        ref / "checkpoints" / f"step_{STEPS:08d}")
    assert final.keys() == want.keys()
    for key in final:
        torch.testing.assert_close(final[key], want[key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.e2e
def test_a_one_rank_checkpoint_resumes_expert_parallel_on_two_ranks(tmp_path, shared_launches):
    """ep_size 1 on 1 rank (the session's 1-process reference, stopped at its step-6 checkpoint)
    resumed at ep_size 2 on 2 ranks: every expert and its Adam moments land on their owner."""
    import shutil

    ref = shared_launches.get(1, lambda o: L.reference_run(o, micro=8))  # read only
    out, stop = tmp_path / "ep1-to-ep2", 6
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(ref / "checkpoints" / f"step_{stop:08d}", out / "checkpoints" / f"step_{stop:08d}")
    shutil.copy(ref / "metrics.csv", out / "metrics.csv")
    proc = L.deepspeed(2, _args(out, "parallel.ep_size=2") + ["--resume", "auto", "--reshard"])
    assert proc.returncode == 0, L.explain(proc)
    log = proc.stdout + proc.stderr
    assert f"resuming at step {stop}" in log and "ep_size 1 -> 2" in log, L.explain(proc)
    _continues(out, L.train_losses(ref), stop)
    _consolidated_matches(out, ref, STEPS)


# checkpoint.inspect_saved_parts reads the first "*model_states.pt" in sorted order, which with
# expert parallelism is DeepSpeed's layer_0_expert_0_mp_rank_00_model_states.pt (experts only),
# so it finds no scheduler state and refuses the resume.


@pytest.mark.e2e
def test_ep2_launch_trains_like_ep1_checkpoints_per_expert_and_resumes(tmp_path, shared_launches):
    ref = shared_launches.get(2, _args)  # read only
    ref_losses = L.train_losses(ref)

    out = tmp_path / "ep2"
    proc = L.deepspeed(2, _args(out, "parallel.ep_size=2"), DS_TRHASH_FAULT=f"kill_after_step:{KILL_AFTER}")
    assert L.was_killed(proc)
    assert L.checkpoint_steps(out) == [SAVED]
    killed_losses = L.train_losses(out)
    assert len(killed_losses) == KILL_AFTER - 1
    assert killed_losses == pytest.approx(ref_losses[:KILL_AFTER - 1], rel=1e-5)
    _consolidated_matches(out, ref, SAVED)
    _resharded_onto_one_rank(out, tmp_path / "ep2-to-ep1", ref_losses, ref)

    proc = L.deepspeed(2, _args(out, "parallel.ep_size=2"), RESUME="auto")
    assert proc.returncode == 0, L.explain(proc)
    assert f"resuming at step {SAVED}" in proc.stdout + proc.stderr
    rows = L.metrics(out)
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    assert rows[-1]["experts_backend"] == "pytorch"
    losses = L.train_losses(out)
    assert losses[:KILL_AFTER - 1] == killed_losses  # step 4 recomputed after the resume: the same loss
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    _consolidated_matches(out, ref, STEPS)

    # weights-only init from the expert-parallel checkpoint sees the released names, full experts
    from ds_trhash.checkpoints.weights import load_weights_only

    weights, record = load_weights_only(out / "checkpoints" / f"step_{STEPS:08d}")
    assert record.stage.value == "pretraining"
    assert weights["layers.0.mlp.engine.expert_gate"].shape[0] == 4
    TRHashForCausalLM(TRHashConfig.from_preset("tiny")).load_checkpoint_state(weights)


def test_ep_size_2_refusals_name_the_reason():
    base = ["parallel.ep_size=2", "data.kind=pretrain"]
    cfg = tcfg.load_config("ds_configs/tiny/pretrain.yaml", overrides=base + ["zero.stage=1"])
    check_runnable(cfg, 2)  # runnable
    with pytest.raises(EngineError, match="zero.stage 1 or 2"):
        check_runnable(tcfg.load_config("ds_configs/tiny/pretrain.yaml", overrides=base + ["zero.stage=0"]), 2)
    sft = tcfg.load_config("ds_configs/tiny/sft.yaml", overrides=["parallel.ep_size=2", "zero.stage=2"])
    assert sft.eval.heldout
    check_runnable(sft, 2)  # held-out eval runs every forward on every rank, so EP is fine
    lora = tcfg.load_config("ds_configs/tiny/sft_lora.yaml",
                            overrides=["parallel.ep_size=2", "zero.stage=2", "eval.heldout=false", "eval.select=last"])
    with pytest.raises(EngineError, match="lora"):
        check_runnable(lora, 2)


# --------------------------------------------------------------------- a shape of the config's own

# the tiny preset with its width, depth, heads and experts replaced (head_dim 32 follows from 96 / 3)
SHAPE = {"hidden_size": 96, "num_layers": 3, "num_heads": 3, "num_kv_heads": 1, "shared_width": 192,
         "expert_width": 24, "route_seed": 12345}
SHAPE_STEPS = 3


@pytest.mark.e2e
def test_a_custom_shape_trains_expert_parallel_and_exports_a_transformers_model(tmp_path):
    import dataclasses
    import json

    from transformers import AutoModelForCausalLM

    from ds_trhash.model.expert_parallel import consolidate_checkpoint
    from ds_trhash.model.routing import build_route_table

    out = tmp_path / "shape"
    args = ["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", str(out), "--max-steps", str(SHAPE_STEPS),
            "--set", "batch.micro_batch=4", "--set", "zero.stage=1", "--set", "parallel.ep_size=2",
            *[a for k, v in SHAPE.items() for a in ("--set", f"model.{k}={v}")]]
    proc = L.deepspeed(2, args)
    assert proc.returncode == 0, L.explain(proc)
    assert "preset tiny with hidden_size=96, num_layers=3" in proc.stdout + proc.stderr
    want = TRHashConfig.from_preset("tiny", **SHAPE)
    # the run's config.json and every checkpoint carry the shape
    assert {k: json.loads((out / "config.json").read_text())["model"][k] for k in SHAPE} == SHAPE
    last = out / "checkpoints" / f"step_{SHAPE_STEPS:08d}"
    recorded = TRHashConfig.from_dict(json.loads((last / "trainer_state.json").read_text())["model_config"])
    assert recorded == dataclasses.replace(want, loss_chunk_tokens=recorded.loss_chunk_tokens)
    weights = consolidate_checkpoint(last / "state")
    assert weights["layers.0.mlp.engine.expert_gate"].shape == (4, 96, 24)
    assert torch.equal(weights["layers.2.mlp.engine.route_table"], build_route_table(4096, 4, 2, 12345, 2))

    # the stage's final/ export loads in transformers with that shape and computes our logits
    hf = AutoModelForCausalLM.from_pretrained(out / "final", trust_remote_code=True).eval()
    assert (hf.config.hidden_size, hf.config.num_hidden_layers, hf.config.num_attention_heads,
            hf.config.num_key_value_heads, hf.config.head_dim) == (96, 3, 3, 1, 32)
    ours = TRHashForCausalLM(recorded).eval()
    ours.load_checkpoint_state(weights)
    ids = torch.randint(0, 4096, (2, 19), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max().item() < 1e-4

    # `ds-trhash model` counted, without the model, what the launch measured on each rank and in all
    import re

    from ds_trhash.prelaunch.model_size import estimate_size

    measured = re.search(r"model +preset tiny with [^:]*: ([\d,]+) parameters", proc.stdout + proc.stderr)
    figures = estimate_size(tcfg.load_config("ds_configs/tiny/pretrain.yaml", args[args.index("--set"):][1::2]), 2)
    assert figures.params_per_gpu == int(measured.group(1).replace(",", ""))  # this rank's share, experts split
    assert figures.total_params == sum(p.numel() for p in ours.parameters())
