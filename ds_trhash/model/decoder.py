"""One TR-HASH decoder layer: attention, then the shared + hash-routed MoE MLP (docs/contracts.md §1).

``TRHashMoEEngine`` holds the experts and the persisted route buffers (routing is data: a
checkpoint's tables are used as they are, never rebuilt), ``TRHashMoE`` adapts [B, T, H]
activations to its flat-token interface, ``check_route_buffers`` is the one check that a table
and the fused codes/pairs kernels read agree. This module exists apart from ``transformer`` so
that the block LoRA and expert parallelism adapt (``LoRAMoEEngine``, ``enable_expert_parallel``)
can be read without the causal-LM wrapper and its checkpoint-state loading around it. Module
names mirror the released checkpoint keys (``layers.{i}.mlp.engine.*``).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .attention import DocumentMask, TRHashAttention
from .config import TRHashConfig
from .experts import routed_experts
from .norms import RMSNorm
from .routing import RouteTableError, build_route_table, expert_pairs, pair_codes, validate_route_table

if TYPE_CHECKING:  # imports deepspeed.moe; built only by enable_expert_parallel
    from .expert_parallel import HashRoutedExperts


class TRHashMoEEngine(nn.Module):
    """Shared SwiGLU expert plus top-2 routed experts on flattened tokens [N, H].

    The route buffers are persistent: once a checkpoint provides them they are the routing,
    whatever the config would build (docs/contracts.md §1.1: routing is data, not code).
    """

    # the registered buffers (nn.Module types an attribute it does not know as tensor or module)
    route_table: torch.Tensor
    fused_route_codes: torch.Tensor
    fused_expert_pairs: torch.Tensor

    def __init__(self, config: TRHashConfig, layer: int) -> None:
        super().__init__()
        self.config = config
        self.layer = layer
        e, h, w = config.num_experts, config.hidden_size, config.expert_width
        self.expert_gate = nn.Parameter(torch.empty(e, h, w))
        self.expert_up = nn.Parameter(torch.empty(e, h, w))
        self.expert_down = nn.Parameter(torch.empty(e, w, h))
        self.shared_gate = nn.Linear(h, config.shared_width, bias=False)
        self.shared_up = nn.Linear(h, config.shared_width, bias=False)
        self.shared_down = nn.Linear(config.shared_width, h, bias=False)
        num_pairs = e * (e - 1) // 2
        # torch.empty follows an ambient torch.device(...) context, so meta construction is free.
        self.register_buffer("route_table", torch.empty(2, config.vocab_size, dtype=torch.int64))
        self.register_buffer("fused_route_codes", torch.empty(config.vocab_size, dtype=torch.uint8))
        self.register_buffer("fused_expert_pairs", torch.empty(num_pairs, 2, dtype=torch.int32))
        self.backend = "pytorch"
        self.last_backend: str | None = None
        # Expert parallelism (ds_trhash.model.expert_parallel): None = every expert lives here
        # as the stacked expert_{gate,up,down}; else the HashRoutedExperts child `ep` holds this
        # rank's experts and the stacked parameters are gone.
        self.ep: HashRoutedExperts | None = None
        self.register_load_state_dict_pre_hook(_slice_full_experts_on_load)
        self.reset_parameters()
        self.init_routes()

    def config_routes(self) -> torch.Tensor:
        """int64 [2, V]: the table this layer's config builds (what a fresh model starts with)."""
        c = self.config
        return build_route_table(c.vocab_size, c.num_experts, self.layer, c.route_seed, c.hash_channels)

    def init_routes(self) -> None:
        """(Re)build the route buffers from the config; a no-op on meta tensors."""
        if self.route_table.is_meta:
            return
        table = self.config_routes()
        pairs = expert_pairs(self.config.num_experts)
        with torch.no_grad():
            self.route_table.copy_(table)
            self.fused_expert_pairs.copy_(pairs)
            self.fused_route_codes.copy_(pair_codes(table, pairs))

    def validate_routes(self) -> None:
        check_route_buffers(self.route_table, self.fused_route_codes, self.fused_expert_pairs,
                            self.config, f"layer {self.layer}")

    def reset_parameters(self) -> None:
        """The contract init (docs/contracts.md §1); the down projections feed the residual stream: depth-scaled std."""
        c = self.config
        residual_std = c.init_std / math.sqrt(2 * c.num_layers)
        if self.ep is not None:  # draw the full stacked tensors (same RNG use), keep this rank's slice
            e, h, w = c.num_experts, c.hidden_size, c.expert_width
            full = [torch.empty(e, h, w), torch.empty(e, h, w), torch.empty(e, w, h)]
            with torch.no_grad():
                full[0].normal_(0.0, c.init_std)
                full[1].normal_(0.0, c.init_std)
                self.shared_gate.weight.normal_(0.0, c.init_std)
                self.shared_up.weight.normal_(0.0, c.init_std)
                full[2].normal_(0.0, residual_std)
                self.shared_down.weight.normal_(0.0, residual_std)
            self.ep.load_full(*full)
            return
        with torch.no_grad():
            for p in (self.expert_gate, self.expert_up, self.shared_gate.weight, self.shared_up.weight):
                p.normal_(0.0, c.init_std)
            for p in (self.expert_down, self.shared_down.weight):
                p.normal_(0.0, residual_std)

    def enable_expert_parallel(self, group: dist.ProcessGroup, ep_size: int) -> None:
        """Keep only this rank's experts (EP rank r: experts [r·E/P, (r+1)·E/P)) in a
        DeepSpeed-MoE child `ep` that exchanges tokens in `group`; see expert_parallel.py."""
        from .expert_parallel import ExpertParallelError, HashRoutedExperts  # lazy: imports deepspeed.moe

        if self.ep is not None:
            raise ExpertParallelError(f"layer {self.layer} is already expert-parallel")
        if type(self).effective_expert_weights is not TRHashMoEEngine.effective_expert_weights:
            raise ExpertParallelError(f"layer {self.layer}: adapted experts ({type(self).__name__}, e.g. LoRA) "
                                      "cannot be made expert-parallel")
        local = self.config.num_experts // ep_size
        first = torch.distributed.get_rank(group) * local
        sl = slice(first, first + local)
        ep = HashRoutedExperts(self.expert_gate[sl], self.expert_up[sl], self.expert_down[sl],
                               self.config.num_experts, group, ep_size)
        for name in ("expert_gate", "expert_up", "expert_down"):
            delattr(self, name)
        self.ep = ep

    def effective_expert_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate, up, down) the routed experts run on; LoRA mode adds its low-rank deltas here.
        Under expert parallelism: this rank's experts only ([E/P, ...])."""
        if self.ep is not None:
            return self.ep.local_weights()
        return self.expert_gate, self.expert_up, self.expert_down

    def full_expert_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Full stacked (gate, up, down) [E, ...]; under expert parallelism an all-gather in the
        EP group (collective: call on every rank of it)."""
        if self.ep is not None:
            return self.ep.gather_full()
        return self.expert_gate.detach(), self.expert_up.detach(), self.expert_down.detach()

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        c = self.config
        routes = self.route_table[:, token_ids.clamp(0, c.vocab_size - 1)].t().contiguous()  # [N, 2]
        shared = self.shared_down(F.silu(self.shared_gate(x)) * self.shared_up(x))
        if self.ep is not None:  # all-to-all to the experts' owners; the PyTorch gathered path there
            routed = self.ep(x, routes, c.route_weights)
            self.last_backend = "pytorch"
        else:
            gate, up, down = self.effective_expert_weights()
            routed = routed_experts(x, routes, gate, up, down, c.route_weights, backend=self.backend)
            self.last_backend = self.backend
        return c.shared_scale * shared + c.routed_scale * routed



def _slice_full_experts_on_load(module: TRHashMoEEngine, state_dict: dict[str, torch.Tensor], prefix: str,
                                local_metadata: dict[str, object], strict: bool, missing_keys: list[str],
                                unexpected_keys: list[str], error_msgs: list[str]) -> None:
    """Load-state-dict pre-hook: an expert-parallel engine given the released full stacked
    expert_{gate,up,down} takes its own experts' slices (renamed to its `ep` keys)."""
    if module.ep is None:
        return
    names = ("expert_gate", "expert_up", "expert_down")
    present = [prefix + n in state_dict for n in names]
    if not any(present):
        return
    if not all(present):
        error_msgs.append(f"{prefix}: a full checkpoint must hold all of {list(names)}")
        return
    full = [state_dict.pop(prefix + n) for n in names]
    if full[0].shape[0] != module.config.num_experts:
        error_msgs.append(f"{prefix}expert_gate holds {full[0].shape[0]} experts, the model "
                          f"{module.config.num_experts}")
        return
    from .expert_parallel import EXPERT_KEY_PREFIX, LOCAL_NAMES  # lazy: imports deepspeed.moe

    first = module.ep.first_expert
    for j in range(module.ep.num_local_experts):
        for local_name, tensor in zip(LOCAL_NAMES, full):
            state_dict[f"{prefix}ep.{EXPERT_KEY_PREFIX}{j}.{local_name}"] = tensor[first + j]



class TRHashMoE(nn.Module):
    """Adapts [B, T, H] activations and token ids to the engine's flat-token interface."""

    def __init__(self, config: TRHashConfig, layer: int) -> None:
        super().__init__()
        self.engine = TRHashMoEEngine(config, layer)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        return self.engine(x.reshape(b * t, h), input_ids.reshape(b * t)).view(b, t, h)


class TRHashDecoderLayer(nn.Module):
    """Pre-norm residual layer: x + attention(norm(x)), then + MoE(norm(x)), on [B, T, H]."""

    def __init__(self, config: TRHashConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = TRHashAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = TRHashMoE(config, layer)
        self.checkpointed = False  # recompute this layer in backward (set_activation_checkpointing)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attn_mask: torch.Tensor | DocumentMask | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), position_ids, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x), input_ids)



def check_route_buffers(table: torch.Tensor, codes: torch.Tensor | None, pairs: torch.Tensor | None,
                        config: TRHashConfig, where: str) -> None:
    """A table must be valid, and the fused codes/pairs (what kernels read) must agree with it."""
    try:
        validate_route_table(table, config.vocab_size, config.num_experts)
        if table.is_meta:
            return
        expected_pairs = expert_pairs(config.num_experts)
        if pairs is not None and not torch.equal(pairs.cpu(), expected_pairs):
            raise RouteTableError(f"fused_expert_pairs {pairs.tolist()} is not the lexicographic pair list")
        if codes is not None:
            if codes.dtype != torch.uint8 or tuple(codes.shape) != (config.vocab_size,):
                raise RouteTableError(
                    f"fused_route_codes must be uint8 [{config.vocab_size}], got {codes.dtype} {list(codes.shape)}")
            mismatch = (codes.cpu() != pair_codes(table, expected_pairs)).nonzero().flatten()
            if mismatch.numel():
                raise RouteTableError(
                    f"fused_route_codes disagree with route_table for tokens {mismatch[:8].tolist()}")
    except RouteTableError as err:
        raise RouteTableError(f"{where}: {err}") from None
