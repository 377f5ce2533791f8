import os

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from ds_trhash.model.loss import chunked_ce, liger_ce, plain_ce, tied_ce


def make_case(n=70, h=12, v=50, ignored=(0, 3, 4, -1), seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen).requires_grad_()
    weight = torch.randn(v, h, generator=gen).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[list(ignored)] = -100
    return hidden, weight, labels


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def value_and_grads(fn, hidden, weight, labels):
    loss = fn(hidden, weight, labels)
    return (loss, *torch.autograd.grad(loss * 1.7, (hidden, weight)))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [1, 16, 1024])
def test_chunked_equals_plain(reduction, chunk):
    case = make_case()
    plain = value_and_grads(lambda h, w, l: plain_ce(h, w, l, reduction), *case)
    chunked = value_and_grads(lambda h, w, l: chunked_ce(h, w, l, chunk, reduction), *case)
    for p, c in zip(plain, chunked):
        assert rel_err(c, p) <= 1e-6  # fp32: only summation order differs


def test_frozen_head_gets_no_gradient_but_hidden_does():
    hidden, weight, labels = make_case()
    weight.requires_grad_(False)
    chunked = torch.autograd.grad(chunked_ce(hidden, weight, labels, 16), hidden)[0]
    plain = torch.autograd.grad(plain_ce(hidden, weight, labels), hidden)[0]
    assert rel_err(chunked, plain) <= 1e-6


def test_mean_divides_by_valid_labels_only():
    hidden, weight, labels = make_case()
    total = plain_ce(hidden, weight, labels, "sum")
    torch.testing.assert_close(plain_ce(hidden, weight, labels), total / 66)
    logits = hidden @ weight.t()
    manual = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100)
    torch.testing.assert_close(chunked_ce(hidden, weight, labels, 8), manual)


@pytest.mark.parametrize("fn", [plain_ce, lambda h, w, l, r: chunked_ce(h, w, l, 4, r)])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_no_valid_label_gives_zero_loss_and_zero_grads(fn, reduction):
    hidden, weight, labels = make_case(n=9, ignored=range(9))
    loss = fn(hidden, weight, labels, reduction)
    gh, gw = torch.autograd.grad(loss, (hidden, weight))
    assert loss.item() == 0.0
    assert torch.count_nonzero(gh) == 0 and torch.count_nonzero(gw) == 0


def test_unknown_names_are_rejected():
    hidden, weight, labels = make_case(n=8)
    with pytest.raises(ValueError, match="reduction 'max'"):
        chunked_ce(hidden, weight, labels, reduction="max")
    with pytest.raises(ValueError, match="loss backend 'fused'"):
        tied_ce(hidden, weight, labels, "fused")


def peak_bytes(fn, n, v, h=16):
    """Peak bytes allocated during forward+backward, from the profiler's allocation events."""
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(hidden, weight, labels).backward()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def test_chunked_loss_keeps_one_logit_block_alive():
    v, h, chunk = 4096, 16, 64
    block = chunk * v * 4  # one fp32 [chunk, V] logit block
    plain = {n: peak_bytes(plain_ce, n, v, h) for n in (512, 2048)}
    chunked = {n: peak_bytes(lambda a, b, c: chunked_ce(a, b, c, chunk), n, v, h) for n in (512, 2048)}
    # plain materialises [N, V] logits: at least N·V·4 bytes, growing with the token count
    assert plain[2048] >= 2048 * v * 4 and plain[2048] - plain[512] >= 1536 * v * 4
    # chunked: a few blocks plus the gradient buffers (hidden and weight), whatever N is
    gradient_buffers = (2048 * h + v * h) * 4 * 2
    assert chunked[2048] <= 4 * block + gradient_buffers
    assert chunked[2048] - chunked[512] <= 0.05 * (plain[2048] - plain[512])


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Liger needs CUDA or the Triton interpreter")
def test_liger_loss_matches_plain_contract():
    case = make_case(n=24, v=40)
    plain = value_and_grads(plain_ce, *case)
    liger = value_and_grads(liger_ce, *case)
    for p, l in zip(plain, liger):
        torch.testing.assert_close(l, p, rtol=1e-5, atol=1e-6)


def test_chunked_loss_memory_stays_bounded_as_the_vocabulary_grows():
    """Growing V grows the plain loss by N·V logits but the chunked loss only by one
    [chunk, V] block plus the [V, H] weight gradient, so its peak stays a small fraction."""
    n, h, chunk = 2048, 16, 64
    plain, chunked = {}, {}
    for v in (1024, 4096, 16384):
        plain[v] = peak_bytes(plain_ce, n, v, h)
        chunked[v] = peak_bytes(lambda a, b, c: chunked_ce(a, b, c, chunk), n, v, h)
        assert plain[v] >= n * v * 4
        assert chunked[v] <= 4 * chunk * v * 4 + (n * h + v * h) * 4 * 2
    growth_plain = plain[16384] - plain[1024]
    growth_chunked = chunked[16384] - chunked[1024]
    assert growth_chunked <= 0.1 * growth_plain
