"""The Triton NF4 kernels against bitsandbytes' own dequantisation: the pipeline's dequantise pass
(common/fast/nf4_dequantize.py) and the fused matmul kept in bench/ (bench/nf4_fused.py), x @ dequantize_4bit(W).T.

With CUDA the kernel is compiled and every test runs on the GPU. Without, it runs under Triton's CPU
interpreter (tests/conftest.py sets TRITON_INTERPRET=1). The interpreter's tl.dot mishandles bf16 (it
multiplies the raw bits), so on CPU the kernel runs in fp32 and fp16; bf16 is checked by the *_gpu tests.
All skip where triton is not installed (`make venv` installs it on a CPU machine), but for the import check.
"""
from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
# fp32 x: tl.dot rounds its inputs to tf32 on the GPU
TOL = {torch.float32: 2e-3 if DEVICE == "cuda" else 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.fixture(scope="module")
def nf4():
    pytest.importorskip("triton", reason="triton not installed")
    sys.path.insert(0, str(REPO / "bench"))
    import nf4_fused

    from common.fast import nf4_dequantize
    assert nf4_fused.available() and nf4_dequantize.available()
    return types.SimpleNamespace(nf4_linear=nf4_fused.nf4_linear, nf4_dequantize=nf4_dequantize.nf4_dequantize)


def quantized(n, k, blocksize=64, device=DEVICE, seed=0):
    """(packed, absmax fp32, quant_state) of a random (n, k) weight, absmax decoded as the decode step does."""
    import bitsandbytes.functional as F
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(device)
    packed, qs = F.quantize_4bit(w, blocksize=blocksize, quant_type="nf4", compress_statistics=True)
    absmax = (F.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset) if qs.nested else qs.absmax.float()
    return packed, absmax, qs


def reference(x, packed, qs):
    """x @ W^T in fp32, W as bitsandbytes dequantises it, rounded to x's dtype as the kernel rounds it."""
    import bitsandbytes.functional as F
    w = F.dequantize_4bit(packed, qs).float().to(x.dtype).float()
    return x.float() @ w.T


def rel_err(y, ref):
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


def run(nf4, x, packed, absmax, qs, n, k, **kw):
    return nf4.nf4_linear(x, packed, absmax, qs.code, n, k, blocksize=qs.blocksize, **kw)


@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("m,n,k", [(m, n, k) for m in (1, 5, 64) for n in (64, 96) for k in (128, 256)])
def test_matches_bitsandbytes(nf4, m, n, k, split_k):
    packed, absmax, qs = quantized(n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    y = run(nf4, x, packed, absmax, qs, n, k, split_k=split_k)
    assert y.shape == (m, n) and y.dtype == x.dtype
    assert rel_err(y, reference(x, packed, qs)) < TOL[torch.float32]


@pytest.mark.parametrize("m,blocksize,split_k,block_k", [(5, 64, None, None), (5, 64, 3, 64), (64, 64, 4, None),
                                                         (3, 128, 2, None), (130, 64, 2, None)])
def test_fp16_blocksize_and_m_tiles(nf4, m, blocksize, split_k, block_k):
    """fp16 like the GPU's bf16 path; an uneven split (8 K tiles in 3); blocksize 128; M past 128 (two M tiles)."""
    n, k = 96, 512
    packed, absmax, qs = quantized(n, k, blocksize=blocksize)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).to(DEVICE).half()
    y = run(nf4, x, packed, absmax, qs, n, k, split_k=split_k, block_k=block_k)
    assert y.dtype == torch.float16
    assert rel_err(y, reference(x, packed, qs)) < TOL[torch.float16]


@pytest.mark.parametrize("two_dots", [False, True])
@pytest.mark.parametrize("pair_lut", [False, True])
@pytest.mark.parametrize("block_k,split_k", [(64, 1), (128, 3), (256, 1), (256, 2)])
def test_knobs_match_bitsandbytes(nf4, block_k, split_k, pair_lut, two_dots):
    """Several quant blocks a K tile (scales broadcast within the tile), the pair table, two dots, split-K over
    tiles (K=768 in 128-column tiles: 6 in 3 splits)."""
    m, n, k = 5, 96, 768
    packed, absmax, qs = quantized(n, k, seed=6)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    y = run(nf4, x, packed, absmax, qs, n, k, block_k=block_k, split_k=split_k, pair_lut=pair_lut, two_dots=two_dots)
    assert rel_err(y, reference(x, packed, qs)) < TOL[torch.float32]


@pytest.mark.parametrize("m,blocksize,block_k,split_k,pair_lut,two_dots,block_n",
                         [(3, 128, 256, 2, True, True, 32), (3, 128, 128, 4, True, False, 64),
                          (130, 64, 256, 2, True, True, 64), (64, 64, 128, 1, False, True, 128),
                          (17, 64, 128, 4, True, False, 32)])
def test_knobs_fp16_blocksize_and_m_tiles(nf4, m, blocksize, block_k, split_k, pair_lut, two_dots, block_n):
    """The knobs with fp16 x, blocksize 128 (two quant blocks a 256 tile), M past 128, and other BLOCK_N (each tile
    within an H200's shared memory: BLOCK_K 512 with BLOCK_N 128 is not); an
    uneven split (K=1024 in 128-column tiles: 8 in 4 splits; 2 in 4 becomes 2 splits)."""
    n, k = 96, 1024 if block_k == 128 and blocksize == 64 else 512
    packed, absmax, qs = quantized(n, k, blocksize=blocksize, seed=8)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(9)).to(DEVICE).half()
    y = run(nf4, x, packed, absmax, qs, n, k, block_k=block_k, split_k=split_k, pair_lut=pair_lut,
            two_dots=two_dots, block_n=block_n)
    assert y.dtype == torch.float16
    assert rel_err(y, reference(x, packed, qs)) < TOL[torch.float16]


@pytest.mark.parametrize("pair_lut,two_dots,block_k", [(False, False, 256), (True, False, 128), (True, True, 256),
                                                        (False, True, 64)])
def test_weights_exactly_bitsandbytes_values(nf4, pair_lut, two_dots, block_k):
    """x one-hot rows (the identity): out = W^T, every weight bit-for-bit as bitsandbytes dequantises it in x's dtype
    (fp32 on CPU; bf16 on the GPU, where an fp32 dot would round to tf32). Catches what a tolerance could miss,
    such as rounding the code table before scaling."""
    import bitsandbytes.functional as F
    n, k = 96, 256
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    packed, absmax, qs = quantized(n, k, seed=10)
    ref = F.dequantize_4bit(packed, qs).float().to(dtype)
    x = torch.eye(k, device=DEVICE, dtype=dtype)
    y = run(nf4, x, packed, absmax, qs, n, k, block_k=block_k, pair_lut=pair_lut, two_dots=two_dots)
    assert torch.equal(y, ref.T)


def test_pair_table_and_knob_checks(nf4):
    import nf4_fused
    code = quantized(64, 128)[2].code
    table = nf4_fused._pair_table(code)
    assert table is nf4_fused._pair_table(code)  # cached
    pairs = table.view(torch.float32).reshape(256, 2)
    b = torch.arange(256, device=code.device)
    assert torch.equal(pairs[:, 0], code[b >> 4]) and torch.equal(pairs[:, 1], code[b & 15])
    packed, absmax, qs = quantized(64, 192)
    x = torch.randn(2, 192, device=DEVICE)
    for block_k in (128, 96, 32):  # 192 is not a multiple of 128; 96 is no power of two; 32 < blocksize
        with pytest.raises(AssertionError, match="block_k"):
            run(nf4, x, packed, absmax, qs, 64, 192, block_k=block_k)
    assert nf4_fused._config(64, 64, 192, 64, torch.device("cpu")).block_k == 64  # the rule picks a divisor of K
    assert nf4_fused._block_k(4096, 64, target=512) == 512 and nf4_fused._block_k(768, 128, target=512) == 256


def test_default_config_rule(nf4):
    """The rule at M=64 for Llama 3 8B's shapes, on an H200 (132 SMs, as the interpreter is taken to have)."""
    import nf4_fused
    got = {(n, k): nf4_fused._config(64, n, k, 64, torch.device("cpu"))
           for n, k in [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]}
    assert {s: (c.block_n, c.block_k, c.split_k) for s, c in got.items()} == {
        (4096, 4096): (64, 128, 4), (1024, 4096): (64, 128, 8), (14336, 4096): (64, 128, 2), (4096, 14336): (64, 128, 8)}


@pytest.mark.parametrize("split_k", [1, 2])
def test_out_column_slice_and_residual(nf4, split_k):
    """q, k, v written side by side into one buffer: out is a column slice (row stride 3N), and so is residual."""
    m, n, k = 5, 64, 256
    packed, absmax, qs = quantized(n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    buf = torch.full((m, 3 * n), 7.0, device=DEVICE)
    res_buf = torch.randn(m, 2 * n, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    residual = res_buf[:, n:]
    y = run(nf4, x, packed, absmax, qs, n, k, out=buf[:, n:2 * n], residual=residual, split_k=split_k)
    assert y.data_ptr() == buf[:, n:].data_ptr()
    ref = reference(x, packed, qs)
    assert rel_err(buf[:, n:2 * n] - residual, ref) < TOL[torch.float32]
    assert (buf[:, :n] == 7).all() and (buf[:, 2 * n:] == 7).all()
    # without residual, into the same slice
    run(nf4, x, packed, absmax, qs, n, k, out=buf[:, n:2 * n], split_k=split_k)
    assert rel_err(buf[:, n:2 * n], ref) < TOL[torch.float32]


@pytest.mark.parametrize("knobs", [{}, {"block_k": 256, "pair_lut": True}, {"block_k": 128, "two_dots": True}])
def test_comparison_is_sensitive(nf4, knobs):
    """One block's absmax doubled, or the two nibbles of each byte swapped: far outside the tolerance."""
    m, n, k = 5, 96, 256
    packed, absmax, qs = quantized(n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    ref = reference(x, packed, qs)
    assert rel_err(run(nf4, x, packed, absmax, qs, n, k, **knobs), ref) < TOL[torch.float32]
    bad = absmax.clone()
    bad[37] *= 2
    assert rel_err(run(nf4, x, packed, bad, qs, n, k, **knobs), ref) > 1e-2
    swapped = (packed << 4) | (packed >> 4)
    assert rel_err(run(nf4, x, swapped, absmax, qs, n, k, **knobs), ref) > 1e-1


def _dequantize_check(nf4, dtype):
    import bitsandbytes.functional as F
    packed, absmax, qs = quantized(96, 256)
    qs.dtype = dtype
    ref = F.dequantize_4bit(packed, qs)  # bitsandbytes' own values in `dtype`
    out = torch.full((96, 256), float("nan"), dtype=dtype, device=DEVICE)
    nf4.nf4_dequantize(packed, absmax, qs.code, out, block=512)  # several programs, the last one partial
    assert torch.equal(out, ref)
    absmax[3] *= 2  # one block's scale: exactly its 64 weights change
    changed = nf4.nf4_dequantize(packed, absmax, qs.code, out.clone(), block=512) != ref
    assert changed.sum() == (ref.reshape(-1)[3 * 64:4 * 64] != 0).sum() and changed.reshape(-1)[3 * 64:4 * 64].any()


def test_dequantize_gives_bitsandbytes_values(nf4):
    _dequantize_check(nf4, torch.float32)  # the interpreter rounds bf16 otherwise than the GPU: see the _gpu test


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="GPU only")
def test_dequantize_gives_bitsandbytes_bf16_values_gpu(nf4):
    _dequantize_check(nf4, torch.bfloat16)


@pytest.mark.slow
def test_importable_without_triton():
    code = ("import sys; sys.modules['triton'] = None; sys.path.insert(0, '.');"
            "import common.fast.nf4_dequantize as m; assert not m.available()")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU (and Triton compiling, not interpreting)")
@pytest.mark.parametrize("n,k", [(1024, 4096), (4096, 14336)])
def test_llama_shapes_bf16_gpu(nf4, n, k):
    packed, absmax, qs = quantized(n, k, device="cuda")
    x = torch.randn(64, k, device="cuda").bfloat16()
    y = run(nf4, x, packed, absmax, qs, n, k)
    assert y.dtype == torch.bfloat16
    assert rel_err(y, reference(x, packed, qs)) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU (and Triton compiling, not interpreting)")
@pytest.mark.parametrize("n,k", [(1024, 4096), (14336, 4096)])
def test_cuda_graph_with_slice_and_residual_gpu(nf4, n, k):
    """Captured after one eager call (split-K for 1024 rows, none for 14336), replayed on new inputs."""
    packed, absmax, qs = quantized(n, k, device="cuda")
    x = torch.randn(64, k, device="cuda").bfloat16()
    residual = torch.randn(64, n, device="cuda").bfloat16()
    buf = torch.zeros(64, 2 * n, device="cuda", dtype=torch.bfloat16)
    out = buf[:, n:]
    run(nf4, x, packed, absmax, qs, n, k, out=out, residual=residual)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(nf4, x, packed, absmax, qs, n, k, out=out, residual=residual)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    ref = reference(x, packed, qs)
    assert rel_err(out.float() - residual.float(), ref) < 2e-2  # out rounded to bf16 after the residual add
    assert not buf[:, :n].any()
