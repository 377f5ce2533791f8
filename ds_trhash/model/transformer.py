"""TR-HASH causal LM: pre-norm decoder layers with a shared + hash-routed MoE MLP (docs/contracts.md §1).

Module names mirror the released checkpoint keys exactly (no `model.` prefix, no lm_head:
the head is tied to embed_tokens), so a state dict loads in both directions unchanged. This
module is the causal-LM wrapper (embedding, layers, tied head, backends, activation
checkpointing, expert load) and its checkpoint-state loading (route tables checked before
anything loads, differences from the config reported); the decoder layer and its MoE block are
in ``decoder``.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Mapping, cast

import torch
import torch.utils.checkpoint
from torch import nn

from ds_trhash.errors import UserError

from .attention import ROPE_BACKENDS, TRHashAttention, build_document_mask
from .config import TRHashConfig
from .decoder import TRHashDecoderLayer, TRHashMoEEngine, check_route_buffers
from .experts import EXPERT_BACKENDS
from .loss import LOSS_BACKENDS, tied_ce
from .norms import NORM_BACKENDS, RMSNorm

ACTIVATION_CHECKPOINTING = ("none", "full", "every_n")


class WeightsError(UserError, ValueError):
    """Saved weights (valid torch data) whose tensors are not this model's."""

_DROPPED_KEY_SUFFIX = ".self_attn.rotary_emb.inv_freq"  # recomputed, never a parameter


class TRHashForCausalLM(nn.Module):
    def __init__(self, config: TRHashConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TRHashDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.loss_backend = "chunked"
        self.last_loss_backend: str | None = None
        self.kernel_self_check: dict[str, str] = {}  # set by backend.apply after a self-check
        self.experts_probe: dict[str, object] = {}  # set by backend.apply: the per-shape timing that chose the experts
        self.compile_mode = "none"  # set by ds_trhash.model.compile
        # Per-layer routed-token counts [L, E] of training forwards (expert_load.csv, monitors); off by default.
        self.track_expert_load = False
        self._expert_load: torch.Tensor | None = None
        with torch.no_grad():
            self.embed_tokens.weight.normal_(0.0, config.init_std)  # submodules init themselves

    # ----------------------------------------------------------------- initialisation
    def init_weights(self) -> None:
        """Re-apply the contract init everywhere, e.g. after `to_empty()` on a meta-built model
        (call init_routes() too: to_empty leaves the route buffers uninitialised)."""
        with torch.no_grad():
            self.embed_tokens.weight.normal_(0.0, self.config.init_std)
        self.norm.reset_parameters()
        for layer in self.decoder_layers():
            layer.input_layernorm.reset_parameters()
            layer.post_attention_layernorm.reset_parameters()
            layer.self_attn.reset_parameters()
            layer.mlp.engine.reset_parameters()

    def decoder_layers(self) -> list[TRHashDecoderLayer]:
        """The layers as what they are (iterating the ModuleList yields plain modules)."""
        return [cast(TRHashDecoderLayer, layer) for layer in self.layers]

    def init_routes(self) -> None:
        for engine in self.engines():
            engine.init_routes()

    def engines(self) -> list[TRHashMoEEngine]:
        return [layer.mlp.engine for layer in self.decoder_layers()]

    # ----------------------------------------------------------------- activation checkpointing
    def set_activation_checkpointing(self, mode: str, every: int = 2) -> list[int]:
        """Recompute decoder layers in backward instead of storing their activations.

        ``none``; ``full`` (every layer); ``every_n`` (layers 0, n, 2n, ... for n = ``every``).
        Non-reentrant ``torch.utils.checkpoint`` with the RNG state preserved, so the gradients
        are those of the plain forward; only peak memory and time change. Returns the layers.
        """
        if mode not in ACTIVATION_CHECKPOINTING:
            raise ValueError(f"unknown activation checkpointing {mode!r}; allowed: {list(ACTIVATION_CHECKPOINTING)}")
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"activation checkpointing every_n needs n >= 1, got {every!r}")
        step = {"none": 0, "full": 1, "every_n": every}[mode]
        chosen = [i for i in range(len(self.layers)) if step and i % step == 0]
        for i, layer in enumerate(self.decoder_layers()):
            layer.checkpointed = i in chosen
        return chosen

    # ----------------------------------------------------------------- expert load
    def _count_expert_load(self, input_ids: torch.Tensor) -> None:
        """Add this forward's routes to the [L, E] counts (on the device, no host sync). Counted
        here, outside the decoder layers, so a checkpointed layer's recompute is not counted twice;
        a scatter-add into a fixed [L, E] shape (not bincount, whose output size depends on the
        data) keeps a compiled model in one graph."""
        ids = input_ids.reshape(-1).clamp(0, self.config.vocab_size - 1)
        routes = torch.stack([e.route_table[:, ids].reshape(-1) for e in self.engines()]).long()  # [L, k*N]
        counts = torch.zeros(len(self.layers), self.config.num_experts, dtype=torch.long, device=routes.device)
        counts.scatter_add_(1, routes, torch.ones_like(routes))
        self._expert_load = counts if self._expert_load is None else self._expert_load + counts

    def expert_load_mark(self) -> torch.Tensor | None:
        """The counts so far (not copied: each forward adds into a new tensor), to go back to with
        ``restore_expert_load`` when a step is abandoned and trained again."""
        return self._expert_load

    def restore_expert_load(self, mark: torch.Tensor | None) -> None:
        self._expert_load = mark

    def take_expert_load(self) -> torch.Tensor | None:
        """The counts since the last call ([L, E] int64), and start again; None when none."""
        counts, self._expert_load = self._expert_load, None
        return counts

    # ----------------------------------------------------------------- backends
    def set_backends(self, experts: str | None = None, loss: str | None = None,
                     norm: str | None = None, rope: str | None = None) -> None:
        """Switch implementations; None leaves a choice unchanged. Names are checked here so a
        typo fails at set-up rather than in the first forward."""
        for name, value, allowed in (("experts", experts, EXPERT_BACKENDS), ("loss", loss, LOSS_BACKENDS),
                                     ("norm", norm, NORM_BACKENDS), ("rope", rope, ROPE_BACKENDS)):
            if value is not None and value not in allowed:
                raise ValueError(f"unknown {name} backend {value!r}; allowed: {list(allowed)}")
        if experts is not None:
            for engine in self.engines():
                engine.backend = experts
        if loss is not None:
            self.loss_backend = loss
        if norm is not None:
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.backend = norm
        if rope is not None:
            for layer in self.decoder_layers():
                layer.self_attn.rope_backend = rope

    def backends_used(self) -> dict[str, object]:
        """What ran in the last forward (None: not exercised, e.g. loss when no labels), plus
        the kernel self-check's findings, the experts' per-shape timing and the compile mode
        when there are any."""

        def merged(values: list[str | None]) -> str | None:
            seen = sorted({v for v in values if v is not None})
            return "+".join(seen) if seen else None

        norms = [m.last_backend for m in self.modules() if isinstance(m, RMSNorm)]
        used: dict[str, object] = {"experts": merged([e.last_backend for e in self.engines()]),
                "loss": self.last_loss_backend, "norm": merged(norms),
                "rope": merged([layer.self_attn.last_rope_backend for layer in self.decoder_layers()])}
        if self.kernel_self_check:  # what the startup self-check found (fallbacks say why)
            used["self_check"] = dict(self.kernel_self_check)
        if self.experts_probe:  # the timings that picked the experts backend at this shape
            used["experts_probe"] = dict(self.experts_probe)
        if self.compile_mode != "none":
            used["compile"] = self.compile_mode
        return used

    def _reset_backend_records(self) -> None:
        self.last_loss_backend = None
        for module in self.modules():
            if isinstance(module, (RMSNorm, TRHashMoEEngine)):
                module.last_backend = None
            elif isinstance(module, TRHashAttention):
                module.last_rope_backend = None

    # ----------------------------------------------------------------- forward
    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                      document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T] ids -> [B, T, H] hidden after the final norm."""
        self._reset_backend_records()
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(t, device=input_ids.device).expand(b, t)
        # packed rows: one block-sparse document mask shared by every layer (no [T, T] tensor)
        attn_mask = build_document_mask(document_ids) if document_ids is not None else None
        x = self.embed_tokens(input_ids)
        if self.track_expert_load and torch.is_grad_enabled():
            self._count_expert_load(input_ids)
        for layer in self.layers:
            if layer.checkpointed and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, input_ids, position_ids, attn_mask, use_reentrant=False)
            else:
                x = layer(x, input_ids, position_ids, attn_mask)
        return self.norm(x)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, document_ids: torch.Tensor | None = None,
                reduction: str = "mean") -> torch.Tensor:
        """Loss when labels are given (labels pre-aligned: labels[t] is position t's target),
        else logits [B, T, V]."""
        h = self.hidden_states(input_ids, position_ids, document_ids)
        weight = self.embed_tokens.weight
        if labels is None:
            return h @ weight.t()
        loss = tied_ce(h.reshape(-1, h.shape[-1]), weight, labels.reshape(-1).long(), self.loss_backend,
                       reduction=reduction, chunk_tokens=self.config.loss_chunk_tokens)
        self.last_loss_backend = self.loss_backend
        return loss

    # ----------------------------------------------------------------- checkpoints
    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True,
                        assign: bool = False) -> nn.modules.module._IncompatibleKeys:
        """Standard load, minus stale rotary caches, refusing route tables that cannot be used.

        Route buffers are taken from the checkpoint as they are, never rebuilt.
        """
        filtered = OrderedDict((k, v) for k, v in state_dict.items() if not k.endswith(_DROPPED_KEY_SUFFIX))
        metadata = getattr(state_dict, "_metadata", None)
        if metadata is not None:
            filtered._metadata = metadata  # type: ignore[attr-defined]  # torch's own convention for state dicts
        check_state_dict_routes(filtered, self.config)
        return super().load_state_dict(filtered, strict=strict, assign=assign)

    def validate_routes(self) -> None:
        for engine in self.engines():
            engine.validate_routes()

    def load_checkpoint_state(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True,
                              where: str = "the saved weights", assign: bool = False) -> list[str]:
        """Load, validate every layer's routes, and report where they differ from the config.
        ``where`` names the source in the error when the tensors are another model's. ``assign``:
        take the tensors themselves (a model built on the meta device checks that weights fit
        without allocating a copy of them)."""
        try:
            self.load_state_dict(state_dict, strict=strict, assign=assign)
        except RuntimeError as exc:  # missing / unexpected keys, wrong shapes: the file is another model's
            raise WeightsError(f"{where} do not fit this model ({self.config.num_layers} layers, hidden "
                               f"{self.config.hidden_size}): {' '.join(str(exc).split())[:300]}") from None
        self.validate_routes()
        return report_route_differences(self)


def check_state_dict_routes(state_dict: Mapping[str, torch.Tensor], config: TRHashConfig) -> None:
    """Validate every route table present in a (possibly partial) state dict before loading."""
    for i in range(config.num_layers):
        prefix = f"layers.{i}.mlp.engine."
        table = state_dict.get(prefix + "route_table")
        if table is not None:
            check_route_buffers(table, state_dict.get(prefix + "fused_route_codes"),
                                state_dict.get(prefix + "fused_expert_pairs"), config, f"checkpoint layer {i}")


def report_route_differences(model: TRHashForCausalLM,
                             state_dict: Mapping[str, torch.Tensor] | None = None) -> list[str]:
    """One line per layer whose routes (state_dict's, else the model's) differ from the tables
    the model's config builds; empty when they all agree."""
    c = model.config
    lines = []
    for engine in model.engines():
        key = f"layers.{engine.layer}.mlp.engine.route_table"
        table = engine.route_table if state_dict is None else state_dict.get(key)
        if table is None:
            lines.append(f"layer {engine.layer}: no route_table in the checkpoint")
            continue
        built = engine.config_routes()
        if tuple(table.shape) != tuple(built.shape):
            lines.append(f"layer {engine.layer}: route_table shape {list(table.shape)} "
                         f"differs from the config's {list(built.shape)}")
            continue
        tokens = (table.cpu() != built).any(dim=0).sum().item()
        if tokens:
            lines.append(f"layer {engine.layer}: {tokens} of {c.vocab_size} tokens routed differently "
                         f"from the tables built by route_seed={c.route_seed:#x}")
    return lines
