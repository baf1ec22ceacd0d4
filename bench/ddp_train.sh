#!/usr/bin/env bash
# DDP training speed and memory of SFT, the reward model and GRPO on a random-init Llama 3 8B shape
# (4-bit NF4 + rank-64 rsLoRA, the llama3-8b recipe's batches): first on 1 GPU, then on 2 GPUs with
# configs/accelerate/multi_gpu.yaml, through `accelerate launch` as slurm/stage.sh runs the stages.
#
#   bash bench/ddp_train.sh                   # everything: ~16 GB model built once, then 1 and 2 GPUs
#   GPU_COUNTS=2 bash bench/ddp_train.sh --steps 10     # only 2 GPUs; options go to bench/ddp_train.py
#
# Env: PYTHON (default .venv/bin/python, else python3), MODEL_DIR (default
# .cache/models/llama3-8b-random), BENCH_OUT (default bench/out-ddp), GPU_COUNTS (default "1 2"),
# ALLOW_CPU=1 for a smoke run without GPUs (with MODEL_DIR=.cache/models/tiny-llama3).
# When trl, bitsandbytes or datasets is missing, their wheels in .whl/ are installed with --no-deps.
# Results: $BENCH_OUT/<n>gpu/results.json, and at the end a markdown table for bench/RESULTS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "ddp_train.sh: $*" >&2; exit 2; }

if [[ -z ${PYTHON:-} ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
MODEL_DIR=${MODEL_DIR:-.cache/models/llama3-8b-random}
BENCH_OUT=${BENCH_OUT:-bench/out-ddp}
GPU_COUNTS=${GPU_COUNTS:-1 2}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled

if ! "$PYTHON" -c 'import trl, bitsandbytes, datasets' 2>/dev/null; then
  wheels=()
  for name in trl bitsandbytes datasets dill multiprocess; do
    for w in .whl/"$name"-*.whl; do [[ -f $w ]] && wheels+=("$w"); done
  done
  (( ${#wheels[@]} )) || die "trl/bitsandbytes/datasets missing and no wheels in .whl/"
  "$PYTHON" -m pip install -q --no-deps "${wheels[@]}"
  "$PYTHON" -c 'import trl, bitsandbytes, datasets' || die "still cannot import trl, bitsandbytes, datasets"
fi

have=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
for n in $GPU_COUNTS; do  # ALLOW_CPU=1: a smoke run on the CPU (MODEL_DIR=.cache/models/tiny-llama3)
  (( n <= have )) || [[ ${ALLOW_CPU:-} == 1 ]] || die "$n GPUs asked for, $have visible"
done
echo "== $("$PYTHON" -c 'import torch, transformers, trl, peft, accelerate, bitsandbytes as b
print(f"torch {torch.__version__} transformers {transformers.__version__} trl {trl.__version__} peft {peft.__version__} accelerate {accelerate.__version__} bitsandbytes {b.__version__}")')"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader || true

"$PYTHON" bench/ddp_train.py --build "$MODEL_DIR"

for n in $GPU_COUNTS; do
  # One process with several GPUs visible makes the Trainer wrap the model in nn.DataParallel
  # (which TRL refuses): the 1-GPU baseline sees only GPU 0.
  # Several GPUs: the first n of those visible (an unset CUDA_VISIBLE_DEVICES must stay unset; set
  # to an empty string it would hide every GPU and run the 8B model on the CPU).
  if (( n == 1 )); then
    config=configs/accelerate/single_gpu.yaml; visible=0
  else
    config=configs/accelerate/multi_gpu.yaml; visible=$(seq -s, 0 $(( n - 1 )))
    [[ -n ${CUDA_VISIBLE_DEVICES:-} ]] && visible=$(cut -d, -f1-"$n" <<< "$CUDA_VISIBLE_DEVICES")
  fi
  echo "== $n GPU(s): $config, CUDA_VISIBLE_DEVICES=$visible"
  start=$(date +%s)
  # --line-buffered: a run killed part-way still shows what it printed
  CUDA_VISIBLE_DEVICES=$visible "$PYTHON" -u -m accelerate.commands.launch --config_file "$config" --num_processes "$n" \
    --num_machines 1 --machine_rank 0 --main_process_port $(( 29500 + n )) \
    bench/ddp_train.py --model "$MODEL_DIR" --out "$BENCH_OUT/${n}gpu" "$@" 2>&1 \
    | grep --line-buffered -v -e 'examples/s' -e 'Loading weights' -e '^{' || true
  [[ -f $BENCH_OUT/${n}gpu/results.json ]] || die "$n GPU(s): no results (see the output above)"
  echo "   took $(( $(date +%s) - start )) s"
done

"$PYTHON" - "$BENCH_OUT" $GPU_COUNTS <<'EOF'
import json, sys
from pathlib import Path
out, counts = Path(sys.argv[1]), sys.argv[2:]
rows, grpo, base = [], [], {}
for n in counts:
    data = json.loads((out / f"{n}gpu" / "results.json").read_text())
    for r in data["results"]:
        if r["kind"] == "grpo":
            base.setdefault("grpo", r["seconds_per_step"])
            peaks = " / ".join("-" if p["peak_allocated_gib"] is None else f"{p['peak_allocated_gib']:.1f}"
                               for p in r["per_rank"])
            grpo.append(f"| {r['processes']} | {r['completions_per_step']} | {r['seconds_per_step']:.2f} "
                        f"| {r['projected_1000_premises_min']:.2f} | {base['grpo'] / r['seconds_per_step']:.2f}x | {peaks} |")
            continue
        base.setdefault(r["kind"], r["tokens_per_s"])
        gib = lambda key: " / ".join("-" if p[key] is None else f"{p[key]:.1f}" for p in r["per_rank"])  # noqa: E731
        peaks, reserved = gib("peak_allocated_gib"), gib("peak_reserved_gib")
        rows.append(f"| {r['kind']} | {r['processes']} | {r['rows_per_step_all_ranks']} x {r['tokens_per_row']} "
                    f"| {r['tokens_per_s']:,.0f} | {r['tokens_per_s_per_gpu']:,.0f} "
                    f"| {r['tokens_per_s'] / base[r['kind']]:.2f}x | {peaks} | {reserved} |")
print(f"\n{data['meta']['devices']}, torch {data['meta']['torch']}, CUDA {data['meta']['cuda']}\n")
print("| training | GPUs | rows x tokens per optimiser step | tokens/s | tokens/s per GPU | vs 1 GPU "
      "| peak allocated per GPU (GiB) | peak reserved per GPU (GiB) |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
print("\n".join(rows))
if grpo:
    print("\n| GRPO: GPUs | completions per step | s per step | 1,000 premises (min) | vs 1 GPU | peak allocated per GPU (GiB) |")
    print("| --- | --- | --- | --- | --- | --- |")
    print("\n".join(grpo))
EOF
