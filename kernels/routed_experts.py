"""Triton routed experts for TR-HASH (docs/contracts.md §1 routed experts, §7 kernels).

``routed_experts_triton(x, routes, gate, up, down, weights)`` computes, for every token n,

    y[n] = sum_k w_k * (silu(x[n] @ gate[e]) * (x[n] @ up[e])) @ down[e],   e = routes[n, k]

with the same contract as the PyTorch reference ``ds_trhash.model.experts.routed_experts``.

Design (see docs/kernels.md):

* The N*2 (token, slot) assignments a = 2*n + k are flattened and sorted stably by expert.
  ``order[r]`` is the assignment at sorted row r; ``offsets[e]:offsets[e+1]`` is expert e's
  segment (empty segments are fine). No gathered copy of x is made: kernels read token rows
  through ``order[r] // 2``.
* A 1-D "tile space" of ``cdiv(M, BLOCK_M) + E`` programs covers every expert's segment in
  BLOCK_M-row tiles; each program finds its expert by walking the (few) offsets, so the grid
  is known on the host without a device sync. Surplus programs are fully masked.
* Forward: kernel ``_gate_up_kernel`` (grouped GEMM x[tok] @ [gate_e | up_e], SwiGLU epilogue,
  writes h, g, u in sorted order), ``_grouped_mm_kernel`` (h @ down_e, sorted rows), and
  ``_pair_reduce_kernel`` (y[n] = w0 * out[inv[2n]] + w1 * out[inv[2n+1]]; deterministic, no
  atomics).
* Backward (a custom op registered as the forward's autograd formula): dh = w_slot * dy[tok] @ down_e^T with the SwiGLU
  backward fused in the epilogue (``_grouped_mm_kernel`` with A read through the index),
  dgate/dup/ddown as split-K grouped weight-gradient GEMMs (``_grouped_dw_kernel``, fp32
  partials summed in a fixed order: deterministic), dx = [dg | du] @ [gate_e | up_e]^T per
  sorted row, then the same pair reduction with weights (1, 1).

Accumulation is fp32; tensors stored between kernels keep the input dtype (bf16 on GPU).
On CPU the kernels run only under ``TRITON_INTERPRET=1`` (fp32/fp16; bf16 is wrong in the
interpreter), and autotuning is reduced to one config there.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["routed_experts_triton", "reset_autotuning", "TOP_K", "MAX_EXPERT_WIDTH", "SUPPORTED_DTYPES"]

TOP_K = 2
#: Widest expert for which the policy picks this kernel (one block holds the whole W).
MAX_EXPERT_WIDTH = 256
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _configs(gpu_options, interpret_option):
    """One config under the interpreter (every config would be run there), a few on GPU."""
    if _INTERPRET:
        return [triton.Config(interpret_option, num_warps=4, num_stages=1)]
    return [triton.Config(meta, num_warps=warps, num_stages=stages) for meta, warps, stages in gpu_options]


_ROW_TILE_CONFIGS = _configs(
    [
        ({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}, 4, 3),
        ({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}, 4, 3),
        ({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64}, 4, 3),
        ({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32}, 8, 3),
        ({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 128}, 8, 2),
    ],
    {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16},
)

_DW_CONFIGS = _configs(
    [
        ({"BLOCK_P": 64, "BLOCK_Q": 64, "BLOCK_R": 64}, 4, 3),
        ({"BLOCK_P": 64, "BLOCK_Q": 128, "BLOCK_R": 64}, 4, 3),
        ({"BLOCK_P": 128, "BLOCK_Q": 64, "BLOCK_R": 64}, 8, 3),
        ({"BLOCK_P": 128, "BLOCK_Q": 128, "BLOCK_R": 32}, 8, 3),
    ],
    {"BLOCK_P": 16, "BLOCK_Q": 16, "BLOCK_R": 16},
)

_REDUCE_CONFIGS = _configs(
    [
        ({"BLOCK_T": 8, "BLOCK_H": 256}, 4, 1),
        ({"BLOCK_T": 16, "BLOCK_H": 128}, 4, 1),
        ({"BLOCK_T": 4, "BLOCK_H": 512}, 4, 1),
    ],
    {"BLOCK_T": 8, "BLOCK_H": 16},
)


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _tile_of(pid, offsets_ptr, E, BLOCK_M: tl.constexpr):
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


@triton.autotune(configs=_ROW_TILE_CONFIGS, key=["H", "W", "DOT_PRECISION"])
@triton.jit
def _gate_up_kernel(
    x_ptr, order_ptr, offsets_ptr, gate_ptr, up_ptr, h_ptr, g_ptr, u_ptr,
    E, H, W,
    stride_xm, stride_xh,
    stride_ge, stride_gh, stride_gw,
    stride_ue, stride_uh, stride_uw,
    stride_hm,
    TOPK: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """h[r] = silu(x[tok_r] @ gate_e) * (x[tok_r] @ up_e) for sorted rows r of expert e.

    Also stores the pre-activations g, u (same layout as h) for the backward pass.
    """
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
    out_off = rows.to(tl.int64)[:, None] * stride_hm + cols[None, :]
    out_ok = row_ok[:, None] & col_ok[None, :]
    tl.store(h_ptr + out_off, h.to(h_ptr.dtype.element_ty), mask=out_ok)
    tl.store(g_ptr + out_off, acc_g.to(g_ptr.dtype.element_ty), mask=out_ok)
    tl.store(u_ptr + out_off, acc_u.to(u_ptr.dtype.element_ty), mask=out_ok)


@triton.autotune(configs=_ROW_TILE_CONFIGS, key=["K", "N", "A_INDIRECT", "SWIGLU_BWD", "DOT_PRECISION"])
@triton.jit
def _grouped_mm_kernel(
    a_ptr, order_ptr, offsets_ptr, b_ptr, out_ptr, g_ptr, u_ptr, E, K, N, w0, w1,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_om, stride_gm,
    TOPK: tl.constexpr, A_INDIRECT: tl.constexpr, SWIGLU_BWD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """acc[r] = A[row(r)] @ B_e for the sorted rows r of expert e (B_e given by strides).

    A_INDIRECT: A rows are tokens (row(r) = order[r] // TOPK) and acc is scaled by the route
    weight of the slot (w0 or w1): this is dh = w * dy[tok] @ down_e^T in backward. Otherwise
    A rows are the sorted rows themselves (h @ down_e forward, [dg|du] @ [gate|up]^T backward).
    SWIGLU_BWD: acc is dh; with the saved g, u it writes dg to out[:, :N] and du to
    out[:, N:2N] instead of acc.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert, row_start, row_end = _tile_of(pid_m, offsets_ptr, E, BLOCK_M)

    rows = row_start + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    if A_INDIRECT:
        assign = tl.load(order_ptr + rows, mask=row_ok, other=0)
        a_rows = assign // TOPK
    else:
        a_rows = rows
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_base = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am
    b_base = b_ptr + expert.to(tl.int64) * stride_be + cols[None, :] * stride_bn
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        a = tl.load(a_base + k[None, :] * stride_ak, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_base + k[:, None] * stride_bk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)

    if A_INDIRECT:
        slot = assign % TOPK
        scale = tl.where(slot == 0, w0, w1)
        acc = acc * scale[:, None]

    out_ok = row_ok[:, None] & col_ok[None, :]
    o_off = rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    if SWIGLU_BWD:
        gu_off = rows.to(tl.int64)[:, None] * stride_gm + cols[None, :]
        g = tl.load(g_ptr + gu_off, mask=out_ok, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + gu_off, mask=out_ok, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        silu = g * sig
        d_g = acc * u * (sig * (1.0 + g * (1.0 - sig)))
        d_u = acc * silu
        tl.store(out_ptr + o_off, d_g.to(out_ptr.dtype.element_ty), mask=out_ok)
        tl.store(out_ptr + o_off + N, d_u.to(out_ptr.dtype.element_ty), mask=out_ok)
    else:
        tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=out_ok)


@triton.autotune(configs=_DW_CONFIGS, key=["P", "Q", "A_INDIRECT", "B_INDIRECT", "SPLITS", "DOT_PRECISION"])
@triton.jit
def _grouped_dw_kernel(
    a_ptr, b_ptr, order_ptr, offsets_ptr, part_ptr, P, Q, w0, w1,
    stride_am, stride_ap, stride_bm, stride_bq, stride_ps, stride_pe, stride_pp,
    TOPK: tl.constexpr, A_INDIRECT: tl.constexpr, B_INDIRECT: tl.constexpr,
    SCALE_BY_SLOT: tl.constexpr, SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """part[s, e] = sum over split s of expert e's sorted rows r of A[row_a(r)]^T B[row_b(r)].

    Rows read "indirect" are token rows (order[r] // TOPK); others are sorted rows. With
    SCALE_BY_SLOT, B rows are multiplied by the route weight of their slot. The SPLITS
    partials are summed afterwards in a fixed order, so the result is deterministic.
    Grid: (E * SPLITS, cdiv(P, BLOCK_P), cdiv(Q, BLOCK_Q)).
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
        if A_INDIRECT:
            a_rows = assign // TOPK
        else:
            a_rows = rows
        if B_INDIRECT:
            b_rows = assign // TOPK
        else:
            b_rows = rows
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

    out = part_ptr + split.to(tl.int64) * stride_ps + expert.to(tl.int64) * stride_pe \
        + ps[:, None] * stride_pp + qs[None, :]
    tl.store(out, acc, mask=p_ok[:, None] & q_ok[None, :])


@triton.autotune(configs=_REDUCE_CONFIGS, key=["H"])
@triton.jit
def _pair_reduce_kernel(
    src_ptr, inv_ptr, out_ptr, T, H, w0, w1,
    stride_sm, stride_om,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """out[n] = w0 * src[inv[2n]] + w1 * src[inv[2n + 1]] (fp32 sum, fixed order)."""
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    ts = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    hs = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = ts < T
    ok = t_ok[:, None] & (hs < H)[None, :]
    r0 = tl.load(inv_ptr + 2 * ts, mask=t_ok, other=0).to(tl.int64)
    r1 = tl.load(inv_ptr + 2 * ts + 1, mask=t_ok, other=0).to(tl.int64)
    v0 = tl.load(src_ptr + r0[:, None] * stride_sm + hs[None, :], mask=ok, other=0.0).to(tl.float32)
    v1 = tl.load(src_ptr + r1[:, None] * stride_sm + hs[None, :], mask=ok, other=0.0).to(tl.float32)
    y = w0 * v0 + w1 * v1
    tl.store(out_ptr + ts.to(tl.int64)[:, None] * stride_om + hs[None, :],
             y.to(out_ptr.dtype.element_ty), mask=ok)


# --------------------------------------------------------------------------------------------
# Host-side launchers
# --------------------------------------------------------------------------------------------


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: exact IEEE products (matches the fp32 PyTorch reference; no TF32).
    return "ieee" if dtype == torch.float32 else "tf32"


def _tile_grid(M: int, E: int, n_cols: int):
    return lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) + E, triton.cdiv(n_cols, meta["BLOCK_N"]))


def _sort_assignments(routes: torch.Tensor, E: int):
    """Stable sort of the flattened (token, slot) assignments by expert.

    Returns (order int32 [M]: assignment id at sorted row, inv int32 [M]: sorted row of each
    assignment, offsets int32 [E+1]: segment bounds). No host synchronisation.
    """
    experts = routes.reshape(-1)
    sorted_e, order = torch.sort(experts, stable=True)
    bounds = torch.arange(E + 1, device=routes.device, dtype=sorted_e.dtype)
    offsets = torch.searchsorted(sorted_e, bounds).to(torch.int32)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    return order.to(torch.int32), inv.to(torch.int32), offsets


def _launch_gate_up(x, order, offsets, gate, up):
    M = order.numel()
    E, H, W = gate.shape
    h = torch.empty((M, W), device=x.device, dtype=x.dtype)
    g = torch.empty_like(h)
    u = torch.empty_like(h)
    _gate_up_kernel[_tile_grid(M, E, W)](
        x, order, offsets, gate, up, h, g, u,
        E, H, W,
        x.stride(0), x.stride(1),
        gate.stride(0), gate.stride(1), gate.stride(2),
        up.stride(0), up.stride(1), up.stride(2),
        h.stride(0),
        TOPK=TOP_K, DOT_PRECISION=_dot_precision(x.dtype),
    )
    return h, g, u


def _launch_grouped_mm(a, order, offsets, b, n_cols, *, a_indirect=False, weights=(1.0, 1.0),
                       swiglu=None):
    """out[r] = A[row(r)] @ b[e] (b: [E, K, N] by strides); see _grouped_mm_kernel."""
    M = order.numel()
    E, K, N = b.shape
    assert N == n_cols
    if swiglu is not None:
        g, u = swiglu
        out = torch.empty((M, 2 * N), device=a.device, dtype=a.dtype)
    else:
        g = u = out = torch.empty((M, N), device=a.device, dtype=a.dtype)
    _grouped_mm_kernel[_tile_grid(M, E, N)](
        a, order, offsets, b, out, g, u,
        E, K, N, float(weights[0]), float(weights[1]),
        a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), g.stride(0),
        TOPK=TOP_K, A_INDIRECT=a_indirect, SWIGLU_BWD=swiglu is not None,
        DOT_PRECISION=_dot_precision(a.dtype),
    )
    return out


def _default_splits(M: int, E: int) -> int:
    """Split-K factor for the weight gradients: ~1024 rows per program, at most 16 splits."""
    return max(1, min(16, triton.cdiv(M, E * 1024)))


def _launch_grouped_dw(a, b, order, offsets, E, *, a_indirect, b_indirect, weights=None,
                       splits=None):
    """dW[e] = sum over expert e's rows of A[row]^T @ (w_slot *) B[row], shape [E, P, Q] fp32."""
    M = order.numel()
    P, Q = a.shape[1], b.shape[1]
    S = splits if splits is not None else _default_splits(M, E)
    part = torch.empty((S, E, P, Q), device=a.device, dtype=torch.float32)
    w0, w1 = (1.0, 1.0) if weights is None else (float(weights[0]), float(weights[1]))
    grid = lambda meta: (E * S, triton.cdiv(P, meta["BLOCK_P"]), triton.cdiv(Q, meta["BLOCK_Q"]))  # noqa: E731
    _grouped_dw_kernel[grid](
        a, b, order, offsets, part,
        P, Q, w0, w1,
        a.stride(0), a.stride(1),
        b.stride(0), b.stride(1),
        part.stride(0), part.stride(1), part.stride(2),
        TOPK=TOP_K, A_INDIRECT=a_indirect, B_INDIRECT=b_indirect,
        SCALE_BY_SLOT=weights is not None, SPLITS=S, DOT_PRECISION=_dot_precision(a.dtype),
    )
    return part[0] if S == 1 else part.sum(dim=0)


def _launch_pair_reduce(src, inv, T, weights, out_dtype):
    H = src.shape[1]
    out = torch.empty((T, H), device=src.device, dtype=out_dtype)
    grid = lambda meta: (triton.cdiv(T, meta["BLOCK_T"]), triton.cdiv(H, meta["BLOCK_H"]))  # noqa: E731
    _pair_reduce_kernel[grid](
        src, inv, out, T, H, float(weights[0]), float(weights[1]),
        src.stride(0), out.stride(0),
    )
    return out


# --------------------------------------------------------------------------------------------
# Autograd function and public entry point
# --------------------------------------------------------------------------------------------


# The forward and backward are ``torch.library`` custom ops (fake implementations give their
# output shapes, which never depend on the routes), so ``torch.compile(fullgraph=True)`` of a layer
# or a model keeps each call as one node. The forward also returns the SwiGLU tensors h, g, u
# [2N, W] that the backward needs; the assignment sort is recomputed there (integer work on 2N
# ids, cheaper than keeping three more tensors for the whole step).


@torch.library.custom_op("ds_trhash::routed_experts_triton", mutates_args=())
def _forward_op(x: torch.Tensor, routes: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                down: torch.Tensor, w0: float,
                w1: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_route_values(routes, gate.shape[0])
    N, H = x.shape
    order, inv, offsets = _sort_assignments(routes, gate.shape[0])
    h, g, u = _launch_gate_up(x, order, offsets, gate, up)
    out_sorted = _launch_grouped_mm(h, order, offsets, down, H)
    y = _launch_pair_reduce(out_sorted, inv, N, (w0, w1), x.dtype)
    return y, h, g, u


@_forward_op.register_fake
def _(x, routes, gate, up, down, w0, w1):
    m, w = routes.numel(), gate.shape[2]
    return (torch.empty_like(x), x.new_empty((m, w)), x.new_empty((m, w)), x.new_empty((m, w)))


@torch.library.custom_op("ds_trhash::routed_experts_triton_backward", mutates_args=())
def _backward_op(dy: torch.Tensor, x: torch.Tensor, routes: torch.Tensor, gate: torch.Tensor,
                 up: torch.Tensor, down: torch.Tensor, h: torch.Tensor, g: torch.Tensor,
                 u: torch.Tensor, w0: float, w1: float, need_x: bool,
                 need_weights: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dgate, dup, ddown); a gradient not asked for comes back as an empty tensor."""
    N, H = x.shape
    E, _, W = gate.shape
    w = (w0, w1)
    order, inv, offsets = _sort_assignments(routes, E)
    dy = dy.contiguous().to(x.dtype)
    d_x = d_gate = d_up = d_down = x.new_empty(0)
    if need_weights:
        # d_down[e] = sum_r h[r]^T (w_slot(r) * dy[tok(r)])
        d_down = _launch_grouped_dw(h, dy, order, offsets, E, a_indirect=False,
                                    b_indirect=True, weights=w).to(down.dtype)
    # dgu[r] = [dg | du] with dh = w_slot * dy[tok] @ down_e^T, SwiGLU backward fused.
    down_t = down.transpose(1, 2)  # [E, H, W] view: B_e = down_e^T
    dgu = _launch_grouped_mm(dy, order, offsets, down_t, W, a_indirect=True, weights=w, swiglu=(g, u))
    if need_weights:
        d_gu = _launch_grouped_dw(x, dgu, order, offsets, E, a_indirect=True, b_indirect=False)  # [E, H, 2W]
        d_gate = d_gu[:, :, :W].to(gate.dtype).contiguous()
        d_up = d_gu[:, :, W:].to(up.dtype).contiguous()
    if need_x:
        gu_t = torch.cat([gate, up], dim=2).transpose(1, 2)  # [E, 2W, H] view
        dx_sorted = _launch_grouped_mm(dgu, order, offsets, gu_t, H)
        d_x = _launch_pair_reduce(dx_sorted, inv, N, (1.0, 1.0), x.dtype)
    return d_x, d_gate, d_up, d_down


@_backward_op.register_fake
def _(dy, x, routes, gate, up, down, h, g, u, w0, w1, need_x, need_weights):
    def grad_like(t, needed):
        return torch.empty_like(t) if needed else t.new_empty(0)

    return (grad_like(x, need_x), grad_like(gate, need_weights), grad_like(up, need_weights),
            grad_like(down, need_weights))


def _setup_context(ctx, inputs, output):
    x, routes, gate, up, down, w0, w1 = inputs
    _, h, g, u = output
    ctx.mark_non_differentiable(h, g, u)
    ctx.save_for_backward(x, routes, gate, up, down, h, g, u)
    ctx.weights = (w0, w1)


def _backward(ctx, dy, _dh, _dg, _du):
    x, routes, gate, up, down, h, g, u = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_x, need_weights = need[0], need[2] or need[3] or need[4]
    d_x, d_gate, d_up, d_down = _backward_op(dy, x, routes, gate, up, down, h, g, u, *ctx.weights,
                                             need_x, need_weights)
    return (d_x if need_x else None, None, d_gate if need[2] else None,
            d_up if need[3] else None, d_down if need[4] else None, None, None)


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def _check_route_values(routes: torch.Tensor, E: int) -> None:
    """Routes must name experts in [0, E); checked inside the op, where values exist."""
    if not routes.numel():
        return
    if routes.device.type == "cuda":
        # Device-side check: no host synchronisation on the training path.
        torch._assert_async(((routes >= 0) & (routes < E)).all(),
                            "routed_experts_triton: a route is outside [0, E)")
    elif bool(((routes < 0) | (routes >= E)).any()):
        raise ValueError(f"routed_experts_triton: routes must lie in [0, {E}), got values outside")


def _check(x, routes, gate, up, down, weights):
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
                          weights=(0.5, 0.5)) -> torch.Tensor:
    """Routed top-2 SwiGLU experts with Triton grouped GEMMs; differentiable in x, gate, up, down.

    x [N, H]; routes [N, 2] int64 (routes[:, k] = expert of slot k); gate, up [E, H, W];
    down [E, W, H]; weights (w0, w1) are constants (no gradient). Returns [N, H] in x.dtype.
    """
    weights = tuple(float(w) for w in weights)
    _check(x, routes, gate, up, down, weights)
    N, H = x.shape
    if N == 0:
        # Nothing routed: keep the graph connected so the weights still get (zero) grads.
        return x.new_zeros((0, H)) + 0.0 * (x.sum() + gate.sum() + up.sum() + down.sum())
    y, _, _, _ = _forward_op(x.contiguous(), routes.contiguous(), gate.contiguous(), up.contiguous(),
                             down.contiguous(), weights[0], weights[1])
    return y


def reset_autotuning() -> None:
    """Forget the tuned configs, e.g. after a start-up check on a batch far smaller than training's
    (the autotune keys hold the widths, not the row count)."""
    for kernel in (_gate_up_kernel, _grouped_mm_kernel, _grouped_dw_kernel, _pair_reduce_kernel):
        kernel.cache.clear()
