"""The 4-bit + rsLoRA code path on other architectures than Llama, through the same code (no branch on a
model's name): tiny random Qwen2 (q/k/v biases, tied embeddings, ChatML with a default system turn),
Gemma 3 text (its own norms and scaling, sliding-window layers; a base model without a chat template)
and MPNet (the encoder judge), built in tmp_path on the tiny tokenizer. Each loads as a policy (causal
LM), as a judge (sequence classification or encoder), and every fast path it meets either gives the
plain path's numbers or is not taken, and the run says which."""
from __future__ import annotations

import pytest
import torch
from conftest import tiny_arch

from common.config import ModelArgs
from common.fast.shared_prompt import packs_rows
from common.model import CAUSAL_LM, ENCODER, SEQ_CLS, load_model, load_tokenizer, unwrap_peft
from common.rewards import RewardScorer

PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("archs")
    return {arch: tiny_arch(folder, arch) for arch in ("qwen2", "gemma3_text", "mpnet")}


@pytest.mark.parametrize("arch", ["qwen2", "gemma3_text"])
def test_decoders_load_in_4bit_with_lora_on_every_projection(models, arch):
    args = ModelArgs(model_name_or_path=str(models[arch]), lora_dropout=0.0)
    tokenizer = load_tokenizer(args)
    prompt = [{"role": "user", "content": "Change my view: cats are better than dogs."}]
    ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
    for kind in (CAUSAL_LM, SEQ_CLS):
        model = load_model(args, kind, tokenizer=tokenizer)
        adapted = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}
        assert adapted == PROJECTIONS, (arch, kind, adapted)
        assert any("Linear4bit" in type(m).__name__ for m in unwrap_peft(model).modules())
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids["input_ids"]], device=model.device)).logits
        assert out.shape[-1] == (1 if kind == SEQ_CLS else unwrap_peft(model).config.vocab_size)
        assert torch.isfinite(out).all()


def test_a_base_model_without_a_chat_template_gets_the_plain_one(models):
    tokenizer = load_tokenizer(ModelArgs(model_name_or_path=str(models["gemma3_text"])))
    text = tokenizer.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}],
                                         add_generation_prompt=True, tokenize=False)
    assert "S" in text and "Q" in text and text.rstrip().endswith("assistant:")
    chatml = load_tokenizer(ModelArgs(model_name_or_path=str(models["qwen2"])))
    assert "You are a helpful assistant." in chatml.apply_chat_template(  # the model's own template is kept
        [{"role": "user", "content": "Q"}], add_generation_prompt=True, tokenize=False)


def test_the_mpnet_encoder_judge_scores_a_pair(models):
    args = ModelArgs(model_name_or_path=str(models["mpnet"]))
    model = load_model(args, ENCODER, trainable=False)
    tokenizer = load_tokenizer(args)
    batch = tokenizer(["premise one", "premise two"], ["a reply", "another, longer reply"], padding=True,
                      return_tensors="pt").to(model.device)
    with torch.no_grad():
        scores = model(**batch).logits[:, 0]
    assert scores.shape == (2,) and torch.isfinite(scores).all() and scores[0] != scores[1]


@pytest.mark.parametrize("arch", ["qwen2", "gemma3_text"])
@pytest.mark.parametrize("share_prompt", [False, True])
def test_the_packed_judge_gives_the_padded_rewards(models, arch, share_prompt):
    """Padding-free judge scoring (common/fast/padding_free.py) on the architecture, rows longer than the
    tiny Gemma's sliding window (8 tokens), so a mask that forgot the window would show."""
    from peft import get_peft_model
    from transformers import AutoModelForSequenceClassification

    from common.fast.padding_free import unpad_rows
    from common.model import lora_config
    torch.manual_seed(0)
    base = AutoModelForSequenceClassification.from_pretrained(models[arch], num_labels=1, dtype=torch.float32,
                                                              attn_implementation="sdpa")
    pad = base.config.pad_token_id
    model = get_peft_model(base, lora_config(ModelArgs(model_name_or_path=str(models[arch]), lora_dropout=0.0), SEQ_CLS))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    lengths = [14, 6, 19, 11]  # pairs (0, 2) and (1, 3)
    ids = torch.full((4, 19), pad)
    mask = torch.zeros(4, 19, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(10, 500, (n,), generator=g)
        mask[row, :n] = 1
    ids[2, :5] = ids[0, :5]
    ids[3, :3] = ids[1, :3]
    model.train()
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask).logits
        unpad_rows(model, share_prompt=share_prompt)
        packed = model(input_ids=ids, attention_mask=mask).logits
    assert len(set(padded[:, 0].tolist())) == 4
    if arch == "qwen2":
        assert packs_rows(model)
        assert torch.allclose(packed, padded, atol=1e-4), (arch, packed, padded)
    else:  # why Gemma 3 falls back: our mask lets a sliding-window layer see past its window
        assert not packs_rows(model) and not torch.allclose(packed, padded, atol=1e-4)
        scorer = RewardScorer(model, load_tokenizer(ModelArgs(model_name_or_path=str(models[arch]))), 8, 24)
        assert not scorer.packed and scorer.scoring == "padded (sliding-window layers)"


def test_the_mpnet_judge_says_it_runs_eager_attention(models):
    args = ModelArgs(model_name_or_path=str(models["mpnet"]))
    scorer = RewardScorer(load_model(args, ENCODER, trainable=False), load_tokenizer(args), 8, 32, kind=ENCODER)
    assert scorer.scoring == "padded (eager attention)"
    scores = scorer.score([[{"role": "user", "content": "premise"}]] * 2, ["a reply", "another reply"])
    assert len(scores) == 2 and scores[0] != scores[1]
