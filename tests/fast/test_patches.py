"""The private names of TRL and Liger that the pipeline relies on: each test fails as soon as a
new release renames one, instead of a stage silently losing the change it asked for. common/trl_compat.py
lists them all (tests/test_trl_compat.py checks each); these also check how the patches use them."""
from __future__ import annotations

import inspect

import pytest
import torch
import trl


def test_trainers_still_filter_columns_through_signature_columns():
    # common.fast.model_changes.add_length_column extends the column filter of TRL's trainers.
    for trainer in (trl.SFTTrainer, trl.RewardTrainer):
        assert callable(getattr(trainer, "_set_signature_columns_if_needed", None)), trainer
        assert "_signature_columns" in inspect.getsource(trainer._set_signature_columns_if_needed)


def test_grpo_still_tokenizes_prompts_and_accepts_a_rollout_function():
    # common.fast.static_decoder.grpo_rollout tokenises prompts exactly as TRL does, and is passed as rollout_func.
    assert callable(getattr(trl.GRPOTrainer, "_tokenize_prompts", None))
    assert "rollout_func" in inspect.signature(trl.GRPOTrainer.__init__).parameters


def test_length_column_survives_the_column_filter(tiny_model):
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from common import trl_compat
    from common.fast.model_changes import add_length_column
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    data = Dataset.from_list([{"chosen_ids": [1, 2, 3], "rejected_ids": [1, 2]}] * 4)
    args = trl.RewardConfig(output_dir="/tmp/unused", use_cpu=True, bf16=False, report_to="none",
                            train_sampling_strategy="group_by_length")
    trainer = trl.RewardTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=data)
    assert add_length_column(trainer)
    kept = trl_compat.remove_unused_columns(trainer, trainer.train_dataset)
    assert "length" in kept.column_names and kept["length"] == [3] * 4


def test_trainer_hooks_of_token_budget_batches_still_exist():
    # common.fast.token_budget: the Trainer's column filter (private), the step's micro-batches fetched in
    # get_batch_samples, and training_step reading loss_is_scaled_for_ga (transformers >= 5.19).
    import transformers
    trainer = transformers.Trainer
    assert callable(getattr(trainer, "_remove_unused_columns", None))
    assert list(inspect.signature(trainer.get_batch_samples).parameters) == ["self", "epoch_iterator", "num_batches",
                                                                              "device"]
    assert "get_batch_samples" in inspect.getsource(trainer._run_epoch)
    assert "self.loss_is_scaled_for_ga" in inspect.getsource(trainer.training_step)


def _rope_inputs(B=3, H=4, KV=2, T=5, D=8):
    """q, k as Llama's attention makes them (a transposed view of the projections' output) and
    cos/sin for per-row positions (left padding shifts them)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    torch.manual_seed(0)
    q = torch.randn(B, T, H, D, requires_grad=True)
    k = torch.randn(B, T, KV, D, requires_grad=True)
    positions = torch.stack([torch.arange(T) + shift for shift in range(B)])
    cos, sin = LlamaRotaryEmbedding(LlamaConfig(hidden_size=H * D, num_attention_heads=H))(q, positions)
    return q, k, cos, sin


def test_batch_folded_rope_equals_the_batched_one_values_and_gradients():
    """apply_liger_kernels folds the batch into one sequence so that Liger's kernel, which compiles
    per batch size, compiles once; the rotation (and its gradient) is that of the batched call."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from common.fast.model_changes import batch_folded_rope
    q, k, cos, sin = _rope_inputs()
    results = []
    for rope in (apply_rotary_pos_emb, batch_folded_rope(apply_rotary_pos_emb)):
        q.grad = k.grad = None
        rq, rk = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        (rq.square().sum() + rk.sum()).backward()
        results.append([rq.detach(), rk.detach(), q.grad.clone(), k.grad.clone()])
    for mine, theirs in zip(*results):
        torch.testing.assert_close(mine, theirs)
    wrong = batch_folded_rope(apply_rotary_pos_emb)(q.transpose(1, 2), k.transpose(1, 2), cos.flip(0), sin.flip(0))[0]
    assert not torch.allclose(wrong, results[0][0])  # each row keeps its own positions


@pytest.mark.gpu  # Liger's Triton RoPE
def test_gpu_batch_folded_liger_rope_equals_hf_rope():
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from common.fast.model_changes import batch_folded_rope
    q, k, cos, sin = (t.detach().cuda() for t in _rope_inputs(B=4, H=32, KV=8, T=40, D=128))
    ref = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    mine = batch_folded_rope(liger_rotary_pos_emb)(q.transpose(1, 2).clone(), k.transpose(1, 2).clone(), cos, sin)
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_partial_offload_keeps_its_budget_and_gives_the_same_gradients():
    """offload_keep_gib: saved tensors stay until the budget is kept, the rest go to CPU memory and come
    back for backward; the gradients are those of a plain backward, bit for bit."""
    from common.fast.offload import OffloadBeyond
    torch.manual_seed(0)
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)

    def loss():
        h = x
        for _ in range(6):
            h = torch.tanh(h @ w)
        return h.sum()
    plain = torch.autograd.grad(loss(), w)[0]
    one = 32 * 64 * 4  # bytes of one saved activation
    for keep in (0, 3 * one, 100 * one):
        hooks = OffloadBeyond(keep, min_bytes=0)
        with hooks:
            value = loss()
        assert torch.equal(torch.autograd.grad(value, w)[0], plain), keep
        assert hooks.kept <= max(keep, 0) and (hooks.offloaded > 0) == (keep < 100 * one), (keep, hooks.kept)


def _sines(x: torch.Tensor, layers: int) -> torch.Tensor:
    """A chain whose every op saves one tensor, its input: backward takes them back in reverse order."""
    for _ in range(layers):
        x = torch.sin(x)
    return x.sum()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])  # on a GPU: the copies on a side stream
def test_offload_copies_each_tensor_back_before_backward_needs_it(device):
    """Taking one offloaded tensor back starts the copy of the one saved before it: every tensor but the
    first taken back has arrived when backward asks, and the gradients are a plain backward's, bit for bit
    (on a GPU the copies run on a side stream while the compute stream works)."""
    from common.fast.offload import OffloadBeyond
    torch.manual_seed(0)
    x = torch.randn(512, 1024, device=device, requires_grad=True)  # 2 MiB a saved input
    plain = torch.autograd.grad(_sines(x, 8), x)[0]
    hooks = OffloadBeyond(0)
    with hooks:
        value = _sines(x, 8)
    assert torch.equal(torch.autograd.grad(value, x)[0], plain)
    assert hooks.tensors_offloaded == 8 and hooks.arrived_early == 7


def test_offloaded_copies_are_freed_by_backward_not_by_the_garbage_collector():
    """The hooks object lives on in a reference cycle; the CPU copies must not: backward frees each one,
    or every step would pin a new copy of every saved input."""
    import gc
    import weakref

    from common.fast.offload import OffloadBeyond
    x = torch.randn(512, 1024, requires_grad=True)
    gc.disable()
    try:
        hooks = OffloadBeyond(0)
        with hooks:
            value = _sines(x, 4)
            copies, item = [], hooks.last
            while item is not None:
                copies.append(weakref.ref(item))
                item = item.before
        assert len(copies) == 4 and all(c() is not None for c in copies)
        torch.autograd.grad(value, x)
        del value
        assert [c() for c in copies] == [None] * 4
    finally:
        gc.enable()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])  # on a GPU: the flash and cuDNN kernels' records
def test_kept_attention_outputs_give_the_checkpointed_gradients_without_running_attention_again(tiny_model, device):
    """keep_attention_outputs: each layer's recomputation gets its attention kernel's outputs from the forward's
    record (one replay a layer, no attention kernel run in backward) and the gradients are those of plain
    reentrant checkpointing with offloading, bit for bit (the tiny model, float32, SDPA; in bf16 on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AutoModelForCausalLM

    from common.fast.kept_attention import ATTENTION_KERNELS, keep_attention_outputs
    from common.fast.offload import OffloadBeyond

    class CountKernels(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.runs = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.runs += func in ATTENTION_KERNELS
            return func(*args, **(kwargs or {}))

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    ids = torch.randint(0, 200, (2, 64), device=device)
    grads, runs_in_backward = [], []
    for keep in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=dtype, attn_implementation="sdpa")
        model.to(device).train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        model.enable_input_require_grads()  # reentrant checkpointing needs an input that requires grad
        kept = keep and keep_attention_outputs(model)
        with OffloadBeyond(0, min_bytes=0):
            loss = model(input_ids=ids, labels=ids).loss
        with CountKernels() as counter:
            loss.backward()
        runs_in_backward.append(counter.runs)
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    layers = model.config.num_hidden_layers
    assert kept == layers and runs_in_backward == [layers, 0]
    assert sum(layer._gradient_checkpointing_func.replayed for layer in model.model.layers) == layers
    for g, h in zip(*grads, strict=True):
        assert torch.equal(g, h)


def test_an_offloaded_tensor_comes_back_equal_and_a_dense_one_with_its_strides():
    from common.fast.offload import Offloaded
    base = torch.randn(2, 3, 4, 5)
    for tensor, dense in ((base.permute(0, 2, 1, 3), True), (base.transpose(1, 3), True), (base[:, :2], False),
                          (torch.randn(4, 1).expand(4, 3), False)):
        back = Offloaded(tensor, before=None).fetch()
        assert torch.equal(back, tensor)
        assert back.stride() == tensor.stride() if dense else back.is_contiguous()
