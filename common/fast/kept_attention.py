"""Attention kept through the recomputation: a checkpointed layer's backward recomputes its forward, attention
included, though attention's output is all that backward needs of it beside its inputs.

With `keep_attention_outputs` (and offload_activations), each checkpointed decoder layer's forward records
what its fused attention kernel returned (output, log-sum-exp and the kernel's own bookkeeping), copies it to
CPU memory with the layer's input (`Offloaded`), and the recomputation in backward gets those outputs back
instead of running the kernel again. Autograd still records the kernel's own node, with its own backward,
over the recomputed q, k and v: the gradients are the plain checkpointed ones, bit for bit
(tests/fast/test_patches.py). Whatever kernel SDPA picks (flash, cuDNN, memory-efficient, or the CPU's flash) is
recorded; SDPA's math path runs as before. At 20,480 tokens a layer's attention forward is several TFLOP,
its output the size of the layer's input (docs/performance.md).
"""
from __future__ import annotations

import functools
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import TrainerCallback

from common import trl_compat
from common.fast.offload import Offloaded

aten = torch.ops.aten
ATTENTION_KERNELS = {aten._scaled_dot_product_flash_attention.default,
                     aten._scaled_dot_product_cudnn_attention.default,
                     aten._scaled_dot_product_efficient_attention.default,
                     aten._scaled_dot_product_flash_attention_for_cpu.default}
# Kernels that compute the log-sum-exp backward needs only when asked (argument 4, `compute_log_sumexp`): SDPA
# does not ask in a forward without grad, as a reentrant checkpoint's first forward is.
ASKED_FOR_LOG_SUMEXP = {aten._scaled_dot_product_cudnn_attention.default,
                        aten._scaled_dot_product_efficient_attention.default}


class KeepAttentionOutputs(TrainerCallback):
    """The Trainer turns checkpointing on for every decoder layer as training begins; then each checkpointed
    layer keeps its attention's outputs for the recomputation."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        keep_attention_outputs(model)


def keep_attention_outputs(model) -> int:
    """Wrap the checkpoint function of each of `model`'s checkpointed decoder layers; returns how many."""
    from transformers.modeling_layers import GradientCheckpointingLayer  # internal: common/trl_compat.py
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
              and not isinstance(getattr(m, "_gradient_checkpointing_func", None), KeepingAttention)]
    before = None
    for layer in layers:
        keeping = before = KeepingAttention(layer._gradient_checkpointing_func, before)
        layer._gradient_checkpointing_func = keeping
        attention = getattr(layer, "self_attn", None)  # the record's scope: the attention module where there is one
        if attention is not None:
            restore_attention(attention)
            attention.forward = keeping.within(attention)
        else:
            keeping.whole_layer = True
    return len(layers)


def restore_attention(module) -> None:
    """The module's own forward again (a model trained twice in one process, as the bench does)."""
    if hasattr(module.__dict__.get("forward"), "__wrapped__"):
        del module.forward


class KeepingAttention:
    """A checkpoint function that gives each call (one layer, one forward) its own record of attention outputs.
    The record rides in the function that the checkpoint keeps for its recomputation, so the recomputation
    finds the outputs of its own forward, whatever else ran in between. Operations go through the record's
    dispatch mode only inside the layer's attention module (or the whole layer, where it has none)."""

    def __init__(self, checkpoint, before: KeepingAttention | None = None):
        self.checkpoint, self.before = checkpoint, before  # before: the layer under this one
        self.latest = lambda: None  # the record of this layer's latest forward, weakly
        self.record: AttentionRecord | None = None  # while one of this layer's checkpointed passes runs
        self.replaying = False  # that pass is the recomputation
        self.whole_layer = False
        self.replayed = 0  # kernels not run again in recomputations (tests and logs read it)

    def __call__(self, function, *args, **kwargs):
        if not torch.is_grad_enabled():  # no backward will follow: nothing to keep
            return self.checkpoint(function, *args, **kwargs)
        return self.checkpoint(functools.partial(self._run, AttentionRecord(), function), *args, **kwargs)

    def _run(self, record, function, *args, **kwargs):
        replaying = record.outputs is not None
        if replaying:
            # Backward recomputes the layers top down: the next layer's outputs start to come back now, and
            # this layer's have (started when the layer above it was recomputed, or now for the top one).
            below = self.before.latest() if self.before else None
            for each in (record, below):
                if each is not None and each.outputs:
                    each.prefetch()
            record.next = 0
        else:
            record.outputs = []
            self.latest = weakref.ref(record)
        self.record, self.replaying = record, replaying
        try:
            if self.whole_layer:
                with RecordOrReplay(record, replaying):
                    out = function(*args, **kwargs)
            else:
                out = function(*args, **kwargs)
        finally:
            self.record = None
        self.replayed += replaying * len(record.outputs)
        return out

    def within(self, module):
        """The attention module's forward under the record of the pass that is running, if any."""
        forward = module.forward

        @functools.wraps(forward)
        def run(*args, **kwargs):
            if self.record is None or self.whole_layer or trl_compat.attn_implementation(module) != "sdpa":
                return forward(*args, **kwargs)  # FlexAttention's operator runs under torch.compile, not a mode
            with RecordOrReplay(self.record, self.replaying):
                return forward(*args, **kwargs)
        return run


class AttentionRecord:
    """What one layer's attention kernels returned in its forward, in CPU memory (tensors of a megabyte or more
    while on a GPU), in the order they ran."""

    def __init__(self):
        self.outputs: list | None = None
        self.next = 0  # the next output to replay

    def prefetch(self):
        for kernel, outputs in self.outputs:
            for value in outputs:
                if isinstance(value, Offloaded):
                    value.prefetch()

    def replay(self, kernel) -> tuple:
        recorded, outputs = self.outputs[self.next]
        if recorded is not kernel:
            raise RuntimeError(f"the recomputation ran {kernel} where its forward ran {recorded}")
        self.next += 1
        return tuple(value.fetch() if isinstance(value, Offloaded) else
                     value.detach() if isinstance(value, torch.Tensor) else value for value in outputs)


class RecordOrReplay(TorchDispatchMode):
    """Below autograd: an attention kernel's call runs and is recorded in the forward, and is answered from
    the record in the recomputation. Every other operation runs as it is."""

    def __init__(self, record: AttentionRecord, replaying: bool):
        super().__init__()
        self.record, self.replaying = record, replaying

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in ATTENTION_KERNELS:
            return func(*args, **(kwargs or {}))
        if self.replaying:
            return self.record.replay(func)
        if func in ASKED_FOR_LOG_SUMEXP:
            args = (*args[:4], True, *args[5:])
        outputs = func(*args, **(kwargs or {}))
        self.record.outputs.append((func, tuple(_offload(value) for value in outputs)))
        return outputs


def _offload(value):
    """A GPU tensor of a megabyte or more to CPU memory (its copy on the side stream); anything else as it is."""
    if isinstance(value, torch.Tensor) and value.is_cuda and value.numel() * value.element_size() >= 2 ** 20:
        return Offloaded(value, before=None)
    return value
