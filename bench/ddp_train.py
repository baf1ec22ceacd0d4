"""Data-parallel (DDP) speed and memory of SFT, reward-model and GRPO training, one process per GPU.

    accelerate launch --config_file configs/accelerate/multi_gpu.yaml --num_processes 2 \
        bench/ddp_train.py --model /tmp/llama3-8b-random --out bench/out-ddp/2gpu
    python bench/ddp_train.py --build /tmp/llama3-8b-random     # the random 8B-shaped model, once

bench/ddp_train.sh runs all of it (the model, then 1 and 2 GPUs) and prints a table.

The pipeline's own code: `load_model` (4-bit NF4 + rank-64 rsLoRA, placed on this process's own GPU
by LOCAL_RANK), `trainer_args` and `train` from common/training.py, TRL's SFTTrainer and
RewardTrainer, with the llama3-8b recipe's batch settings (configs/llama3-8b/0[23]_*.yaml). It does
not go through the stage scripts, so it needs no pairs run or run directory. The data are random
token ids of fixed length (pre-tokenized), so every step is the same size: tokens/s counts every
token of every rank (SFT: the sequence; reward: chosen + rejected), over the steps after the warm-up.
Weights are random (no model hub): compute and memory are those of Llama 3 8B.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import yaml  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from transformers.trainer_utils import SaveStrategy  # noqa: E402

from common.config import ModelArgs, RunArgs, TrainArgs  # noqa: E402
from common.provenance import bench_commit  # noqa: E402

GIB = 2 ** 30
TINY = REPO / ".cache" / "models" / "tiny-llama3"
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, bos_token_id=128000,
                 eos_token_id=128009, max_position_embeddings=8192, tie_word_embeddings=False)


@dataclass
class BenchConfig(RunArgs, ModelArgs, TrainArgs):
    pass


def recipe(stage_yaml: str, model: str, steps: int) -> BenchConfig:
    """The recipe's optimisation and LoRA fields (stage-only keys such as pairs_run are dropped)."""
    fields = {f.name for f in dataclasses.fields(BenchConfig)}
    values = {k: v for k, v in yaml.safe_load((REPO / stage_yaml).read_text()).items() if k in fields}
    values.update(model_name_or_path=model, max_steps=steps, save_steps=10 ** 9, logging_steps=1,
                  report_to="none")
    if "group_by_length" in fields:
        values["group_by_length"] = False  # every example has the same length here
    return BenchConfig(**values)


def build_model(path: Path) -> None:
    """A random-initialised Llama 3 8B shape (bf16 safetensors, ~16 GB), made on the GPU, with the tiny
    recipe's tokenizer beside it (its ids are a subset of the 128k vocabulary)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    if (path / "config.json").is_file():
        return
    if not (TINY / "tokenizer.json").is_file():
        from common.local_models import ensure
        ensure("tiny", TINY)
    start = time.time()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA3_8B))
    torch.set_default_dtype(torch.float32)
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (TINY / name).is_file():
            shutil.copy(TINY / name, tmp / name)
    tmp.replace(path)
    print(f"built {path} in {time.time() - start:.0f} s", flush=True)


class StepClock(TrainerCallback):
    def __init__(self):
        self.times = []

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())


def gather_memory(world: int, rank: int, **extra) -> list[dict]:
    """Every rank's device and peak memory (GiB), gathered on each rank."""
    cuda = torch.cuda.is_available()
    mine = {"rank": rank, "device": torch.cuda.get_device_name() if cuda else "cpu", **extra,
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB if cuda else None}
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [mine]
    per_rank = [None] * world
    torch.distributed.all_gather_object(per_rank, mine)
    return per_rank


def free_memory() -> None:
    """After a section: the next one loads its own 4-bit base."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def random_ids(n_rows: int, length: int, seed: int, low: int = 16, high: int = 2000) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (n_rows, length), generator=g).tolist()


def measure_grpo(args, world: int, rank: int) -> dict:
    """GRPO as stage 04 builds it (`04_train_grpo.build_trainer`: static-decoder rollouts, the judge,
    the shared-prompt update), data parallel: each rank samples, scores and trains on its share of a
    step. The recipe's 64 completions a step are kept over all ranks (gradient accumulation divided by
    the ranks), so the step count of 1,000 premises does not change with the GPUs. Prompts have real
    ChangeMyView lengths (bench/results/2026-11-30_5e9908e/cmv_lengths.json) in one repeated word, as in
    bench.py."""
    import importlib.util
    import random

    from datasets import Dataset

    from common.config import GRPOStageConfig
    from common.data import fit_prompt
    from common.model import CAUSAL_LM, SEQ_CLS, load_model, load_tokenizer
    from common.reward_terms import WATCH, Term
    from common.rewards import RewardScorer
    from common.training import train

    values = yaml.safe_load((REPO / "configs/llama3-8b/04_train_grpo.yaml").read_text())
    values.update(model_name_or_path=args.model, sft_run="unused", reward_run="unused", max_steps=args.steps,
                  save_steps=10 ** 9, logging_steps=1, report_to="none")
    values["gradient_accumulation_steps"] = max(1, values["gradient_accumulation_steps"] // world)
    if args.grpo_completion_len:
        values["max_completion_length"] = args.grpo_completion_len
    config = GRPOStageConfig(**values)
    config.check()
    per_step = config.per_device_train_batch_size * config.gradient_accumulation_steps * world
    tokenizer = load_tokenizer(config)
    tokenizer.padding_side = "left"
    lengths = json.loads((REPO / "bench" / "results" / "2026-11-30_5e9908e" / "cmv_lengths.json").read_text())["prompts"]
    lengths = random.Random(4).sample(lengths, min(len(lengths), 256))
    prompts = Dataset.from_list([{"prompt": fit_prompt(tokenizer, [{"role": "user", "content": "the" + " the" * n}],
                                                       config.max_prompt_tokens)} for n in lengths])
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    policy = load_model(config, CAUSAL_LM, tokenizer=tokenizer)
    judge_model = load_model(config, SEQ_CLS, tokenizer=tokenizer, trainable=False)
    judge = [Term(RewardScorer(judge_model, tokenizer, config.max_prompt_tokens, 768, config.reward_batch_size), "judge"),
             *WATCH]
    spec = importlib.util.spec_from_file_location("grpo_stage", REPO / "04_train_grpo.py")
    stage = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stage)
    run = SimpleNamespace(dir=Path(args.work) / "grpo", manifest={}, save_manifest=lambda: None)
    trainer = stage.build_trainer(config, run, policy, judge, prompts, tokenizer)
    trainer.args.save_strategy = SaveStrategy.NO
    clock = StepClock()
    trainer.add_callback(clock)
    start = time.perf_counter()
    metrics = train(trainer, run)
    warm = min(args.warmup, len(clock.times) - 1)
    t0 = clock.times[warm - 1] if warm else start
    step_s = (clock.times[-1] - t0) / (len(clock.times) - warm)
    per_rank = gather_memory(world, rank)
    del trainer, policy, judge_model
    free_memory()
    return {"kind": "grpo", "processes": world, "global_step": metrics["global_step"],
            "per_device_batch": config.per_device_train_batch_size,
            "gradient_accumulation_steps": config.gradient_accumulation_steps, "completions_per_step": per_step,
            "max_completion_length": config.max_completion_length, "rollout_weights": config.rollout_weights,
            "patches": run.manifest.get("patches"), "steps_timed": len(clock.times) - warm,
            "seconds_per_step": round(step_s, 3),
            "projected_1000_premises_min": round(step_s * 1000 * config.num_generations / per_step / 60, 2),
            "per_rank": per_rank}


def measure(kind: str, args, world: int, rank: int) -> dict:
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer, SFTConfig, SFTTrainer

    from common import fast
    from common.model import CAUSAL_LM, SEQ_CLS, load_model, load_tokenizer
    from common.training import train, trainer_args

    stage_yaml = {"sft": "configs/llama3-8b/02_train_sft.yaml", "reward": "configs/llama3-8b/03_train_reward.yaml"}[kind]
    config = recipe(stage_yaml, args.model, args.steps)
    per_step = config.per_device_train_batch_size * config.gradient_accumulation_steps  # rows per rank
    n_rows = per_step * world * args.steps
    tokenizer = load_tokenizer(config)
    # checkpoints/ would go there (none are saved); train() records its segments in the manifest
    run = SimpleNamespace(dir=Path(args.work) / kind, manifest={}, save_manifest=lambda: None)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    if kind == "sft":
        prompt = args.sft_prompt
        data = Dataset.from_list([{"input_ids": ids, "completion_mask": [0] * prompt + [1] * (args.sft_len - prompt)}
                                  for ids in random_ids(n_rows, args.sft_len, seed=1)])
        model = load_model(config, CAUSAL_LM, tokenizer=tokenizer)
        targs = trainer_args(SFTConfig, config, run, max_length=args.sft_len, completion_only_loss=True)
        targs.save_strategy = SaveStrategy.NO  # not even at the end: 2 GB of adapter and optimiser state
        trainer = SFTTrainer(model=model, args=targs, processing_class=tokenizer, train_dataset=data)
        tokens_per_row = args.sft_len
    else:
        chosen, rejected = random_ids(n_rows, args.reward_len, 2), random_ids(n_rows, args.reward_len, 3)
        data = Dataset.from_list([{"chosen_ids": c, "rejected_ids": r} for c, r in zip(chosen, rejected)])
        model = load_model(config, SEQ_CLS, tokenizer=tokenizer)
        targs = trainer_args(RewardConfig, config, run, max_length=args.reward_len)
        targs.save_strategy = SaveStrategy.NO
        trainer = RewardTrainer(model=model, args=targs, processing_class=tokenizer, train_dataset=data)
        tokens_per_row = 2 * args.reward_len
    loaded_gib = torch.cuda.memory_allocated() / GIB if torch.cuda.is_available() else None
    clock = StepClock()
    trainer.add_callback(clock)
    fast.apply(trainer, config)  # what the stages' build_trainer applies
    start = time.perf_counter()
    metrics = train(trainer, run)
    warm = min(args.warmup, len(clock.times) - 1)
    t0 = clock.times[warm - 1] if warm else start
    seconds = clock.times[-1] - t0
    timed_steps = len(clock.times) - warm
    tokens = timed_steps * per_step * world * tokens_per_row
    per_rank = gather_memory(world, rank, base_loaded_gib=loaded_gib)
    del trainer, model
    free_memory()
    return {"kind": kind, "processes": world, "global_step": metrics["global_step"],
            "per_device_batch": config.per_device_train_batch_size,
            "gradient_accumulation_steps": config.gradient_accumulation_steps,
            "tokens_per_row": tokens_per_row, "rows_per_step_all_ranks": per_step * world,
            "steps_timed": timed_steps, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1), "tokens_per_s_per_gpu": round(tokens / seconds / world, 1),
            "gradient_checkpointing": config.gradient_checkpointing, "per_rank": per_rank}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", metavar="DIR", help="only build the random 8B-shaped model in DIR")
    ap.add_argument("--model", default="/tmp/llama3-8b-random")
    ap.add_argument("--out", default="bench/out-ddp")
    ap.add_argument("--work", default="/tmp/ddp_train-work", help="the trainers' output_dir (nothing is saved)")
    ap.add_argument("--sections", default="sft,reward,grpo")
    ap.add_argument("--grpo_completion_len", type=int, default=0, help="GRPO reply tokens (0: the recipe's 256)")
    ap.add_argument("--steps", type=int, default=6, help="optimiser steps per measurement")
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing")
    ap.add_argument("--sft_len", type=int, default=768)
    ap.add_argument("--sft_prompt", type=int, default=256, help="prompt tokens (no loss) of each SFT row")
    ap.add_argument("--reward_len", type=int, default=768, help="tokens of each chosen and rejected reply")
    args = ap.parse_args(argv)
    if args.build:
        build_model(Path(args.build))
        return
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if not torch.cuda.is_available() and os.environ.get("ALLOW_CPU") != "1":  # a GPU bench on the CPU is a bug
        sys.exit(f"ddp_train.py: no GPU visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
                 "ALLOW_CPU=1 for a smoke run")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for kind in args.sections.split(","):
        result = measure_grpo(args, world, rank) if kind == "grpo" else measure(kind, args, world, rank)
        results.append(result)
        if rank == 0:
            print(f"RESULT {json.dumps(result)}", flush=True)
    if rank == 0:
        meta = {"world_size": world, "torch": torch.__version__, "cuda": torch.version.cuda,
                "command": " ".join(sys.argv), **bench_commit(),
                "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
        (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
