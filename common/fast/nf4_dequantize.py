"""bitsandbytes' NF4 dequantisation as one Triton pass, for the decode step (common/fast/decode_step.py).

The same values as bitsandbytes' `dequantize_4bit` (checked in tests/fast/test_nf4_dequantize.py), written by a
memory-bound kernel that reads half a byte and writes one weight per element; faster than bitsandbytes'
own kernel at decode shapes (docs/performance.md).

Layout (bitsandbytes `Linear4bit`): `packed` (uint8) holds the row-major weight flattened, two codes a
byte, the element of even index in the high nibble; `absmax` (fp32) one scale per `blocksize`
consecutive elements; `code` (fp32, 16) the NF4 values: W = code[nibble] * absmax.

Importable without triton (CI installs the CPU torch wheel only): `available()` is then False.
Under TRITON_INTERPRET=1 (set before this module is imported) it runs on CPU tensors, for tests.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CI: requirements.txt has no triton
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _nf4_dequantize_kernel(packed_ptr, absmax_ptr, code_ptr, out_ptr, n_bytes,
                               BYTES_PER_ABSMAX: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n_bytes
        p = tl.load(packed_ptr + i, mask=mask, other=0).to(tl.int32)
        a = tl.load(absmax_ptr + i // BYTES_PER_ABSMAX, mask=mask, other=0.0)
        hi = tl.load(code_ptr + (p >> 4)) * a  # the even element
        lo = tl.load(code_ptr + (p & 15)) * a
        w = tl.reshape(tl.join(hi, lo), (2 * BLOCK,)).to(out_ptr.dtype.element_ty)
        o = tl.program_id(0) * 2 * BLOCK + tl.arange(0, 2 * BLOCK)
        tl.store(out_ptr + o, w, mask=o < 2 * n_bytes)


def nf4_dequantize(packed, absmax, code, out, blocksize=64, block=2048) -> torch.Tensor:
    """bitsandbytes' NF4 dequantisation (the same values, rounded to out's dtype as it rounds them) into `out`
    (contiguous, numel = 2 x packed bytes): a memory-bound pass that reads half a byte and writes one weight
    per element. The decode step's nf4 mode runs it in place of bitsandbytes' kernel (bench/RESULTS.md)."""
    if triton is None:
        raise RuntimeError("nf4_dequantize needs triton (not installed)")
    n_bytes = packed.numel()
    assert out.is_contiguous() and out.numel() == 2 * n_bytes and absmax.numel() * blocksize == 2 * n_bytes
    _nf4_dequantize_kernel[(triton.cdiv(n_bytes, block),)](packed, absmax, code, out, n_bytes,
                                                           BYTES_PER_ABSMAX=blocksize // 2, BLOCK=block, num_warps=8)
    return out
