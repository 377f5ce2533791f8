"""Training FLOPs of a TR-HASH model and the nominal peaks of the devices it runs on (for MFU)."""
from __future__ import annotations

from ds_trhash.model.config import TRHashConfig

__all__ = ["train_flops_per_token", "NOMINAL_BF16_TFLOPS", "nominal_bf16_tflops"]

#: Nominal dense bf16 tensor-core peaks (vendor datasheets), TFLOP/s.
NOMINAL_BF16_TFLOPS = {"H200": 989.4, "H100 80GB HBM3": 989.4, "H100 SXM": 989.4, "H100 PCIe": 756.0,
                       "A100": 312.0}


def train_flops_per_token(cfg: TRHashConfig, seq_len: int) -> float:
    """6 x (matmul parameters a token passes through, tied head included) + causal attention.

    Attention: per layer and token, QK^T and AV over on average seq_len / 2 keys cost
    2 x 2 x (seq_len / 2) x heads x head_dim forward, x3 for training = 6 x seq_len x d_attn.
    For the 200m preset at 2,048 this gives 1.3502e9.
    """
    h, d_attn = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    d_kv = cfg.num_kv_heads * cfg.head_dim
    attn = h * d_attn + 2 * h * d_kv + d_attn * h
    shared = 3 * h * cfg.shared_width
    routed = cfg.top_k * 3 * h * cfg.expert_width
    params = cfg.num_layers * (attn + shared + routed) + cfg.vocab_size * h
    return 6.0 * params + 6.0 * cfg.num_layers * seq_len * d_attn


def nominal_bf16_tflops(device_name: str) -> float | None:
    """The datasheet bf16 peak of a CUDA device by name; None when unknown (or an NVL part,
    which runs lower clocks than the SXM figures)."""
    if "NVL" in device_name:
        return None
    for key, value in NOMINAL_BF16_TFLOPS.items():
        if key in device_name:
            return value
    return None
