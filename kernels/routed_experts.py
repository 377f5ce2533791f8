"""Triton routed experts for TR-HASH (docs/contracts.md §1 routed experts, §7 kernels).

``routed_experts_triton(x, routes, gate, up, down, weights)`` computes, for every token n,

    y[n] = sum_k w_k * (silu(x[n] @ gate[e]) * (x[n] @ up[e])) @ down[e],   e = routes[n, k]

with the same contract as the PyTorch reference ``ds_trhash.model.experts.routed_experts``.

Design (see docs/kernels.md). At the 200m shape the op is bound by launches and latency, not
arithmetic, so the forward and backward together are 6 Triton launches (8 with split-K weight
gradients at large N) and a handful of torch ops, with no host synchronisation:

* The N*2 (token, slot) assignments a = 2*n + k are flattened and sorted stably by expert,
  once, in the forward: ``order[r]`` is the assignment at sorted row r; ``offsets[e]:offsets[e+1]``
  is expert e's segment (empty segments are fine). Both are outputs of the forward op that the
  backward reuses. No gathered copy of x is made: kernels read token rows through
  ``order[r] // 2``.
* A 1-D "tile space" of ``cdiv(M, BLOCK_M) + E`` programs covers every expert's segment in
  BLOCK_M-row tiles; each program finds its expert by walking the (few) offsets, so the grid
  is known on the host without a device sync. Surplus programs are fully masked.
* Forward: ``_gate_up_kernel`` (grouped GEMM x[tok] @ [gate_e | up_e], SwiGLU epilogue, writes
  h, g, u into one [3, M, W] buffer in sorted order) and ``_grouped_mm_kernel`` (h @ down_e,
  scaled by the route weight of the slot and stored at the assignment's own row 2n + k); the
  pair reduction is then one sum over the two slots of each token ([N, 2, H] -> [N, H]):
  deterministic, no atomics, no inverse permutation.
* Backward (a custom op registered as the forward's autograd formula): dh = w_slot * dy[tok] @
  down_e^T with the SwiGLU backward fused in the epilogue (``_grouped_mm_kernel`` with A read
  through the index), dgate/dup/ddown as split-K grouped weight-gradient GEMMs
  (``_grouped_dw_kernel``, written straight into the gradients in their dtype with one split,
  else fp32 partials summed in a fixed order by ``_sum_splits_kernel``: deterministic), dx =
  dg @ gate_e^T + du @ up_e^T per sorted row stored at the assignment's row, then the same sum.

Accumulation is fp32; tensors stored between kernels keep the input dtype (bf16 on GPU).
On CPU the kernels run only under ``TRITON_INTERPRET=1`` (fp32/fp16; bf16 is wrong in the
interpreter), and autotuning is reduced to one config there. On GPU fp32 (a test dtype;
training runs bf16) is pruned to one config per kernel, and configs wider than the problem
are pruned for every dtype (``_prune``), so tuning compiles few variants.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["routed_experts_triton", "reset_autotuning", "TOP_K", "MAX_EXPERT_WIDTH", "SUPPORTED_DTYPES"]

TOP_K = 2
#: Widest expert for which the policy picks this kernel (one block holds the whole W).
MAX_EXPERT_WIDTH = 256
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# (meta, num_warps, num_stages) per kernel family on GPU: the first entry is fp32's only config
# (IEEE fp32 dots: small tiles), the others are the bf16/fp16 candidates.
ROW_TILE_OPTIONS = [
    ({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}, 4, 2),
    ({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}, 4, 3),
    ({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}, 4, 3),
    ({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64}, 4, 3),
    ({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32}, 8, 3),
    ({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 128}, 8, 2),
]
DW_OPTIONS = [
    ({"BLOCK_P": 64, "BLOCK_Q": 64, "BLOCK_R": 32}, 4, 2),
    ({"BLOCK_P": 64, "BLOCK_Q": 64, "BLOCK_R": 64}, 4, 3),
    ({"BLOCK_P": 64, "BLOCK_Q": 128, "BLOCK_R": 64}, 4, 3),
    ({"BLOCK_P": 128, "BLOCK_Q": 64, "BLOCK_R": 64}, 8, 3),
    ({"BLOCK_P": 128, "BLOCK_Q": 128, "BLOCK_R": 32}, 8, 3),
]
_SUM_BLOCK = 1024


def _configs(gpu_options: list[tuple[dict[str, int], int, int]], interpret_option: dict[str, int]) -> list[triton.Config]:
    """One config under the interpreter (every config would be run there), a few on GPU."""
    if _INTERPRET:
        return [triton.Config(interpret_option, num_warps=4, num_stages=1)]
    return [triton.Config(meta, num_warps=warps, num_stages=stages) for meta, warps, stages in gpu_options]


def _arg(named: dict[str, object], kwargs: dict[str, object], name: str) -> object:
    return kwargs[name] if name in kwargs else named.get(name)


def _pruner(cols: str, inner: str, col_block: str, inner_block: str) -> Callable[..., list[triton.Config]]:
    """``early_config_prune`` for a kernel whose output columns are ``cols`` wide in
    ``col_block`` blocks and whose reduction runs over ``inner`` in ``inner_block`` steps.

    fp32 (``DOT_PRECISION`` "ieee", the GPU tests' dtype) keeps only the first config: each
    config is a compile, and the tests' fp32 cases spent a minute tuning. Other dtypes drop the
    configs whose column or reduction block is wider than the problem needs (a W = 64 expert
    never needs BLOCK_N 128); at least one config always stays."""
    def prune(configs: list[triton.Config], named_args: dict[str, object], **kwargs: object) -> list[triton.Config]:
        if _arg(named_args, kwargs, "DOT_PRECISION") == "ieee" or len(configs) == 1:
            return configs[:1]
        candidates = configs[1:]  # the first config is fp32's
        n_cols, n_inner = _arg(named_args, kwargs, cols), _arg(named_args, kwargs, inner)
        fits = [c for c in candidates
                if (n_cols is None or c.kwargs[col_block] <= max(16, triton.next_power_of_2(int(cast(int, n_cols)))))
                and (n_inner is None or c.kwargs[inner_block] <= max(16, triton.next_power_of_2(int(cast(int, n_inner)))))]
        return fits or candidates[:1]
    return prune


_ROW_TILE_CONFIGS = _configs(ROW_TILE_OPTIONS, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16})
_DW_CONFIGS = _configs(DW_OPTIONS, {"BLOCK_P": 16, "BLOCK_Q": 16, "BLOCK_R": 16})


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------
# TRITON_PARAMETERS: Triton reads a kernel's parameter annotations as kernel types (``tl.constexpr``
# makes a compile-time constant), so the tensor pointers and scalars stay unannotated, for Triton to
# specialise on, and the type checker is told to let these defs be (each with a ``type: ignore`` for no-untyped-def).


@triton.jit
def _tile_of(pid, offsets_ptr, E, BLOCK_M: tl.constexpr):  # type: ignore[no-untyped-def]  # TRITON_PARAMETERS
    """Map a program id of the tile space to (expert, first sorted row, segment end).

    Experts own consecutive runs of cdiv(count_e, BLOCK_M) tiles. A program past the last
    tile gets an empty range (row_start == row_end), so every access it makes is masked.
    """
    zero = pid * 0  # int32 tensors: loop-carried values keep one type when compiled
    expert = zero
    row_start = zero
    row_end = zero
    tiles_before = zero
    for e in range(E):
        seg_start = tl.load(offsets_ptr + e).to(tl.int32)
        seg_end = tl.load(offsets_ptr + e + 1).to(tl.int32)
        n_tiles = tl.cdiv(seg_end - seg_start, BLOCK_M)
        mine = (pid >= tiles_before) & (pid < tiles_before + n_tiles)
        expert = tl.where(mine, e, expert)
        row_start = tl.where(mine, seg_start + (pid - tiles_before) * BLOCK_M, row_start)
        row_end = tl.where(mine, seg_end, row_end)
        tiles_before += n_tiles
    return expert, row_start, row_end


@triton.jit
def _k_loop(acc, a_rows_ptr, stride_ak, b_cols_ptr, stride_bk, K, row_ok, col_ok,  # type: ignore[no-untyped-def]  # TRITON_PARAMETERS
            BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc += A[:, :K] @ B[:K, :] in BLOCK_K steps (A rows and B columns already offset)."""
    ks = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        a = tl.load(a_rows_ptr + k[None, :] * stride_ak, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_cols_ptr + k[:, None] * stride_bk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _swiglu_bwd_store(dh, g_ptr, stride_gu, out_ptr, N, ok):  # type: ignore[no-untyped-def]  # TRITON_PARAMETERS
    """SwiGLU backward of dh with the saved g (at g_ptr) and u (g_ptr + stride_gu): dg to
    out[:, :N], du to out[:, N:2N]."""
    g = tl.load(g_ptr, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(g_ptr + stride_gu, mask=ok, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    d_g = dh * u * (sig * (1.0 + g * (1.0 - sig)))
    d_u = dh * (g * sig)
    tl.store(out_ptr, d_g.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(out_ptr + N, d_u.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _split_store(acc, out_ptr, out2_ptr, q, ok, HALF, TWO_OUT: tl.constexpr):  # type: ignore[no-untyped-def]  # TRITON_PARAMETERS
    """acc at columns q: TWO_OUT, those below HALF to out, the rest to out2 (column q - HALF);
    else all to out."""
    if TWO_OUT:
        tl.store(out_ptr + q, acc.to(out_ptr.dtype.element_ty), mask=ok & (q < HALF))
        tl.store(out2_ptr + q - HALF, acc.to(out2_ptr.dtype.element_ty), mask=ok & (q >= HALF))
    else:
        tl.store(out_ptr + q, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.autotune(configs=_ROW_TILE_CONFIGS, key=["H", "W", "DOT_PRECISION"],
                 prune_configs_by={"early_config_prune": _pruner("W", "H", "BLOCK_N", "BLOCK_K")})
@triton.jit
def _gate_up_kernel(  # type: ignore[no-untyped-def]  # TRITON_PARAMETERS
    x_ptr, order_ptr, offsets_ptr, gate_ptr, up_ptr, act_ptr,
    E, H, W,
    stride_xm, stride_xh,
    stride_ge, stride_gh, stride_gw,
    stride_ue, stride_uh, stride_uw,
    stride_at, stride_am,
    TOPK: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """act[0, r] = silu(x[tok_r] @ gate_e) * (x[tok_r] @ up_e) for sorted rows r of expert e,
    and the pre-activations act[1] = g, act[2] = u (same layout) for the backward pass."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert, row_start, row_end = _tile_of(pid_m, offsets_ptr, E, BLOCK_M)

    rows = row_start + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    tok = tl.load(order_ptr + rows, mask=row_ok, other=0) // TOPK
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < W
    ks = tl.arange(0, BLOCK_K)

    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_rows = x_ptr + tok.to(tl.int64)[:, None] * stride_xm
    g_base = gate_ptr + expert.to(tl.int64) * stride_ge + cols[None, :] * stride_gw
    u_base = up_ptr + expert.to(tl.int64) * stride_ue + cols[None, :] * stride_uw
    for k0 in range(0, H, BLOCK_K):
        k = k0 + ks
        k_ok = k < H
        a = tl.load(x_rows + k[None, :] * stride_xh, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        bg = tl.load(g_base + k[:, None] * stride_gh, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        bu = tl.load(u_base + k[:, None] * stride_uh, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc_g = tl.dot(a, bg, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a, bu, acc_u, input_precision=DOT_PRECISION)

    h = acc_g * tl.sigmoid(acc_g) * acc_u
    out = act_ptr + rows.to(tl.int64)[:, None] * stride_am + cols[None, :]
    out_ok = row_ok[:, None] & col_ok[None, :]
    tl.store(out, h.to(act_ptr.dtype.element_ty), mask=out_ok)
    tl.store(out + stride_at, acc_g.to(act_ptr.dtype.element_ty), mask=out_ok)
    tl.store(out + 2 * stride_at, acc_u.to(act_ptr.dtype.element_ty), mask=out_ok)


@triton.autotune(configs=_ROW_TILE_CONFIGS,
                 key=["K", "N", "A_INDIRECT", "SWIGLU_BWD", "TWO_B", "DOT_PRECISION"],
                 prune_configs_by={"early_config_prune": _pruner("N", "K", "BLOCK_N", "BLOCK_K")})
@triton.jit
def _grouped_mm_kernel(  # type: ignore[no-untyped-def]  # TRITON_PARAMETERS
    a_ptr, order_ptr, offsets_ptr, b_ptr, b2_ptr, out_ptr, act_ptr, E, K, N, w0, w1,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_om, stride_at, stride_actm,
    TOPK: tl.constexpr, A_INDIRECT: tl.constexpr, SCALE_SLOT: tl.constexpr, OUT_ASSIGN: tl.constexpr,
    SWIGLU_BWD: tl.constexpr, TWO_B: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """acc[r] = A[row(r)] @ B_e for the sorted rows r of expert e (B_e given by strides).

    A_INDIRECT: A rows are tokens (row(r) = order[r] // TOPK), else the sorted rows themselves.
    TWO_B: A has 2K columns and acc = A[:, :K] @ B_e + A[:, K:] @ B2_e (B2 with B's strides):
    dx = dg @ gate_e^T + du @ up_e^T without concatenating the weights. SCALE_SLOT: acc is
    scaled by the route weight of the row's slot (w0 or w1). OUT_ASSIGN: row r is stored at
    row order[r] (the assignment 2n + k), so that a token's two rows are adjacent and the pair
    reduction is a sum over [N, 2, H]. SWIGLU_BWD: acc is dh; with g = act[1], u = act[2]
    (sorted rows) it stores dg to out[:, :N] and du to out[:, N:2N] instead of acc.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert, row_start, row_end = _tile_of(pid_m, offsets_ptr, E, BLOCK_M)

    rows = row_start + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    assign = tl.load(order_ptr + rows, mask=row_ok, other=0)
    if A_INDIRECT:
        a_rows = assign // TOPK
    else:
        a_rows = rows
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_base = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am
    b_off = expert.to(tl.int64) * stride_be + cols[None, :] * stride_bn
    acc = _k_loop(acc, a_base, stride_ak, b_ptr + b_off, stride_bk, K, row_ok, col_ok, BLOCK_K, DOT_PRECISION)
    if TWO_B:
        acc = _k_loop(acc, a_base + K * stride_ak, stride_ak, b2_ptr + b_off, stride_bk, K, row_ok, col_ok,
                      BLOCK_K, DOT_PRECISION)

    if SCALE_SLOT:
        acc = acc * tl.where(assign % TOPK == 0, w0, w1)[:, None]

    out_ok = row_ok[:, None] & col_ok[None, :]
    if OUT_ASSIGN:
        o_off = assign.to(tl.int64)[:, None] * stride_om + cols[None, :]
    else:
        o_off = rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    if SWIGLU_BWD:
        gu = act_ptr + stride_at + rows.to(tl.int64)[:, None] * stride_actm + cols[None, :]
        _swiglu_bwd_store(acc, gu, stride_at, out_ptr + o_off, N, out_ok)
    else:
        tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=out_ok)


@triton.autotune(configs=_DW_CONFIGS, key=["P", "Q", "A_INDIRECT", "B_INDIRECT", "SPLITS", "DOT_PRECISION"],
                 prune_configs_by={"early_config_prune": _pruner("Q", "P", "BLOCK_Q", "BLOCK_P")})
@triton.jit
def _grouped_dw_kernel(  # type: ignore[no-untyped-def]  # TRITON_PARAMETERS
    a_ptr, b_ptr, order_ptr, offsets_ptr, out_ptr, out2_ptr, P, Q, HALF, w0, w1,
    stride_am, stride_ap, stride_bm, stride_bq, stride_os, stride_oe, stride_op,
    TOPK: tl.constexpr, A_INDIRECT: tl.constexpr, B_INDIRECT: tl.constexpr,
    SCALE_BY_SLOT: tl.constexpr, SPLITS: tl.constexpr, TWO_OUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """out[s, e] = sum over split s of expert e's sorted rows r of A[row_a(r)]^T B[row_b(r)].

    Rows read "indirect" are token rows (order[r] // TOPK); others are sorted rows. With
    SCALE_BY_SLOT, B rows are multiplied by the route weight of their slot. One split: the
    result is stored in out's dtype (the gradient itself; TWO_OUT: columns below HALF to out,
    the rest to out2, both [E, P, HALF]); several: fp32 partials, which ``_sum_splits_kernel``
    adds in a fixed order (deterministic). Grid: (E * SPLITS, cdiv(P, BLOCK_P), cdiv(Q, BLOCK_Q)).
    """
    pid_es = tl.program_id(0)
    pid_p = tl.program_id(1)
    pid_q = tl.program_id(2)
    expert = pid_es // SPLITS
    split = pid_es % SPLITS

    seg_start = tl.load(offsets_ptr + expert).to(tl.int32)
    seg_end = tl.load(offsets_ptr + expert + 1).to(tl.int32)
    chunk = tl.cdiv(seg_end - seg_start, SPLITS)
    r_begin = seg_start + split * chunk
    r_end = tl.minimum(seg_end, r_begin + chunk)

    ps = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    qs = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    p_ok = ps < P
    q_ok = qs < Q
    rr = tl.arange(0, BLOCK_R)

    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    for r0 in range(r_begin, r_end, BLOCK_R):
        rows = r0 + rr
        r_ok = rows < r_end
        assign = tl.load(order_ptr + rows, mask=r_ok, other=0)
        a_rows = rows
        if A_INDIRECT:
            a_rows = assign // TOPK
        b_rows = rows
        if B_INDIRECT:
            b_rows = assign // TOPK
        # A tile [BLOCK_R, BLOCK_P] (loaded along its contiguous P axis), B tile [BLOCK_R, BLOCK_Q]
        a = tl.load(
            a_ptr + a_rows.to(tl.int64)[:, None] * stride_am + ps[None, :] * stride_ap,
            mask=r_ok[:, None] & p_ok[None, :], other=0.0)
        b = tl.load(
            b_ptr + b_rows.to(tl.int64)[:, None] * stride_bm + qs[None, :] * stride_bq,
            mask=r_ok[:, None] & q_ok[None, :], other=0.0)
        if SCALE_BY_SLOT:
            scale = tl.where(assign % TOPK == 0, w0, w1)
            b = (b.to(tl.float32) * scale[:, None]).to(b_ptr.dtype.element_ty)
        acc = tl.dot(tl.trans(a), b, acc, input_precision=DOT_PRECISION)

    base = split.to(tl.int64) * stride_os + expert.to(tl.int64) * stride_oe + ps[:, None] * stride_op
    _split_store(acc, out_ptr + base, out2_ptr + base, qs[None, :], p_ok[:, None] & q_ok[None, :], HALF, TWO_OUT)


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, out2_ptr, SPLITS, TOTAL, Q, HALF,  # type: ignore[no-untyped-def]  # TRITON_PARAMETERS
                       TWO_OUT: tl.constexpr, BLOCK: tl.constexpr):
    """out = sum over s of part[s] (fp32, s in order), part [SPLITS, E, P, Q] contiguous, stored
    in out's dtype; TWO_OUT: columns below HALF to out, the rest to out2 (each [E, P, HALF])."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < TOTAL
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, SPLITS):
        acc += tl.load(part_ptr + s * TOTAL + idx, mask=ok, other=0.0)
    if TWO_OUT:
        q = idx % Q
        row = (idx // Q) * HALF
        _split_store(acc, out_ptr + row, out2_ptr + row, q, ok, HALF, True)
    else:
        tl.store(out_ptr + idx, acc.to(out_ptr.dtype.element_ty), mask=ok)


# --------------------------------------------------------------------------------------------
# Host-side launchers
# --------------------------------------------------------------------------------------------


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: exact IEEE products (matches the fp32 PyTorch reference; no TF32).
    return "ieee" if dtype == torch.float32 else "tf32"


def _tile_grid(M: int, E: int, n_cols: int) -> Callable[[dict[str, int]], tuple[int, int]]:
    return lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) + E, triton.cdiv(n_cols, meta["BLOCK_N"]))


_BOUNDS: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}


def _sort_assignments(routes: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable sort of the flattened (token, slot) assignments by expert.

    Returns (order int64 [M]: assignment id at sorted row, offsets int32 [E+1]: segment bounds).
    Two device ops (the bounds 0..E are kept per device); no host synchronisation.
    """
    sorted_e, order = torch.sort(routes.reshape(-1), stable=True)
    key = (E, routes.device, sorted_e.dtype)
    bounds = _BOUNDS.get(key)
    if bounds is None:
        bounds = _BOUNDS[key] = torch.arange(E + 1, device=routes.device, dtype=sorted_e.dtype)
    return order, torch.searchsorted(sorted_e, bounds, out_int32=True)


def _launch_gate_up(x: Tensor, order: Tensor, offsets: Tensor, gate: Tensor, up: Tensor) -> Tensor:
    """act [3, M, W]: h, g, u of every sorted row."""
    M = order.numel()
    E, H, W = gate.shape
    act = torch.empty((3, M, W), device=x.device, dtype=x.dtype)
    _gate_up_kernel[_tile_grid(M, E, W)](
        x, order, offsets, gate, up, act,
        E, H, W,
        x.stride(0), x.stride(1),
        gate.stride(0), gate.stride(1), gate.stride(2),
        up.stride(0), up.stride(1), up.stride(2),
        act.stride(0), act.stride(1),
        TOPK=TOP_K, DOT_PRECISION=_dot_precision(x.dtype),
    )
    return act


def _launch_grouped_mm(a: Tensor, order: Tensor, offsets: Tensor, b: Tensor, b_strides: tuple[int, ...], K: int,
                       N: int, *, b2: Tensor | None = None, a_indirect: bool = False,
                       weights: tuple[float, float] | None = None, out_assign: bool = False,
                       act: Tensor | None = None) -> Tensor:
    """out[r] = A[row(r)] @ B_e, B_e of shape [K, N] given by ``b_strides`` (expert, k, n); see
    _grouped_mm_kernel for the flags. Returns [M, N] ([M, 2N] with ``act``: the SwiGLU backward)."""
    M = order.numel()
    E = offsets.numel() - 1
    out = torch.empty((M, 2 * N if act is not None else N), device=a.device, dtype=a.dtype)
    w0, w1 = weights if weights is not None else (1.0, 1.0)
    gu = act if act is not None else out
    _grouped_mm_kernel[_tile_grid(M, E, N)](
        a, order, offsets, b, b2 if b2 is not None else b, out, gu,
        E, K, N, float(w0), float(w1),
        a.stride(0), a.stride(1), *b_strides,
        out.stride(0), gu.stride(0), gu.stride(1) if act is not None else 0,
        TOPK=TOP_K, A_INDIRECT=a_indirect, SCALE_SLOT=weights is not None, OUT_ASSIGN=out_assign,
        SWIGLU_BWD=act is not None, TWO_B=b2 is not None, DOT_PRECISION=_dot_precision(a.dtype),
    )
    return out


def _default_splits(M: int, E: int) -> int:
    """Split-K factor for the weight gradients: ~1024 rows per program, at most 16 splits."""
    return max(1, min(16, triton.cdiv(M, E * 1024)))


def _launch_grouped_dw(a: Tensor, b: Tensor, order: Tensor, offsets: Tensor, *, out_dtype: torch.dtype,
                       a_indirect: bool, b_indirect: bool, weights: tuple[float, float] | None = None,
                       half: int | None = None, splits: int | None = None) -> tuple[Tensor, ...]:
    """dW[e] = sum over expert e's rows of A[row]^T @ (w_slot *) B[row]: [E, P, Q] in ``out_dtype``,
    (one tensor), or with ``half`` (Q = 2 * half) the pair of its column halves, each [E, P, half]."""
    M, E = order.numel(), offsets.numel() - 1
    P, Q = a.shape[1], b.shape[1]
    S = splits if splits is not None else _default_splits(M, E)
    cols = half if half is not None else Q
    outs = [torch.empty((E, P, cols), device=a.device, dtype=out_dtype) for _ in range(1 if half is None else 2)]
    target = outs[0] if S == 1 else torch.empty((S, E, P, Q), device=a.device, dtype=torch.float32)
    w0, w1 = (1.0, 1.0) if weights is None else weights
    grid = lambda meta: (E * S, triton.cdiv(P, meta["BLOCK_P"]), triton.cdiv(Q, meta["BLOCK_Q"]))  # noqa: E731
    two_out = half is not None and S == 1
    _grouped_dw_kernel[grid](
        a, b, order, offsets, target, outs[-1], P, Q, cols, float(w0), float(w1),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        target.stride(0) if S > 1 else 0, target.stride(-3), target.stride(-2),
        TOPK=TOP_K, A_INDIRECT=a_indirect, B_INDIRECT=b_indirect, SCALE_BY_SLOT=weights is not None,
        SPLITS=S, TWO_OUT=two_out, DOT_PRECISION=_dot_precision(a.dtype),
    )
    if S > 1:
        total = E * P * Q
        _sum_splits_kernel[(triton.cdiv(total, _SUM_BLOCK),)](
            target, outs[0], outs[-1], S, total, Q, cols, TWO_OUT=half is not None, BLOCK=_SUM_BLOCK)
    return tuple(outs)


def _strides_t(w: torch.Tensor) -> tuple[int, int, int]:
    """Strides of w[e]^T for every e: the [E, B, A] view of an [E, A, B] tensor, without a copy."""
    return w.stride(0), w.stride(2), w.stride(1)


# --------------------------------------------------------------------------------------------
# Autograd function and public entry point
# --------------------------------------------------------------------------------------------


# The forward and backward are ``torch.library`` custom ops (fake implementations give their
# output shapes, which never depend on the routes), so ``torch.compile(fullgraph=True)`` of a layer
# or a model keeps each call as one node. The forward also returns what the backward needs
# besides its inputs: the SwiGLU tensors h, g, u [3, 2N, W] and the sort (order [2N], offsets
# [E+1]), so the backward neither recomputes nor re-sorts.


@torch.library.custom_op("ds_trhash::routed_experts_triton", mutates_args=())
def _forward_op(x: torch.Tensor, routes: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                down: torch.Tensor, w0: float,
                w1: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y [N, H], act [3, 2N, W], order [2N] int64, offsets [E+1] int32)."""
    _check_route_values(routes, gate.shape[0])
    N, H = x.shape
    order, offsets = _sort_assignments(routes, gate.shape[0])
    act = _launch_gate_up(x, order, offsets, gate, up)
    # out[2n + k] = w_k * h[n, k] @ down_e: a token's two slots are adjacent rows
    out = _launch_grouped_mm(act[0], order, offsets, down, down.stride(), down.shape[1], H,
                             weights=(w0, w1), out_assign=True)
    return out.view(N, TOP_K, H).sum(dim=1), act, order, offsets


@_forward_op.register_fake
def _(x: Tensor, routes: Tensor, gate: Tensor, up: Tensor, down: Tensor, w0: float,
      w1: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    m, w = routes.numel(), gate.shape[2]
    return (torch.empty_like(x), x.new_empty((3, m, w)), routes.new_empty((m,), dtype=torch.int64),
            routes.new_empty((gate.shape[0] + 1,), dtype=torch.int32))


@torch.library.custom_op("ds_trhash::routed_experts_triton_backward", mutates_args=())
def _backward_op(dy: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                 act: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, w0: float, w1: float,
                 need_x: bool, need_weights: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dgate, dup, ddown); a gradient not asked for comes back as an empty tensor."""
    N, H = x.shape
    W = gate.shape[2]
    w = (w0, w1)
    if dy.dtype != x.dtype:
        dy = dy.to(x.dtype)
    if up.stride() != gate.stride():  # dx reads both through gate's strides
        gate, up = gate.contiguous(), up.contiguous()
    d_x = d_gate = d_up = d_down = None
    if need_weights:
        # d_down[e] = sum_r h[r]^T (w_slot(r) * dy[tok(r)]); h = act[0] (act's first rows)
        (d_down,) = _launch_grouped_dw(act[0], dy, order, offsets, out_dtype=down.dtype, a_indirect=False,
                                    b_indirect=True, weights=w)
    # dgu[r] = [dg | du] with dh = w_slot * dy[tok] @ down_e^T, SwiGLU backward fused.
    dgu = _launch_grouped_mm(dy, order, offsets, down, _strides_t(down), H, W, a_indirect=True, weights=w,
                             act=act)
    if need_weights:
        d_gate, d_up = _launch_grouped_dw(x, dgu, order, offsets, out_dtype=gate.dtype, a_indirect=True,
                                          b_indirect=False, half=W)
    if need_x:
        # out[2n + k] = dg @ gate_e^T + du @ up_e^T of the slot's row; dx[n] = sum over the two slots
        out = _launch_grouped_mm(dgu, order, offsets, gate, _strides_t(gate), W, H, b2=up, out_assign=True)
        d_x = out.view(N, TOP_K, H).sum(dim=1)
    empty = x.new_empty(0)

    def given(grad: torch.Tensor | None) -> torch.Tensor:
        return grad if grad is not None else empty

    return given(d_x), given(d_gate), given(d_up), given(d_down)


@_backward_op.register_fake
def _(dy: Tensor, x: Tensor, gate: Tensor, up: Tensor, down: Tensor, act: Tensor, order: Tensor, offsets: Tensor,
      w0: float, w1: float, need_x: bool, need_weights: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    def grad_like(t: Tensor, needed: bool) -> Tensor:
        return torch.empty_like(t) if needed else t.new_empty(0)

    return (grad_like(x, need_x), grad_like(gate, need_weights), grad_like(up, need_weights),
            grad_like(down, need_weights))


# the autograd context object torch passes is untyped (the op sets attributes on it): Any
def _setup_context(ctx: Any, inputs: tuple[Tensor, ...], output: tuple[Tensor, ...]) -> None:  # Any: autograd ctx
    x, routes, gate, up, down, w0, w1 = inputs
    _, act, order, offsets = output
    ctx.mark_non_differentiable(act, order, offsets)
    ctx.set_materialize_grads(False)  # no zero gradients made for act, order, offsets
    ctx.save_for_backward(x, gate, up, down, act, order, offsets)
    ctx.weights = (w0, w1)


def _backward(ctx: Any, dy: Tensor | None, _act: Tensor | None, _order: Tensor | None,  # Any: autograd ctx
              _offsets: Tensor | None) -> tuple[Tensor | None, ...]:
    if dy is None:  # y was not used (grads are not materialised): nothing flows back
        return None, None, None, None, None, None, None
    x, gate, up, down, act, order, offsets = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_x, need_weights = need[0], need[2] or need[3] or need[4]
    d_x, d_gate, d_up, d_down = _backward_op(dy, x, gate, up, down, act, order, offsets, *ctx.weights,
                                             need_x, need_weights)
    return (d_x if need_x else None, None, d_gate if need[2] else None,
            d_up if need[3] else None, d_down if need[4] else None, None, None)


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def _check_route_values(routes: torch.Tensor, E: int) -> None:
    """Routes must name experts in [0, E). Checked on the CPU (the interpreter) only: on a GPU
    the check would cost device ops (or a host sync) on every call of the hot path, and the
    model's routes come from its route table, validated when it is built or loaded
    (``decoder.validate_routes``). A route outside [0, E) there is a caller bug: its row is
    never computed."""
    if routes.device.type == "cpu" and routes.numel() and bool(((routes < 0) | (routes >= E)).any()):
        raise ValueError(f"routed_experts_triton: routes must lie in [0, {E}), got values outside")


def _check(x: Tensor, routes: Tensor, gate: Tensor, up: Tensor, down: Tensor, weights: tuple[float, ...]) -> None:
    if x.dim() != 2:
        raise ValueError(f"routed_experts_triton: x must be [N, H], got {tuple(x.shape)}")
    N, H = x.shape
    if gate.dim() != 3 or up.shape != gate.shape or gate.shape[1] != H:
        raise ValueError(
            f"routed_experts_triton: gate/up must both be [E, H={H}, W], got {tuple(gate.shape)} "
            f"and {tuple(up.shape)}")
    E, _, W = gate.shape
    if tuple(down.shape) != (E, W, H):
        raise ValueError(f"routed_experts_triton: down must be [E={E}, W={W}, H={H}], got {tuple(down.shape)}")
    if tuple(routes.shape) != (N, TOP_K):
        raise ValueError(f"routed_experts_triton: routes must be [N={N}, {TOP_K}], got {tuple(routes.shape)}")
    if routes.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"routed_experts_triton: routes must be int64, got {routes.dtype}")
    if len(weights) != TOP_K:
        raise ValueError(f"routed_experts_triton: weights needs {TOP_K} values, got {weights!r}")
    if x.dtype not in SUPPORTED_DTYPES or not (x.dtype == gate.dtype == up.dtype == down.dtype):
        raise ValueError(
            "routed_experts_triton: x, gate, up, down must share one dtype among "
            f"{SUPPORTED_DTYPES}, got {x.dtype}, {gate.dtype}, {up.dtype}, {down.dtype}")
    devices = {t.device for t in (x, routes, gate, up, down)}
    if len(devices) != 1:
        raise ValueError(f"routed_experts_triton: all tensors must be on one device, got {devices}")
    if x.device.type != "cuda" and not _INTERPRET:
        raise RuntimeError(
            "routed_experts_triton needs a CUDA device, or TRITON_INTERPRET=1 set before triton "
            "is first imported (CPU interpreter, fp32/fp16 only)")


def routed_experts_triton(x: torch.Tensor, routes: torch.Tensor, gate: torch.Tensor,
                          up: torch.Tensor, down: torch.Tensor,
                          weights: Sequence[float] = (0.5, 0.5)) -> torch.Tensor:
    """Routed top-2 SwiGLU experts with Triton grouped GEMMs; differentiable in x, gate, up, down.

    x [N, H]; routes [N, 2] int64 (routes[:, k] = expert of slot k); gate, up [E, H, W];
    down [E, W, H]; weights (w0, w1) are constants (no gradient). Returns [N, H] in x.dtype.
    """
    pair = tuple(float(w) for w in weights)
    _check(x, routes, gate, up, down, pair)
    N, H = x.shape
    if N == 0:
        # Nothing routed: keep the graph connected so the weights still get (zero) grads.
        return x.new_zeros((0, H)) + 0.0 * (x.sum() + gate.sum() + up.sum() + down.sum())
    y, _, _, _ = _forward_op(x, routes, gate, up, down, pair[0], pair[1])
    return y


def reset_autotuning() -> None:
    """Forget the tuned configs, e.g. after a start-up check on a batch far smaller than training's
    (the autotune keys hold the widths, not the row count)."""
    for kernel in (_gate_up_kernel, _grouped_mm_kernel, _grouped_dw_kernel):
        kernel.cache.clear()
