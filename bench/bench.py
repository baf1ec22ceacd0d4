"""Speed and memory of every stage, the pipeline's settings side by side with TRL's defaults.

    python bench/bench.py --out bench/out            # one GPU: a random Llama 3 8B-shaped model in 4-bit
    python bench/bench.py --tiny --out /tmp/bench    # CPU smoke run of the same code on the tiny model

Everything goes through the pipeline's own code: `load_model` (4-bit NF4 + rank-64 rsLoRA),
`trainer_args`, the stage scripts' dataset builders and trainers, with the llama3-8b recipe's
configs (the fast settings). "trl" rows run the same model and data with TRL 1.16's default
arguments (the pipeline before this bench: random batches, HF `generate`, 16 completions a step).
Weights are random (no model hub): compute and memory are those of the real model. The text is
one repeated word, sized so that each example has the token length of a real ChangeMyView example
(bench/results/2026-11-30_5e9908e/cmv_lengths.json, from words x 1.3, cut as the stages cut); the
stand-in tokenizer is the tiny recipe's (2k ids), and generated ids beyond it decode as that word,
so replies keep their length for the reward model. Results: results.json (and a table on stdout) under --out.

The review task's shapes (not in the default --sections; bench/HISTORY.md "review shapes"):

    python bench/bench.py --out bench/out --sections review_sft,review_dpo,review_gen --deadline 480

review_sft: one SFT sequence of 8,192 tokens (configs/llama3-8b/review: a paper window + a ~1k-token
review) and of 20,480 (configs/llama31-8b/review: the paper whole), through 02's build_trainer with
the review task, against TRL's SFTTrainer defaults. review_dpo: an 8,192-token prompt with 1,024-token
chosen and rejected replies through 04_train_dpo's preference_dataset and build_trainer
(configs/llama3-8b/review/04_train_dpo.yaml, max_length 9,216) against TRL's DPOTrainer defaults; both
on the model as a PeftModel, so TRL adds its frozen `ref` copy of the adapter. review_gen: greedy
review generation with common.fast.static_decoder.decode, 8,192-token prompt, 1,024 new tokens, at batch 1, 2,
4, 8, 16 (up to the first out-of-memory). Training rows run one micro-batch per optimiser step
(gradient accumulation 1): memory and tokens/s are those of a micro-batch of the recipe.
"""
from __future__ import annotations

import argparse
import contextlib
import fnmatch
import gc
import importlib
import json
import math
import os
import platform
import random
import shutil
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

START = time.time()

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from common.config import DPOStageConfig, GRPOStageConfig, RewardStageConfig, SFTStageConfig  # noqa: E402
from common.provenance import bench_commit  # noqa: E402
from common.tasks import cmv  # noqa: E402
from common.trl_compat import attn_implementation  # noqa: E402

TINY_MODEL = REPO / ".cache" / "models" / "tiny-llama3"
LENGTHS = REPO / "bench" / "results" / "2026-11-30_5e9908e" / "cmv_lengths.json"  # the lengths every run measured on
GIB = 2 ** 30
MODEL_LORA_DROPOUT = 0.05  # the models are loaded once, with ModelArgs' default; rows set their own (lever)
PROFILE_DIR: Path | None = None  # --profile: where each training row's kernel table goes
REVIEW_PROMPT, REVIEW_REPLY = 8192, 1024  # review_gen: a paper's first window, one review
REVIEW_SFT_TARGETS = {"llama3-8b": 16.0, "llama31-8b": 24.0}  # GiB targets: 8,192 and 20,480 tokens
# The pipeline's rows: each recipe as it is, then one lever changed (which attention, the layer inputs
# in CPU memory, the reference log-probs precomputed once before training).
# The SFT rows at 20,480 tokens: the recipe (cuDNN attention, every saved layer input in CPU memory),
# then one lever changed: part of the saved inputs kept on the GPU, none offloaded, MLPs in pieces (a
# small GPU), SDPA's flash kernel instead of cuDNN's.
REVIEW_SFT_SETTINGS = [("llama3-8b", "ours", {}),
                       ("llama31-8b", "ours", {}),
                       # the levers as written (memory_levers as_set), one changed
                       ("llama31-8b", "ours_offload_all", {"memory_levers": "as_set"}),
                       ("llama31-8b", "ours_keep_3gib", {"memory_levers": "as_set", "offload_keep_gib": 3.0}),
                       ("llama31-8b", "ours_no_offload", {"memory_levers": "as_set", "offload_activations": False}),
                       ("llama31-8b", "ours_chunks", {"memory_levers": "as_set", "mlp_chunk_tokens": 4096}),
                       ("llama31-8b", "ours_flash", {"cudnn_attention": False}),
                       # memory_levers fit within a smaller GPU's budget
                       ("llama31-8b", "ours_fit_12gib", {"memory_budget_gib": 12.0}),
                       ("llama31-8b", "ours_fit_12gib_attention_kept",
                        {"memory_budget_gib": 12.0, "keep_attention_outputs": True}),
                       ("llama31-8b", "ours_fit_24gib", {"memory_budget_gib": 24.0})]
REVIEW_DPO_SETTINGS = [("llama3-8b", "ours", {}),
                       ("llama3-8b", "ours_sdpa", {"one_sequence_attention": "sdpa"}),
                       ("llama3-8b", "ours_offload", {"memory_levers": "as_set", "offload_activations": True}),
                       ("llama3-8b", "ours_precomputed_ref", {"precompute_ref_log_probs": True}),
                       ("llama31-8b", "ours", {}),
                       ("llama31-8b", "ours_sdpa", {"one_sequence_attention": "sdpa"}),
                       ("llama31-8b", "ours_offload_all", {"memory_levers": "as_set"}),
                       ("llama31-8b", "ours_keep_3gib", {"memory_levers": "as_set", "offload_keep_gib": 3.0}),
                       ("llama31-8b", "ours_no_levers", {"memory_levers": "as_set", "offload_activations": False}),
                       ("llama31-8b", "ours_fit_12gib", {"memory_budget_gib": 12.0}),
                       ("llama31-8b", "ours_fit_12gib_attention_kept",
                        {"memory_budget_gib": 12.0, "keep_attention_outputs": True}),
                       ("llama31-8b", "ours_fit_24gib", {"memory_budget_gib": 24.0})]
REVIEW_DPO_TARGETS = {"llama3-8b": 12.0, "llama31-8b": 16.0}  # GiB: 7,168 and 19,456-token prompts
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, bos_token_id=128000,
                 eos_token_id=128009, max_position_embeddings=131072, tie_word_embeddings=False)


def stage(filename: str):
    """A stage script as a module (its build_trainer and datasets), e.g. stage("02_train_sft.py")."""
    return importlib.import_module(Path(filename).stem)


# --- the length distribution of the real data ----------------------------------------------------

def make_lengths(path: Path = LENGTHS) -> dict:
    """Token lengths of the bundled ChangeMyView pairs as the stages cut them (prompt <= 512 tokens,
    prompt + reply <= 768), approximated as ceil(words x 1.3) (no Llama tokenizer here) plus the
    Llama 3 chat template's tokens (5 around the prompt, 1 closing the reply)."""
    from common.data import read_jsonl
    from common.tasks.cmv import to_pair
    pairs = [p for p in (to_pair(r, w, 470) for w, r in read_jsonl(REPO / "data/cmv/cmv_pairs.jsonl.gz"))
             if isinstance(p, dict)]
    words = lambda s: math.ceil(1.3 * len(s.split()))  # noqa: E731
    out = {"method": "ceil(1.3 x words) + chat-template tokens; prompt cut at 512, prompt + reply at 768",
           "source": "data/cmv/cmv_pairs.jsonl.gz (all pairs, premise cut at 470 words as stage 01)",
           "sft": [], "reward": [], "prompts": []}
    seen = set()
    for p in pairs:
        prompt = min(512, words(p["prompt"][0]["content"]) + 5)
        reply = lambda text: min(words(text), 768 - prompt - 1) + 1  # noqa: E731
        out["sft"].append([prompt, reply(p["chosen"])])
        out["reward"].append([prompt, reply(p["chosen"]), reply(p["rejected"])])
        if p["group_id"] not in seen:
            seen.add(p["group_id"])
            out["prompts"].append(prompt)
    path.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    return out


# --- synthetic rows of given token lengths -------------------------------------------------------

class Words:
    """Text of an exact token length for the stand-in tokenizer: one word repeated."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.word_id = tokenizer(" the", add_special_tokens=False)["input_ids"][0]
        empty = tokenizer.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True,
                                              tokenize=True)
        self.prompt_overhead = len(empty["input_ids"] if hasattr(empty, "keys") else empty)

    @staticmethod
    def text(n: int, word: str = "the") -> str:
        """n tokens of `word` ("the" or "a": one token each, with or without the space before it)."""
        return (word + f" {word}" * (n - 1)) if n > 0 else ""

    def prompt(self, n_tokens: int) -> list[dict]:
        return [{"role": "user", "content": self.text(max(1, n_tokens - self.prompt_overhead))}]


def scale(lengths, factor):
    return [[max(2, int(x * factor)) for x in row] if isinstance(row, list) else max(2, int(row * factor))
            for row in lengths]


def step_batches(items, batch, n_steps, grouped, seed, key=sum):
    """n_steps optimiser-step batches (of `batch` examples), drawn at random from one epoch over all
    `items` as the sampler forms them: transformers' LengthGroupedSampler (grouped) or random order."""
    from transformers.trainer_pt_utils import get_length_grouped_indices
    g = torch.Generator().manual_seed(seed)
    if grouped:
        order = get_length_grouped_indices([key(x) for x in items], batch, generator=g)
    else:
        order = torch.randperm(len(items), generator=g).tolist()
    steps = [order[i:i + batch] for i in range(0, len(order) - batch + 1, batch)]
    chosen = random.Random(seed).sample(steps, min(n_steps, len(steps)))
    return [items[i] for step in chosen for i in step]


def budget_steps(items, rows, budget, grad_accum, n_steps, seed, key=sum):
    """max_tokens_per_batch: n_steps optimiser steps (grad_accum micro-batches each), drawn at random from
    one epoch over all `items` as the pipeline's TokenBudgetBatchSampler forms them. The trainer packs
    these examples again and gets the same micro-batches: each is a run of the length-sorted order."""
    from common.fast.token_budget import TokenBudgetBatchSampler
    order = list(TokenBudgetBatchSampler([key(x) for x in items], rows, budget, seed))
    steps = [order[i:i + grad_accum] for i in range(0, len(order) - grad_accum + 1, grad_accum)]
    chosen = random.Random(seed).sample(steps, min(n_steps, len(steps)))
    return [items[i] for step in chosen for micro in step for i in micro]


# --- measuring -----------------------------------------------------------------------------------

# TRL's configs default to bf16; without a GPU its rows run fp32 on the CPU. Not tied to --tiny: on a GPU
# the tiny model is loaded there, and `use_cpu` would hand its batches over on the CPU.
CPU_ONLY = {} if torch.cuda.is_available() else {"bf16": False, "use_cpu": True}


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def mem_reset():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(trained: dict | None = None):
    """The peak of allocated memory since `mem_reset` (GiB; None without a GPU). A row trained through the
    stages' `train()` passes its metrics: train() resets the counter at every step and keeps the run's peak
    (`gpu_peak_gib`), so the row's peak is the larger of the two."""
    if not torch.cuda.is_available():
        return None
    return max(torch.cuda.max_memory_allocated() / GIB, (trained or {}).get("gpu_peak_gib") or 0.0)


def step_parts(step_seconds: list[float], timing: dict, steps_per_rollout: int = 1) -> dict:
    """Where a GRPO step's time goes, averaged over the steps after the first rollout's (its warm-up): the
    rollout (prefill + decode), the judge's scoring, and the rest (the update and TRL's bookkeeping). With
    `steps_per_rollout` optimiser steps sharing a generation batch (steps_per_generation), its time is
    spread over them."""
    k = steps_per_rollout
    step_seconds = [sum(step_seconds[i:i + k]) / k for i in range(0, len(step_seconds) - k + 1, k)]
    timing = {**timing, "rollout_s": [s / k for s in timing["rollout_s"]],
              "reward_s": [s / k for s in timing["reward_s"]]}
    n = len(step_seconds)
    later = slice(1, None) if n > 1 else slice(None)
    per_step = max(len(timing["reward_s"]) // max(n, 1), 1)  # score calls a step
    rollout = timing["rollout_s"][later]
    scoring = [sum(timing["reward_s"][i * per_step:(i + 1) * per_step]) for i in range(n)][later]
    steps = step_seconds[later]
    mean = lambda xs: round(sum(xs) / len(xs), 3) if xs else None  # noqa: E731
    return {"rollout_s": mean(rollout), "scoring_s": mean(scoring),
            "update_and_rest_s": mean([s - r - c for s, r, c in zip(steps, rollout, scoring)])}


class StepClock(TrainerCallback):
    """Each optimiser step's end time (the training stages record memory per step themselves)."""
    def __init__(self):
        self.times = []

    def on_step_end(self, args, state, control, **kwargs):
        sync()
        self.times.append(time.perf_counter())


class StepProfile(TrainerCallback):
    """--profile: torch.profiler over optimiser steps 2 and later (step 1 selects kernels), written as a
    table of GPU kernels (self time) and of the operators that launched them, with the share of the
    steps' wall time the GPU was busy."""
    def __init__(self, path: Path):
        self.path, self.prof, self.t0 = path, None, None

    def on_step_end(self, args, state, control, **kwargs):
        if self.prof is None and state.global_step == 1:
            from torch.profiler import ProfilerActivity, profile
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = profile(activities=acts, record_shapes=False)
            self.prof.__enter__()
            self.t0 = time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs):
        if self.prof is None:
            return
        sync()
        wall = time.perf_counter() - self.t0
        self.prof.__exit__(None, None, None)
        write_profile(self.prof, wall, self.path)


def write_profile(prof, wall_s, path: Path):
    events = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / 1e6
    path.parent.mkdir(parents=True, exist_ok=True)
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    path.write_text(f"wall {wall_s:.3f} s, GPU kernels {gpu:.3f} s ({gpu / max(wall_s, 1e-9):.0%} busy)\n\n"
                    + events.table(sort_by=sort, row_limit=40, max_name_column_width=90) + "\n\nby CPU time:\n"
                    + events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=90) + "\n")
    print(f"profile: {path} (GPU busy {gpu / max(wall_s, 1e-9):.0%})", flush=True)


def count_tokens(trainer, sink):
    """Wrap the collator: real (non-pad) and padded tokens of every micro-batch, in order."""
    collate = trainer.data_collator

    def wrapped(examples):
        batch = collate(examples)
        ids = batch["input_ids"]
        real = int(batch["attention_mask"].sum()) if "attention_mask" in batch else ids.numel()
        ran = real if getattr(trainer.model, "padding_free", False) else ids.numel()  # the model runs no padding
        sink.append((real, ran, len(ids)))
        return batch
    trainer.data_collator = wrapped


@contextlib.contextmanager
def lever(model, ours: bool, lora_dropout: float | None = None):
    """One row's setting. TRL rows run PyTorch's defaults (cuDNN attention on; `fast.apply` sets it for
    the pipeline's rows from their `cudnn_attention`, process-wide, so it is set back here).
    lora_dropout: the LoRA layers' dropout for this row only (the model is loaded once)."""
    if not ours:
        torch.backends.cuda.enable_cudnn_sdp(True)
    saved = {}
    if lora_dropout is not None:
        for name, module in model.named_modules():
            if isinstance(getattr(module, "lora_dropout", None), torch.nn.ModuleDict) and "default" in module.lora_dropout:
                saved[name] = module.lora_dropout["default"]
                module.lora_dropout["default"] = torch.nn.Dropout(lora_dropout) if lora_dropout else torch.nn.Identity()
    try:
        yield
    finally:
        for name, module in model.named_modules():
            if name in saved:
                module.lora_dropout["default"] = saved[name]


def fresh_adapter(model):
    """A new LoRA adapter on the same 4-bit base, so that every variant starts alike."""
    for module in model.modules():
        if hasattr(module, "reset_lora_parameters") and "default" in getattr(module, "lora_A", {}):
            module.reset_lora_parameters("default", True)
    model.zero_grad(set_to_none=True)
    base = model.get_base_model()
    if getattr(base, "is_activation_checkpointing", getattr(base, "is_gradient_checkpointing", False)):
        base.gradient_checkpointing_disable()


def train_run(trainer, micro_per_step, pipeline, warmup_steps=1):
    """Train; tokens/s over the steps after the first `warmup_steps` (kernel selection, allocator)."""
    tokens, clock = [], StepClock()
    count_tokens(trainer, tokens)
    trainer.add_callback(clock)
    if PROFILE_DIR is not None:
        trainer.add_callback(StepProfile(PROFILE_DIR / f"{Path(trainer.args.output_dir).parent.name}.txt"))
    trainer.args.train_sampling_strategy = "sequential"  # the batches were drawn by step_batches
    mem_reset()
    sync()
    start = time.perf_counter()
    trained = None
    if pipeline:  # through the stages' train(): its right-padding, offload and Liger settings apply
        from common.training import train
        trained = train(trainer, bench_run(Path(trainer.args.output_dir).parent))
    else:
        trainer.train()
    peak = peak_gib(trained)
    w = min(warmup_steps, len(clock.times) - 1)
    t0 = clock.times[w - 1] if w > 0 else start
    measured = tokens[w * micro_per_step: len(clock.times) * micro_per_step]
    seconds = clock.times[-1] - t0
    real, padded = sum(m[0] for m in measured), sum(m[1] for m in measured)
    return {"steps_timed": len(clock.times) - w, "seconds": round(seconds, 3), "warmup_s": round(t0 - start, 2),
            "real_tokens": real, "padded_tokens": padded, "real_share": round(real / max(padded, 1), 3),
            "rows_per_micro_batch": round(sum(m[2] for m in measured) / max(len(measured), 1), 2),
            "padded_tokens_per_micro_batch": round(padded / max(len(measured), 1)),
            "tokens_per_s": round(real / seconds, 1), "peak_gib": peak}


def bench_run(path: Path, task: str = "cmv"):
    """What the stages' build_trainer and train() need of a run, without a run directory's records."""
    return SimpleNamespace(dir=path, manifest={}, save_manifest=lambda: None, task=task, is_main=True)


# --- the bench -----------------------------------------------------------------------------------

class Bench:
    def __init__(self, args):
        self.args, self.tiny = args, args.tiny
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(args.work)
        self.start = START  # the deadline counts the model build too
        self.results = {"meta": meta(args), "rows": [], "errors": []}
        self.lengths = json.loads(LENGTHS.read_text()) if LENGTHS.is_file() else make_lengths()
        f = 1 / 8 if self.tiny else 1.0  # tiny: lengths / 8 (CPU)
        self.f = f
        self.sft_lengths = scale(self.lengths["sft"], f)
        self.reward_lengths = scale(self.lengths["reward"], f)
        self.prompt_lengths = scale(self.lengths["prompts"], f)
        self.max_prompt, self.max_length = int(512 * f), int(768 * f)
        self.steps = 2 if self.tiny else args.steps
        self.review_steps = 2 if self.tiny else getattr(args, "review_steps", 4)  # the first is not timed
        self.sft_mod, self.grpo_mod = stage("02_train_sft.py"), stage("04_train_grpo.py")
        self.model_path = str(TINY_MODEL if self.tiny else args.model)
        self.other_resident = 0.0  # GiB of another stage's model kept on the GPU meanwhile

    def left(self):
        return self.args.deadline - (time.time() - self.start)

    def record(self, row):
        row["at_s"] = round(time.time() - self.start, 1)
        if row.get("peak_gib") is not None:
            row["peak_gib_raw"] = round(row["peak_gib"], 3)
            row["peak_gib"] = round(row["peak_gib"] - self.other_resident, 3)
        self.results["rows"].append(row)
        print("RESULT", json.dumps(row), flush=True)
        self.save()

    def save(self):
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1) + "\n")

    def guarded(self, name, fn, need_s=0):
        if getattr(self.args, "rows", "") and not any(fnmatch.fnmatch(name, part) for part in self.args.rows.split(",")):
            return
        if self.left() < need_s:
            self.results["errors"].append({"name": name, "error": f"skipped: {self.left():.0f} s left"})
            print(f"SKIP {name}", flush=True)
            return
        print(f"=== {name} ({self.left():.0f} s left)", flush=True)
        try:
            fn()
        except Exception as err:  # one failed measurement must not cost the others
            traceback.print_exc()
            self.results["errors"].append({"name": name, "error": f"{type(err).__name__}: {err}"[:2000]})
            self.save()
        finally:
            mem_reset()

    def config(self, cls, yaml_name, recipe="llama3-8b", **over):
        """A recipe's config for a stage (default llama3-8b, its fast settings), with the bench's
        overrides. The bench feeds the trainers itself: its input runs are placeholders."""
        import dataclasses

        from common.cli import parse_config
        argv = ["--config", str(REPO / "configs" / recipe / yaml_name), "--model_name_or_path", self.model_path,
                "--report_to", "none", "--save_steps", "1000000", "--logging_steps", "1000000"]
        inputs = ("pairs_run", "reward_run") if cls.STAGE == "SFT" else ("pairs_run", "sft_run", "reward_run")
        for name in inputs:  # SFT's sft_run is RAFT's start, no input an SFT needs
            if name in {f.name for f in dataclasses.fields(cls)}:
                argv += [f"--{name}", "bench"]
        for key, value in over.items():
            argv += [f"--{key}", json.dumps(value) if not isinstance(value, str) else value]
        return parse_config(cls, argv)[0]

    def scaled_budget(self, yaml_name, per_device, ours) -> dict:
        """The recipe's max_tokens_per_batch for these rows: --tiny scales it as it scales the lengths (/ 8)
        and the examples a micro-batch (4 for the recipe's 8). TRL's rows run without one."""
        budget = self.config(SFTStageConfig if yaml_name.startswith("02") else RewardStageConfig,
                             yaml_name).max_tokens_per_batch
        if not ours or not budget:
            return {}
        return {"max_tokens_per_batch": int(budget * self.f * per_device / 8)}

    def run_dir(self, name, task="cmv"):
        path = self.work / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return bench_run(path, task)

    # SFT -----------------------------------------------------------------------------------------
    def sft_rows(self, lengths):
        return [{"prompt": self.words.prompt(p), "chosen": Words.text(r - 1)} for p, r in lengths]

    def sft(self, name, kind, lengths, ours, lora_dropout=None, **over):
        import trl
        per_device = 4 if self.tiny else 8
        cfg = self.config(SFTStageConfig, "02_train_sft.yaml", max_steps=self.steps,
                          max_prompt_tokens=self.max_prompt, max_length=self.max_length,
                          per_device_train_batch_size=per_device,
                          **self.scaled_budget("02_train_sft.yaml", per_device, ours), **over)
        ga = cfg.gradient_accumulation_steps if ours else 1
        budget = cfg.max_tokens_per_batch if ours else 0
        if kind != "real":
            items = lengths
        elif budget:  # the recipe's token-budget micro-batches
            items = budget_steps(lengths, 1, budget, ga, self.steps, seed=1)
        else:
            items = step_batches(lengths, per_device * ga, self.steps, ours and cfg.group_by_length, seed=1)
        rows = self.sft_rows(items)
        fresh_adapter(self.policy)
        run = self.run_dir(name)
        if ours:
            trainer = self.sft_mod.build_trainer(cfg, run, self.policy, self.tokenizer, rows, [])
        else:  # TRL's defaults, same model and data
            args = trl.SFTConfig(output_dir=str(run.dir / "checkpoints"), max_length=cfg.max_length,
                                 max_steps=self.steps, report_to="none", save_strategy="no", disable_tqdm=True,
                                 per_device_train_batch_size=cfg.per_device_train_batch_size, **CPU_ONLY)
            trainer = trl.SFTTrainer(model=self.policy, args=args, processing_class=self.tokenizer,
                                     train_dataset=self.sft_mod.sft_dataset(rows, self.tokenizer, cfg, cmv))
        dropout = (cfg.lora_dropout if lora_dropout is None else lora_dropout) if ours else None
        with lever(self.policy, ours, dropout):
            r = train_run(trainer, ga, ours)
        _remove_offload_hooks(self.policy)
        self.record({"stage": "sft", "name": name, "setting": "ours" if ours else "trl", "batches": kind,
                     "cudnn_attention": cfg.cudnn_attention or not ours,
                     "lora_dropout": MODEL_LORA_DROPOUT if dropout is None else dropout,
                     "per_device": None if budget else cfg.per_device_train_batch_size, "max_tokens_per_batch": budget,
                     "pad_to_multiple_of": cfg.pad_to_multiple_of if ours else 0,
                     "grad_accum": ga, "checkpointing": cfg.gradient_checkpointing,
                     "offload_activations": bool(cfg.offload_activations and ours),
                     "memory_plan": run.manifest.get("memory_plan"),
                     "group_by_length": bool(budget) or (cfg.group_by_length and ours),
                     "liger": cfg.liger_kernel and ours, **r})
        del trainer

    # whole-paper training --------------------------------------------------------------------------
    def long(self, ours, **over):
        import trl
        n = 512 if self.tiny else self.args.long_tokens
        reply = n // 48
        cfg = self.config(SFTStageConfig, "02_train_sft.yaml", max_steps=3,
                          max_prompt_tokens=n - reply, max_length=n, per_device_train_batch_size=1,
                          gradient_accumulation_steps=1, offload_activations=ours, **over)
        rows = self.sft_rows([[n - reply, reply - 1]] * 3)
        fresh_adapter(self.policy)
        run = self.run_dir("long")
        if ours:
            trainer = self.sft_mod.build_trainer(cfg, run, self.policy, self.tokenizer, rows, [])
        else:
            args = trl.SFTConfig(output_dir=str(run.dir / "checkpoints"), max_length=n, max_steps=3,
                                 per_device_train_batch_size=1, report_to="none", save_strategy="no",
                                 disable_tqdm=True, **CPU_ONLY)
            trainer = trl.SFTTrainer(model=self.policy, args=args, processing_class=self.tokenizer,
                                     train_dataset=self.sft_mod.sft_dataset(rows, self.tokenizer, cfg, cmv))
        with lever(self.policy, ours):  # TRL's rows: PyTorch's attention defaults
            r = train_run(trainer, 1, ours)
        self.record({"stage": "long", "name": f"long_{n}_{'ours' if ours else 'trl'}" + ("_chunked" if
                     cfg.mlp_chunk_tokens else ""), "setting": "ours" if ours else "trl", "tokens": n,
                     "offload_activations": ours, "liger": cfg.liger_kernel and ours,
                     "mlp_chunk_tokens": cfg.mlp_chunk_tokens, **r})
        del trainer
        _remove_offload_hooks(self.policy)
        _remove_mlp_chunking(self.policy)

    # eval generation -------------------------------------------------------------------------------
    def evalgen(self, ours):
        import yaml

        import common.generation as gen
        cfg = SimpleNamespace(batch_size=16, repetition_penalty=1.0)
        cfg.__dict__.update(yaml.safe_load((REPO / "configs/llama3-8b/05_eval.yaml").read_text()))
        n, new = (cfg.batch_size, 256) if ours else (16, 64)
        if self.tiny:
            n, new = 4, 8
        lengths = random.Random(2).sample(self.prompt_lengths, n)
        prompts = [self.words.prompt(p) for p in lengths]
        fresh_adapter(self.policy)
        gen.generate_replies(self.policy, self.tokenizer, prompts[:2], 4, cfg.batch_size, static=ours)  # warm-up
        mem_reset()
        sync()
        t = time.perf_counter()
        gen.generate_replies(self.policy, self.tokenizer, prompts, new, cfg.batch_size if ours else 16,
                             cfg.repetition_penalty, static=ours)
        sync()
        seconds = time.perf_counter() - t
        self.policy.train()
        self.record({"stage": "eval", "name": "eval_" + ("ours" if ours else "trl"), "setting": "ours" if ours
                     else "trl", "backend": "static+cuda-graph" if ours else "hf-generate",
                     "sequences": n, "batch": cfg.batch_size if ours else 16, "new_tokens_each": new,
                     "seconds": round(seconds, 3), "new_tokens_per_s": round(n * new / seconds, 1),
                     "peak_gib": peak_gib()})

    # review shapes (the paper-review task) ---------------------------------------------------------
    def review_sft(self, recipe, setting, **over):
        """One SFT sequence of the recipe's max_length (a paper window or the whole paper + a review):
        02's build_trainer with the review task and the recipe's levers (`over` on top), or (`setting`
        trl) TRL's SFTTrainer defaults."""
        import trl

        from common.tasks import review
        base = self.config(SFTStageConfig, "review/02_train_sft.yaml", recipe)
        n_full = base.max_length
        ours = setting != "trl"
        over = {"max_steps": self.review_steps, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 1,
                **over}
        if self.tiny:  # lengths / 8 (CPU)
            over.update(max_length=n_full // 8, max_prompt_tokens=base.max_prompt_tokens // 8,
                        window_overlap=base.window_overlap // 8,
                        mlp_chunk_tokens=over.get("mlp_chunk_tokens", base.mlp_chunk_tokens) // 8)
        cfg = self.config(SFTStageConfig, "review/02_train_sft.yaml", recipe, **over)
        reply = int(REVIEW_REPLY * self.f)
        # A paper longer than the window: each example is one full window (sliding_window) or the paper
        # cut to fit (whole), with the whole review: max_length tokens, as real long papers give.
        rows = [{"id": f"paper{i}", "paper": Words.text(cfg.max_length), "chosen": Words.text(reply - 1)}
                for i in range(self.review_steps)]
        fresh_adapter(self.policy)
        run = self.run_dir(f"review_sft_{n_full}", task="review")
        try:
            if ours:
                trainer = self.sft_mod.build_trainer(cfg, run, self.policy, self.tokenizer, rows, [])
            else:  # TRL's defaults, same model and data; max_length so that nothing is cut, batch 1
                args = trl.SFTConfig(output_dir=str(run.dir / "checkpoints"), max_length=cfg.max_length,
                                     max_steps=self.review_steps, per_device_train_batch_size=1, report_to="none",
                                     save_strategy="no", disable_tqdm=True, **CPU_ONLY)
                trainer = trl.SFTTrainer(model=self.policy, args=args, processing_class=self.tokenizer,
                                         train_dataset=self.sft_mod.sft_dataset(rows, self.tokenizer, cfg, review))
            with lever(self.policy, ours):  # TRL's rows: PyTorch's attention defaults
                r = train_run(trainer, 1, ours)
        finally:
            if ours:
                _remove_offload_hooks(self.policy)
                _remove_mlp_chunking(self.policy)
        target = REVIEW_SFT_TARGETS[recipe]
        self.record({"stage": "review_sft", "name": f"review_sft_{n_full}_{setting}",
                     "setting": setting, "batches": str(n_full), "recipe": recipe,
                     "max_length": cfg.max_length, "input_strategy": cfg.input_strategy,
                     "sequence_tokens": r["real_tokens"] // max(r["steps_timed"], 1), "grad_accum": 1,
                     "checkpointing": cfg.gradient_checkpointing, "memory_plan": run.manifest.get("memory_plan"),
                     "offload_activations": bool(cfg.offload_activations and ours),
                     "offload_keep_gib": cfg.offload_keep_gib if ours and cfg.offload_activations else None,
                     "patches": run.manifest.get("patches"),
                     "cudnn_attention": cfg.cudnn_attention or not ours,
                     "mlp_chunk_tokens": cfg.mlp_chunk_tokens if ours else 0,
                     "liger": bool(cfg.liger_kernel and ours), "target_gib": target, **r,
                     "target_met": None if r["peak_gib"] is None else r["peak_gib"] < target})
        del trainer

    def review_dpo(self, recipe, setting, **over):
        """DPO steps on one pair each: the recipe's prompt (llama3-8b: 7,168 tokens; llama31-8b: 19,456)
        with chosen and rejected replies of max_length - prompt tokens (1,024). `setting` trl: TRL's
        DPOTrainer defaults (two sequences per pair); otherwise 04_train_dpo's preference_dataset and
        build_trainer with the recipe (shared prompt, its levers) and `over` on top. Both get the policy
        as a PeftModel, so TRL adds its frozen `ref` copy of the adapter. Tokens/s count 2 x (prompt +
        reply) per pair for every setting, TRL's work."""
        import trl

        from common.data import fit_prompt, template_closing_tokens
        from common.model import unwrap_peft
        dpo = stage("04_train_dpo.py")
        base = self.config(DPOStageConfig, "review/04_train_dpo.yaml", recipe)
        P, R = int(base.max_prompt_tokens * self.f), int((base.max_length - base.max_prompt_tokens) * self.f)
        # three untimed steps: FlexAttention compiles (policy and reference pass, the first shape, then
        # dynamic shapes) once per process; its seconds are in the row as warmup_s
        steps = self.review_steps + 2
        over = {"max_steps": steps, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 1,
                "max_prompt_tokens": P, "max_length": P + R, **over}
        if self.tiny:
            over["mlp_chunk_tokens"] = base.mlp_chunk_tokens // 8
        cfg = self.config(DPOStageConfig, "review/04_train_dpo.yaml", recipe, **over)
        ours = setting != "trl"
        # Papers differ in length: each step's prompt is 1/64 of P shorter than the one before (a new
        # shape every step, as in a real run), the replies R tokens each (with their end of turn).
        prompts = [fit_prompt(self.tokenizer, self.words.prompt(P - i * (P // 64)), cfg.max_prompt_tokens)
                   for i in range(steps)]
        text = Words.text(R - template_closing_tokens(self.tokenizer, prompts[0]))
        rows = [{"id": f"paper{i}", "chosen": text, "rejected": text} for i in range(steps)]
        data = dpo.preference_dataset(rows, prompts, [None] * len(rows), self.tokenizer, cfg)
        dtypes = {name: p.dtype for name, p in self.policy.named_parameters() if "lora_" in name}
        fresh_adapter(self.policy)
        run = self.run_dir(f"review_dpo_{P}_{setting}", task="review")
        model = unwrap_peft(self.policy)
        loaded_attn = attn_implementation(model)
        built_s = None
        try:
            if ours:
                t = time.perf_counter()
                trainer = dpo.build_trainer(cfg, run, self.policy, self.tokenizer, data)
                built_s = round(time.perf_counter() - t, 2)  # includes the reference pass when precomputed
            else:
                args = trl.DPOConfig(output_dir=str(run.dir / "checkpoints"), max_length=cfg.max_length,
                                     max_steps=steps, per_device_train_batch_size=1, report_to="none",
                                     save_strategy="no", disable_tqdm=True, **CPU_ONLY)
                trainer = trl.DPOTrainer(model=self.policy, args=args, train_dataset=data,
                                         processing_class=self.tokenizer)
            ref_adapter = "ref" in self.policy.peft_config
            with lever(self.policy, ours):  # TRL's rows: PyTorch's attention defaults
                r = train_run(trainer, 1, ours, warmup_steps=3)
            del trainer
        finally:  # the next trainer gets the model as it was: no `ref` adapter, LoRA in its own dtype
            if "ref" in self.policy.peft_config:
                self.policy.delete_adapter("ref")
            self.policy.set_adapter("default")
            for name, p in self.policy.named_parameters():
                if name in dtypes and p.dtype != dtypes[name]:
                    p.data = p.data.to(dtypes[name])
            if attn_implementation(model) != loaded_attn:
                model.set_attn_implementation(loaded_attn)
            if ours:
                _remove_offload_hooks(self.policy)
                _remove_mlp_chunking(self.policy)
        timed = max(r["steps_timed"], 1)
        target = REVIEW_DPO_TARGETS[recipe]
        self.record({"stage": "review_dpo", "name": f"review_dpo_{P}_{setting}", "setting": setting,
                     "batches": f"{P}+2x{R}", "recipe": recipe, "prompt_tokens": P, "reply_tokens": R,
                     "max_length": cfg.max_length, "sequence_tokens": r["real_tokens"] // (2 * timed),
                     "pair_in_one_sequence": bool(ours and cfg.pair_in_one_sequence), "attn_implementation":
                     run.manifest.get("one_sequence_attention", loaded_attn), "ref_adapter": ref_adapter,
                     "precompute_ref_log_probs": bool(ours and cfg.precompute_ref_log_probs),
                     "trainer_build_s": built_s, "seconds_per_step": round(r["seconds"] / timed, 3),
                     "grad_accum": 1, "checkpointing": cfg.gradient_checkpointing,
                     "memory_plan": run.manifest.get("memory_plan"),
                     "offload_activations": bool(cfg.offload_activations and ours),
                     "patches": run.manifest.get("patches"),
                     "mlp_chunk_tokens": cfg.mlp_chunk_tokens if ours else 0,
                     "liger": bool(cfg.liger_kernel and ours), "target_gib": target, **r,
                     "target_met": None if r["peak_gib"] is None else r["peak_gib"] <= target})

    def review_gen(self, reserve_s=0.0):
        """Greedy review generation with the pipeline's decoder (common.fast.static_decoder.decode, as stage 05
        and 04_train_dpo's rejected replies run it): an 8,192-token prompt and 1,024 new tokens at
        batch 1, 2, 4, ..., up to the first out-of-memory; new tokens/s (prefill included) and peak.
        `reserve_s`: seconds kept for the rows that follow."""
        import common.fast.static_decoder as gen
        from common.data import token_ids
        from common.model import eos_ids
        P, new = (int(REVIEW_PROMPT * self.f), 16) if self.tiny else (REVIEW_PROMPT, REVIEW_REPLY)
        batches = [int(b) for b in (self.args.review_gen_batches if not self.tiny else "1,2,4").split(",")]
        ids = token_ids(self.tokenizer.apply_chat_template(self.words.prompt(P), add_generation_prompt=True,
                                                           tokenize=True))
        fresh_adapter(self.policy)
        self.policy.eval()
        eos, pad = eos_ids(self.policy, self.tokenizer), self.tokenizer.pad_token_id
        capture, marks = gen._capture, {}

        def timed_capture(step, state):  # decode calls it once the prefill is done (CUDA graphs only)
            sync()
            marks["prefill_done"] = time.perf_counter()
            return capture(step, state)
        gen._capture = timed_capture
        done = []
        try:
            gen.decode(self.policy, [ids[:64]] * 2, 8, eos, pad, temperature=0.0)  # warm-up: kernels, allocator
            for b in batches:
                if done:  # prefill grows with the batch, a decode step much less
                    last = done[-1]
                    estimate = 2 * (last["prefill_s"] or 0) + 1.5 * (last["seconds"] - (last["prefill_s"] or 0))
                    if self.left() - reserve_s < estimate:
                        self.results["errors"].append({"name": f"review gen batch {b}", "error":
                                                       f"skipped: {self.left():.0f} s left, {reserve_s:.0f} s kept "
                                                       f"for later rows, about {estimate:.0f} s needed"})
                        print(f"SKIP review gen batch {b}", flush=True)
                        break
                mem_reset()
                marks.clear()
                oom, out = None, None
                sync()
                t = time.perf_counter()
                try:
                    out = gen.decode(self.policy, [ids] * b, new, eos, pad, temperature=0.0)
                    sync()
                except torch.OutOfMemoryError as err:
                    oom = f"{type(err).__name__}: {err}"[:300]
                seconds = time.perf_counter() - t
                peak = peak_gib()
                if oom:
                    out = None
                    mem_reset()  # free what the failed batch held before anything else runs
                    self.record({"stage": "review_gen", "name": f"review_gen_b{b}", "setting": "ours", "batch": b,
                                 "prompt_tokens": len(ids), "new_tokens_each": new, "oom": True, "error": oom,
                                 "peak_gib": peak})
                    break
                n_new = sum(len(o) for o in out)
                prefill = marks["prefill_done"] - t if "prefill_done" in marks else None
                row = {"stage": "review_gen", "name": f"review_gen_b{b}", "setting": "ours", "batch": b,
                       "backend": "static+cuda-graph" if "prefill_done" in marks else "static, eager steps",
                       "prompt_tokens": len(ids), "new_tokens_each": new, "new_tokens": n_new,
                       "stopped_early": sum(len(o) < new for o in out), "seconds": round(seconds, 3),
                       "prefill_s": None if prefill is None else round(prefill, 3),
                       "new_tokens_per_s": round(n_new / seconds, 1),
                       "decode_ms_per_step": None if prefill is None else
                       round(1000 * (seconds - prefill) / max(new - 1, 1), 2),
                       "peak_gib": peak, "oom": False}
                self.record(row)
                done.append(row)
                del out
        finally:
            gen._capture = capture
            self.policy.train()
        if done:
            best = max(done, key=lambda r: r["new_tokens_per_s"])
            small = [r for r in done if r["peak_gib"] is not None and r["peak_gib"] < 24.0]
            self.results["review_gen_best"] = {
                "batch": best["batch"], "new_tokens_per_s": best["new_tokens_per_s"], "peak_gib": best["peak_gib"],
                "largest_batch_run": done[-1]["batch"],
                "oom_at": next((r["batch"] for r in self.results["rows"] if r["stage"] == "review_gen" and r.get("oom")),
                               None),
                "best_under_24_gib": None if not small else {
                    k: max(small, key=lambda r: r["new_tokens_per_s"])[k] for k in ("batch", "new_tokens_per_s", "peak_gib")}}
            self.save()
            print("review gen best", json.dumps(self.results["review_gen_best"]), flush=True)

    # reward ----------------------------------------------------------------------------------------
    def reward(self, name, kind, lengths, ours, lora_dropout=None, **over):
        import trl
        per_device = 4 if self.tiny else 8
        cfg = self.config(RewardStageConfig, "03_train_reward.yaml", max_steps=self.steps,
                          max_prompt_tokens=self.max_prompt, max_length=self.max_length,
                          per_device_train_batch_size=per_device,
                          **self.scaled_budget("03_train_reward.yaml", per_device, ours), **over)
        ga = cfg.gradient_accumulation_steps if ours else 1
        budget = cfg.max_tokens_per_batch if ours else 0
        longer = lambda x: x[0] + max(x[1], x[2])  # noqa: E731 (the longer reply sets the padding)
        if kind != "real":
            items = lengths
        elif budget and cfg.padding_free:  # budgeted in real tokens: both rows, no padding
            items = budget_steps(lengths, 0, budget, ga, self.steps, seed=3, key=lambda x: 2 * x[0] + x[1] + x[2])
        elif budget:  # the recipe's token-budget micro-batches: chosen and rejected rows
            items = budget_steps(lengths, 2, budget, ga, self.steps, seed=3, key=longer)
        else:
            items = step_batches(lengths, per_device * ga, self.steps, ours and cfg.group_by_length, seed=3,
                                 key=longer)
        # Replies of different words, as a pair's two replies differ from their first token: the shared
        # prompt (padding_free) then shares the prompt only.
        rows = [{"prompt": self.words.prompt(p), "chosen": Words.text(c - 1), "rejected": Words.text(j - 1, "a")}
                for p, c, j in items]
        fresh_adapter(self.judge_model)
        self.plain_judge()
        run = self.run_dir(name)
        from common.rewards import RewardScorer, preference_dataset
        scorer = RewardScorer(self.judge_model, self.tokenizer, cfg.max_prompt_tokens, cfg.max_length)
        data = preference_dataset(rows, scorer)  # encoded by the scorer, as stage 03 does
        if ours:
            from common import fast
            from common.runs import settle
            from common.training import trainer_args
            levers, run.manifest["memory_plan"] = fast.fit_memory(cfg, self.judge_model)
            settle(run, cfg, levers)  # as stage 03's build_trainer does
            args = trainer_args(trl.RewardConfig, cfg, run, max_length=cfg.max_length)
        else:
            args = trl.RewardConfig(output_dir=str(run.dir / "checkpoints"), max_length=cfg.max_length,
                                    max_steps=self.steps, report_to="none", save_strategy="no", disable_tqdm=True,
                                    per_device_train_batch_size=cfg.per_device_train_batch_size, **CPU_ONLY)
        trainer = trl.RewardTrainer(model=self.judge_model, args=args, processing_class=self.tokenizer,
                                    train_dataset=data)
        if ours:  # what stage 03's trainer gets
            fast.apply(trainer, cfg)
        dropout = (cfg.lora_dropout if lora_dropout is None else lora_dropout) if ours else None
        with lever(self.judge_model, ours, dropout):
            # FlexAttention (padding_free on a GPU) compiles for the first shapes: those steps are not timed
            r = train_run(trainer, ga, ours, warmup_steps=3 if cfg.padding_free and not self.tiny else 1)
        _remove_offload_hooks(self.judge_model)
        self.record({"stage": "reward", "name": name, "setting": "ours" if ours else "trl", "batches": kind,
                     "cudnn_attention": cfg.cudnn_attention or not ours,
                     "lora_dropout": MODEL_LORA_DROPOUT if dropout is None else dropout,
                     "pairs_per_device": None if budget else cfg.per_device_train_batch_size,
                     "max_tokens_per_batch": budget, "pad_to_multiple_of": cfg.pad_to_multiple_of if ours else 0,
                     "padding_free": cfg.padding_free and ours,
                     "grad_accum": ga, "checkpointing": cfg.gradient_checkpointing,
                     "offload_activations": bool(cfg.offload_activations and ours),
                     "memory_plan": run.manifest.get("memory_plan"),
                     "group_by_length": bool(budget) or (cfg.group_by_length and ours),
                     "liger": cfg.liger_kernel and ours, **r})
        del trainer

    def plain_judge(self):
        """Undo an earlier row's padding-free wrapper: the class's forward and SDPA again."""
        from common.model import unwrap_peft
        for attr in ("forward", "padding_free"):
            self.judge_model.__dict__.pop(attr, None)
        if attn_implementation(unwrap_peft(self.judge_model)) != "sdpa":
            unwrap_peft(self.judge_model).set_attn_implementation("sdpa")

    # GRPO ------------------------------------------------------------------------------------------
    def grpo(self, ours, steps, name=None, judge_in_one_row=True, **over):
        from common.fast import decode_step, model_changes
        from common.model import unwrap_peft
        from common.reward_terms import WATCH, Term
        from common.rewards import RewardScorer
        over = over if ours else {"rollout_backend": "hf", "gradient_accumulation_steps": 1}
        cfg = self.config(GRPOStageConfig, "04_train_grpo.yaml", max_steps=steps or 1,
                          max_prompt_tokens=self.max_prompt, **over,
                          **({"max_completion_length": 8, "per_device_train_batch_size": 8} if self.tiny else {}))
        # steps_per_generation: one generation batch feeds k optimiser steps (k = 1: TRL's default)
        spg = cfg.steps_per_generation or cfg.gradient_accumulation_steps
        k = max(1, spg // cfg.gradient_accumulation_steps)
        if steps is None:  # two generation batches
            cfg.max_steps = 2 * k
        pairs = self.work / "pairs"
        pairs.mkdir(parents=True, exist_ok=True)
        lengths = random.Random(4).sample(self.prompt_lengths, min(len(self.prompt_lengths), 256))
        with open(pairs / "train.jsonl", "w") as f:
            for i, p in enumerate(lengths):
                f.write(json.dumps({"group_id": f"g{i}", "prompt": self.words.prompt(p)}) + "\n")
        self.tokenizer.padding_side = "left"
        prompts = self.grpo_mod.prompt_dataset(str(pairs), self.tokenizer, cfg)
        fresh_adapter(self.policy)
        if attn_implementation(unwrap_peft(self.policy)) != "sdpa":  # an earlier row's shared prompt
            unwrap_peft(self.policy).set_attn_implementation("sdpa")
        self.plain_judge()
        self.judge_model.eval()
        # as stage 04 gives it (the watch's statistics included); no guard: a random model's lengths are flat
        judge = [Term(RewardScorer(self.judge_model, self.tokenizer, self.max_prompt, self.max_length,
                                   cfg.reward_batch_size), "judge"), *WATCH]
        one_row = model_changes.judges_in_one_row
        if not judge_in_one_row:
            model_changes.judges_in_one_row = lambda judges: False
        try:
            built = self.run_dir("grpo")
            trainer = self.grpo_mod.build_trainer(cfg, built, self.policy, judge, prompts, self.tokenizer)
        finally:
            model_changes.judges_in_one_row = one_row
        timing = {"rollout_s": [], "new_tokens": [], "reward_s": [], "prefill_s": [], "peak_after_rollout": []}
        generate = trainer._generate  # private, wrapped below: common/trl_compat.py
        import common.fast.static_decoder as gen
        capture, t_start = gen._capture, []

        def timed_capture(step, state):  # decode calls it once its prefill is done (CUDA graphs only)
            sync()
            timing["prefill_s"].append(round(time.perf_counter() - t_start[-1], 3))
            return capture(step, state)

        def timed_generate(*a, **k):
            sync()
            t = time.perf_counter()
            t_start.append(t)
            out = generate(*a, **k)
            sync()
            timing["rollout_s"].append(time.perf_counter() - t)
            timing["peak_after_rollout"].append(round(peak_gib(), 3) if torch.cuda.is_available() else None)
            timing["new_tokens"].append(sum(len(c) for c in out[1]))
            return out
        trainer._generate = timed_generate
        gen._capture = timed_capture
        score = judge[0].scorer.score

        def timed_score(*a, **k):
            t = time.perf_counter()
            out = score(*a, **k)
            timing["reward_s"].append(time.perf_counter() - t)
            return out
        judge[0].scorer.score = timed_score
        clock = StepClock()
        trainer.add_callback(clock)
        if PROFILE_DIR is not None:
            trainer.add_callback(StepProfile(PROFILE_DIR / f"grpo_{'ours' if ours else 'trl'}_{cfg.rollout_weights}.txt"))
        mem_reset()
        sync()
        t0 = time.perf_counter()
        from common.training import train
        with lever(self.policy, ours, lora_dropout=cfg.lora_dropout if ours else None):
            trained = train(trainer, bench_run(self.work / "grpo"))
        per_step = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
        times = [t0] + clock.times
        secs = [b - a for a, b in zip(times, times[1:])]
        timed = secs[k:] or secs  # the first rollout's steps carry the warm-up
        step_s = sum(timed) / len(timed)
        gens = timing["rollout_s"][1:] or timing["rollout_s"]
        # one decode call per rollout when the rollout batch holds the step's completions
        decodes = list(zip(timing["rollout_s"], timing["prefill_s"]))[1:] if len(timing["prefill_s"]) == len(gens) + 1 else []
        toks = timing["new_tokens"][1:] or timing["new_tokens"]
        premises_per_step = per_step / cfg.num_generations
        dense = "_bf16_rollouts" if cfg.rollout_weights == "bf16" else ""
        self.record({"stage": "grpo", "name": name or "grpo_" + ("ours" if ours else "trl") + dense,
                     "setting": "ours" if ours else "trl", "rollout_backend": cfg.rollout_backend, "rollout_batch": cfg.rollout_batch_size,
                     "rollout_weights": cfg.rollout_weights,
                     "nf4_kernel": decode_step.nf4_dequantizer(next(self.policy.parameters()).device) if cfg.rollout_weights == "nf4" else None,
                     "gradient_checkpointing": cfg.gradient_checkpointing,
                     "completions_per_step": per_step, "reward_batch": cfg.reward_batch_size,
                     "lora_dropout": cfg.lora_dropout if ours else MODEL_LORA_DROPOUT,
                     "generation_batch": cfg.per_device_train_batch_size * spg, "steps_per_generation": spg,
                     "generation_batches": len(timing["rollout_s"]),
                     # TRL's clip ratio over the steps after the first (the bench logs the first step and the end)
                     "clip_ratio_region_mean": next((h["clip_ratio/region_mean"] for h in trained["log_history"][::-1]
                                                     if h.get("clip_ratio/region_mean") is not None), None),
                     "max_completion_length": cfg.max_completion_length,
                     "steps_timed": len(timed), "step_seconds": [round(s, 2) for s in secs],
                     "seconds_per_step": round(step_s, 3),
                     "rollout_seconds": [round(s, 2) for s in timing["rollout_s"]],
                     "prefill_seconds": timing["prefill_s"],
                     # per new token after the prefill (the random model rarely ends a reply early)
                     "decode_ms_per_token": round(1000 * sum(r - p for r, p in decodes)
                                                  / max(len(decodes) * (cfg.max_completion_length - 1), 1), 2)
                     if decodes else None,
                     "reward_seconds_total": round(sum(timing["reward_s"]), 2),
                     "rollout_new_tokens_per_s": round(sum(toks) / max(sum(gens), 1e-9), 1),
                     "projected_1000_premises_min": round(step_s * 1000 / premises_per_step / 60, 2),
                     # each step's peak up to the end of its rollout, and the whole step's (the stage's own
                     # record, its counter reset at each step's start), with what is still allocated at its end
                     "peak_after_rollout_gib": timing["peak_after_rollout"],
                     "peak_per_step_gib": [m["peak_gib"] for m in trained["gpu_memory_per_step"]],
                     "allocated_at_step_end_gib": [m["allocated_gib"] for m in trained["gpu_memory_per_step"]],
                     "reserved_at_step_end_gib": [m["reserved_gib"] for m in trained["gpu_memory_per_step"]],
                     "seconds_per_step_parts": step_parts(secs, timing, k), "patches": built.manifest.get("patches"),
                     "memory_plan": built.manifest.get("memory_plan"),
                     "peak_gib": peak_gib(trained)})
        judge[0].scorer.score = score
        gen._capture = capture
        del trainer

    # ------------------------------------------------------------------------------------------------
    def run(self, sections):
        from common.config import ModelArgs
        from common.model import CAUSAL_LM, SEQ_CLS, load_model, load_tokenizer
        margs = ModelArgs(model_name_or_path=self.model_path, lora_dropout=MODEL_LORA_DROPOUT)
        self.tokenizer = load_tokenizer(margs)
        self.words = Words(self.tokenizer)
        _map_unknown_ids(self.tokenizer, self.words.word_id)
        t = time.perf_counter()
        self.policy = load_model(margs, CAUSAL_LM, tokenizer=self.tokenizer)
        self.results["meta"]["load_causal_s"] = round(time.perf_counter() - t, 1)
        self.results["meta"]["causal_model_gib"] = _allocated()
        print("loaded policy", self.results["meta"], flush=True)
        # Every TRL-default row first: Liger (on in the recipe) patches the model's layers for good.
        S, L = self.sft_lengths, self.max_length
        uniform_sft = [[self.max_prompt, L - self.max_prompt]] * (self.steps * 16)
        uniform_rw = [[self.max_prompt, L - self.max_prompt, L - self.max_prompt]] * (self.steps * 16)
        g = self.guarded
        # The review shapes: TRL's defaults first (Liger, in the recipes, patches the layers for good), then
        # generation (no Liger, as stage 05 runs it), then the pipeline's training rows.
        if "review_sft" in sections:
            for recipe in REVIEW_SFT_TARGETS:
                g(f"review sft {recipe} trl", lambda r=recipe: self.review_sft(r, "trl"), 30)
        if "review_dpo" in sections:
            for recipe in REVIEW_DPO_TARGETS:
                g(f"review dpo {recipe} trl", lambda r=recipe: self.review_dpo(r, "trl"), 30)
        if "review_gen" in sections:
            reserve = 0.0 if self.tiny else (120.0 if "review_sft" in sections else 0.0) + \
                (60.0 if "review_dpo" in sections else 0.0)
            g("review gen", lambda: self.review_gen(reserve), 40)
        if "review_sft" in sections:
            for recipe, setting, over in REVIEW_SFT_SETTINGS:
                g(f"review sft {recipe} {setting}", lambda r=recipe, s=setting, o=over: self.review_sft(r, s, **o), 30)
        if "review_dpo" in sections:
            for recipe, setting, over in REVIEW_DPO_SETTINGS:
                if self.tiny and setting == "ours_sdpa":
                    continue  # the CPU runs sdpa anyway (FlexAttention has no backward there): same as "ours"
                g(f"review dpo {recipe} {setting}", lambda r=recipe, s=setting, o=over: self.review_dpo(r, s, **o), 30)
        if "sft" in sections:
            if "uniform" in self.args.batches:
                g("sft uniform trl", lambda: self.sft("sft_uniform_trl", "uniform", uniform_sft, False), 40)
            g("sft real trl", lambda: self.sft("sft_real_trl", "real", S, False), 40)
            g("sft real trl warm", lambda: self.sft("sft_real_trl_warm", "real", S, False), 40)
        if "long" in sections:
            g("long trl", lambda: self.long(False), 60)
        if "eval" in sections:
            g("eval trl", lambda: self.evalgen(False), 60)
        if {"reward", "grpo"} & set(sections):
            before = _allocated() or 0.0
            t = time.perf_counter()
            self.judge_model = load_model(margs, SEQ_CLS, tokenizer=self.tokenizer)
            self.results["meta"]["load_seqcls_s"] = round(time.perf_counter() - t, 1)
            self.results["meta"]["seqcls_model_gib"] = judge_gib = round((_allocated() or 0.0) - before, 3)
            self.results["meta"]["causal_resident_gib"] = before
        if "reward" in sections:
            self.other_resident = before  # the policy stays loaded: not part of the reward stage's memory
            if "uniform" in self.args.batches:
                g("reward uniform trl", lambda: self.reward("reward_uniform_trl", "uniform", uniform_rw, False), 40)
            g("reward real trl", lambda: self.reward("reward_real_trl", "real", self.reward_lengths, False), 40)
            g("reward real trl warm", lambda: self.reward("reward_real_trl_warm", "real", self.reward_lengths, False), 40)
            self.other_resident = 0.0
        if "grpo" in sections:
            g("grpo trl", lambda: self.grpo(False, 1), 80)  # one step: about 45 s of HF generate
        # The pipeline's settings; the judge's 4-bit model is loaded meanwhile: its bytes are subtracted.
        self.other_resident = judge_gib if {"reward", "grpo"} & set(sections) else 0.0
        if "eval" in sections:
            g("eval ours", lambda: self.evalgen(True), 30)
        if "sft" in sections:
            if "uniform" in self.args.batches:
                g("sft uniform ours", lambda: self.sft("sft_uniform_ours", "uniform", uniform_sft, True), 40)
            g("sft real ours", lambda: self.sft("sft_real_ours", "real", S, True), 40)
            # the same micro-batches again: every shape seen once before (a run's second epoch, its recurring shapes)
            g("sft real ours warm", lambda: self.sft("sft_real_ours_warm", "real", S, True), 40)
            # real lengths padded to a multiple of 64: a few shapes, seen again (pad_to_multiple_of)
            g("sft real ours pad64", lambda: self.sft("sft_real_ours_pad64", "real", S, True, pad_to_multiple_of=64), 40)
            g("sft real ours cudnn", lambda: self.sft("sft_real_ours_cudnn", "real", S, True, cudnn_attention=True), 40)
            g("sft real ours dropout", lambda: self.sft("sft_real_ours_dropout", "real", S, True, lora_dropout=0.05), 40)
            # every layer checkpointed, as the recipe's levers are written (memory_levers as_set)
            g("sft real ours checkpointed", lambda: self.sft("sft_real_ours_checkpointed", "real", S, True,
                                                            memory_levers="as_set"), 40)
        if "long" in sections:
            g("long ours", lambda: self.long(True), 45)
            g("long ours chunked", lambda: self.long(True, mlp_chunk_tokens=4096), 45)
        if "reward" in sections:
            self.other_resident = before
            if "uniform" in self.args.batches:
                g("reward uniform ours", lambda: self.reward("reward_uniform_ours", "uniform", uniform_rw, True), 40)
            g("reward real ours", lambda: self.reward("reward_real_ours", "real", self.reward_lengths, True), 40)
            g("reward real ours warm", lambda: self.reward("reward_real_ours_warm", "real", self.reward_lengths, True), 40)
            g("reward real ours pad64", lambda: self.reward("reward_real_ours_pad64", "real", self.reward_lengths, True,
                                                            pad_to_multiple_of=64), 40)
            g("reward real ours padded", lambda: self.reward("reward_real_ours_padded", "real", self.reward_lengths, True,
                                                             padding_free=False), 40)
            g("reward real ours padded warm", lambda: self.reward("reward_real_ours_padded_warm", "real",
                                                                  self.reward_lengths, True, padding_free=False), 40)
            g("reward real ours cudnn", lambda: self.reward("reward_real_ours_cudnn", "real", self.reward_lengths, True,
                                                            cudnn_attention=True), 40)
            g("reward real ours dropout", lambda: self.reward("reward_real_ours_dropout", "real", self.reward_lengths,
                                                              True, lora_dropout=0.05), 40)
            g("reward real ours checkpointed", lambda: self.reward("reward_real_ours_checkpointed", "real",
                                                                   self.reward_lengths, True, memory_levers="as_set"), 40)
        self.other_resident = 0.0
        if "grpo" in sections:
            g("grpo ours", lambda: self.grpo(True, 2 if self.tiny else self.args.grpo_steps), 60)
            # memory_levers fit within 20 GiB (the recipe's fit takes the whole GPU)
            g("grpo ours 20gib", lambda: self.grpo(True, 2 if self.tiny else self.args.grpo_steps, "grpo_ours_20gib",
                                                   memory_budget_gib=20.0), 60)
            # before the judge scored a step's replies in one row: one padded row a premise, dense SDPA masks
            g("grpo ours judge sdpa", lambda: self.grpo(True, 2 if self.tiny else 3, "grpo_ours_judge_sdpa",
                                                        judge_in_one_row=False), 60)
            # one generation batch shared by steps_per_generation / gradient_accumulation_steps optimiser steps:
            # two generation batches each, the first one's steps not timed
            for spg in [int(n) for n in self.args.grpo_steps_per_generation.split(",") if n]:
                g(f"grpo ours spg {spg}", lambda spg=spg: self.grpo(True, None, f"grpo_ours_spg_{spg}",
                                                                    steps_per_generation=spg), 60 * max(1, spg // 4))
            grpo = [r for r in self.results["rows"] if r["name"] == "grpo_ours_20gib"]
            if grpo and (grpo[0]["peak_gib"] or 0) > 19.5:  # over the 24 GB card's budget: half the rollout batch
                g("grpo ours rollout 32", lambda: self.grpo(True, 3, memory_budget_gib=20.0, rollout_batch_size=32), 60)
            # rollouts on a bf16 copy of the frozen base (about 14 GB more on the 8B shape)
            g("grpo ours bf16 rollouts", lambda: self.grpo(True, 2 if self.tiny else 3, rollout_weights="bf16",
                                                           memory_levers="as_set"), 60)
            # 128 completions sampled at once (32 premises a step, half the optimiser steps): the decode step
            # costs about the same at twice the batch
            g("grpo ours bf16 rollouts 128", lambda: self.grpo(True, 2 if self.tiny else 3, "grpo_ours_bf16_rollouts_128",
                                                                rollout_weights="bf16", gradient_accumulation_steps=8,
                                                                rollout_batch_size=128, memory_levers="as_set"), 60)
            # a GPU with room: no activation checkpointing in the update either
            g("grpo ours bf16 rollouts no checkpointing", lambda: self.grpo(
                True, 2 if self.tiny else 3, "grpo_ours_bf16_rollouts_no_checkpointing", rollout_weights="bf16",
                gradient_checkpointing=False), 60)
            g("grpo ours bf16 rollouts 128 no checkpointing", lambda: self.grpo(
                True, 2 if self.tiny else 3, "grpo_ours_bf16_rollouts_128_no_checkpointing", rollout_weights="bf16",
                gradient_accumulation_steps=8, rollout_batch_size=128, gradient_checkpointing=False), 60)

def _allocated():
    return round(torch.cuda.memory_allocated() / GIB, 3) if torch.cuda.is_available() else None


def _remove_mlp_chunking(model):
    for layer in model.get_base_model().model.layers:
        forward = layer.mlp.forward
        if getattr(forward, "__name__", "") == "chunked":
            layer.mlp.forward = forward.__defaults__[0]


def _remove_offload_hooks(model):
    from common.fast.kept_attention import restore_attention
    model._forward_pre_hooks.clear()
    model._forward_hooks.clear()
    for module in model.modules():  # keep_attention_outputs, which comes with offloading
        restore_attention(module)


def _map_unknown_ids(tokenizer, word_id):
    """The random 128k-vocabulary model samples ids the 2k stand-in tokenizer lacks: decode them as
    the repeated word, so that a reply keeps its token length when the reward model re-encodes it."""
    n, decode = len(tokenizer), tokenizer.batch_decode

    def batch_decode(sequences, **kwargs):
        return decode([[t if t < n else word_id for t in seq] for seq in sequences], **kwargs)
    tokenizer.batch_decode = batch_decode


def load_lora(path: Path, adapter: str | None = None):
    """(model, tokenizer) as the stages load them (4-bit NF4, rank-64 rsLoRA), in eval mode, LoRA A's init
    seeded (the same adapter in every process); without `adapter`, LoRA B set to small random values, so that
    the adapter changes the output as a trained one does."""
    from common.config import ModelArgs
    from common.model import CAUSAL_LM, load_model, load_tokenizer
    margs = ModelArgs(model_name_or_path=str(path), lora_dropout=0.0)
    tok = load_tokenizer(margs)
    torch.manual_seed(0)
    model = load_model(margs, CAUSAL_LM, tokenizer=tok, adapter=adapter).eval()
    if adapter is None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.01)
    return model, tok


def build_random_model(path: Path, tokenizer_from: Path = TINY_MODEL) -> None:
    """A random-initialised Llama 3 8B shape (bf16 safetensors), made on the GPU, with the stand-in
    tokenizer beside it. Loaded later through load_model, 4-bit quantisation included."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.local_models import ensure
    ensure("tiny", tokenizer_from)  # the stand-in tokenizer: built from the bundled data if missing
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return
    t = time.perf_counter()
    config = LlamaConfig(**LLAMA3_8B, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config)
    torch.set_default_dtype(previous)
    model.save_pretrained(path)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, path / name)
    print(f"built {path} in {time.perf_counter() - t:.0f} s", flush=True)


def meta(args) -> dict:
    import peft
    import transformers
    import trl
    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv), "host": platform.node(),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "trl": trl.__version__, "peft": peft.__version__, "tiny": args.tiny, **bench_commit(),
            "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    from importlib.metadata import PackageNotFoundError, version
    for name in ("bitsandbytes", "datasets", "accelerate", "liger-kernel"):
        try:
            info[name] = version(name)
        except PackageNotFoundError:
            pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count_visible"] = torch.cuda.device_count()
    return info


def table(results) -> str:
    """Markdown table: each measurement and its ratio to TRL's defaults on the same work."""
    rows = results["rows"]
    base = {}
    for r in rows:
        if r["setting"] == "trl":
            base[(r["stage"], r.get("batches"))] = r
    lines = ["| row | stage | batches | setting | throughput | peak GiB | vs TRL defaults |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["stage"] == "grpo":
            value = (f"{r['seconds_per_step']} s/step ({r['completions_per_step']} completions), rollout "
                     f"{r['rollout_new_tokens_per_s']} new tok/s, 1,000 premises: {r['projected_1000_premises_min']} min")
            key = "projected_1000_premises_min"
        elif r["stage"] == "eval":
            value, key = f"{r['new_tokens_per_s']} new tok/s ({r['sequences']} x {r['new_tokens_each']})", "new_tokens_per_s"
        elif r["stage"] == "review_gen":
            value = "out of memory" if r.get("oom") else \
                f"{r['new_tokens_per_s']} new tok/s ({r['batch']} x {r['prompt_tokens']} -> {r['new_tokens_each']})"
            key = "new_tokens_per_s"
        else:
            value, key = f"{r['tokens_per_s']} real tok/s (real share {r['real_share']})", "tokens_per_s"
        ref = base.get((r["stage"], r.get("batches")))
        ratio = ""
        if ref is not None and ref is not r and ref.get(key) and r.get(key):
            x = ref[key] / r[key] if key == "projected_1000_premises_min" else r[key] / ref[key]
            ratio = f"{x:.2f}x faster"
            if r.get("peak_gib") is not None and ref.get("peak_gib"):
                ratio += f", {r['peak_gib'] / ref['peak_gib']:.2f}x memory"
        peak = "" if r.get("peak_gib") is None else f"{r['peak_gib']:.2f}"
        lines.append(f"| {r['name']} | {r['stage']} | {r.get('batches', r.get('tokens', ''))} | {r['setting']} | {value} | {peak} | {ratio} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the tiny local model on the CPU (smoke run)")
    ap.add_argument("--out", default="bench/out")
    ap.add_argument("--work", default="/tmp/bench-work", help="scratch run directories")
    ap.add_argument("--model", default="/tmp/llama3-8b-random", help="built here when missing (GPU)")
    ap.add_argument("--sections", default="sft,long,eval,reward,grpo")
    ap.add_argument("--steps", type=int, default=8, help="optimiser steps per training measurement")
    ap.add_argument("--batches", default="uniform,real", help="which SFT/reward batch kinds to measure")
    ap.add_argument("--long_tokens", type=int, default=32768)
    ap.add_argument("--grpo_steps", type=int, default=3, help="optimiser steps of the 'grpo ours' row (20: does "
                    "its memory stay flat?)")
    ap.add_argument("--grpo_steps_per_generation", default="", help="GRPO rows 'grpo ours spg N', one for each "
                    "steps_per_generation N listed (TRL's: micro-batches a generation batch feeds; the llama3-8b recipe "
                    "has 4 a step, so 4,8,16 share one over 1, 2 and 4 optimiser steps)")
    ap.add_argument("--review_steps", type=int, default=4, help="review_sft / review_dpo: optimiser steps "
                    "of one sequence (one pair) each; the first is not timed")
    ap.add_argument("--review_gen_batches", default="1,2,4,8,16", help="review_gen: batch sizes, in order, "
                    "up to the first out-of-memory")
    ap.add_argument("--rows", default="", help="only the measurements whose name (as printed: 'sft real ours') "
                    "matches one of these comma-separated shell patterns, e.g. '*ours*,grpo*'")
    ap.add_argument("--profile", action="store_true", help="profile each training row's timed steps with "
                    "torch.profiler: a kernel table per row under --out/profiles (the rows' own timings then "
                    "include the profiler's overhead: use them for shares, not for speed)")
    ap.add_argument("--deadline", type=float, default=540, help="seconds: later measurements are skipped")
    ap.add_argument("--make_lengths", action="store_true", help=f"rewrite {LENGTHS.relative_to(REPO)} and exit")
    args = ap.parse_args(argv)
    if args.make_lengths:
        make_lengths()
        return
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("no GPU: use --tiny for the CPU smoke run")
    from common.cli import CUDA_ALLOC_CONF
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", CUDA_ALLOC_CONF)  # as the stages run (common/cli.py)
    if args.tiny:
        from common.local_models import ensure
        ensure("tiny", TINY_MODEL)  # built from the bundled data if missing
    else:
        build_random_model(Path(args.model))
    if args.profile:
        global PROFILE_DIR
        PROFILE_DIR = Path(args.out) / "profiles"
    bench = Bench(args)
    bench.results["meta"]["build_and_setup_s"] = round(time.time() - bench.start, 1)
    bench.run(args.sections.split(","))
    bench.results["meta"]["total_s"] = round(time.time() - bench.start, 1)
    from common.fast.static_decoder import GRAPH_FAILURES
    bench.results["meta"]["cuda_graph_failures"] = GRAPH_FAILURES
    bench.save()
    text = table(bench.results)
    (Path(args.out) / "table.md").write_text(text + "\n")
    print(text)
    for e in bench.results["errors"]:
        print("ERROR", e["name"], e["error"][:300])


if __name__ == "__main__":
    main()
