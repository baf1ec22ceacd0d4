"""A fused NF4 matmul in Triton, tried for the decode step (common/fast/decode_step.py); not run by the pipeline.

`nf4_linear`: out = x @ W^T (+ residual) with W dequantised in registers, never stored: one kernel.
Correct, but slower so far than dequantising + cuBLAS (common/fast/nf4_dequantize.py) at every tiling
tried (docs/performance.md), so the pipeline does not run it: it is kept here, with its benchmark
(bench/bench_nf4_matmul.py), for a next attempt.

For the decode step (x is M x K with M the batch of sequences, 1 to 128): bitsandbytes writes each
weight out in bf16 and cuBLAS reads it back, three passes over 2-byte weights; `nf4_linear` reads each
4-bit weight once.

Layout (bitsandbytes `Linear4bit`, checked against its `dequantize_4bit` in tests/test_nf4_matmul.py):
- `packed` (uint8, N*K/2 bytes): the row-major (N, K) weight flattened, two codes a byte, the element of
  even index in the high nibble, the odd one in the low nibble.
- `absmax` (fp32): one scale per `blocksize` consecutive elements of the flattened weight, so with K a
  multiple of blocksize a block lies within a row: element (n, k) has scale absmax[n * K/blocksize + k // blocksize].
- `code` (fp32, 16): the NF4 values; W[n, k] = code[nibble] * absmax, rounded to x's dtype as bitsandbytes does.

Design: one program computes a BLOCK_N x M tile of out^T over its share of K, one K tile per quant block
(BLOCK_K = blocksize, so one absmax per row per tile, loaded as a vector). The dequantised weight tile is
the dot's first operand (acc^T = W_tile @ x_tile^T): on Hopper wgmma takes its A operand from registers,
so the weight goes from the packed load to the tensor cores without a trip through shared memory, and
the weight rows fill the MMA's 64-row side even when M is 1. High and low nibbles are dequantised as two
(BLOCK_N, BLOCK_K/2) halves and interleaved with tl.join, so x is read as plain contiguous tiles. The
16-entry table is gathered with tl.load (it stays in L1). All of x's rows are in one program (BLOCK_M >= M
up to 128; a grid axis over M tiles beyond), so each weight is dequantised once a call.

Few N tiles (k/v projections, N = 1024) would leave most of the 132 SMs idle, so K is split across programs
until the grid is about one wave: each writes fp32 partial sums to a workspace and a small second kernel adds
them (and the residual) into out. Plain stores, not atomics: deterministic, and the workspace needs no zeroing.
The configuration is a fixed rule of the shape (`_config`), not triton.autotune, so that no call benchmarks:
after one eager call per (M, N, K) the launch is CUDA-graph capturable (the workspace is a same-sized
torch.empty each call, which the graph's memory pool serves).

Importable without triton (CI installs the CPU torch wheel only): `available()` is then False.
Under TRITON_INTERPRET=1 (set before this module is imported) it runs on CPU tensors, for tests.
"""
from __future__ import annotations

import functools

import torch

from common.fast.nf4_dequantize import available, triton  # noqa: F401 (available: this module's too)

if triton is not None:
    import triton.language as tl


    @triton.jit
    def _nf4_matmul_kernel(x_ptr, packed_ptr, absmax_ptr, code_ptr, out_ptr, res_ptr, ws_ptr,
                           M, N, K, stride_xm, stride_om, stride_rm, blocks_per_split,
                           HAS_RESIDUAL: tl.constexpr, SPLIT_K: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           TWO_DOTS: tl.constexpr = False):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        n_mask = n < N
        m_mask = m < M
        kb_start = pid_k * blocks_per_split
        kb_end = tl.minimum(kb_start + blocks_per_split, K // BLOCK_K)
        p_ptrs = packed_ptr + n[:, None] * (K // 2) + tl.arange(0, BLOCK_K // 2)[None, :]
        a_ptrs = absmax_ptr + n * (K // BLOCK_K)
        xt_ptrs = x_ptr + m[None, :] * stride_xm + tl.arange(0, BLOCK_K)[:, None]  # x^T tile (BLOCK_K, BLOCK_M)
        xe_ptrs = x_ptr + m[None, :] * stride_xm + 2 * tl.arange(0, BLOCK_K // 2)[:, None]  # its even rows
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for kb in range(kb_start, kb_end):
            # rows past N read code 0 scaled by absmax 0: zero weights, so no mask is needed downstream
            p = tl.load(p_ptrs + kb * (BLOCK_K // 2), mask=n_mask[:, None], other=0).to(tl.int32)
            a = tl.load(a_ptrs + kb, mask=n_mask, other=0.0)[:, None]
            # sm_90 SASS of this loop: ~11 instructions a weight, a third for the gather (two 64-bit address
            # instructions and a load each); by that count, not measured, instruction issue rather than HBM bounds
            # the kernel. At num_stages >= 2 triton prefetches the gathers through shared memory (cp.async).
            hi = tl.load(code_ptr + (p >> 4)) * a  # even k
            lo = tl.load(code_ptr + (p & 15)) * a  # odd k
            if TWO_DOTS:  # no interleaving: the even and the odd columns of x, one dot each
                xe = tl.load(xe_ptrs + kb * BLOCK_K, mask=m_mask[None, :], other=0.0)
                xo = tl.load(xe_ptrs + kb * BLOCK_K + 1, mask=m_mask[None, :], other=0.0)
                acc = tl.dot(hi.to(x_ptr.dtype.element_ty), xe, acc)
                acc = tl.dot(lo.to(x_ptr.dtype.element_ty), xo, acc)
            else:
                w = tl.reshape(tl.join(hi, lo), (BLOCK_N, BLOCK_K)).to(x_ptr.dtype.element_ty)
                xt = tl.load(xt_ptrs + kb * BLOCK_K, mask=m_mask[None, :], other=0.0)
                acc = tl.dot(w, xt, acc)
        mask = n_mask[:, None] & m_mask[None, :]
        if SPLIT_K == 1:
            if HAS_RESIDUAL:
                acc += tl.load(res_ptr + m[None, :] * stride_rm + n[:, None], mask=mask).to(tl.float32)
            tl.store(out_ptr + m[None, :] * stride_om + n[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(ws_ptr + pid_k * M * N + m[None, :] * N + n[:, None], acc, mask=mask)

    @triton.jit
    def _splitk_sum_kernel(ws_ptr, out_ptr, res_ptr, M, N, stride_om, stride_rm,
                           HAS_RESIDUAL: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < M * N
        m = i // N
        n = i % N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            acc += tl.load(ws_ptr + s * M * N + i, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            acc += tl.load(res_ptr + m * stride_rm + n, mask=mask).to(tl.float32)
        tl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter: as on an H200, so CPU tests take the same configurations


def _config(M: int, N: int, K: int, blocksize: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_N, SPLIT_K): 64-row tiles (one wgmma row side), K split while the grid stays within one wave
    and each split keeps at least 8 quant blocks (K/split >= 512), so the partial sums stay small beside the
    weight bytes. H200, M=64: k/v (1024x4096) split 8, q/o (4096x4096) and down (4096x14336) split 2,
    gate/up (14336x4096) unsplit (224 programs)."""
    block_n = 64
    programs = triton.cdiv(N, block_n) * triton.cdiv(M, 128)
    nblocks = K // blocksize
    split = 1
    while programs * split * 2 <= _num_sms(device) and nblocks // (split * 2) >= 8:
        split *= 2
    return block_n, split


def nf4_linear(x, packed, absmax, code, out_features, in_features, blocksize=64, out=None, residual=None, *,
               block_n=None, split_k=None, num_warps=4, num_stages=4, two_dots=False) -> torch.Tensor:
    """x (M, K) @ W^T (+ residual) with W the NF4 weight (packed, absmax, code) of shape (out_features, in_features).

    out: None, or an (M, N) tensor, possibly a column slice of a wider buffer (unit column stride); written
    and returned. residual: None or (M, N), distinct from out. block_n/split_k/num_warps/num_stages override
    the configuration (bench/bench_nf4_matmul.py sweeps them). The first call for a shape compiles; capture
    CUDA graphs after it.
    """
    if triton is None:
        raise RuntimeError("nf4_linear needs triton (not installed)")
    N, K = out_features, in_features
    M = x.shape[0]
    assert blocksize in (64, 128), f"blocksize {blocksize} not supported (64 and 128 are)"
    assert x.dim() == 2 and x.shape[1] == K and x.stride(1) == 1, "x must be (M, in_features), rows contiguous"
    assert K % blocksize == 0, "in_features must be a multiple of blocksize"
    assert packed.dtype == torch.uint8 and packed.numel() * 2 == N * K and packed.is_contiguous()
    assert absmax.dtype == torch.float32 and absmax.numel() == N * K // blocksize and absmax.is_contiguous()
    assert code.dtype == torch.float32 and code.numel() == 16
    assert N * K < 2**31, "32-bit offsets"
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    assert out.shape == (M, N) and out.stride(1) == 1, "out must be (M, out_features) with unit column stride"
    if residual is not None:
        assert residual.shape == (M, N) and residual.stride(1) == 1
        assert residual.data_ptr() != out.data_ptr(), "out and residual must be distinct"
    if M == 0:
        return out
    auto_n, auto_split = _config(M, N, K, blocksize, x.device)
    block_n = block_n or auto_n
    split = split_k or auto_split
    nblocks = K // blocksize
    per_split = triton.cdiv(nblocks, split)
    split = triton.cdiv(nblocks, per_split)  # no empty splits
    block_m = max(16, triton.next_power_of_2(min(M, 128)))
    res = residual if residual is not None else out  # never read without HAS_RESIDUAL
    ws = torch.empty((split, M, N), dtype=torch.float32, device=x.device) if split > 1 else out
    grid = (triton.cdiv(N, block_n), split, triton.cdiv(M, block_m))
    _nf4_matmul_kernel[grid](x, packed, absmax, code, out, res, ws, M, N, K, x.stride(0), out.stride(0),
                             res.stride(0), per_split, HAS_RESIDUAL=residual is not None, SPLIT_K=split,
                             BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=blocksize, TWO_DOTS=two_dots,
                             num_warps=num_warps, num_stages=num_stages)
    if split > 1:
        block = 1024
        _splitk_sum_kernel[(triton.cdiv(M * N, block),)](ws, out, res, M, N, out.stride(0), res.stride(0),
                                                         HAS_RESIDUAL=residual is not None, SPLIT_K=split,
                                                         BLOCK=block, num_warps=4)
    return out
