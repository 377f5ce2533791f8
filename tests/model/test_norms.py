"""RMSNorm: the formula, fp32 statistics for low-precision activations, backend records."""

import pytest
import torch

from ds_trhash.model.norms import RMSNorm, rms_norm


def test_rms_norm_is_the_formula():
    x = torch.randn(3, 5, 16)
    w = torch.randn(16)
    expected = w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), expected)


def test_statistics_are_fp32_for_bf16_activations():
    # large activations: summing squares in bf16 would lose the scale; fp32 statistics keep it
    x = (torch.randn(4, 256) * 300).to(torch.bfloat16)
    out = rms_norm(x, torch.ones(256, dtype=torch.bfloat16), 1e-6)
    ref = rms_norm(x.float(), torch.ones(256), 1e-6)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


def test_module_records_the_backend_that_ran_and_refuses_unknown_ones():
    norm = RMSNorm(8, 1e-6)
    assert norm.last_backend is None
    norm(torch.randn(2, 8))
    assert norm.last_backend == "pytorch"
    norm.backend = "fused"
    with pytest.raises(ValueError, match="unknown norm backend 'fused'"):
        norm(torch.randn(2, 8))
