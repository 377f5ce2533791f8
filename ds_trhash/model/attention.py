"""Grouped-query self-attention with QK-norm and rotate-half RoPE (docs/contracts.md §1).

q, k and v stay separate modules (the checkpoint names them separately and LoRA wraps
q_proj/v_proj as modules); the released fused layout is exposed through fused_qkv_weight.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils.checkpoint import checkpoint

from .autocast import autocast_dtype
from .config import TRHashConfig
from .norms import RMSNorm

ROPE_BACKENDS = ("pytorch", "liger")


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """fp32 [D/2] rotary frequencies; exports persist them as ``self_attn.rotary_emb.inv_freq``."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, 1, T, D] built in fp32: bf16 angles at position ~2k lose whole radians."""
    inv_freq = rope_inv_freq(head_dim, theta, position_ids.device)
    angles = position_ids.to(torch.float32)[..., None] * inv_freq  # [B, T, D/2]
    angles = torch.cat((angles, angles), dim=-1)  # rotate-half pairs i with i + D/2
    return angles.cos()[:, None], angles.sin()[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [B, heads, T, D]; math in fp32, result in x's dtype."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """bool [B, 1, T, T], True = may attend: causal and same document (packed SFT rows).

    The dense reference for document_block_mask; the model itself never builds it."""
    t = document_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=document_ids.device).tril()
    same_doc = document_ids[:, :, None] == document_ids[:, None, :]
    return (same_doc & causal)[:, None]


#: Query/key block of the document block mask (flex attention's default tile).
DOC_BLOCK = 128


def document_block_mask(document_ids: torch.Tensor, block: int = DOC_BLOCK) -> BlockMask:
    """Flex-attention BlockMask of document_mask, built from per-block document ranges.

    Nothing of size [T, T] is made: each (query block i, key block j) is classified from the
    smallest and largest document id in the two blocks ([B, T/block, T/block] work), and the
    exact rule (same document, causal) is the mask_mod applied inside the partial blocks only.
    Empty: j > i, or the two blocks' id ranges are disjoint (no shared document possible).
    Full: j < i and both blocks lie entirely inside one and the same document.
    Everything else is partial, which is always correct (the mask_mod decides there).
    """
    b, t = document_ids.shape
    nb = -(-t // block)
    pad = nb * block - t
    docs = document_ids.long()
    # a cut-short last block repeats its last id: its range is then that of its real positions
    blocks = torch.cat((docs, docs[:, -1:].expand(b, pad)), dim=1).view(b, nb, block)
    lo, hi = blocks.amin(-1), blocks.amax(-1)  # [B, nb]
    q_lo, q_hi, k_lo, k_hi = lo[:, :, None], hi[:, :, None], lo[:, None, :], hi[:, None, :]
    idx = torch.arange(nb, device=docs.device)
    below = idx[None, :, None] > idx[None, None, :]  # j < i: [1, nb, nb]
    causal = idx[None, :, None] >= idx[None, None, :]
    overlap = (q_lo <= k_hi) & (k_lo <= q_hi)
    whole = torch.ones(nb, dtype=torch.bool, device=docs.device)
    if pad:
        whole[-1] = False  # the last block is cut short: never a full block
    single = (lo == hi) & whole[None]
    full = below & single[:, :, None] & single[:, None, :] & (q_lo == k_lo)
    partial = causal & overlap & ~full
    padded = F.pad(docs, (0, pad), value=-1)  # the kernels may index up to the block end

    def same_document_causal(b_idx: Tensor, h_idx: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (padded[b_idx, q_idx] == padded[b_idx, kv_idx]) & (q_idx >= kv_idx)

    def ordered(dense: Tensor) -> tuple[Tensor, Tensor]:  # [B, nb, nb] bool -> counts [B, 1, nb], indices [B, 1, nb, nb]
        counts = dense.sum(-1, dtype=torch.int32)
        indices = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True)
        return counts[:, None], indices.to(torch.int32)[:, None]

    kv_num, kv_idx = ordered(partial)
    full_num, full_idx = ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block,
                                    mask_mod=same_document_causal, seq_lengths=(t, t))


@dataclass
class DocumentMask:
    """Packed rows' attention mask in the forms the attention paths use; never [T, T].

    document_ids [B, T] drives the query-blockwise path (CPU: flex attention cannot train
    there in torch 2.13, its backward is CUDA-only); block_mask is flex attention's
    block-sparse form (built on CUDA, or on request for inference).
    """

    document_ids: torch.Tensor
    block_mask: BlockMask | None = None


def build_document_mask(document_ids: torch.Tensor, flex: bool | None = None) -> DocumentMask:
    """One mask per forward, shared by every layer; flex defaults to "on CUDA"."""
    if flex is None:
        flex = document_ids.device.type == "cuda"
    return DocumentMask(document_ids, document_block_mask(document_ids) if flex else None)


def _blockwise_document_attention(q: Tensor, k: Tensor, v: Tensor, document_ids: Tensor, scale: float | None,
                                  enable_gqa: bool, block: int = DOC_BLOCK) -> Tensor:
    """Same result as SDPA with document_mask, one query block at a time.

    Query block [s, e) sees keys [0, e) (causal prefix) through a [B, 1, e - s, e] mask made
    from the document ids; the block runs under activation checkpointing so that its mask is
    rebuilt in backward instead of being kept: the masks alive at once stay [B, 1, block, T].
    """
    t = q.shape[2]
    positions = torch.arange(t, device=q.device)

    def one_block(qb: Tensor, kb: Tensor, vb: Tensor, docs: Tensor, start: int) -> Tensor:
        stop = start + qb.shape[2]
        mask = (docs[:, start:stop, None] == docs[:, None, :stop]) \
            & (positions[start:stop, None] >= positions[None, :stop])
        return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask[:, None], scale=scale,
                                              enable_gqa=enable_gqa)

    # each block is copied into one output as it is made: no list of blocks plus their concatenation
    out = q.new_empty(q.shape[:3] + v.shape[3:])  # [B, heads, T, D]
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    for start in range(0, t, block):
        stop = min(start + block, t)
        args = (q[:, :, start:stop], k[:, :, :stop], v[:, :, :stop], document_ids, start)
        out[:, :, start:stop] = checkpoint(one_block, *args, use_reentrant=False) if grad else one_block(*args)
    return out


_compiled_flex: Callable[..., Tensor] | None = None


def _flex(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask, scale: float | None, enable_gqa: bool) -> Tensor:
    """flex_attention, compiled into a fused kernel on CUDA (eager flex is an unfused reference
    that materialises the scores). Inside an outer torch.compile the plain call is traced and
    fused by that compile, on CPU too; eager CPU runs the unfused reference."""
    global _compiled_flex
    if q.device.type == "cuda" and not torch.compiler.is_compiling():
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        return _compiled_flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)


class TRHashAttention(nn.Module):
    def __init__(self, config: TRHashConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        hidden, q_width, kv_width = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(hidden, q_width, bias=False)
        self.k_proj = nn.Linear(hidden, kv_width, bias=False)
        self.v_proj = nn.Linear(hidden, kv_width, bias=False)
        self.o_proj = nn.Linear(q_width, hidden, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps)
        self.rope_backend = "pytorch"
        self.last_rope_backend: str | None = None
        self.init_std = config.init_std
        self.residual_std = config.init_std / math.sqrt(2 * config.num_layers)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The contract init (docs/contracts.md §1); o_proj writes into the residual stream, so it gets the depth-scaled std."""
        with torch.no_grad():
            for proj in (self.q_proj, self.k_proj, self.v_proj):
                proj.weight.normal_(0.0, self.init_std)
            self.o_proj.weight.normal_(0.0, self.residual_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()

    def fused_qkv_weight(self) -> torch.Tensor:
        """[kv + q + kv, H] in the released fused row order K, Q, V (docs/contracts.md §1)."""
        return torch.cat((self.k_proj.weight, self.q_proj.weight, self.v_proj.weight), dim=0)

    def load_fused_qkv_weight(self, fused: torch.Tensor) -> None:
        """Inverse of fused_qkv_weight, for importing released fused checkpoints."""
        kv = self.num_kv_heads * self.head_dim
        k, q, v = fused.split((kv, self.num_heads * self.head_dim, kv), dim=0)
        with torch.no_grad():
            self.k_proj.weight.copy_(k)
            self.q_proj.weight.copy_(q)
            self.v_proj.weight.copy_(v)

    def _rope(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        if self.rope_backend == "liger":
            from liger_kernel.transformers.functional import liger_rope

            # Liger rotates in cos/sin's dtype (fp32 here) and stores in q/k's dtype, like apply_rope.
            q, k = liger_rope(q, k, cos, sin)
        elif self.rope_backend == "pytorch":
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:
            raise ValueError(f"unknown rope backend {self.rope_backend!r}; allowed: {list(ROPE_BACKENDS)}")
        self.last_rope_backend = self.rope_backend
        return q, k

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor,
                attn_mask: torch.Tensor | DocumentMask | None) -> torch.Tensor:
        """attn_mask: None (causal), a dense bool [B, 1, T, T] (reference) or a DocumentMask."""
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(position_ids, self.head_dim, self.rope_theta)
        q, k = self._rope(q, k, cos, sin)  # [B, heads, T, D]
        gqa = self.num_heads != self.num_kv_heads
        if isinstance(attn_mask, DocumentMask) and attn_mask.block_mask is not None:
            dtype = autocast_dtype(v) or v.dtype  # flex needs one dtype; autocast gives none
            out = _flex(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask.block_mask,
                        self.head_dim ** -0.5, gqa)
        elif isinstance(attn_mask, DocumentMask):
            out = _blockwise_document_attention(q, k, v, attn_mask.document_ids, self.head_dim ** -0.5, gqa)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None,
                scale=self.head_dim ** -0.5, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))
