"""Expert parallelism for the hash-routed experts, as a DeepSpeed MoE layer.

With ``parallel.ep_size = P > 1`` each rank of an expert-parallel group of P ranks holds
E/P of the E routed experts: EP rank r owns the global experts [r·E/P, (r+1)·E/P).

Forward, per MoE block (tokens flattened to [N, H]):
  1. every (token, slot) assignment, slot k in {0, 1}, goes to the rank that owns expert
     route_table[k, token]; assignments are ordered by destination rank;
  2. the per-destination counts, then the (local expert id, slot) codes, then the hidden rows
     are exchanged with ``all_to_all_single`` in the expert-parallel group (the rows with the
     autograd-aware ``torch.distributed.nn.functional.all_to_all_single``);
  3. the owner runs its local experts with the reference gathered path
     (``experts.routed_experts_pytorch``), once per slot so each row gets its slot weight
     exactly where the single-rank path applies it (at width W, before the down projection);
  4. the results travel back the same way and are added into their tokens.
The backward of the two row exchanges is the reverse exchange, so each expert's gradient on
its owner is the sum of every EP rank's contribution.

DeepSpeed integration. ``deepspeed.runtime.engine`` recognises MoE layers only through
``isinstance(module, deepspeed.moe.layer.MoE)``; that switches on expert-aware gradient
reduction (params with ``allreduce=False`` and a ``group_name`` are reduced over the
expert-data-parallel group only), ZeRO 1/2 partitioning of the ``moe`` optimizer groups over
that group, the expert-aware broadcast at start-up, and the per-expert checkpoint files.
`HashRoutedExperts` is such a subclass that skips ``MoE.__init__`` (no learned gate:
routing is the persisted route table) and sets exactly the attributes the engine reads:
``num_experts``, ``ep_size``, ``num_local_experts``, ``expert_group_name``,
``enable_expert_tensor_parallelism`` and ``set_deepspeed_parallelism``.

The engine's MoE checkpoint code (``_save_moe_checkpoint`` / ``load_moe_state_dict``) finds
expert tensors by the key pattern ``.deepspeed_moe.experts.deepspeed_experts.<local id>.``
and writes one ``layer_<l>_expert_<global id>_mp_rank_00_model_states.pt`` per expert, with
the local id renamed to the global one (and back on load). So the local experts live in
exactly that module structure: ``deepspeed_moe.experts.deepspeed_experts[j].{gate,up,down}``
([H, W], [H, W], [W, H] per expert). Consequently, in EP mode a model's own state dict holds
``layers.i.mlp.engine.ep.deepspeed_moe.experts.deepspeed_experts.<j>.{gate,up,down}`` (its
local experts only) instead of the stacked ``layers.i.mlp.engine.expert_{gate,up,down}``.
The docs/contracts.md §1 names and full [E, H, W] tensors are recovered by:

- `full_state_dict(model)`: collective all-gather in the EP group -> released-layout state dict (exports);
- `consolidate_checkpoint(tag_dir)`: offline, from the DeepSpeed files of an EP checkpoint
  (``mp_rank_00_model_states.pt`` + the per-expert files) -> released-layout state dict (weights-only
  init / export); these are the module weights DeepSpeed saved (bf16 copies under bf16);
- loading a released-layout state dict (full stacked tensors) into an EP model slices it on load
  (`TRHashMoEEngine` load pre-hook), and `enable_expert_parallel` slices a full model.
"""
from __future__ import annotations

import re
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Mapping, Protocol, Sequence, TypeVar, cast

import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE
from deepspeed.utils import groups
from torch import nn
from torch.distributed.nn.functional import all_to_all_single

from ds_trhash.errors import UserError

from .experts import routed_experts_pytorch


# torch 2.13 marks the autograd all_to_all of torch.distributed.nn.functional deprecated (in
# favour of the private _functional_collectives); it is the public autograd-aware collective.
warnings.filterwarnings("ignore", message=r"torch\.distributed\.nn\.functional\.all_to_all_single is deprecated",
                        category=FutureWarning)

EXPERT_KEY_PREFIX = "deepspeed_moe.experts.deepspeed_experts."
STACKED_NAMES = ("expert_gate", "expert_up", "expert_down")
LOCAL_NAMES = ("gate", "up", "down")  # per-expert parameters, in STACKED_NAMES order


class ExpertParallelError(UserError, RuntimeError):
    """An expert-parallel set-up that cannot be honoured (sizes, groups, LoRA, checkpoints)."""


def group_name(ep_size: int) -> str:
    """DeepSpeed's name for the expert(-data)-parallel groups of size ep_size."""
    return f"ep_size_{ep_size}"


def deepspeed_expert_group(ep_size: int) -> dist.ProcessGroup:
    """The expert-parallel group DeepSpeed registers for ep_size, created (collectively, on
    every rank) when missing; DeepSpeed's engine then finds and reuses it."""
    name = group_name(ep_size)
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep_size)
    return groups._get_expert_parallel_group(name)


class LocalExpert(nn.Module):
    """One SwiGLU expert's weights in the x @ W layout (slices of the stacked tensors)."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.gate = nn.Parameter(gate.detach().clone())
        self.up = nn.Parameter(up.detach().clone())
        self.down = nn.Parameter(down.detach().clone())


class HashRoutedExperts(MoE):
    """This rank's routed experts and the all-to-all dispatch; a DeepSpeed ``MoE`` subclass
    with no gate, so the DeepSpeed engine treats it (and its parameters) as expert-parallel."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, num_experts: int,
                 group: dist.ProcessGroup, ep_size: int) -> None:
        nn.Module.__init__(self)  # MoE.__init__ would build a learned TopKGate and its own experts
        group_ranks = dist.get_world_size(group)
        if group_ranks != ep_size:
            raise ExpertParallelError(f"the expert-parallel group has {group_ranks} ranks, expected ep_size={ep_size}")
        if num_experts % ep_size:
            raise ExpertParallelError(f"ep_size={ep_size} does not divide the {num_experts} routed experts")
        local = num_experts // ep_size
        if gate.shape[0] != local:
            raise ExpertParallelError(f"got {gate.shape[0]} local experts, expected {local}")
        # The attributes DeepSpeed's engine reads from MoE layers.
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.num_local_experts = local
        self.expert_group_name = group_name(ep_size)
        self.enable_expert_tensor_parallelism = False
        self.use_residual = False
        self.group = group
        self.ep_rank = dist.get_rank(group)
        self.deepspeed_moe = nn.Module()
        self.deepspeed_moe.experts = nn.Module()
        self.deepspeed_moe.experts.deepspeed_experts = nn.ModuleList(
            LocalExpert(gate[j], up[j], down[j]) for j in range(local))
        for p in self.deepspeed_moe.parameters():
            setattr(p, "allreduce", False)  # deepspeed.moe.utils.is_moe_param
            setattr(p, "group_name", self.expert_group_name)

    @property
    def first_expert(self) -> int:
        return self.ep_rank * self.num_local_experts

    def experts(self) -> nn.ModuleList:
        holder = cast(nn.Module, self.deepspeed_moe.experts)
        return cast(nn.ModuleList, holder.deepspeed_experts)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Called by ``deepspeed.initialize`` on every module that has it: make sure DeepSpeed's
        expert groups exist and are the ones this layer exchanges tokens in."""
        if use_data_before_expert_parallel_:
            raise ExpertParallelError("use_data_before_expert_parallel is not supported by the TR-HASH experts")
        ds_group = deepspeed_expert_group(self.ep_size)
        mine, theirs = dist.get_process_group_ranks(self.group), dist.get_process_group_ranks(ds_group)
        if mine != theirs:
            raise ExpertParallelError(f"this layer exchanges tokens with ranks {mine} but DeepSpeed's "
                                      f"{self.expert_group_name} group is {theirs}")

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Stacked local (gate [E/P, H, W], up [E/P, H, W], down [E/P, W, H]), differentiable."""
        experts = self.experts()
        return tuple(torch.stack([getattr(e, n) for e in experts]) for n in LOCAL_NAMES)  # type: ignore[return-value]

    @torch.no_grad()
    def gather_full(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Full stacked (gate, up, down) over the EP group, expert order; collective."""
        out = []
        for w in self.local_weights():
            parts = [torch.empty_like(w) for _ in range(self.ep_size)]
            dist.all_gather(parts, w.contiguous(), group=self.group)
            out.append(torch.cat(parts))
        return tuple(out)  # type: ignore[return-value]

    @torch.no_grad()
    def load_full(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        """Copy this rank's slice of full stacked tensors into the local experts."""
        for full, name in zip((gate, up, down), LOCAL_NAMES):
            if full.shape[0] != self.num_experts:
                raise ExpertParallelError(f"expected {self.num_experts} stacked experts, got {list(full.shape)}")
            for j, e in enumerate(self.experts()):
                getattr(e, name).copy_(full[self.first_expert + j])

    def forward(self, x: torch.Tensor, routes: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
        """x [N, H], routes [N, K] global expert ids -> Σ_k w_k · expert_{routes[:, k]}(x), [N, H]."""
        n, k = routes.shape
        local = self.num_local_experts
        flat_expert = routes.reshape(-1)  # token-major, as in the single-rank path
        flat_token = torch.arange(n, device=x.device).repeat_interleave(k)
        flat_slot = torch.arange(k, device=x.device).repeat(n)
        dest = torch.div(flat_expert, local, rounding_mode="floor")
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=self.ep_size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_split, recv_split = send_counts.tolist(), recv_counts.tolist()

        # (local expert id, slot) of every row, one int64 code each
        codes = (flat_expert[order] - dest[order] * local) * k + flat_slot[order]
        recv_codes = codes.new_empty(sum(recv_split))
        dist.all_to_all_single(recv_codes, codes, recv_split, send_split, group=self.group)

        tokens = flat_token[order]
        send_rows = x.index_select(0, tokens)
        recv_rows = all_to_all_single(x.new_empty(sum(recv_split), x.shape[1]), send_rows,
                                      recv_split, send_split, group=self.group)
        gate, up, down = self.local_weights()
        recv_expert = torch.div(recv_codes, k, rounding_mode="floor")
        recv_slot = recv_codes - recv_expert * k
        done = torch.zeros_like(recv_rows)
        for slot, w in enumerate(weights):
            rows = (recv_slot == slot).nonzero().flatten()
            part = routed_experts_pytorch(recv_rows.index_select(0, rows), recv_expert[rows, None],
                                          gate, up, down, (w,))
            done = done.index_copy(0, rows, part)
        back = all_to_all_single(x.new_empty(send_rows.shape), done, send_split, recv_split, group=self.group)
        return torch.zeros_like(x).index_add(0, tokens, back)


# ----------------------------------------------------------------------------- model level


class ExpertEngine(Protocol):
    """What the model-level functions use of a layer's MoE engine (``decoder.TRHashMoEEngine``,
    which imports this module: named by its surface here)."""

    layer: int

    @property
    def ep(self) -> HashRoutedExperts | None: ...

    def enable_expert_parallel(self, group: dist.ProcessGroup, ep_size: int) -> None: ...


class ExpertModel(Protocol):
    """What they use of the model (``TRHashForCausalLM``)."""

    def engines(self) -> Sequence[ExpertEngine]: ...

    def state_dict(self) -> Mapping[str, torch.Tensor]: ...


M = TypeVar("M", bound=ExpertModel)


def enable_expert_parallel(model: M, ep_size: int, group: dist.ProcessGroup | None = None) -> M:
    """Switch every MoE block of a full model to expert parallelism in place: each keeps its
    slice of the (already initialised or loaded) stacked experts. ``group`` defaults to
    DeepSpeed's ep_size group (created when missing). Call on every rank, before
    ``deepspeed.initialize``. ep_size 1 leaves the model untouched."""
    if ep_size == 1:
        return model
    if group is None:
        group = deepspeed_expert_group(ep_size)
    for engine in model.engines():
        engine.enable_expert_parallel(group, ep_size)
    return model


def is_expert_parallel(model: ExpertModel) -> bool:
    return any(engine.ep is not None for engine in model.engines())


def _spec_order(ep_state: Mapping[str, torch.Tensor],
                experts: Mapping[str, Mapping[str, torch.Tensor]]) -> OrderedDict[str, torch.Tensor]:
    """EP-mode state dict -> released names, stacked experts placed where the full model has them
    (before the engine's route_table buffer)."""
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for key, value in ep_state.items():
        if ".ep." + EXPERT_KEY_PREFIX in key:
            continue
        if key.endswith(".mlp.engine.route_table"):
            prefix = key[: -len("route_table")]
            for name in STACKED_NAMES:
                out[prefix + name] = experts[prefix][name]
        out[key] = value
    return out


def full_state_dict(model: ExpertModel) -> Mapping[str, torch.Tensor]:
    """The docs/contracts.md §1 state dict of an expert-parallel model (full stacked experts), on every
    rank; collective over each EP group. A model without EP returns its own state dict."""
    state = model.state_dict()
    if not is_expert_parallel(model):
        return state
    experts = {}
    for engine in model.engines():
        if engine.ep is None:  # every engine is expert-parallel or none is (enable_expert_parallel)
            continue
        full = engine.ep.gather_full()
        experts[f"layers.{engine.layer}.mlp.engine."] = dict(zip(STACKED_NAMES, full))
    return _spec_order(state, experts)


_EXPERT_FILE = re.compile(r"layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_EXPERT_KEY = re.compile(r"^(layers\.\d+\.mlp\.engine\.)ep\." + re.escape(EXPERT_KEY_PREFIX) + r"(\d+)\.(gate|up|down)$")


def expert_parameter(name: str) -> tuple[str, str, int] | None:
    """An expert-parallel parameter name (``layers.<l>.mlp.engine.ep.deepspeed_moe.experts.
    deepspeed_experts.<j>.<gate|up|down>``) as (engine prefix ``layers.<l>.mlp.engine.``, released
    stacked name ``expert_<gate|up|down>``, local expert index j); None for any other name."""
    m = _EXPERT_KEY.match(name)
    if m is None:
        return None
    return m.group(1), STACKED_NAMES[LOCAL_NAMES.index(m.group(3))], int(m.group(2))


def expert_files(tag_dir: str | Path) -> list[Path]:
    """DeepSpeed's per-expert files in a checkpoint tag directory (empty without EP)."""
    return sorted(p for p in Path(tag_dir).iterdir() if _EXPERT_FILE.match(p.name))


def consolidate_checkpoint(tag_dir: str | Path) -> "OrderedDict[str, torch.Tensor]":
    """Full state dict with the released names from an expert-parallel DeepSpeed checkpoint directory
    (``<step>/state``): the non-expert weights of ``mp_rank_00_model_states.pt`` plus every
    ``layer_*_expert_*`` file, stacked in expert order. Fails when an expert is missing."""
    tag_dir = Path(tag_dir)
    main = tag_dir / "mp_rank_00_model_states.pt"
    if not main.is_file():
        raise ExpertParallelError(f"{main} is missing: not a DeepSpeed checkpoint directory")
    module = torch.load(main, map_location="cpu", weights_only=False)["module"]
    found: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for path in expert_files(tag_dir):
        for key, tensor in torch.load(path, map_location="cpu", weights_only=True).items():
            m = _EXPERT_KEY.match(key)
            if m is None:
                raise ExpertParallelError(f"{path.name}: unexpected key {key!r}")
            prefix, expert, name = m.group(1), int(m.group(2)), m.group(3)
            found.setdefault(prefix, {}).setdefault(name, {})[expert] = tensor
    engines = [k[: -len("route_table")] for k in module if k.endswith(".mlp.engine.route_table")]
    if not found:
        raise ExpertParallelError(f"{tag_dir} holds no layer_*_expert_* files: not an expert-parallel checkpoint")
    experts = {}
    for prefix in engines:
        per_name = found.get(prefix)
        if per_name is None:
            raise ExpertParallelError(f"{tag_dir}: no expert files for {prefix}")
        stacked = {}
        for local, spec in zip(LOCAL_NAMES, STACKED_NAMES):
            by_id = per_name.get(local, {})
            if sorted(by_id) != list(range(len(by_id))) or not by_id:
                raise ExpertParallelError(f"{tag_dir}: {prefix}{spec} has experts {sorted(by_id)}; "
                                          "expected 0..E-1 with none missing")
            stacked[spec] = torch.stack([by_id[e] for e in range(len(by_id))])
        counts = {v.shape[0] for v in stacked.values()}
        if len(counts) != 1:
            raise ExpertParallelError(f"{tag_dir}: {prefix} has unequal expert counts {sorted(counts)}")
        experts[prefix] = stacked
    return _spec_order(module, experts)
