"""GQA attention with QK-norm before RoPE (rotate-half), against a textbook reference, and the
K, Q, V row order of the fused projection."""

import math

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
