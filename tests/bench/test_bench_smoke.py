"""The bench harness and the speed changes it measures, on the CPU with the tiny model.

GPU-only parts are skipped here and named so: CUDA-graph decoding, Liger kernels, peak memory.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from conftest import random_lora, requires_gpu, requires_two_gpus_on_a_gpu  # noqa: E402

import bench  # noqa: E402


@pytest.fixture(scope="module")
def lora_tiny(tiny_model):
    """The tiny Llama in fp32 with a LoRA adapter whose B is not zero (so the adapter matters)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    random_lora(model, 0)
    return model.eval(), AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def lora_tiny_qwen2(tiny_model):
    """A tiny Qwen2 (the tiny Llama's sizes and tokenizer, q/k/v with biases, tied embeddings) in fp32 with a
    LoRA adapter; its biases drawn large enough that a step which dropped them would change the tokens."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=5, pad_token_id=2,
                         initializer_range=0.3)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    random_lora(model, 0)
    return model.eval(), AutoTokenizer.from_pretrained(tiny_model)


def test_the_static_decoder_takes_llama_shaped_models_only(lora_tiny, lora_tiny_qwen2):
    """Qwen2 is Llama's layer with q/k/v biases; one with a sliding window is left to HF generate."""
    from common.fast.static_decoder import supports_fast_decode
    model = lora_tiny_qwen2[0]
    assert supports_fast_decode(lora_tiny[0]) and supports_fast_decode(model)
    model.config.use_sliding_window = True
    try:
        assert not supports_fast_decode(model)
    finally:
        model.config.use_sliding_window = False


def _left_padded(prompts, pad):
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("penalty,prefill_tokens", [(1.0, 40), (1.3, 40), (1.0, 4096)])
def test_static_decode_equals_hf_generate_greedy(request, family, penalty, prefill_tokens):
    from common.fast.static_decoder import decode
    from common.model import eos_ids
    model, tok = request.getfixturevalue({"llama": "lora_tiny", "qwen2": "lora_tiny_qwen2"}[family])
    # repeated prompts (GRPO's replies to one premise) are prefilled once and copied to their rows
    prompts = [[0, 3, 442, 271, 4] + list(range(10, 10 + n)) for n in (3, 17, 3, 9, 30, 17)]
    eos = eos_ids(model, tok)
    # prefill_tokens=40: one prompt row at a time, as large batches are prefilled on the GPU
    ours = decode(model, prompts, 20, eos, tok.pad_token_id, temperature=0.0, repetition_penalty=penalty,
                  prefill_tokens=prefill_tokens)
    ids, mask = _left_padded(prompts, tok.pad_token_id)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                         repetition_penalty=penalty, pad_token_id=tok.pad_token_id, eos_token_id=eos)
    for mine, theirs in zip(ours, ref[:, ids.shape[1]:].tolist()):
        assert mine == theirs[:len(mine)]


def test_the_repetition_penalty_counts_a_prompt_token_that_is_also_the_pad_id():
    """Where the pad id also sits in the prompt (SmolLM2 pads with its end of turn), the token counts as seen
    whatever order the writes of its real and its pad positions land in (a GPU's scatter keeps either)."""
    from common.fast.static_decoder import prompt_tokens_seen
    pad = 2
    ids = torch.tensor([[pad, pad, 7, pad, 9], [4, pad, 7, 8, 9]])
    key_ok = torch.tensor([[False, False, True, True, True], [True, True, True, True, True]])
    seen = prompt_tokens_seen(ids, key_ok, 12)
    assert seen[0].nonzero().flatten().tolist() == [pad, 7, 9]
    assert seen[1].nonzero().flatten().tolist() == [pad, 4, 7, 8, 9]
    # a pad written after the real occurrence (the order a GPU may take): still seen
    late = prompt_tokens_seen(torch.tensor([[7, pad, 9, pad]]), torch.tensor([[True, True, True, False]]), 12)
    assert late[0].nonzero().flatten().tolist() == [pad, 7, 9]
    unseen = prompt_tokens_seen(torch.tensor([[7, 9, pad]]), torch.tensor([[True, True, False]]), 12)
    assert unseen[0].nonzero().flatten().tolist() == [7, 9]  # a pad id only in the padding: not seen


def test_sampled_decode_stops_at_end_token(lora_tiny):
    from common.fast.static_decoder import decode
    model, tok = lora_tiny
    torch.manual_seed(1)
    out = decode(model, [[0, 3, 442, 271, 4, 20, 21]] * 6, 12, [tok.eos_token_id], tok.pad_token_id, temperature=1.0)
    assert all(1 <= len(o) <= 12 for o in out)
    assert all(tok.eos_token_id not in o[:-1] for o in out)  # cut right after the first end token


@pytest.fixture(scope="module")
def four_bit_lora(tiny_model):
    """The tiny Llama as the pipeline loads it (NF4 base, bf16 compute, rsLoRA), its LoRA B not zero."""
    from common.config import ModelArgs
    from common.model import CAUSAL_LM, load_model, load_tokenizer
    args = ModelArgs(model_name_or_path=str(tiny_model))
    tok = load_tokenizer(args)
    return load_model(args, CAUSAL_LM, tokenizer=tok).eval(), tok


@pytest.mark.parametrize("weights", ["nf4", "bf16"])
def test_fused_decode_step_gives_the_models_own_logits(four_bit_lora, weights):
    """One fused step (stacked q/k/v and gate/up, batched LoRA, folded residuals, 4-bit or bf16 base)
    after a prefill gives the logits of the model's own forward over the whole prompt, far closer than
    the LoRA's own effect on them (so a LoRA dropped, misplaced or mis-scaled fails)."""
    from common.fast.decode_step import DecodeStep
    from common.fast.static_decoder import _prefill
    from common.model import unwrap_peft
    model, _ = four_bit_lora
    random_lora(model, 3)
    lm = unwrap_peft(model)
    dev = lm.model.embed_tokens.weight.device
    ids = torch.tensor([[0, 3, 442, 271, 4] + list(range(10, 17)), [0, 3, 442, 271, 4] + list(range(40, 47))], device=dev)
    B, T = ids.shape
    with torch.no_grad():
        ref = model(input_ids=ids).logits[:, -1].float()
        with model.disable_adapter():
            no_lora = model(input_ids=ids).logits[:, -1].float()
        attn, cfg = lm.model.layers[0].self_attn, lm.config
        keys = torch.zeros(cfg.num_hidden_layers, B, cfg.num_key_value_heads, T, attn.head_dim, dtype=torch.bfloat16, device=dev)
        values = torch.zeros_like(keys)
        causal = torch.ones(T - 1, T - 1, dtype=torch.bool, device=dev).tril()[None, None].expand(B, 1, -1, -1)
        def store(i, k, v):
            keys[i][:, :, :T - 1], values[i][:, :, :T - 1] = k, v
        _prefill(lm, ids[:, :-1], torch.arange(T - 1, device=dev)[None].expand(B, -1), causal, store)
        step = DecodeStep(model, weights)
        logits = step(ids[:, -1], torch.full((B, 1), T - 1, device=dev), keys, values, torch.tensor([T - 1], device=dev),
                      torch.zeros(B, 1, 1, T, dtype=torch.bfloat16, device=dev))
    lora_effect = (ref - no_lora).abs().max()
    assert lora_effect > 0.1
    assert (logits - ref).abs().max() < 0.1 * lora_effect


def test_rollouts_on_bf16_base_weights_equal_the_4bit_decode_and_follow_the_live_lora(four_bit_lora):
    """rollout_weights: bf16. The decode step reads bf16 copies of the base made once; the greedy
    tokens are those of the 4-bit decode, and after the LoRA moves (a training step) they still are:
    the copies hold the frozen base only."""
    from common.fast.static_decoder import decode
    from common.model import eos_ids
    model, tok = four_bit_lora
    prompts = [[0, 3, 442, 271, 4] + list(range(10, 10 + n)) for n in (3, 17, 9, 30)]
    eos = eos_ids(model, tok)

    def greedy(weights):
        return decode(model, prompts, 20, eos, tok.pad_token_id, temperature=0.0, prefill_tokens=40, weights=weights)

    for seed in (1, 2):  # two different adapters: the second one after the bf16 copies exist
        random_lora(model, seed)
        assert greedy("bf16") == greedy("nf4"), seed
    layers = len(model.get_base_model().model.layers)
    assert len(model._dense_base) == 4 * layers  # q/k/v, o, gate/up and down of each layer, once


@requires_gpu  # CUDA-graph decode, which bench/bench.py measures
@pytest.mark.parametrize("case", ["fp32", "nf4", "bf16"])
def test_gpu_cuda_graph_decode_equals_eager(lora_tiny, four_bit_lora, case):
    """The captured fused step (4-bit dequantising into its scratch buffer included) replays to the
    tokens of the same step run eagerly."""
    from common.fast.static_decoder import GRAPH_FAILURES, decode
    model, tok = (lora_tiny[0].cuda(), lora_tiny[1]) if case == "fp32" else four_bit_lora
    weights = "bf16" if case == "bf16" else "nf4"
    prompts = [[0, 3, 442, 271, 4] + list(range(10, 10 + n)) for n in (3, 17)]
    eager = decode(model, prompts, 16, [tok.eos_token_id], tok.pad_token_id, temperature=0.0, cuda_graph=False,
                   weights=weights)
    graph = decode(model, prompts, 16, [tok.eos_token_id], tok.pad_token_id, temperature=0.0, cuda_graph=True,
                   weights=weights)
    assert graph == eager and not GRAPH_FAILURES


@requires_gpu  # CUDA-graph decode's memory
def test_gpu_repeated_decodes_leave_no_memory_behind(four_bit_lora):
    """Each decode captures a new graph after a warm-up step on a side stream; cuBLAS keeps a workspace for
    every stream it has run on, so a new stream each time grew memory by 32 MiB a decode (a GRPO step)."""
    from common.fast.static_decoder import decode
    model, tok = four_bit_lora
    prompts = [[0, 3, 442, 271, 4] + list(range(10, 10 + n)) for n in (3, 17)]
    after = []
    for _ in range(3):
        decode(model, prompts, 8, [tok.eos_token_id], tok.pad_token_id, temperature=1.0, cuda_graph=True)
        torch.cuda.synchronize()
        after.append(torch.cuda.memory_allocated())
    assert after[1] == after[2], after


def test_dropping_the_mask_of_right_padded_batches_is_exact(tiny_model):
    from transformers import AutoModelForCausalLM

    from common.fast.model_changes import unmask_right_padding
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).train()
    ids = torch.randint(10, 2000, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, 7:] = 0
    mask[2, 10:] = 0
    ref = model(input_ids=ids, attention_mask=mask).logits
    unmask_right_padding(model)
    seen = {}
    model.model.register_forward_pre_hook(lambda m, a, k: seen.update(mask=k.get("attention_mask")), with_kwargs=True)
    out = model(input_ids=ids, attention_mask=mask).logits
    assert seen["mask"] is None
    assert torch.equal(out[mask.bool()], ref[mask.bool()])
    model(input_ids=ids, attention_mask=mask.flip(1))  # left padding (GRPO prompts) keeps its mask
    assert seen["mask"] is not None


def test_length_file_is_the_bundled_data(tmp_path):
    fresh = bench.make_lengths(tmp_path / "lengths.json")
    assert fresh == json.loads(bench.LENGTHS.read_text())
    assert all(p <= 512 and p + r <= 768 for p, r in fresh["sft"])


def test_grouped_batches_carry_little_padding():
    lengths = json.loads(bench.LENGTHS.read_text())["sft"]

    def real_share(grouped):
        rows = bench.step_batches(lengths, 16, 40, grouped, seed=1)
        steps = [rows[i:i + 16] for i in range(0, len(rows), 16)]
        return sum(sum(map(sum, s)) for s in steps) / sum(16 * max(map(sum, s)) for s in steps)
    assert real_share(True) > 0.95 > 0.85 > real_share(False)


@pytest.mark.slow
def test_one_sft_measurement_through_the_pipeline(tiny_model, tmp_path):
    """bench's SFT row on the tiny model: the stage's build_trainer and train(), tokens counted and timed.
    GPU-only and not run here: peak memory (None on the CPU) and Liger."""
    args = SimpleNamespace(tiny=True, out=str(tmp_path / "out"), work=str(tmp_path / "work"), deadline=600,
                           steps=2, model=None, long_tokens=512, batches="real")
    b = bench.Bench(args)
    from common.config import ModelArgs
    from common.model import CAUSAL_LM, load_model, load_tokenizer
    margs = ModelArgs(model_name_or_path=str(tiny_model))
    b.tokenizer = load_tokenizer(margs)
    b.words = bench.Words(b.tokenizer)
    b.policy = load_model(margs, CAUSAL_LM, tokenizer=b.tokenizer)
    b.sft("sft_real_ours", "real", b.sft_lengths, True)
    (row,) = b.results["rows"]
    assert row["setting"] == "ours" and row["group_by_length"]
    assert (row["peak_gib"] is None) == (not torch.cuda.is_available())  # measured on GPUs only
    # the recipe's token budget (6,144 for 8 x 768), scaled as --tiny scales lengths (/ 8) and batches (4 for 8)
    assert row["max_tokens_per_batch"] == 6144 // 8 // 2 == 384 and row["per_device"] is None
    assert row["padded_tokens_per_micro_batch"] <= 384 and row["rows_per_micro_batch"] > 4  # more than 4 examples
    assert row["real_tokens"] > 0 and row["tokens_per_s"] > 0 and row["real_share"] > 0.9
    assert "sft_real_ours" in bench.table(b.results)


@pytest.mark.slow
def test_review_sections_run_on_the_tiny_model(tiny_model, tmp_path):
    """`bench.py --tiny --sections review_sft,review_dpo,review_gen` (lengths / 8): TRL's defaults and the
    pipeline's recipes side by side for SFT at both review lengths and for DPO, and the decoder at each
    batch. GPU-only and not run here: peak memory (None on the CPU, so no target is judged), Liger, CUDA
    graphs and out-of-memory."""
    # the bench's deadline is for a GPU call; here it only must not cut a row off on busy cores
    args = SimpleNamespace(tiny=True, out=str(tmp_path / "out"), work=str(tmp_path / "work"), deadline=3600,
                           steps=2, model=None, long_tokens=512, batches="real", review_steps=2,
                           review_gen_batches="1,2,4")
    b = bench.Bench(args)
    b.run(["review_sft", "review_dpo", "review_gen"])
    assert b.results["errors"] == []
    rows = {r["name"]: r for r in b.results["rows"]}
    dpo_rows = {"review_dpo_896_trl", "review_dpo_2432_trl", "review_dpo_896_ours", "review_dpo_896_ours_offload",
                "review_dpo_896_ours_precomputed_ref", "review_dpo_2432_ours",
                "review_dpo_2432_ours_offload_all", "review_dpo_2432_ours_keep_3gib", "review_dpo_2432_ours_no_levers",
                "review_dpo_2432_ours_fit_12gib", "review_dpo_2432_ours_fit_12gib_attention_kept",
                "review_dpo_2432_ours_fit_24gib"}  # the flex rows: GPU only
    sft_levers = {f"review_sft_20480_{s}" for s in ("ours_offload_all", "ours_keep_3gib", "ours_no_offload", "ours_chunks",
                                                    "ours_flash", "ours_fit_12gib", "ours_fit_12gib_attention_kept",
                                                    "ours_fit_24gib")}
    assert set(rows) == {"review_sft_8192_trl", "review_sft_20480_trl", "review_gen_b1", "review_gen_b2",
                         "review_gen_b4", "review_sft_8192_ours", "review_sft_20480_ours"} | dpo_rows | sft_levers
    levers = rows["review_sft_20480_ours_keep_3gib"]
    assert levers["offload_activations"] and levers["offload_keep_gib"] == 3.0 and not levers["mlp_chunk_tokens"]
    assert not rows["review_sft_20480_ours_no_offload"]["offload_activations"]
    cpu = not torch.cuda.is_available()
    # keep_attention_outputs: off in the recipes, on in its own rows (with offloading, under SDPA on the CPU;
    # on a GPU the tiny model fits the budget, so nothing is checkpointed and nothing kept)
    for stage, n in (("sft", 20480), ("dpo", 2432)):
        assert "keep_attention_outputs" not in rows[f"review_{stage}_{n}_ours_fit_12gib"]["patches"]
        kept = rows[f"review_{stage}_{n}_ours_fit_12gib_attention_kept"]
        if cpu:
            assert {"offload_saved_activations", "keep_attention_outputs"} <= set(kept["patches"])
    # the recipe's memory_levers fit plans for a GPU: on the CPU its levers stay as written, and the row says so
    for fit in (rows["review_sft_20480_ours"], rows["review_sft_20480_ours_fit_12gib"]):
        if cpu:
            assert fit["memory_plan"]["levers"] == "as_set" and "CPU" in fit["memory_plan"]["why"]
            assert fit["offload_activations"] == rows["review_sft_20480_ours_offload_all"]["offload_activations"]
        else:
            assert fit["memory_plan"]["levers"] == "fit"
    assert rows["review_sft_20480_ours_offload_all"]["memory_plan"] == {"levers": "as_set"}
    assert rows["review_sft_20480_ours_chunks"]["mlp_chunk_tokens"] == 4096 // 8
    # SFT: one sequence of the recipe's max_length (/ 8) a step, the recipe's levers on ours only
    for n, recipe in ((8192, "llama3-8b"), (20480, "llama31-8b")):
        ours, trl = rows[f"review_sft_{n}_ours"], rows[f"review_sft_{n}_trl"]
        assert ours["recipe"] == recipe and ours["max_length"] == n // 8
        assert n // 8 - 2 <= ours["sequence_tokens"] == trl["sequence_tokens"] <= n // 8
        assert ours["tokens_per_s"] > 0 and trl["tokens_per_s"] > 0
        assert ours["peak_gib"] is None if cpu else ours["peak_gib"] > 0
        assert not trl["offload_activations"] and not trl["liger"]
    assert rows["review_sft_20480_ours"]["offload_activations"] == cpu  # a GPU plans: the tiny model fits, kept
    assert not rows["review_sft_20480_ours"]["mlp_chunk_tokens"]
    assert rows["review_sft_20480_ours"]["input_strategy"] == "whole"
    # DPO: prompts up to 896 or 2,432 + replies of 128 (7,168 or 19,456 + 1,024, / 8), 1/64 shorter each
    # step, nothing cut, TRL's `ref` adapter copy, tokens counted as TRL's two sequences on every row
    for name in dpo_rows:
        r = rows[name]
        n = 1024 if r["recipe"] == "llama3-8b" else 2560
        assert r["ref_adapter"] and r["max_length"] == n and n - n // 16 <= r["sequence_tokens"] < n - 2, name
        assert abs(r["real_tokens"] - 2 * r["sequence_tokens"] * r["steps_timed"]) < 2 * r["steps_timed"]
        assert r["pair_in_one_sequence"] == (r["setting"] != "trl")
    assert rows["review_dpo_896_ours_precomputed_ref"]["precompute_ref_log_probs"]
    assert b.results["meta"]["commit"]  # the code that ran
    # ...and the model is handed back as it was: no `ref` adapter, the LoRA weights trainable, one dtype
    # (TRL's trainers cast a 4-bit model's LoRA weights to bf16; DPO's cast is undone, the SFT rows' stays)
    assert list(b.policy.peft_config) == ["default"]
    lora = [p for n, p in b.policy.named_parameters() if "lora_" in n]
    assert lora and all(p.requires_grad for p in lora) and len({p.dtype for p in lora}) == 1
    # generation: every batch, full-length replies, the best batch named
    for batch in (1, 2, 4):
        r = rows[f"review_gen_b{batch}"]
        assert r["prompt_tokens"] == 1024 and r["new_tokens"] == batch * 16 and not r["oom"]
    assert b.results["review_gen_best"]["batch"] in (1, 2, 4)
    text = bench.table(b.results)
    assert "review_dpo_896_ours" in text and "review_gen_b4" in text and "x faster" in text


@pytest.mark.slow
@requires_two_gpus_on_a_gpu
def test_ddp_bench_grpo_runs_in_two_processes(tiny_model, tmp_path):
    """bench/ddp_train.py's GRPO section, as `bench/ddp_train.sh` launches it on two GPUs, on two CPU
    processes (gloo): stage 04's trainer per rank, the recipe's 64 completions a step over both."""
    import os
    import subprocess
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "bench/ddp_train.py", "--model",
         str(tiny_model), "--sections", "grpo", "--steps", "2", "--warmup", "1", "--grpo_completion_len", "8",
         "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")],
        cwd=REPO, env={**os.environ, "ALLOW_CPU": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (result,) = json.loads((tmp_path / "out" / "results.json").read_text())["results"]
    assert result["processes"] == 2 and result["gradient_accumulation_steps"] == 2  # the recipe's 4, halved
    assert result["completions_per_step"] == 64 and result["global_step"] == 2
    assert "group_in_one_sequence" in result["patches"] and result["seconds_per_step"] > 0


def test_generate_speed_times_both_decoders_on_the_same_posts(tiny_model, tmp_path):
    """bench/generate_speed.py: a row for each decoder on the same CMV posts, and how far their greedy replies
    agree (the 4-bit model computes in bf16, whose rounding differs between the two: exact equality is the fp32
    test's, above)."""
    import generate_speed
    generate_speed.main(SimpleNamespace(models=[str(tiny_model)], out=str(tmp_path), prompts=3, batch_size=3,
                                        max_new_tokens=6, premise_words=40, repetition_penalty=1.2))
    row = json.loads((tmp_path / "generate_speed.json").read_text())["models"][tiny_model.name]
    assert row["static"]["new_tokens"] > 0 and row["hf_generate"]["new_tokens"] > 0
    agree = row["agreement"]
    assert 0 < agree["equal_share"] <= agree["mean_matching_prefix"] <= 1, agree
    assert set(row["sample"]) == {"static", "hf_generate"}


@pytest.mark.slow
def test_the_steps_per_generation_rows_run_on_the_tiny_model(tmp_path):
    """`bench.py --sections grpo --rows 'grpo ours spg*' --grpo_steps_per_generation 4,8`, the GPU's command,
    on the tiny model: one row a value, each generation batch feeding that many micro-batches."""
    import subprocess
    proc = subprocess.run([sys.executable, "bench/bench.py", "--tiny", "--out", str(tmp_path / "out"), "--work",
                           str(tmp_path / "work"), "--sections", "grpo", "--rows", "grpo ours spg*",
                           "--grpo_steps_per_generation", "4,8", "--deadline", "900"],
                          cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert [(r["name"], r["steps_per_generation"]) for r in rows] == [("grpo_ours_spg_4", 4), ("grpo_ours_spg_8", 8)]
    # the generation batch is one micro-batch times steps_per_generation: twice as large at 8 as at 4
    assert rows[1]["generation_batch"] == 2 * rows[0]["generation_batch"] > 0
    assert all(r["seconds_per_step"] > 0 and r["steps_timed"] >= 1 for r in rows)


def test_decode_determinism_decodes_each_variant_repeatedly_on_the_tiny_model(tmp_path):
    """bench/decode_determinism.py, the GPU's check of greedy reproducibility: a row for each decoder variant;
    every variant but SDPA's attention writes the same replies in every repeat on any device (on the CPU SDPA's
    too), so a decoder whose state leaked from one decode into the next would show here."""
    import decode_determinism
    decode_determinism.main(["--tiny", "--out", str(tmp_path), "--prompts", "3", "--new_tokens", "6", "--repeats", "3"])
    found = json.loads((tmp_path / "determinism.json").read_text())
    rows = [r for r in found["rows"] if " only" not in r["variant"]]  # a GPU adds a row for each SDPA backend
    assert [r["variant"] for r in rows] == ["static (as 05: grouped-matmul attention, bf16 copies, CUDA graph)",
                                            "static, no CUDA graph", "static, 4-bit base", "static, adapter off",
                                            "static, SDPA attention (as GRPO's rollouts)", "transformers generate"]
    gpu = torch.cuda.is_available()
    for row in rows:
        if "SDPA" not in row["variant"] or not gpu:
            assert row["equal_in_every_repeat"] == 3 and row["median_first_difference_token"] is None, row
    by_name = {r["variant"]: r["equal_to_first_variant"] for r in rows}
    assert rows[0]["equal_to_first_variant"] == 3 and by_name["static, adapter off"] < 3  # the random LoRA B counts
    if not gpu:  # on the CPU SDPA's attention and transformers' generate (cut at the end token as the static
        # decoder cuts) write the static decoder's replies: a variant that differs on a GPU differs in its
        # arithmetic, not its meaning
        assert by_name["static, SDPA attention (as GRPO's rollouts)"] == 3 and by_name["transformers generate"] == 3
        assert found["decode_attention_backend"] in {"math", "flash"}
    # a second process compared with the first: the reproducible variants write the first process's replies
    decode_determinism.main(["--tiny", "--out", str(tmp_path / "again"), "--prompts", "3", "--new_tokens", "6",
                             "--repeats", "2", "--compare_with", str(tmp_path)])
    again = json.loads((tmp_path / "again" / "determinism.json").read_text())["rows"]
    assert all(r["equal_to_other_process"] == 3 for r in again if not gpu or "SDPA" not in r["variant"]), again
    # --variants: only those named
    decode_determinism.main(["--tiny", "--out", str(tmp_path / "some"), "--prompts", "2", "--new_tokens", "4",
                             "--repeats", "2", "--variants", "(as GRPO", "generate"])
    some = json.loads((tmp_path / "some" / "determinism.json").read_text())["rows"]
    assert [r["variant"] for r in some] == ["static, SDPA attention (as GRPO's rollouts)", "transformers generate"]


def test_profile_decode_profiles_both_base_weight_modes_on_the_tiny_model(tmp_path):
    """bench/profile_decode.py on the CPU: a row and a table for each base-weight mode of the decode step."""
    import profile_decode
    profile_decode.main(["--tiny", "--out", str(tmp_path), "--batch", "2", "--new_tokens", "4"])
    rows = json.loads((tmp_path / "decode_profile.json").read_text())["rows"]
    assert [r["weights"] for r in rows] == ["nf4", "bf16"] and all(r["batch"] == 2 for r in rows), rows
    assert (tmp_path / "decode_nf4.txt").exists() and (tmp_path / "decode_bf16.txt").exists()
