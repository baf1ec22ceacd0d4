"""The 4-bit rsLoRA loader and what training does to it (tiny random Llama, CPU)."""
from __future__ import annotations

import importlib
import json
import os

import bitsandbytes as bnb
import pytest
import torch
from safetensors.torch import load_file

from common.cli import parse_config
from common.config import SFTStageConfig
from common.data import load_split
from common.model import CAUSAL_LM, SEQ_CLS, fingerprint, load_model, load_tokenizer
from common.rewards import RewardScorer
from common.runs import Run
from common.tasks import cmv

sft_stage = importlib.import_module("02_train_sft")


@pytest.fixture()
def sft_config(tiny_model, pairs_run, tmp_path):
    config, _ = parse_config(SFTStageConfig, [
        "--config", "configs/tiny/02_train_sft.yaml", "--pairs_run", str(pairs_run),
        "--model_name_or_path", str(tiny_model), "--runs_dir", str(tmp_path)])
    return config


@pytest.mark.stage
def test_loader_gives_nf4_double_quant_and_rslora_on_all_projections(sft_config):
    model = load_model(sft_config, CAUSAL_LM)
    linear4bit = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linear4bit) == 2 * 7  # 2 layers x (q, k, v, o, gate, up, down)
    weight = linear4bit[0].weight
    assert weight.quant_state.quant_type == "nf4" and weight.quant_state.nested  # double quantisation
    lora = model.peft_config["default"]
    assert lora.r == 64 and lora.use_rslora and set(lora.target_modules) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


@pytest.mark.stage
def test_fingerprint_tracks_base_and_lora_settings(sft_config):
    import dataclasses
    base = fingerprint(sft_config)
    assert fingerprint(dataclasses.replace(sft_config, lora_r=8))["lora_r"] == 8
    assert fingerprint(dataclasses.replace(sft_config, lora_dropout=0.3)) == base  # training detail, same base
    assert len(base["weights_sha256"]) == 64 and len(base["config_sha256"]) == 64


def _lora_grads(config, eval_forward_first: bool, batch):
    torch.manual_seed(0)  # the same LoRA init and dropout masks in both runs
    model = load_model(config, CAUSAL_LM)
    batch = batch.to(next(model.parameters()).device)  # the tokenizer's tensors are on the CPU, the 4-bit model on its GPU
    for name, param in model.named_parameters():  # non-zero B so every LoRA matrix gets a gradient
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    if eval_forward_first:  # what Trainer.evaluate or a generate before training does
        model.eval()
        with torch.no_grad():
            model(**batch)
    model.train()
    model(**batch, labels=batch["input_ids"]).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.stage
def test_gradients_survive_a_no_grad_eval_forward(sft_config):
    """The CPU bitsandbytes trap (docs/performance.md): without the loader's workaround, LoRA gradients
    after an eval-mode no-grad forward silently lose the path through the frozen 4-bit weights."""
    tokenizer = load_tokenizer(sft_config)
    batch = tokenizer(["A reply that could change a view.", "Another, longer reply to a post here."],
                      return_tensors="pt", padding=True)
    plain = _lora_grads(sft_config, False, batch)
    after_eval = _lora_grads(sft_config, True, batch)
    assert plain.keys() == after_eval.keys() and len(plain) == 2 * 7 * 2
    for name in plain:
        assert torch.equal(after_eval[name], plain[name]), name


@pytest.mark.stage
def test_sft_batch_masks_the_prompt_and_trains_the_reply(sft_config, pairs_run):
    tokenizer = load_tokenizer(sft_config)
    model = load_model(sft_config, CAUSAL_LM)
    run = Run("SFT", sft_config, {}, inputs={"pairs_run": pairs_run}, argv=["test"])
    rows = load_split(pairs_run, "train")[:4]
    trainer = sft_stage.build_trainer(sft_config, run, model, tokenizer, rows, [])
    raw = sft_stage.sft_dataset(rows, tokenizer, sft_config, cmv)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    for i in range(4):
        prompt_ids = tokenizer.apply_chat_template(raw[i]["prompt"], add_generation_prompt=True, tokenize=True)
        prompt_ids = list(prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids)
        n_real = int(batch["attention_mask"][i].sum())
        ids, labels = batch["input_ids"][i][:n_real].tolist(), batch["labels"][i][:n_real]
        assert ids[:len(prompt_ids)] == prompt_ids
        assert (labels[:len(prompt_ids)] == -100).all(), "a prompt token carries loss"
        assert (labels[len(prompt_ids):] != -100).all(), "a reply token carries no loss"
        assert n_real > len(prompt_ids)


@pytest.mark.stage
def test_training_moves_lora_and_leaves_the_4bit_base(sft_config, pairs_run):
    tokenizer = load_tokenizer(sft_config)
    model = load_model(sft_config, CAUSAL_LM)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    run = Run("SFT", sft_config, {}, inputs={"pairs_run": pairs_run}, argv=["test"])
    trainer = sft_stage.build_trainer(sft_config, run, model, tokenizer, load_split(pairs_run, "train")[:12], [])
    trainer.train()
    after = dict(model.named_parameters())
    lora = [n for n in before if "lora_" in n]
    frozen = [n for n in before if "lora_" not in n]
    assert lora and any(".weight" in n and "proj.base_layer" in n for n in frozen)
    assert all(not torch.equal(before[n], after[n]) for n in lora if "lora_B" in n), "a LoRA B matrix did not move"
    for name in frozen:
        assert torch.equal(before[name], after[name]), f"frozen weight {name} changed"


@pytest.mark.stage
def test_reward_head_survives_save_and_reload(tiny_model, pairs_run, tmp_path):
    from conftest import run_dir_of, run_stage
    reward = run_dir_of(run_stage("03_train_reward.py", "--config", "configs/tiny/03_train_reward.yaml",
                                  "--pairs_run", pairs_run, "--runs_dir", tmp_path, "--learning_rate", "0.01"))
    config, _ = parse_config(SFTStageConfig, ["--config", "configs/tiny/02_train_sft.yaml", "--pairs_run", str(pairs_run)])
    saved = load_file(reward / "adapter" / "adapter_model.safetensors")
    head_keys = [k for k in saved if "score" in k]
    assert head_keys, "the score head is not in the saved adapter"
    fresh = load_model(config, SEQ_CLS)
    fresh_head = dict(fresh.named_parameters())
    trained_head = saved[head_keys[0]]
    assert not any(torch.equal(trained_head.float(), p.detach().float().cpu()) for n, p in fresh_head.items()
                   if "score" in n)

    scorer = RewardScorer.from_run(reward)
    dev = load_split(pairs_run, "dev")[:8]
    stored = [json.loads(line) for line in (reward / "dev_scores.jsonl").read_text().splitlines()]
    reloaded = scorer.score([r["prompt"] for r in dev], [r["chosen"] for r in dev])
    assert [s["id"] for s in stored] == [r["id"] for r in dev]
    assert reloaded == [s["chosen_score"] for s in stored]  # bit-identical


@pytest.mark.parametrize("change", [
    lambda d: (d / "chat_template.jinja").write_text((d / "chat_template.jinja").read_text() + "{# another template #}"),
    lambda d: (d / "chat_template.jinja").unlink(),
    lambda d: (d / "tokenizer_config.json").write_text((d / "tokenizer_config.json").read_text().replace("}", ', "x": 1}', 1)),
    lambda d: (d / "special_tokens_map.json").write_text("{}")])
def test_the_base_lock_covers_the_tokenizer_and_its_chat_template(tmp_path, tiny_model, change):
    import shutil

    from common.config import ModelArgs
    from common.runs import RunError, _lock_base
    copy = tmp_path / "tiny"
    shutil.copytree(tiny_model, copy)
    before = fingerprint(ModelArgs(model_name_or_path=str(copy)))
    change(copy)
    after = fingerprint(ModelArgs(model_name_or_path=str(copy)))
    assert after["tokenizer_sha256"] != before["tokenizer_sha256"]
    assert {k for k in after if after[k] != before[k]} == {"tokenizer_sha256"}
    with pytest.raises(RunError, match="field 'tokenizer_sha256'"):
        _lock_base({"sft_run": {"run_name": "S", "base": before}}, after)


# --- the base lock reads the weights ------------------------------------------------------------------

def test_the_base_lock_tells_apart_models_of_the_same_shapes(tmp_path, tiny_model):
    import shutil

    from safetensors.torch import load_file, save_file

    from common.config import ModelArgs
    from common.model import fingerprint
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    weights = model / "model.safetensors"
    before = fingerprint(ModelArgs(model_name_or_path=str(model)))
    def header():  # names, dtypes, shapes and offsets: what the lock used to hash
        data = weights.read_bytes()
        return data[8:8 + int.from_bytes(data[:8], "little")]
    before_header = header()
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1e-3  # another release of the same model: same names and shapes
    stat = weights.stat()
    save_file(tensors, weights, metadata={"format": "pt"})
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even with the old modification time
    assert header() == before_header and weights.stat().st_size == stat.st_size
    after = fingerprint(ModelArgs(model_name_or_path=str(model)))
    assert after["weights_sha256"] != before["weights_sha256"]
    assert fingerprint(ModelArgs(model_name_or_path=str(model))) == after  # read from the cache, the same
