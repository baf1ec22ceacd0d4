"""A fused NF4 matmul in Triton for the decode step (common/fast/decode_step.py); not run by the pipeline:
at every configuration swept on an H200 it was slower than dequantising + cuBLAS (bench/RESULTS.md).

`nf4_linear`: out = x @ W^T (+ residual) with W dequantised in registers, never stored: one kernel (two with
split-K). bench/bench_nf4_matmul.py times it against bitsandbytes' dequantise + cuBLAS, and sweeps its knobs.

For the decode step (x is M x K with M the batch of sequences, 1 to 128) the weights dominate the bytes moved:
dequantise + cuBLAS writes each weight out in bf16 and reads it back, three passes over 2-byte weights;
`nf4_linear` reads each 4-bit weight once, so at its best it runs at HBM bandwidth on the packed bytes.

Layout (bitsandbytes `Linear4bit`, checked against its `dequantize_4bit` in tests/fast/test_nf4_dequantize.py):
- `packed` (uint8, N*K/2 bytes): the row-major (N, K) weight flattened, two codes a byte, the element of
  even index in the high nibble, the odd one in the low nibble.
- `absmax` (fp32): one scale per `blocksize` consecutive elements of the flattened weight, so with K a
  multiple of blocksize a block lies within a row: element (n, k) has scale absmax[n * K/blocksize + k // blocksize].
- `code` (fp32, 16): the NF4 values; W[n, k] = code[nibble] * absmax in fp32, then rounded to x's dtype, as
  bitsandbytes does (so the table is never rounded on its own: that would change values).

Design. A program computes a BLOCK_N x BLOCK_M tile of out^T (acc^T = W_tile @ x_tile^T) over its share of K,
BLOCK_K columns an iteration:
- Bytes in flight. A memory-bound kernel reaches HBM bandwidth only with bandwidth x latency bytes
  outstanding (Little's law: ~3-4 MB on an H200). So BLOCK_K is several quant blocks (128 by default, a
  power-of-two multiple of blocksize dividing K: an iteration loads BLOCK_N x BLOCK_K/2 packed bytes),
  num_stages >= 2 lets triton prefetch the next tiles while this one is computed, and K is split across
  programs until the grid holds a couple of programs per SM. Larger tiles are not free: triton prefetches
  the table gathers too (one 4-byte cp.async each, into shared memory), so shared memory and registers grow
  with BLOCK_N x BLOCK_K and cap the programs an SM holds (`_config` gives the numbers).
- The packed tile is loaded as (BLOCK_N, BLOCK_K/blocksize, blocksize/2): its middle axis is the quant block,
  so the scales load as a small (BLOCK_N, BLOCK_K/blocksize, 1) tile and broadcast in registers, with no
  per-element scale loads. The dequantised tile is reshaped to 2-D for the dot.
- The dequantised weight is the dot's first operand: on Hopper wgmma takes its A operand from registers, so
  the weight goes from the packed load to the tensor cores without a trip through shared memory, and the
  weight rows fill the MMA's 64-row side even when M is 1. All of x's rows are in one program (BLOCK_M >= M
  up to 128; a grid axis over M tiles beyond), so each weight is dequantised once a call.
- Code lookup: by default two gathers a byte from the 16-entry table (64 bytes: one L1 line, so each warp's
  gather is one wavefront). PAIR_LUT instead gathers once a byte, 8 bytes from a 256-entry table of fp32
  pairs (code[b >> 4], code[b & 15]) read as int64 and split with bitcasts: exact, and about a third fewer
  instructions a byte (the kernel is near issue-bound), but the 2 KB table spans 16 L1 lines, so a warp's
  gather may take several wavefronts: which wins is for the benchmark to say.
- Interleaving: by default the high (even k) and low (odd k) halves are joined and reshaped into one
  (BLOCK_N, BLOCK_K) tile, so x is read as plain contiguous tiles (which triton pipelines through shared
  memory). TWO_DOTS instead splits x's tile into its even and odd columns in registers and does two dots
  (hi @ x_even^T + lo @ x_odd^T), with no relayout of the weight.

Split-K: each split writes fp32 partial sums to a workspace and a small second kernel adds them (and the
residual) into out. Plain stores, not atomics: deterministic, and the workspace needs no zeroing. The
workspace is split x M x N x 4 bytes, against N x K / 2 weight bytes, so the rule keeps split small when M is
large beside K. The configuration is a fixed rule of the shape (`_config`), not triton.autotune, so that no
call benchmarks: after one eager call per (M, N, K, knobs) the launch is CUDA-graph capturable (the
workspace is a same-sized torch.empty each call, which the graph's memory pool serves; the pair table is
built by the first call and cached).

Importable without triton (CI installs the CPU torch wheel only): `available()` is then False.
Under TRITON_INTERPRET=1 (set before this module is imported) it runs on CPU tensors, for tests.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from common.fast.nf4_dequantize import available, triton  # noqa: F401 (available: this module's too)

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _nf4_matmul_kernel(x_ptr, packed_ptr, absmax_ptr, code_ptr, pair_ptr, out_ptr, res_ptr, ws_ptr,
                           M, N, K, stride_xm, stride_om, stride_rm, tiles_per_split,
                           HAS_RESIDUAL: tl.constexpr, SPLIT: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           QBLOCK: tl.constexpr, TWO_DOTS: tl.constexpr = False, PAIR_LUT: tl.constexpr = False):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        n_mask = n < N
        m_mask = m < M
        kt_start = pid_k * tiles_per_split
        kt_end = tl.minimum(kt_start + tiles_per_split, K // BLOCK_K)
        # the packed tile as (row, quant block within the tile, byte within the quant block)
        q = tl.arange(0, BLOCK_K // QBLOCK)
        b = tl.arange(0, QBLOCK // 2)
        p_ptrs = packed_ptr + n[:, None, None] * (K // 2) + q[None, :, None] * (QBLOCK // 2) + b[None, None, :]
        a_ptrs = absmax_ptr + n[:, None, None] * (K // QBLOCK) + q[None, :, None]  # (BLOCK_N, BLOCK_K/QBLOCK, 1)
        kk = tl.arange(0, BLOCK_K)
        if TWO_DOTS:
            x_ptrs = x_ptr + m[:, None] * stride_xm + kk[None, :]  # x tile (BLOCK_M, BLOCK_K)
        else:
            x_ptrs = x_ptr + m[None, :] * stride_xm + kk[:, None]  # x^T tile (BLOCK_K, BLOCK_M)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for kt in range(kt_start, kt_end):
            # rows past N read code 0 scaled by absmax 0: zero weights, so no mask is needed downstream
            p = tl.load(p_ptrs + kt * (BLOCK_K // 2), mask=n_mask[:, None, None], other=0).to(tl.int32)
            a = tl.load(a_ptrs + kt * (BLOCK_K // QBLOCK), mask=n_mask[:, None, None], other=0.0)
            if PAIR_LUT:  # one 8-byte gather a byte: low word code[p >> 4], high word code[p & 15]
                t = tl.load(pair_ptr + p)
                hi = t.to(tl.int32).to(tl.float32, bitcast=True) * a  # even k
                lo = (t >> 32).to(tl.int32).to(tl.float32, bitcast=True) * a  # odd k
            else:
                hi = tl.load(code_ptr + (p >> 4)) * a  # even k
                lo = tl.load(code_ptr + (p & 15)) * a  # odd k
            if TWO_DOTS:  # no interleaving of the weight: the even and the odd columns of x, one dot each
                xt = tl.load(x_ptrs + kt * BLOCK_K, mask=m_mask[:, None], other=0.0)
                xe, xo = tl.split(tl.reshape(xt, (BLOCK_M, BLOCK_K // 2, 2)))
                acc = tl.dot(tl.reshape(hi, (BLOCK_N, BLOCK_K // 2)).to(x_ptr.dtype.element_ty), tl.trans(xe), acc)
                acc = tl.dot(tl.reshape(lo, (BLOCK_N, BLOCK_K // 2)).to(x_ptr.dtype.element_ty), tl.trans(xo), acc)
            else:
                w = tl.reshape(tl.join(hi, lo), (BLOCK_N, BLOCK_K)).to(x_ptr.dtype.element_ty)
                xt = tl.load(x_ptrs + kt * BLOCK_K, mask=m_mask[None, :], other=0.0)
                acc = tl.dot(w, xt, acc)
        mask = n_mask[:, None] & m_mask[None, :]
        if not SPLIT:  # (a bool, not the split count: one compiled kernel serves every split)
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


class Config(NamedTuple):
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    pair_lut: bool
    two_dots: bool


def _block_k(K: int, blocksize: int, target: int = 256, min_tiles: int = 1) -> int:
    """The largest power-of-two multiple of blocksize, at most `target`, that divides K into >= min_tiles tiles
    (else blocksize itself: K is a multiple of it)."""
    bk = max(target, blocksize)
    while bk > blocksize and (K % bk or K // bk < min_tiles):
        bk //= 2
    return bk


def _config(M: int, N: int, K: int, blocksize: int, device: torch.device) -> Config:
    """The default configuration, a fixed rule of the shape (chosen for an H200, 132 SMs, M around 64).

    64-row weight tiles (one wgmma row side for 4 warps), 128-column K tiles (64 packed bytes a row an
    iteration), 4 warps, 3 stages, the 16-entry table. Compiled for sm_90 at M=64, this takes ~70 KB of shared
    memory (3 programs an SM) and ~180 registers without spills, at ~0.6 issued warp instructions a packed
    byte; 256-column tiles need 8 warps not to spill, then take ~0.8 a byte and 140 KB (one program an SM).
    K is split, doubling, while the grid is under two programs per SM and each split keeps at least 2 K tiles,
    with the fp32 workspace within the weight bytes, and within half of them once the grid fills one wave.
    M=64: q/o (4096x4096) split 4 (256 programs), k/v (1024x4096) split 8 (128), gate/up (14336x4096)
    split 2 (448), down (4096x14336) split 8 (512).
    """
    block_n = 64
    block_k = _block_k(K, blocksize, target=128)
    sms = _num_sms(device)
    programs = triton.cdiv(N, block_n) * triton.cdiv(M, 128)
    tiles = K // block_k
    weight_bytes = N * K // 2
    split = 1
    while programs * split < 2 * sms and tiles // (split * 2) >= 2:
        workspace = split * 2 * M * N * 4
        if workspace > weight_bytes or (programs * split >= sms and workspace > weight_bytes // 2):
            break
        split *= 2
    return Config(block_n=block_n, block_k=block_k, split_k=split, num_warps=4, num_stages=3,
                  pair_lut=False, two_dots=False)


_PAIR_TABLES: dict = {}


def _pair_table(code: torch.Tensor) -> torch.Tensor:
    """(256,) int64: entry b holds the fp32 pair (code[b >> 4], code[b & 15]), the first in the low word (little
    endian). Built once per code tensor (and per in-place change of it); the cache holds the code tensor, so
    its address cannot be reused by another while the entry lives."""
    key = (code.data_ptr(), code.device, code._version)
    hit = _PAIR_TABLES.get(key)
    if hit is None:
        if code.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("nf4_linear(pair_lut=True): make one eager call before capturing a CUDA graph")
        b = torch.arange(256, device=code.device)
        table = torch.stack((code[b >> 4], code[b & 15]), dim=1).contiguous().view(torch.int64).reshape(256)
        hit = _PAIR_TABLES[key] = (code, table)
    return hit[1]


def nf4_linear(x, packed, absmax, code, out_features, in_features, blocksize=64, out=None, residual=None, *,
               block_n=None, split_k=None, num_warps=None, num_stages=None, two_dots=None, block_k=None,
               pair_lut=None) -> torch.Tensor:
    """x (M, K) @ W^T (+ residual) with W the NF4 weight (packed, absmax, code) of shape (out_features, in_features).

    out: None, or an (M, N) tensor, possibly a column slice of a wider buffer (unit column stride); written
    and returned. residual: None or (M, N), distinct from out. The keyword-only knobs override the
    configuration `_config` picks (bench/bench_nf4_matmul.py sweeps them): block_n, block_k (a power-of-two
    multiple of blocksize dividing in_features), split_k, num_warps, num_stages, two_dots, pair_lut. Given
    split_k but not block_k, block_k shrinks (down to blocksize) until K holds split_k tiles. The first call
    for a shape and configuration compiles; capture CUDA graphs after it.
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
    cfg = _config(M, N, K, blocksize, x.device)
    if block_k is None:
        block_k = _block_k(K, blocksize, cfg.block_k, min_tiles=split_k or 1) if split_k else cfg.block_k
    assert block_k % blocksize == 0 and block_k & (block_k - 1) == 0 and K % block_k == 0, \
        f"block_k {block_k} must be a power-of-two multiple of blocksize {blocksize} dividing in_features {K}"
    block_n = block_n or cfg.block_n
    split = split_k or cfg.split_k
    pair_lut = cfg.pair_lut if pair_lut is None else pair_lut
    two_dots = cfg.two_dots if two_dots is None else two_dots
    tiles = K // block_k
    per_split = triton.cdiv(tiles, split)
    split = triton.cdiv(tiles, per_split)  # no empty splits
    block_m = max(16, triton.next_power_of_2(min(M, 128)))
    res = residual if residual is not None else out  # never read without HAS_RESIDUAL
    ws = torch.empty((split, M, N), dtype=torch.float32, device=x.device) if split > 1 else out
    pairs = _pair_table(code) if pair_lut else code  # never read without PAIR_LUT
    grid = (triton.cdiv(N, block_n), split, triton.cdiv(M, block_m))
    _nf4_matmul_kernel[grid](x, packed, absmax, code, pairs, out, res, ws, M, N, K, x.stride(0), out.stride(0),
                             res.stride(0), per_split, HAS_RESIDUAL=residual is not None, SPLIT=split > 1,
                             BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, QBLOCK=blocksize,
                             TWO_DOTS=bool(two_dots), PAIR_LUT=bool(pair_lut),
                             num_warps=num_warps or cfg.num_warps, num_stages=num_stages or cfg.num_stages)
    if split > 1:
        block = 1024
        _splitk_sum_kernel[(triton.cdiv(M * N, block),)](ws, out, res, M, N, out.stride(0), res.stride(0),
                                                         HAS_RESIDUAL=residual is not None, SPLIT_K=split,
                                                         BLOCK=block, num_warps=4)
    return out
