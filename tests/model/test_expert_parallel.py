"""Expert parallelism (ep_size 2) against the single-rank model: two gloo CPU processes hold
two experts each; forward, gradients, the released-layout state dict and slicing a full checkpoint on
load must match the ep_size 1 model on the same inputs (fp32)."""

from __future__ import annotations

import copy
import dataclasses
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ds_trhash.model import TRHashConfig, TRHashForCausalLM
from tests.training.launch_utils import free_port

WORLD = 2
RTOL, ATOL = 1e-5, 1e-6


def _config() -> TRHashConfig:
    return dataclasses.replace(TRHashConfig.from_preset("tiny"), num_layers=2)


def _batch(seed: int, cfg: TRHashConfig):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (3, 40), generator=g)
    return ids, torch.randint(0, cfg.vocab_size, (3, 40), generator=g)


def _close(a, b, what):
    assert torch.allclose(a, b, rtol=RTOL, atol=ATOL), f"{what}: max |diff| {(a - b).abs().max().item():.3e}"


def _check(rank: int) -> None:
    from ds_trhash.model.expert_parallel import (HashRoutedExperts, enable_expert_parallel, full_state_dict,
                                                 is_expert_parallel)

    torch.manual_seed(0)
    cfg = _config()
    ref = TRHashForCausalLM(cfg)
    ref.set_backends(loss="plain")
    model = enable_expert_parallel(copy.deepcopy(ref), 2, group=dist.group.WORLD)
    assert is_expert_parallel(model)
    batches = [_batch(r, cfg) for r in range(WORLD)]

    # the released-layout state dict of the EP model is the reference's, names, order and values
    ref_sd, full = ref.state_dict(), full_state_dict(model)
    assert list(full) == list(ref_sd)
    assert all(torch.equal(full[k], ref_sd[k]) for k in ref_sd)

    # each rank holds experts [2r, 2r + 1], tagged for DeepSpeed as expert-parallel
    engine = model.engines()[0]
    assert isinstance(engine.ep, HashRoutedExperts) and engine.ep.num_local_experts == 2
    assert not hasattr(engine, "expert_gate")
    _close(engine.effective_expert_weights()[0], ref.engines()[0].expert_gate[2 * rank:2 * rank + 2], "slice")
    assert all(p.allreduce is False and p.group_name == "ep_size_2" for p in engine.ep.parameters())

    # forward: logits of this rank's batch
    ids, labels = batches[rank]
    with torch.no_grad():
        _close(model(ids), ref(ids), "logits")

    # gradients: EP rank r backpropagates its own loss; experts collect every rank's share
    ref_losses = [ref(i, labels=l) for i, l in batches]
    sum(ref_losses).backward()
    loss = model(ids, labels=labels)
    loss.backward()
    _close(loss.detach(), ref_losses[rank].detach(), "loss")
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if ".ep." in name:
            continue
        g = p.grad.clone()
        dist.all_reduce(g)  # data-parallel sum of the non-expert gradients
        _close(g, ref_grads[name].grad, name)
    for i, (e_model, e_ref) in enumerate(zip(model.engines(), ref.engines())):
        for local_name, stacked in (("gate", "expert_gate"), ("up", "expert_up"), ("down", "expert_down")):
            got = torch.stack([getattr(e, local_name).grad for e in e_model.ep.experts()])
            want = getattr(e_ref, stacked).grad[2 * rank:2 * rank + 2]
            _close(got, want, f"layer {i} {stacked} grad")
    assert model.backends_used()["experts"] == "pytorch"

    # a full (released-layout) checkpoint loads into the EP model by slicing
    other = TRHashForCausalLM(cfg)
    model.load_state_dict(other.state_dict())
    back = full_state_dict(model)
    assert all(torch.equal(back[k], v) for k, v in other.state_dict().items())
    # init_weights draws the same full tensors as the single-rank model and keeps its slice
    torch.manual_seed(7)
    other.init_weights()
    torch.manual_seed(7)
    model.init_weights()
    back = full_state_dict(model)
    assert all(torch.equal(back[k], v) for k, v in other.state_dict().items())


def _worker(rank: int, port: int, errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        _check(rank)
        # both ranks done before either tears down gloo: destroying the group while the peer
        # still has traffic in flight aborts the process ("terminate called ...")
        dist.barrier()
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


def test_ep2_forward_gradients_and_state_dict_match_ep1():
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(_worker, args=(free_port(), errors), nprocs=WORLD, join=True, start_method="spawn")
    except Exception:
        msgs = []
        while not errors.empty():
            msgs.append(errors.get())
        pytest.fail("\n".join(msgs) or "a worker failed")


def test_ep1_keeps_the_single_rank_model():
    from ds_trhash.model.expert_parallel import enable_expert_parallel, full_state_dict, is_expert_parallel

    model = TRHashForCausalLM(_config())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert enable_expert_parallel(model, 1) is model and not is_expert_parallel(model)
    assert all(e.ep is None for e in model.engines())
    after = full_state_dict(model)
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
