"""GQA attention with QK-norm before RoPE (rotate-half), against a textbook reference, and the
K, Q, V row order of the fused projection."""

import math

import pytest
import torch

from ds_trhash.model import TRHashConfig
from ds_trhash.model.attention import TRHashAttention, apply_rope, document_mask, rope_cos_sin

TINY = TRHashConfig.from_preset("tiny")


def reference_attention(attn: TRHashAttention, x, positions):
    """Textbook GQA: repeat kv heads, explicit causal softmax; QK-norm then rotate-half RoPE."""
    b, t, _ = x.shape
    nh, nkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim

    def norm(z, weight):
        return z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    def rope(z):
        inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
        ang = positions.float()[:, None] * inv  # [T, D/2]
        cos, sin = ang.cos(), ang.sin()
        z1, z2 = z[..., : d // 2], z[..., d // 2:]
        return torch.cat((z1 * cos - z2 * sin, z2 * cos + z1 * sin), dim=-1)

    q = rope(norm((x @ attn.q_proj.weight.t()).view(b, t, nh, d), attn.q_norm.weight).transpose(1, 2))
    k = rope(norm((x @ attn.k_proj.weight.t()).view(b, t, nkv, d), attn.k_norm.weight).transpose(1, 2))
    v = (x @ attn.v_proj.weight.t()).view(b, t, nkv, d).transpose(1, 2)
    k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, nh * d)
    return out @ attn.o_proj.weight.t()


def test_attention_matches_a_textbook_reference():
    torch.manual_seed(0)
    attn = TRHashAttention(TINY)
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 1.5)
        attn.k_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 10, TINY.hidden_size)
    positions = torch.arange(10) + 3
    out = attn(x, positions.expand(2, 10), None)
    torch.testing.assert_close(out, reference_attention(attn, x, positions), rtol=1e-5, atol=1e-6)


def test_fused_qkv_rows_are_k_then_q_then_v():
    attn = TRHashAttention(TINY)
    fused = attn.fused_qkv_weight()
    kv, q = TINY.num_kv_heads * TINY.head_dim, TINY.num_heads * TINY.head_dim
    assert fused.shape == (kv + q + kv, TINY.hidden_size)
    assert torch.equal(fused[:kv], attn.k_proj.weight)
    assert torch.equal(fused[kv:kv + q], attn.q_proj.weight)
    assert torch.equal(fused[kv + q:], attn.v_proj.weight)
    other = TRHashAttention(TINY)
    other.load_fused_qkv_weight(fused)
    assert torch.equal(other.fused_qkv_weight(), fused)


def test_rope_rotates_halves_and_preserves_norms():
    pos = torch.arange(6)[None]  # [1, T]
    cos, sin = rope_cos_sin(pos, 8, 10000.0)
    assert cos.dtype == torch.float32  # built in fp32 whatever the activations are
    x = torch.randn(1, 2, 6, 8)  # [B, heads, T, head_dim]
    y = apply_rope(x, cos, sin)  # cos, sin: [B, 1, T, D]
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))  # a rotation per frequency pair
    torch.testing.assert_close(y[:, :, 0], x[:, :, 0])  # position 0: no rotation
    # rotate-half pairs dimension i with i + d/2 (not interleaved neighbours)
    e = torch.zeros(1, 1, 6, 8)
    e[..., 0] = 1.0
    z = apply_rope(e, cos, sin)
    assert torch.count_nonzero(z[0, 0, 1, 1:4]) == 0 and z[0, 0, 1, 4] != 0


def test_document_mask_is_causal_and_stays_inside_documents():
    mask = document_mask(torch.tensor([[0, 0, 1, 1, 1]]))  # True = may attend
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]],
                            dtype=torch.bool)
    assert torch.equal(mask.reshape(5, 5), expected)


# ---------------------------------------------------------------- packed rows without [T, T]

# row 0: contiguous documents; row 1: one document; row 2: ids that come back (not monotonic)
PACKED = torch.cat([torch.tensor([[0] * 20 + [1] * 30 + [2] * 10, [0] * 60]), torch.tensor([[3, 1, 1, 2] * 15])])


def test_document_block_mask_is_the_dense_document_mask_block_by_block():
    from torch.nn.attention.flex_attention import create_block_mask

    from ds_trhash.model.attention import document_block_mask

    docs = PACKED  # T = 60: the last 16-block is cut short

    def rule(b, h, q, kv):
        return (docs[b, q] == docs[b, kv]) & (q >= kv)

    mine = document_block_mask(docs, block=16)
    ref = create_block_mask(rule, 3, 1, 60, 60, device="cpu", BLOCK_SIZE=16)
    assert torch.equal(mine.to_dense(), ref.to_dense())  # which blocks are visited at all
    assert torch.equal(mine.full_kv_num_blocks, ref.full_kv_num_blocks)  # which skip the mask_mod
    # one document: full below the diagonal, except in the cut-short last query block
    assert mine.full_kv_num_blocks[1, 0].tolist() == [0, 1, 2, 0]
    assert mine.kv_num_blocks[0, 0].tolist() == [1, 2, 2, 3]  # query blocks 2, 3 skip key block 0 (doc 0 only)
    assert 0 not in mine.kv_indices[0, 0, 3, :3].tolist()


def attention_outputs(attn, x, positions, mask, grad=True):
    x = x.detach().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        out = attn(x, positions, mask)
    if not grad:
        return out, None
    return out, torch.autograd.grad((out * out).sum(), x)[0]


def test_flex_attention_and_the_blockwise_path_equal_the_dense_document_mask():
    """Flex attention (forward only on CPU: its backward is CUDA-only in torch 2.13) and the
    query-blockwise SDPA path the CPU trains with, against SDPA with the dense mask."""
    from ds_trhash.model.attention import DocumentMask, _blockwise_document_attention, document_block_mask

    torch.manual_seed(0)
    attn = TRHashAttention(TINY)
    x = torch.randn(3, 60, TINY.hidden_size)
    positions = torch.arange(60).expand(3, 60)
    dense, dense_grad = attention_outputs(attn, x, positions, document_mask(PACKED))

    flex, _ = attention_outputs(attn, x, positions, DocumentMask(PACKED, document_block_mask(PACKED, 16)), False)
    torch.testing.assert_close(flex, dense.detach(), rtol=1e-5, atol=1e-6)

    import ds_trhash.model.attention as attention

    calls = []

    def small_blocks(*args, **kwargs):
        calls.append(1)
        return _blockwise_document_attention(*args, **kwargs, block=16)  # 4 query blocks of T=60

    attention._blockwise_document_attention, saved = small_blocks, attention._blockwise_document_attention
    try:
        blockwise, blockwise_grad = attention_outputs(attn, x, positions, DocumentMask(PACKED))
    finally:
        attention._blockwise_document_attention = saved
    assert calls == [1]
    torch.testing.assert_close(blockwise, dense, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(blockwise_grad, dense_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_flex_attention_trains_on_cuda_like_the_dense_mask():
    from ds_trhash.model.attention import build_document_mask

    torch.manual_seed(0)
    attn = TRHashAttention(TINY).cuda()
    docs = torch.cat([PACKED, PACKED[:, :4]], dim=1).cuda()  # T = 64
    x = torch.randn(3, 64, TINY.hidden_size, device="cuda")
    positions = torch.arange(64, device="cuda").expand(3, 64)
    mask = build_document_mask(docs)
    assert mask.block_mask is not None  # CUDA: flex attention
    flex, flex_grad = attention_outputs(attn, x, positions, mask)
    dense, dense_grad = attention_outputs(attn, x, positions, document_mask(docs))
    torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(flex_grad, dense_grad, rtol=1e-4, atol=1e-5)
