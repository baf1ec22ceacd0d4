"""A split-K NF4 matmul in Triton for the decode step's base weights at M = 16-64 rows: y = x @ dequant(W)^T.

The decode step (common/fast/decode_step.py) dequantises each 4-bit weight into a bf16 buffer and runs cuBLAS:
the weight crosses HBM three times in 2-byte form. `nf4_matmul` reads the packed bytes once and dequantises
in registers. It runs only where `common/fast/nf4_dispatch.py`'s table, written by `bench/nf4_sweep.py` on a
GPU, says it beats that path for the shape and row count (docs/performance.md).

Layout (bitsandbytes `Linear4bit`): `packed` (uint8, N*K/2) the row-major (N, K) weight, two codes a byte,
the even element in the high nibble; `absmax` (fp32) one scale per `blocksize` consecutive elements (with K a
multiple of blocksize, a block lies in one row); `code` (fp32, 16) the NF4 values. W = code[nibble] * absmax in
fp32, rounded to x's dtype: bitsandbytes' values bit for bit.

The absmax is the fp32 one, double quantisation decoded once per layer (decode_step keeps it: `_absmax`), not
resolved in the kernel: it costs 4 bytes per 64 weights (an eighth more than the packed bytes, against about
3% for the nested uint8 form) but saves a dependent second gather per block in the inner loop, and the
decode step already holds it.

Where the two earlier designs (bench/nf4_fused.py, 97-200 GB/s) differ from this one:
- **Split-K is the main axis of parallelism.** At N = 4096 a grid of 64-row tiles is 64 programs for 132 SMs.
  Here a program owns a BLOCK_N x (K / SPLIT_K) slice: BLOCK_N can be large (128-256), which also cuts how
  often x (M x K bf16, from L2) is re-read, since each program reads x once per K-slice: with BLOCK_N 64 at
  M = 64, x's traffic is four times the weight's. fp32 partials go to a workspace and a second small pass
  adds them (and the residual) in a fixed order: deterministic, no atomics, no zeroing.
- **The packed bytes load as int32 words** (8 codes a word, BLOCK_K/8 words a row a tile), so the loads are
  wide; the 8 nibbles of a word come out by shifts against a constant vector (4 * (t ^ 1): the even element
  is the high nibble of its byte), laid out so that the dequantised tile is already in k order: no join or
  interleave of two half tiles.
- **The table lookup stays in registers** (`lut="select"`): the 16 codes are loaded once per program as
  scalars and a nibble picks its value by a 4-level select tree, so the inner loop makes no memory access
  per weight. `lut="prmt"` does the lookup by byte permutes (PTX `prmt`) of bitsandbytes' NF4 table held as
  immediates, four codes at a time: fewer instructions than the tree's 15 selects a code (GPU only). The
  earlier kernels gathered from a global table each nibble, which Triton's pipeliner turned into a 4-byte
  asynchronous copy per weight through shared memory. `lut="memory"` keeps that gather, for the sweep to
  compare.
- Several quant blocks a K tile (BLOCK_K a multiple of blocksize) and num_stages let Triton keep several
  tiles of packed bytes in flight per program.

The configuration (`Config`) is an argument, never autotuned inside a call, so that after one eager call per
shape and configuration the launch can be captured in a CUDA graph.

Importable without triton (CI installs the CPU torch wheel only): `available()` is then False.
Under TRITON_INTERPRET=1 (set before triton is imported) it runs on CPU tensors in fp32/fp16, for tests.
"""
from __future__ import annotations

import os
import struct
from typing import NamedTuple

import torch

from common.fast.nf4_dequantize import available, triton  # noqa: F401 (available: this module's too)

LUTS = ("select", "memory", "prmt")
# bitsandbytes' NF4 code (`get_4bit_type("nf4")`), which lut "prmt" holds as immediates
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)


def _prmt_asm(code) -> str:
    """PTX for lut "prmt": 4 codes (one a byte of $4) -> their 4 fp32 values ($0-$3), by byte permutes from
    registers. Byte plane j of the 16 values is 4 words (entries 0-3, 4-7, 8-11, 12-15); `prmt` picks a byte
    for each of the 4 codes from 8 entries by the code's low 3 bits, twice (entries 0-7 and 8-15), and bit 3
    selects between the two; 4 planes, then a 4x4 byte transpose: about 7 instructions a code, no memory."""
    words = [struct.unpack("<I", struct.pack("<f", v))[0] for v in code]

    def plane(j, first):
        return sum(((words[first + e] >> (8 * j)) & 0xFF) << (8 * e) for e in range(4))
    lines = ["{", ".reg .b32 t, s, s7, m, z, f, a, b, c, d, lo, hi, p0, p1, p2, p3;",
             "mov.b32 z, 0;", "mov.b32 f, 0xFFFFFFFF;",
             # the 4 codes as the 4 selector nibbles of s: byte 0 of (x | x >> 4) holds codes 0 and 1, byte 2 codes 2, 3
             "shr.b32 t, $4, 4;", "or.b32 t, t, $4;", "prmt.b32 s, t, z, 0x0020;",
             "and.b32 s7, s, 0x7777;",
             # m: byte i all ones where code i >= 8 (selector nibble 4 picks f's byte, 0 picks z's)
             "and.b32 t, s, 0x8888;", "shr.b32 t, t, 1;", "prmt.b32 m, z, f, t;"]
    for j in range(4):
        lines += [f"mov.b32 a, {plane(j, 0):#010x};", f"mov.b32 b, {plane(j, 4):#010x};", "prmt.b32 lo, a, b, s7;",
                  f"mov.b32 a, {plane(j, 8):#010x};", f"mov.b32 b, {plane(j, 12):#010x};", "prmt.b32 hi, a, b, s7;",
                  "xor.b32 t, lo, hi;", "and.b32 t, t, m;", f"xor.b32 p{j}, lo, t;"]
    lines += ["prmt.b32 a, p0, p1, 0x5140;", "prmt.b32 b, p0, p1, 0x7362;",
              "prmt.b32 c, p2, p3, 0x5140;", "prmt.b32 d, p2, p3, 0x7362;",
              "prmt.b32 $0, a, c, 0x5410;", "prmt.b32 $1, a, c, 0x7632;",
              "prmt.b32 $2, b, d, 0x5410;", "prmt.b32 $3, b, d, 0x7632;", "}"]
    return "\n".join(lines)


PRMT_ASM = _prmt_asm(NF4)
_LUT_IDS = {"memory": 0, "select": 1, "prmt": 2}  # the kernel's LUT
_NF4_CHECKED: dict = {}


class Config(NamedTuple):
    """One launch configuration: BLOCK_N weight rows and BLOCK_K columns (a multiple of the quant blocksize) a
    tile, K cut into split_k slices of whole tiles, Triton's num_warps and num_stages, the code lookup."""
    block_n: int = 128
    block_k: int = 256
    split_k: int = 4
    num_warps: int = 4
    num_stages: int = 3
    lut: str = "select"


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _select16(nib, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15):
        """code[nib] from 16 scalars in registers: a 4-level select tree on the nibble's bits, no memory access."""
        b0 = (nib & 1) != 0
        b1 = (nib & 2) != 0
        b2 = (nib & 4) != 0
        b3 = (nib & 8) != 0
        s0 = tl.where(b1, tl.where(b0, c3, c2), tl.where(b0, c1, c0))
        s1 = tl.where(b1, tl.where(b0, c7, c6), tl.where(b0, c5, c4))
        s2 = tl.where(b1, tl.where(b0, c11, c10), tl.where(b0, c9, c8))
        s3 = tl.where(b1, tl.where(b0, c15, c14), tl.where(b0, c13, c12))
        return tl.where(b3, tl.where(b2, s3, s2), tl.where(b2, s1, s0))

    # tiles_per_split is 1 at some splits: not specialised on it, so one binary serves every split
    @triton.jit(do_not_specialize=["tiles_per_split"])
    def _nf4_splitk_kernel(x_ptr, words_ptr, absmax_ptr, code_ptr, out_ptr, res_ptr, ws_ptr,
                           M, N, K, stride_xm, stride_om, stride_rm, tiles_per_split,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           QBLOCK: tl.constexpr, LUT: tl.constexpr, SPLIT: tl.constexpr,
                           HAS_RESIDUAL: tl.constexpr, LUT_ASM: tl.constexpr = ""):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        n_mask = n < N
        m_mask = m < M
        NQ: tl.constexpr = BLOCK_K // QBLOCK  # quant blocks a tile
        WQ: tl.constexpr = QBLOCK // 8  # int32 words a quant block
        q = tl.arange(0, NQ)
        w = tl.arange(0, WQ)
        # word (row n, block q, word w) of a tile: codes k = q * QBLOCK + 8 w + t, t = 0..7, nibble t at 4 (t ^ 1)
        shifts = 4 * (tl.arange(0, 8) ^ 1)
        w_ptrs = words_ptr + n[:, None, None] * (K // 8) + q[None, :, None] * WQ + w[None, None, :]
        a_ptrs = absmax_ptr + n[:, None] * (K // QBLOCK) + q[None, :]
        kk = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + m[None, :] * stride_xm + kk[:, None]  # x^T tile (BLOCK_K, BLOCK_M)
        if LUT == 1:  # the 16 codes as scalars, in registers for the whole loop
            c0 = tl.load(code_ptr + 0)
            c1 = tl.load(code_ptr + 1)
            c2 = tl.load(code_ptr + 2)
            c3 = tl.load(code_ptr + 3)
            c4 = tl.load(code_ptr + 4)
            c5 = tl.load(code_ptr + 5)
            c6 = tl.load(code_ptr + 6)
            c7 = tl.load(code_ptr + 7)
            c8 = tl.load(code_ptr + 8)
            c9 = tl.load(code_ptr + 9)
            c10 = tl.load(code_ptr + 10)
            c11 = tl.load(code_ptr + 11)
            c12 = tl.load(code_ptr + 12)
            c13 = tl.load(code_ptr + 13)
            c14 = tl.load(code_ptr + 14)
            c15 = tl.load(code_ptr + 15)
        tiles = tl.cdiv(K, BLOCK_K)
        kt_start = pid_k * tiles_per_split
        kt_end = tl.minimum(kt_start + tiles_per_split, tiles)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for kt in range(kt_start, kt_end):
            k0 = kt * BLOCK_K
            # a K tail past K (K a multiple of QBLOCK, not of BLOCK_K) and rows past N: scale 0, x 0
            q_ok = k0 + q * QBLOCK < K
            wd = tl.load(w_ptrs + k0 // 8, mask=n_mask[:, None, None] & q_ok[None, :, None], other=0)
            a = tl.load(a_ptrs + k0 // QBLOCK, mask=n_mask[:, None] & q_ok[None, :], other=0.0)
            nib = (wd[:, :, :, None] >> shifts[None, None, None, :]) & 15  # (BLOCK_N, NQ, WQ, 8)
            if LUT == 1:
                v = _select16(nib, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15)
            elif LUT == 2:
                v = tl.inline_asm_elementwise(LUT_ASM, "=r,=r,=r,=r,r", [nib.to(tl.uint8)], dtype=tl.float32,
                                              is_pure=True, pack=4)
            else:
                v = tl.load(code_ptr + nib)
            wt = tl.reshape(v * a[:, :, None, None], (BLOCK_N, BLOCK_K)).to(x_ptr.dtype.element_ty)
            xt = tl.load(x_ptrs + k0, mask=m_mask[None, :] & (k0 + kk < K)[:, None], other=0.0)
            acc = tl.dot(wt, xt, acc)
        mask = n_mask[:, None] & m_mask[None, :]
        if SPLIT:
            tl.store(ws_ptr + pid_k * M * N + m[None, :] * N + n[:, None], acc, mask=mask)
        else:
            if HAS_RESIDUAL:
                acc += tl.load(res_ptr + m[None, :] * stride_rm + n[:, None], mask=mask).to(tl.float32)
            tl.store(out_ptr + m[None, :] * stride_om + n[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _sum_splits_kernel(ws_ptr, out_ptr, res_ptr, M, N, splits, stride_om, stride_rm,
                           HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        """out = the split-K partials summed in split order (+ residual): the same bits every run."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < M * N
        m = i // N
        n = i % N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(splits):
            acc += tl.load(ws_ptr + s * M * N + i, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            acc += tl.load(res_ptr + m * stride_rm + n, mask=mask).to(tl.float32)
        tl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


def runs_on(device) -> bool:
    """Whether nf4_matmul can run on `device`: a GPU with Triton, or the CPU under Triton's interpreter."""
    device = torch.device(device)
    if triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def splits(K: int, launch: Config) -> tuple[int, int]:
    """(the split-K count that runs, K tiles a split): launch.split_k slices of whole K tiles, none empty (so
    at most one a tile)."""
    tiles = -(-K // launch.block_k)
    per_split = -(-tiles // max(1, launch.split_k))
    return -(-tiles // per_split), per_split


def check_launch(launch: Config, K: int, blocksize: int) -> None:
    """ValueError naming what is wrong with `launch` for in_features K."""
    bk = launch.block_k
    if launch.lut not in LUTS:
        raise ValueError(f"lut {launch.lut!r}: one of {', '.join(LUTS)}")
    if bk < blocksize or bk % blocksize or bk & (bk - 1):
        raise ValueError(f"block_k {bk}: a power-of-two multiple of the quant blocksize {blocksize}")
    if launch.block_n < 16 or launch.block_n & (launch.block_n - 1):
        raise ValueError(f"block_n {launch.block_n}: a power of two >= 16")
    if launch.split_k < 1 or launch.num_warps < 1 or launch.num_stages < 1:
        raise ValueError(f"split_k, num_warps and num_stages must be >= 1: {launch}")


def _check_prmt(code) -> None:
    """lut "prmt" holds bitsandbytes' NF4 code as immediates: refuse another code, or the interpreter (no PTX).
    Checked once per code tensor (a device sync), so that a captured CUDA graph never checks."""
    if code.device.type != "cuda":
        raise ValueError("lut 'prmt' runs PTX: a GPU only (the interpreter cannot run it)")
    key = (code.data_ptr(), code._version)
    if key not in _NF4_CHECKED:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("nf4_matmul(lut='prmt'): make one eager call before capturing a CUDA graph")
        if not torch.equal(code.cpu(), torch.tensor(NF4)):
            raise ValueError("lut 'prmt' holds bitsandbytes' NF4 code; this code differs (use lut 'select')")
        _NF4_CHECKED[key] = code  # held, so that its address is not reused while the entry lives
    return None


def nf4_matmul(x, packed, absmax, code, out_features, in_features, blocksize=64, launch: Config | None = None,
               out=None, residual=None) -> torch.Tensor:
    """x (M, K) @ W^T (+ residual) for the NF4 weight W (packed, fp32 absmax, code) of shape (out_features,
    in_features), in x's dtype.

    out: None or an (M, N) tensor with unit column stride (a column slice of a wider buffer works); written and
    returned. residual: None or (M, N), not out. launch: the configuration (`Config()` if None). K must be a multiple
    of blocksize (a quant block may not straddle two rows) but not of launch.block_k: the last tile is masked.
    The first call per shape and configuration compiles; capture CUDA graphs after it (the split-K workspace is
    a torch.empty, which a graph's pool serves)."""
    if triton is None:
        raise RuntimeError("nf4_matmul needs triton (not installed)")
    launch = launch or Config()
    N, K = out_features, in_features
    M = x.shape[0]
    if K % blocksize or blocksize % 8:
        raise ValueError(f"in_features {K}: a multiple of the quant blocksize {blocksize} (itself a multiple of 8)")
    check_launch(launch, K, blocksize)
    if x.dim() != 2 or x.shape[1] != K or x.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)}: (M, {K}) with contiguous rows")
    if packed.dtype != torch.uint8 or packed.numel() * 2 != N * K or not packed.is_contiguous():
        raise ValueError(f"packed: {N * K // 2} contiguous uint8 bytes, got {packed.numel()} {packed.dtype}")
    if absmax.dtype != torch.float32 or absmax.numel() * blocksize != N * K or not absmax.is_contiguous():
        raise ValueError(f"absmax: {N * K // blocksize} contiguous fp32 scales (double quantisation decoded)")
    if code.dtype != torch.float32 or code.numel() != 16:
        raise ValueError("code: the 16 fp32 NF4 values")
    if N * K >= 2**31:
        raise ValueError(f"{N} x {K} weights: past 32-bit offsets")
    words = packed.reshape(-1).view(torch.int32)  # K a multiple of 8: a row is whole words
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if out.shape != (M, N) or out.stride(1) != 1:
        raise ValueError(f"out {tuple(out.shape)}: ({M}, {N}) with unit column stride")
    if residual is not None and (residual.shape != (M, N) or residual.stride(1) != 1
                                 or residual.data_ptr() == out.data_ptr()):
        raise ValueError(f"residual {tuple(residual.shape)}: ({M}, {N}) with unit column stride, not out")
    if M == 0:
        return out
    if x.device.type == "cpu" and x.dtype == torch.bfloat16:
        # Triton's interpreter multiplies bf16's raw bits in tl.dot: on the CPU (tests, the tiny model) run in
        # fp32 (the weights unrounded) and round the result
        res32 = residual.float() if residual is not None else None
        out.copy_(nf4_matmul(x.float(), packed, absmax, code, N, K, blocksize, launch, residual=res32))
        return out
    if launch.lut == "prmt":
        _check_prmt(code)
    split, per_split = splits(K, launch)
    block_m = max(16, triton.next_power_of_2(min(M, 64)))
    res = residual if residual is not None else out  # never read without HAS_RESIDUAL
    ws = torch.empty((split, M, N), dtype=torch.float32, device=x.device) if split > 1 else out
    grid = (triton.cdiv(N, launch.block_n), split, triton.cdiv(M, block_m))
    _nf4_splitk_kernel[grid](x, words, absmax, code, out, res, ws, M, N, K, x.stride(0), out.stride(0),
                             res.stride(0), per_split, BLOCK_M=block_m, BLOCK_N=launch.block_n,
                             BLOCK_K=launch.block_k, QBLOCK=blocksize, LUT=_LUT_IDS[launch.lut],
                             SPLIT=split > 1, HAS_RESIDUAL=residual is not None,
                             LUT_ASM=PRMT_ASM if launch.lut == "prmt" else "",
                             num_warps=launch.num_warps, num_stages=launch.num_stages)
    if split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(M * N, block),)](ws, out, res, M, N, split, out.stride(0), res.stride(0),
                                                         HAS_RESIDUAL=residual is not None, BLOCK=block,
                                                         num_warps=4)
    return out
