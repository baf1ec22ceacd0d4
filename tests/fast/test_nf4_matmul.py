"""common/fast/nf4_matmul.py (the split-K NF4 matmul), its dispatch table (common/fast/nf4_dispatch.py), the decode
step on it, and bench/nf4_sweep.py's code path.

Without CUDA the kernel runs under Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1), in fp32
and fp16 (the interpreter's tl.dot mishandles bf16; `nf4_matmul` then runs fp32 on the CPU); bf16 and the real
Llama 3 8B shapes are the `gpu` tests. The reference is bitsandbytes' own dequantize_4bit, then a matmul.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import random_lora, run_in_process
from fast.test_nf4_dequantize import DEVICE, TOL  # the same device and tolerances as the dequantise kernel's


@pytest.fixture(scope="module")
def nm():
    pytest.importorskip("triton", reason="triton not installed")
    from common.fast import nf4_matmul
    assert nf4_matmul.available()
    return nf4_matmul


def quantized(n, k, device=DEVICE, seed=0):
    """(packed, absmax fp32, quant_state) of a random (n, k) NF4 weight, double quantisation decoded."""
    import bitsandbytes.functional as F
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(device)
    packed, qs = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    return packed, F.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset, qs


def reference(x, packed, qs):
    import bitsandbytes.functional as F
    return x.float() @ F.dequantize_4bit(packed, qs).float().to(x.dtype).float().T


def rel_err(y, ref):
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("lut", ["select", "memory"])
@pytest.mark.parametrize("split_k", [1, 2, 4])
def test_matches_dequantize_then_matmul(nm, split_k, lut):
    """M 4, N 64, K 256 in 64-column tiles: 4 tiles in 1, 2 or 4 K-slices."""
    packed, absmax, qs = quantized(64, 256)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    config = nm.Config(block_n=32, block_k=64, split_k=split_k, lut=lut, num_stages=1)
    assert nm.splits(256, config) == (split_k, 4 // split_k)
    y = nm.nf4_matmul(x, packed, absmax, qs.code, 64, 256, launch=config)
    assert y.shape == (4, 64) and y.dtype == x.dtype
    assert rel_err(y, reference(x, packed, qs)) < TOL[torch.float32]


@pytest.mark.parametrize("split_k", [1, 2])
def test_k_tail_rows_past_n_fp16_residual_and_column_slice(nm, split_k):
    """K = 320 in 128-column tiles (the last holds one quant block), N = 96 rows in 64-row tiles, fp16, the
    output a column slice of a wider buffer and a residual added: the o/down projections of the decode step."""
    m, n, k = 5, 96, 320
    packed, absmax, qs = quantized(n, k, seed=2)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)).to(DEVICE).half()
    residual = torch.randn(m, n, generator=torch.Generator().manual_seed(4)).to(DEVICE).half()
    buf = torch.full((m, 2 * n), 7.0, device=DEVICE, dtype=torch.float16)
    config = nm.Config(block_n=64, block_k=128, split_k=split_k, num_stages=1)
    y = nm.nf4_matmul(x, packed, absmax, qs.code, n, k, launch=config, out=buf[:, n:], residual=residual)
    assert y.data_ptr() == buf[:, n:].data_ptr() and (buf[:, :n] == 7).all()
    assert rel_err(y.float() - residual.float(), reference(x, packed, qs)) < TOL[torch.float16]


@pytest.mark.parametrize("lut", ["select", "memory", pytest.param("prmt", marks=pytest.mark.gpu)])
def test_weights_are_bitsandbytes_values_bit_for_bit(nm, lut):
    """x the identity: out = W^T, each weight as bitsandbytes dequantises it (fp32 on the CPU, bf16 on a GPU):
    catches a wrong nibble order, scale or table that a tolerance could miss."""
    import bitsandbytes.functional as F
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    packed, absmax, qs = quantized(64, 256, seed=5)
    x = torch.eye(256, device=DEVICE, dtype=dtype)
    y = nm.nf4_matmul(x[:64], packed, absmax, qs.code, 64, 256, launch=nm.Config(32, 128, 2, lut=lut, num_stages=1))
    assert torch.equal(y, F.dequantize_4bit(packed, qs).to(dtype).T[:64])


def test_split_k_sum_is_deterministic_and_wrong_inputs_show(nm):
    packed, absmax, qs = quantized(64, 256, seed=6)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    config = nm.Config(32, 64, 4, num_stages=1)
    first = nm.nf4_matmul(x, packed, absmax, qs.code, 64, 256, launch=config)
    assert torch.equal(first, nm.nf4_matmul(x, packed, absmax, qs.code, 64, 256, launch=config))
    ref = reference(x, packed, qs)
    bad = absmax.clone()
    bad[37] *= 2  # one quant block's scale
    assert rel_err(nm.nf4_matmul(x, packed, bad, qs.code, 64, 256, launch=config), ref) > 1e-2
    swapped = (packed << 4) | (packed >> 4)  # the two codes of each byte
    assert rel_err(nm.nf4_matmul(x, swapped, absmax, qs.code, 64, 256, launch=config), ref) > 1e-1


def test_bf16_on_the_cpu_runs_in_fp32(nm):
    packed, absmax, qs = quantized(64, 256, device="cpu", seed=8)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(9)).bfloat16()
    if DEVICE == "cuda":
        pytest.skip("the CPU fallback for the interpreter's bf16")
    y = nm.nf4_matmul(x, packed, absmax, qs.code, 64, 256, launch=nm.Config(32, 128, 2, num_stages=1))
    assert y.dtype == torch.bfloat16 and rel_err(y, reference(x, packed, qs)) < TOL[torch.bfloat16]


def test_refusals_name_what_is_wrong(nm):
    packed, absmax, qs = quantized(64, 256)
    x = torch.randn(2, 256, device=DEVICE)
    for config, match in [(nm.Config(block_k=96), "block_k 96"), (nm.Config(block_k=32), "block_k 32"),
                          (nm.Config(block_n=48), "block_n 48"), (nm.Config(lut="pair"), "lut 'pair'"),
                          (nm.Config(split_k=0), "split_k")]:
        with pytest.raises(ValueError, match=match):
            nm.nf4_matmul(x, packed, absmax, qs.code, 64, 256, launch=config)
    with pytest.raises(ValueError, match="in_features 96: a multiple of the quant blocksize 64"):
        nm.nf4_matmul(torch.randn(2, 96, device=DEVICE), packed[:64 * 48], absmax[:96], qs.code, 64, 96)
    with pytest.raises(ValueError, match="absmax"):
        nm.nf4_matmul(x, packed, absmax.half(), qs.code, 64, 256)


def write_table(path, entries):
    path.write_text(json.dumps({"version": 1, "device": "test", "entries": entries}))
    return path


def test_dispatch_table_picks_the_smallest_m_at_or_above(tmp_path):
    from common.fast import nf4_dispatch
    cfg = {"block_n": 128, "block_k": 256, "split_k": 4, "num_warps": 4, "num_stages": 3, "lut": "select"}
    table = nf4_dispatch.read_table(write_table(tmp_path / "t.json", [
        {"N": 4096, "K": 4096, "M": 64, "path": "nf4_matmul", "config": {**cfg, "split_k": 8}},
        {"N": 4096, "K": 4096, "M": 16, "path": "nf4_matmul", "config": cfg},
        {"N": 4096, "K": 4096, "M": 32, "path": "dequantize"}]))
    assert table.plan(4096, 4096, 8).split_k == 4 and table.plan(4096, 4096, 16).split_k == 4
    assert table.plan(4096, 4096, 17) is None  # the M 32 entry: dequantize
    assert table.plan(4096, 4096, 64).split_k == 8
    assert table.plan(4096, 4096, 65) is None and table.plan(1024, 4096, 16) is None  # past the table
    assert "2 of 3" in table.describe()


@pytest.mark.parametrize("content,says", [
    ("{", "not JSON (line 1"),
    ('{"version": 2, "entries": []}', "version 1"),
    ('{"version": 1, "entries": [{"N": 1, "K": 64, "M": 4, "path": "fused"}]}', "entries[0]: ValueError path 'fused'"),
    ('{"version": 1, "entries": [{"N": 1, "K": 64, "M": 4, "path": "nf4_matmul", "config": {"block_k": 100}}]}',
     "entries[0]: ValueError block_k 100"),
    ('{"version": 1, "entries": [{"N": 1, "K": 64, "path": "dequantize"}]}', "entries[0]: KeyError 'M'"),
])
def test_a_wrong_table_is_one_config_error_naming_file_and_entry(tmp_path, content, says):
    from common.config import ConfigError
    from common.fast import nf4_dispatch
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match="nf4_matmul_table .*bad.json: ") as err:
        nf4_dispatch.read_table(path)
    assert says in str(err.value) and err.value.field == "nf4_matmul_table"
    with pytest.raises(ConfigError, match="cannot read it"):
        nf4_dispatch.read_table(tmp_path / "missing.json")


def test_grpo_config_checks_the_table_field(tmp_path):
    from common.config import ConfigError, GRPOStageConfig
    table = write_table(tmp_path / "t.json", [])
    GRPOStageConfig(sft_run="s", reward_run="r", nf4_matmul_table=str(table))
    with pytest.raises(ConfigError, match="no such file"):
        GRPOStageConfig(sft_run="s", reward_run="r", nf4_matmul_table=str(tmp_path / "none.json"))
    with pytest.raises(ConfigError, match="rollout_weights: nf4"):
        GRPOStageConfig(sft_run="s", reward_run="r", nf4_matmul_table=str(table), rollout_weights="bf16")
    assert GRPOStageConfig(sft_run="s", reward_run="r", nf4_matmul_table=str(table),
                           fast_paths=False).nf4_matmul_table == ""


@pytest.fixture(scope="module")
def four_bit_lora(tiny_model):
    from common.config import ModelArgs
    from common.model import CAUSAL_LM, load_model, load_tokenizer
    args = ModelArgs(model_name_or_path=str(tiny_model))
    return load_model(args, CAUSAL_LM, tokenizer=load_tokenizer(args)).eval()


def test_decode_step_on_the_table_gives_the_dequantising_steps_logits(nm, four_bit_lora, tmp_path):
    """The tiny 4-bit Llama with a LoRA: a table naming nf4_matmul for every base shape at M <= 4 makes each group
    run it (o and down with their residual, q/k/v and gate/up into column slices), with the logits of the
    dequantising step; without the table nothing changes, and the manifest string says which ran."""
    from common import fast
    from common.fast.decode_step import DecodeStep
    model = four_bit_lora
    random_lora(model, 3)
    cfg = {"block_n": 32, "block_k": 64, "split_k": 2, "num_warps": 4, "num_stages": 1, "lut": "select"}
    shapes = {(64, 64), (32, 64), (128, 64), (64, 128)}  # q/o, k/v, gate/up, down of the tiny Llama
    table = write_table(tmp_path / "dispatch.json",
                        [{"N": n, "K": k, "M": 4, "path": "nf4_matmul", "config": cfg} for n, k in shapes])
    B, L = 3, 8
    dev = next(model.parameters()).device
    lm = model.get_base_model()
    attn, c = lm.model.layers[0].self_attn, lm.config

    def step_logits():
        torch.manual_seed(0)
        keys = torch.randn(c.num_hidden_layers, B, c.num_key_value_heads, L, attn.head_dim, dtype=torch.bfloat16,
                           device=dev)
        values = torch.randn_like(keys)
        step = DecodeStep(model, "nf4")
        with torch.no_grad():
            logits = step(torch.tensor([11, 42, 7], device=dev), torch.full((B, 1), L - 1, device=dev), keys,
                          values, torch.tensor([L - 1], device=dev), torch.zeros(B, 1, 1, L, dtype=torch.bfloat16, device=dev))
        return logits, step

    plain, step = step_logits()
    assert all(not g.plans for _, *groups in step.layers for g in groups)
    try:
        fast.use_nf4_matmul_table(table)
        assert "nf4_matmul where dispatch.json (4 of 4" in fast.weights_backend(model, "nf4")
        fused, step = step_logits()
        assert all(g.plans[B] and len(g.plans[B]) == len(g.sizes) for _, *groups in step.layers for g in groups)
    finally:
        fast.use_nf4_matmul_table(None)
    assert (fused - plain).abs().max() < 0.02 * plain.abs().max()
    assert "nf4_matmul" not in fast.weights_backend(model, "nf4")


@pytest.mark.slow  # seconds of Triton's interpreter
def test_sweep_tiny_runs_and_writes_a_table_grpo_reads(tmp_path):
    """bench/nf4_sweep.py --tiny: its whole code path with a 2-configuration grid (interpreter on the CPU)."""
    from common.fast import nf4_dispatch
    out = tmp_path / "sweep"
    proc = run_in_process("bench/nf4_sweep.py", "--tiny", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "sweep.json").read_text())
    mine = [t for t in result["timings"] if t["kernel"] == "nf4_matmul"]
    # stage 1: 2 configurations x 2 shapes; stage 2: one more around each shape's best
    assert len(mine) == 6 and all(t["us"] and t["max_rel_diff"] < 1e-2 for t in mine)
    assert sum(t["config"]["num_warps"] == 8 for t in mine) == 2
    assert {t["config"]["lut"] for t in mine} == {"select", "memory"}
    assert {t["kernel"] for t in result["timings"]} >= {"dequantize + cuBLAS", "nf4_fused default",
                                                        "bf16 lm_head cuBLAS"}
    table = nf4_dispatch.read_table(out / "dispatch.json")
    assert set(table.shapes) == {(64, 256), (96, 320)} and all(len(v) == 1 for v in table.shapes.values())
    md = (out / "sweep.md").read_text()
    assert "| 96 x 320 | 4 |" in md and "Projected base matmuls" in md
    assert "shape 96x320" in (out / "progress.log").read_text()


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU (Triton compiling, not interpreting)")
@pytest.mark.parametrize("n,k", [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [16, 64])
def test_llama_shapes_bf16_gpu(nm, n, k, m):
    packed, absmax, qs = quantized(n, k, device="cuda")
    x = torch.randn(m, k, device="cuda").bfloat16()
    ref = reference(x, packed, qs)
    for config in (nm.Config(), nm.Config(64, 128, 8, 4, 3, "memory"), nm.Config(256, 128, 1, 8, 2, "prmt")):
        y = nm.nf4_matmul(x, packed, absmax, qs.code, n, k, launch=config)
        assert y.dtype == torch.bfloat16 and rel_err(y, ref) < TOL[torch.bfloat16], config


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU (Triton compiling, not interpreting)")
def test_cuda_graph_with_residual_gpu(nm):
    """Captured after one eager call (split-K: the workspace from the graph's pool), replayed on new inputs."""
    n, k = 4096, 4096
    packed, absmax, qs = quantized(n, k, device="cuda")
    x = torch.randn(64, k, device="cuda").bfloat16()
    residual = torch.randn(64, n, device="cuda").bfloat16()
    out = torch.empty(64, n, device="cuda", dtype=torch.bfloat16)
    config = nm.Config(128, 256, 4)
    nm.nf4_matmul(x, packed, absmax, qs.code, n, k, launch=config, out=out, residual=residual)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        nm.nf4_matmul(x, packed, absmax, qs.code, n, k, launch=config, out=out, residual=residual)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out.float() - residual.float(), reference(x, packed, qs)) < 2e-2


def run_ptx(asm, inputs):
    """A model of the few PTX instructions lut "prmt" uses (mov, shr, or, and, xor, prmt in its default mode, per
    the PTX ISA: result byte i is byte (nibble i of c) & 7 of {b:a}, or that byte's sign replicated when the
    nibble's bit 3 is set), run on 32-bit operands: `inputs` {"$4": word}; returns the registers."""
    regs = dict(inputs)

    def val(x):
        return regs[x] if x in regs else int(x, 0) & 0xFFFFFFFF
    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        v = [val(x) for x in src]
        if op == "prmt.b32":
            pool = v[0] | (v[1] << 32)
            out = 0
            for i in range(4):
                sel = (v[2] >> (4 * i)) & 15
                byte = (pool >> (8 * (sel & 7))) & 0xFF
                out |= ((0xFF if byte & 0x80 else 0) if sel & 8 else byte) << (8 * i)
        else:
            out = {"mov.b32": lambda: v[0], "shr.b32": lambda: v[0] >> v[1], "or.b32": lambda: v[0] | v[1],
                   "and.b32": lambda: v[0] & v[1], "xor.b32": lambda: v[0] ^ v[1]}[op]()
        regs[d] = out & 0xFFFFFFFF
    return regs


def test_prmt_lookup_gives_the_nf4_values_in_a_ptx_model(nm):
    """lut "prmt"'s PTX, run by a model of its instructions: every code in every byte position gives its fp32 NF4
    value bit for bit (the GPU tests run the PTX itself); and the table is bitsandbytes' NF4 code."""
    import struct

    import bitsandbytes.functional as F
    assert torch.equal(torch.tensor(nm.NF4), F.get_4bit_type("nf4", device="cpu"))
    bits = [struct.unpack("<I", struct.pack("<f", v))[0] for v in nm.NF4]
    g = torch.Generator().manual_seed(0)
    quads = [(c, c, c, c) for c in range(16)] + [tuple(torch.randint(0, 16, (4,), generator=g).tolist())
                                                 for _ in range(200)]
    for quad in quads:
        regs = run_ptx(nm.PRMT_ASM, {"$4": sum(c << (8 * i) for i, c in enumerate(quad))})
        assert [regs[f"${i}"] for i in range(4)] == [bits[c] for c in quad], quad
    wrong = run_ptx(nm._prmt_asm(nm.NF4[::-1]), {"$4": 0})  # another table gives other values
    assert wrong["$0"] != bits[0]


def test_prmt_is_refused_off_a_gpu_and_for_another_code(nm):
    packed, absmax, qs = quantized(64, 256)
    x = torch.randn(2, 256, device=DEVICE)
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="a GPU only"):
            nm.nf4_matmul(x, packed, absmax, qs.code, 64, 256, launch=nm.Config(lut="prmt"))
    else:
        with pytest.raises(ValueError, match="this code differs"):
            nm.nf4_matmul(x, packed, absmax, qs.code.flip(0).contiguous(), 64, 256, launch=nm.Config(lut="prmt"))


def test_the_h200_table_in_the_recipes_covers_every_8b_projection():
    """configs/llama3-8b/nf4_matmul_h200.json, bench/nf4_sweep.py's table from the H200: it reads, and names a
    path (nf4_matmul or dequantise) for each of the 8B's projection shapes at each decode batch it measured."""
    from common.fast.nf4_dispatch import read_table
    table = read_table(Path(__file__).resolve().parents[2] / "configs/llama3-8b/nf4_matmul_h200.json")
    assert table.device == "NVIDIA H200"
    for shape in [(1024, 4096), (4096, 4096), (4096, 14336), (14336, 4096)]:
        assert [m for m, _ in table.shapes[shape]] == [16, 32, 64], shape
