"""Resharding across expert-parallel layouts: a checkpoint of ``ep_size`` E on W ranks onto
``ep_size`` E' on W' ranks (either side may be 1), parameter by parameter, by global expert id.

DeepSpeed's universal conversion cannot do this: it merges every rank's optimizer partitions as
if each group were split over all ranks, while a routed expert's group is split over its
expert-data-parallel group only, under a local name that means another expert on each EP rank.
So here the checkpoint's own files are read directly:

- the module weights in the released layout (``consolidate_checkpoint`` for an EP checkpoint:
  its per-expert files by global id; the module file otherwise);
- every ZeRO 1/2 (or bf16-optimizer) partition file ``*zero_pp_rank_<r>_mp_rank_00_optim_states.pt``:
  per parameter group, the rank's flat fp32 master partition, its Adam ``exp_avg`` /
  ``exp_avg_sq`` partitions and ``param_slice_mappings`` (name -> offset and length in that
  partition). A dense parameter's fragments, in rank order, make the whole parameter; a local
  expert j of rank r is global expert ``(r mod E) · E_total / E + j`` (DeepSpeed's EP groups are
  consecutive ranks), its fragments ordered by expert-data-parallel rank ``r div E``.

The result is every parameter whole, with fp32 master weight and both Adam moments, stacked
experts in global order under the released names. The new engine (built fresh for its own
layout) then takes each of its parameters' share: its module loads the released weights (an EP
module slices its experts on load), and through DeepSpeed's own fragment mappings
(``deepspeed.utils.safe_set_full_fp32_param`` / ``safe_set_full_optimizer_state``) each rank's
partition of the master weights and moments is set from the whole tensor, so every expert's
optimizer state moves with it. The Adam step, the learning-rate schedule and the engine's step
counters are restored as saved; the RNG is re-seeded like every reshard (``reshard.py``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from ds_trhash.checkpoints.state import ENGINE_TAG, CheckpointError, Log, read_trainer_state
from ds_trhash.engine_api import DeepSpeedEngine

if TYPE_CHECKING:  # this module imports torch and the model where a reshard needs them
    import torch

    from ds_trhash.model.expert_parallel import HashRoutedExperts
    from ds_trhash.model.transformer import TRHashForCausalLM

MODULE_FILE = "mp_rank_00_model_states.pt"
MOMENTS = ("exp_avg", "exp_avg_sq")
STATE_KEYS = ("fp32", *MOMENTS)


def saved_ep_size(saved_state: dict[str, Any]) -> int:
    """The ``parallel.ep_size`` a checkpoint was trained with (1 when it records none)."""
    crit = saved_state.get("training_critical") or {}
    value = crit.get("parallel.ep_size", (crit.get("parallel") or {}).get("ep_size", 1))
    return int(value) if isinstance(value, int) else 1


def moves_experts(ckpt_dir: str | os.PathLike, target_ep_size: int) -> bool:
    """Whether a ``--reshard`` of this checkpoint goes parameter by parameter (this module)
    rather than through DeepSpeed's universal format: when either side is expert-parallel."""
    return target_ep_size > 1 or saved_ep_size(read_trainer_state(Path(ckpt_dir))) > 1


@dataclass
class _Pieces:
    """The fragments of one saved parameter (one expert's, for a routed expert) by partition order."""

    shape: tuple[int, ...]
    parts: dict[str, list[tuple[int, torch.Tensor]]] = field(default_factory=lambda: {k: [] for k in STATE_KEYS})

    def whole(self, where: str) -> dict[str, torch.Tensor]:
        import torch

        out: dict[str, torch.Tensor] = {}
        for key, parts in self.parts.items():
            orders = [o for o, _ in parts]
            if len(set(orders)) != len(orders):
                raise CheckpointError(f"{where}: {key} has two fragments from one partition")
            flat = torch.cat([t for _, t in sorted(parts, key=lambda item: item[0])])
            if flat.numel() != _numel(self.shape):
                raise CheckpointError(f"{where}: {key} fragments hold {flat.numel()} values, the parameter "
                                      f"{list(self.shape)} has {_numel(self.shape)}; a partition file is missing")
            out[key] = flat.reshape(self.shape).clone()
        return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _optim_file(tag: Path, rank: int) -> Path:
    found = sorted(tag.glob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
    if len(found) != 1:
        raise CheckpointError(f"{tag}: expected one ZeRO partition file of rank {rank}, found "
                              f"{[p.name for p in found]}; --reshard across expert-parallel layouts reads ZeRO 1/2 "
                              "partitions")
    return found[0]


def _collect(tag: Path, world: int, ep: int, experts: int,
             shapes: dict[str, tuple[int, ...]]) -> tuple[dict[tuple[str, int | None], _Pieces], torch.Tensor]:
    """Every rank's fragments: {(name, global expert or None): _Pieces}, and the Adam step."""
    import torch

    from ds_trhash.model.expert_parallel import expert_parameter

    pieces: dict[tuple[str, int | None], _Pieces] = {}
    steps = []
    for rank in range(world):
        path = _optim_file(tag, rank)
        osd = torch.load(path, map_location="cpu", mmap=True, weights_only=False)["optimizer_state_dict"]
        base = osd["base_optimizer_state"]["state"]
        for g, mapping in enumerate(osd["param_slice_mappings"]):
            if g not in base:
                raise CheckpointError(f"{path.name}: parameter group {g} has no optimizer state")
            flat = {"fp32": osd["single_partition_of_fp32_groups"][g], **{k: base[g][k] for k in MOMENTS}}
            steps.append(base[g]["step"])
            for name, addr in mapping.items():
                expert = expert_parameter(name)
                key: tuple[str, int | None]
                if expert is None:
                    key, order = (name, None), rank
                else:
                    prefix, stacked, local = expert
                    key, order = (prefix + stacked, (rank % ep) * (experts // ep) + local), rank // ep
                entry = pieces.setdefault(key, _Pieces(tuple(shapes[name])))
                for k, tensor in flat.items():
                    entry.parts[k].append((order, tensor.narrow(0, addr.start, addr.numel)))
    if not steps or any(float(s) != float(steps[0]) for s in steps):
        raise CheckpointError(f"{tag}: the optimizer's step differs between groups or ranks ({sorted({float(s) for s in steps})})")
    return pieces, steps[0]


def saved_parameter_states(ckpt_dir: str | os.PathLike) -> tuple[dict[str, dict[str, torch.Tensor]], torch.Tensor]:
    """Every trainable parameter of a checkpoint whole, under the released names:
    {name: {"fp32", "exp_avg", "exp_avg_sq"}}, routed experts stacked [E, ...] in global order;
    and the Adam step tensor. Reads the files as saved; CheckpointError when one is missing."""
    import torch

    ckpt = Path(ckpt_dir)
    state = read_trainer_state(ckpt)
    world, ep = int(state["world_size"]), saved_ep_size(state)
    experts = int((state.get("model_config") or {}).get("num_experts", 0)) or None
    tag = ckpt / ENGINE_TAG
    if ep > 1 and experts is None:
        raise CheckpointError(f"{ckpt}: trainer_state.json records no model_config.num_experts")
    main = torch.load(tag / MODULE_FILE, map_location="cpu", mmap=True, weights_only=False)
    shapes = {name: shape for group in main["param_shapes"] for name, shape in group.items()}
    pieces, step = _collect(tag, world, ep, experts or 1, shapes)
    out: dict[str, dict[str, torch.Tensor]] = {}
    stacked: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    total = experts or 0  # expert pieces come only from a checkpoint that records num_experts
    for (name, expert), entry in pieces.items():
        whole = entry.whole(f"{ckpt}: {name}" + (f" expert {expert}" if expert is not None else ""))
        if expert is None:
            out[name] = whole
        else:
            stacked.setdefault(name, {})[expert] = whole
    for name, by_id in stacked.items():
        if sorted(by_id) != list(range(total)):
            raise CheckpointError(f"{ckpt}: {name} has optimizer state for experts {sorted(by_id)}, expected 0..{total - 1}")
        out[name] = {k: torch.stack([by_id[e][k] for e in range(total)]) for k in STATE_KEYS}
    return out, step


def _whole_value(states: dict[str, dict[str, torch.Tensor]], module: torch.nn.Module,
                 name: str) -> dict[str, torch.Tensor]:
    """The saved whole tensors of the engine's parameter ``name`` (this rank's expert of a
    stacked one, for an expert-parallel module)."""
    from ds_trhash.model.expert_parallel import expert_parameter

    expert = expert_parameter(name)
    if expert is None:
        if name not in states:
            raise CheckpointError(f"the checkpoint has no optimizer state for {name}")
        return states[name]
    prefix, stacked, local = expert
    saved = states.get(prefix + stacked)
    if saved is None:
        raise CheckpointError(f"the checkpoint has no optimizer state for {prefix + stacked}")
    index = cast("HashRoutedExperts", module.get_submodule(prefix + "ep")).first_expert + local
    return {k: v[index] for k, v in saved.items()}


class _ZeroOptimizer(Protocol):
    """DeepSpeed's ZeRO 1/2 optimizer: the torch optimizer it wraps holds this rank's fp32 partitions."""

    optimizer: torch.optim.Optimizer


def _set_optimizer(engine: DeepSpeedEngine, states: dict[str, dict[str, torch.Tensor]], step: torch.Tensor) -> None:
    """Each rank's partition of the fp32 master weights and Adam moments, from the whole tensors."""
    import torch
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    opt = cast(_ZeroOptimizer, engine.optimizer)
    lp_groups = getattr(opt, "bit16_groups", None) or getattr(opt, "bf16_groups", None)
    if lp_groups is None:
        raise CheckpointError(f"--reshard across expert-parallel layouts needs a ZeRO 1/2 optimizer, the engine has "
                              f"{type(opt).__name__}")
    names = {id(p): n for n, p in engine.module.named_parameters()}
    for i, group in enumerate(opt.optimizer.param_groups):
        hp = group["params"][0]
        # the state torch's AdamW would hold after its first step, filled below (a fused or
        # capturable AdamW keeps its step on the parameter's device, the others on the CPU)
        on_device = group.get("fused") or group.get("capturable")
        opt.optimizer.state[hp] = {"step": step.detach().clone().to(hp.device if on_device else "cpu"),
                                   **{k: torch.zeros_like(hp) for k in MOMENTS}}
        for lp in lp_groups[i]:
            if lp._hp_mapping is None:  # no fragment of it in this rank's partition
                continue
            lp._hp_mapping.set_optim_state_fragment(hp, opt.optimizer.state[hp])
            whole = _whole_value(states, engine.module, names[id(lp)])
            safe_set_full_fp32_param(lp, whole["fp32"].to(hp.device))
            for key in MOMENTS:
                safe_set_full_optimizer_state(lp, whole[key].to(hp.device), key)


def _set_schedule(engine: DeepSpeedEngine, main: dict[str, Any]) -> None:
    """The learning-rate schedule and the engine's counters as saved. The saved scheduler knew
    the old layout's parameter groups (one more with expert parallelism); every group follows the
    one lambda, so its position and last rate carry over to any number of groups."""
    # (Private scheduler fields, as torch's own LRScheduler.load_state_dict sets them.)
    sched, saved = engine.lr_scheduler, main.get("lr_scheduler")
    if sched is None or saved is None:
        raise CheckpointError("the checkpoint or the engine has no learning-rate scheduler state")
    rates = set(saved["_last_lr"])
    if len(rates) != 1:
        raise CheckpointError(f"the saved parameter groups have different learning rates {sorted(rates)}")
    rate = rates.pop()
    sched.last_epoch, sched._step_count = saved["last_epoch"], saved["_step_count"]
    sched._last_lr = [rate] * len(engine.optimizer.param_groups)
    for group in engine.optimizer.param_groups:
        group["lr"] = rate
    engine.global_steps = main["global_steps"]
    engine.global_samples = main.get("global_samples", engine.global_steps * engine.train_batch_size())
    engine.skipped_steps = main.get("skipped_steps", 0)


def load_by_parameter(engine: DeepSpeedEngine, ckpt_dir: str | os.PathLike, log: Log = print) -> None:
    """Restore a freshly built engine of any expert-parallel layout from a checkpoint of another:
    weights, fp32 master weights and Adam moments (each expert's with it, by global id), the Adam
    step, the schedule and the step counters. Every rank reads the files itself (memory-mapped)."""
    import torch

    from ds_trhash.model.expert_parallel import consolidate_checkpoint, expert_files

    ckpt = Path(ckpt_dir)
    tag = ckpt / ENGINE_TAG
    main = torch.load(tag / MODULE_FILE, map_location="cpu", mmap=True, weights_only=False)
    weights = consolidate_checkpoint(tag) if expert_files(tag) else main["module"]
    cast("TRHashForCausalLM", engine.module).load_checkpoint_state(weights, where=str(ckpt))
    states, step = saved_parameter_states(ckpt)
    _set_optimizer(engine, states, step)
    # the loss scaler (fp16), overflow flag and clipping as saved, through the optimizer's own reader
    restore_global = getattr(engine.optimizer, "_load_global_state", None)
    if restore_global is not None:
        restore_global(torch.load(_optim_file(tag, 0), map_location="cpu", mmap=True,
                                  weights_only=False)["optimizer_state_dict"])
    _set_schedule(engine, main)
    log(f"--reshard: moved {len(states)} parameters with their fp32 master weights and Adam moments by name "
        "and global expert id")
