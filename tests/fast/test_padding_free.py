"""Padding-free reward-model training (`padding_free`, common/fast/padding_free.py), and which models may
drop their attention mask (`unmask_right_padding`: causal decoders only).

The packed forward gives the padded model's rewards, row for row; one optimiser step of padding-free
token-budget micro-batches gives the loss and LoRA gradients of one plain padded batch (tiny model,
float32, the CPU's SDPA path of the same document mask)."""
from __future__ import annotations

import pytest
import torch
from conftest import TINY, set_tf32
from test_token_budget import BUDGET, _lora_model, _relative_error, build, one_step

from common.config import ConfigError, ModelArgs, RewardStageConfig
from common.fast.model_changes import unmask_right_padding
from common.fast.padding_free import packed_rewards, unpad_rows
from common.fast.shared_prompt import common_prefix, pack


def test_packed_row_mask_keeps_groups_and_branches_apart():
    # row 0: group 0 (prefix [5, 6], branches [7, 8] and [9]) then group 1 (no prefix, one branch [4, 4]);
    # row 1: one group (prefix [3], branch [2]), padded
    packed = pack([[(torch.tensor([5, 6]), [torch.tensor([7, 8]), torch.tensor([9])]),
                    (torch.tensor([], dtype=torch.long), [torch.tensor([4, 4])])],
                   [(torch.tensor([3]), [torch.tensor([2])])]], "cpu")
    assert packed.ids.tolist() == [[5, 6, 7, 8, 9, 4, 4], [3, 2, 0, 0, 0, 0, 0]]
    assert packed.positions[0].tolist() == [0, 1, 2, 3, 2, 0, 1]  # a branch continues its prefix
    assert packed.starts.tolist() == [2, 4, 5, 8] and packed.prefix_starts.tolist() == [0, 5, 7]  # flattened
    mask = packed.mask("sdpa")[:, 0]
    q, kv = torch.meshgrid(torch.arange(7), torch.arange(7), indexing="ij")
    doc, branch = packed.doc[0], packed.branch[0]
    assert torch.equal(mask[0], (kv <= q) & (doc[q] == doc[kv]) & ((branch[kv] == 0) | (branch[kv] == branch[q])))
    assert mask[0, 4, 1] and mask[0, 4, 4] and not mask[0, 4, 3] and not mask[0, 4, 2]  # prefix and itself only
    assert mask[0, 5, 5] and not mask[0, 5, 4]  # a group never sees the one before it
    assert mask[1, 1, :2].all() and not mask[1, :2, 2:].any()  # real tokens never see the padding
    assert mask[1].any(-1).all()  # and no query row is empty
    assert common_prefix([torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4, 5])]) == 2
    assert common_prefix([torch.tensor([1, 2]), torch.tensor([1, 2, 4])]) == 1  # every branch keeps a token


@pytest.mark.parametrize("share_prompt", [False, True])
def test_packed_forward_gives_the_padded_rewards(share_prompt):
    model = _lora_model("reward", ModelArgs(model_name_or_path=str(TINY), lora_dropout=0.0))
    pad = model.config.pad_token_id
    lengths = [7, 3, 11, 5]  # pairs (0, 2) and (1, 3): TRL's chosen rows, then its rejected rows
    ids = torch.full((4, 11), pad)
    mask = torch.zeros(4, 11, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(3, 500, (n,), generator=g)
        mask[row, :n] = 1
    ids[2, :4] = ids[0, :4]  # pair 0 shares a 4-token prompt
    ids[1, 2] = pad  # a sequence ending in the pad token: the head reads the token before it, as HF's does
    ids[3, :2] = ids[1, :2]  # ... and pair 1 shares the tokens before it
    ids, mask = ids.to(model.device), mask.to(model.device)  # the 4-bit model sits on the GPU where there is one
    model.train()
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask).logits
        unpad_rows(model, share_prompt=share_prompt)
        packed = model(input_ids=ids, attention_mask=mask).logits
    assert packed.shape == padded.shape == (4, 1)
    assert torch.allclose(packed, padded, atol=1e-5), (packed, padded)
    assert len(set(padded[:, 0].tolist())) == 4  # four different rewards: a mix-up of rows would show
    model.eval()  # scoring keeps the padded forward
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids, attention_mask=mask).logits, padded, atol=1e-5)


def test_the_flex_forward_runs_the_main_kernel_and_gives_the_sdpa_rewards(monkeypatch, fresh_compile):
    """FlexAttention's packed forward (the GPU's; the CPU has its forward, not its backward) asks for the main
    kernel, since Inductor's decoding kernel, which it picks for rows under 128 tokens, fails on a GPU for short
    fp32 rows; the rewards equal the SDPA mask's."""
    import transformers.integrations.flex_attention as hf_flex
    model = _lora_model("reward", ModelArgs(model_name_or_path=str(TINY), lora_dropout=0.0)).eval()
    classifier = model.get_base_model()
    g = torch.Generator().manual_seed(1)
    rows = [[[torch.randint(3, 500, (n,), generator=g) for n in (9, 13)], [torch.randint(3, 500, (20,), generator=g)]]]
    asked = []
    real = hf_flex.compile_friendly_flex_attention
    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention",
                        lambda *a, **k: asked.append(k.get("kernel_options")) or real(*a, **k))
    with torch.no_grad():
        sdpa = packed_rewards(classifier, rows, "sdpa")
        assert not asked
        classifier.set_attn_implementation("flex_attention")
        flex = packed_rewards(classifier, rows, "flex_attention")
    assert asked and all(k == {"FORCE_USE_FLEX_ATTENTION": True} for k in asked), asked
    assert torch.allclose(flex, sdpa, atol=1e-5) and len(set(sdpa[:, 0].tolist())) == 3, (flex, sdpa)


@pytest.mark.slow
@pytest.mark.parametrize("budget,share", [(BUDGET["reward"], True), (120, True), (120, False)])
def test_padding_free_step_equals_one_padded_batch(tmp_path, budget, share):
    plain = build("reward", tmp_path / "plain")
    _tf32_on_a_gpu()
    loss, grads, sizes = one_step(plain)
    assert sizes == [16] and "unmask_right_padding" in plain.applied
    packed = build("reward", tmp_path / "packed", max_tokens_per_batch=budget, padding_free=True, prompt_once_per_pair=share)
    _tf32_on_a_gpu()
    assert packed.applied[0] == "padding_free" and "unmask_right_padding" not in packed.applied
    assert ("prompt_once_per_pair" in packed.applied) == share
    packed_loss, packed_grads, packed_sizes = one_step(packed)
    assert len(packed_sizes) > 1 and sum(packed_sizes) == 16  # several micro-batches, every pair once
    loss_tolerance, grad_tolerance = (2e-3, 1e-2) if torch.cuda.is_available() else (1e-5, 1e-4)
    assert abs(packed_loss - loss) < loss_tolerance * abs(loss)
    assert grads.keys() == packed_grads.keys()
    for name, grad in grads.items():
        assert _relative_error(packed_grads[name], grad) < grad_tolerance, name


def _tf32_on_a_gpu():
    """On a GPU the padding-free steps run with TF32 matmuls, as the stages' trainers set them. With TF32 on,
    these steps compiled on an H200 (torch 2.11) and matched to 1e-3 in gradients (docs/performance.md);
    since the test turned TF32 off (exact_fp32), Inductor found no FlexAttention backward kernel for its
    fp32 attention ("No choices exist for backend"). Not the tiny shape: head_dim 16 is the smallest the
    Triton template takes, and a stage's model (bf16 parts on the 4-bit base) never runs fp32 attention."""
    if torch.cuda.is_available():
        set_tf32(True)


def test_padding_free_budget_counts_real_tokens(tmp_path):
    trainer = build("reward", tmp_path, max_tokens_per_batch=BUDGET["reward"], padding_free=True)
    loader = trainer.get_train_dataloader()
    assert loader.batch_sampler.rows == 0
    for batch in loader:  # what a micro-batch runs: the real tokens of both replies, within the budget
        real = int(batch["attention_mask"].sum())
        assert real <= BUDGET["reward"] or len(batch["input_ids"]) == 2


def test_padding_free_is_for_the_pairwise_4bit_judge():
    for over in ({"judge_backbone": "encoder"}, {"judge_objective": "pointwise"}):
        with pytest.raises(ConfigError, match="padding_free"):
            RewardStageConfig(pairs_run="x", padding_free=True, **over).check()


def test_only_causal_models_drop_their_mask():
    from transformers import BertConfig, BertForSequenceClassification
    encoder = BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                       intermediate_size=37, num_labels=1))
    assert unmask_right_padding(encoder) is False  # bidirectional: its real tokens see the padding
    assert not encoder._forward_pre_hooks
    decoder = _lora_model("reward", ModelArgs(model_name_or_path=str(TINY)))
    assert unmask_right_padding(decoder) is True and decoder._forward_pre_hooks
