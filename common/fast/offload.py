"""Saved activations in CPU memory: what autograd saves for backward inside a training forward (with reentrant
checkpointing, each layer's input) is copied to pinned CPU memory and back when backward needs it. On a GPU
the copies run on a side stream, ahead of the compute that needs them."""
from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger("pipeline")


def offload_saved_activations(model, keep_bytes: int = 0) -> None:
    """Inside each training forward, what autograd saves for backward (with reentrant checkpointing: each
    layer's input) goes to pinned CPU memory, once `keep_bytes` of it are kept on the GPU: 32k-token inputs
    then fit a small GPU, and a GPU with room copies only what it lacks room for."""
    active, said = [], []

    def enter(module, args):
        if module.training and torch.is_grad_enabled():
            ctx = OffloadBeyond(keep_bytes)
            ctx.__enter__()
            active.append(ctx)

    def leave(module, args, output):
        if active:
            ctx = active.pop()
            ctx.__exit__(None, None, None)
            if not said:
                log.info("offload_activations: the first forward kept %.2f GiB of saved activations on the GPU and "
                         "copied %.2f GiB to CPU memory", ctx.kept / 2 ** 30, ctx.offloaded / 2 ** 30)
                said.append(True)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave)


class OffloadBeyond(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors stay where they are until `keep_bytes` are kept; later ones of a megabyte or more are
    copied to (pinned) CPU memory and back when backward needs them, as torch's `save_on_cpu` does with
    every one (smaller ones are not worth a copy). On a GPU the copies run on a side stream, so neither
    direction stalls the compute: a copy out overlaps the rest of the forward, and when backward takes one
    tensor back, the copy in of the one saved before it starts, to arrive while this one's layer is
    recomputed (backward takes them back in the reverse order)."""

    def __init__(self, keep_bytes: int, min_bytes: int = 2 ** 20):
        self.kept = self.offloaded = 0
        self.tensors_offloaded = self.arrived_early = 0  # the second: tensors backward found copied back
        self.last: Offloaded | None = None  # each links to the one saved before it, not a list: the hooks
        # live on in a reference cycle until the garbage collector runs, and must not keep the copies alive

        def pack(tensor):
            size = tensor.numel() * tensor.element_size()
            if size < min_bytes or self.kept + size <= keep_bytes:
                self.kept += size
                return tensor
            self.offloaded += size
            self.tensors_offloaded += 1
            self.last = Offloaded(tensor, before=self.last)
            return self.last

        def unpack(packed):
            if not isinstance(packed, Offloaded):
                return packed
            self.arrived_early += packed.on_device is not None
            tensor = packed.fetch()
            if packed.before is not None:
                packed.before.prefetch()
            return tensor

        super().__init__(pack, unpack)

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.last = None  # from here the autograd graph alone holds the copies


class Offloaded:
    """One saved tensor in CPU memory. On a GPU its copies run on one side stream, ordered against the
    compute stream by waits, never by synchronising the host."""

    def __init__(self, tensor: torch.Tensor, before: Offloaded | None):
        self.before, self.device = before, tensor.device
        self.stream = _copy_stream(tensor.device) if tensor.is_cuda else None
        # empty_like keeps a dense tensor's strides (an attention kernel's output is a permuted buffer, and its
        # backward sees it as the kernel made it); any other comes back contiguous.
        self.on_cpu = torch.empty_like(tensor, device="cpu", pin_memory=tensor.is_cuda)
        self.on_device, self.arrived = None, None
        if self.stream is None:
            self.on_cpu.copy_(tensor)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the tensor is written
        with torch.cuda.stream(self.stream):
            self.on_cpu.copy_(tensor, non_blocking=True)
        tensor.record_stream(self.stream)  # its memory is not reused before the copy has read it

    def prefetch(self) -> None:
        """Start the copy back (a plain copy on the CPU)."""
        if self.on_device is not None:
            return
        if self.stream is None:
            self.on_device = self.on_cpu.clone()
            return
        compute = torch.cuda.current_stream(self.device)
        self.on_device = torch.empty_like(self.on_cpu, device=self.device)  # from the compute stream's memory
        self.stream.wait_stream(compute)  # that memory is free for the side stream to write
        with torch.cuda.stream(self.stream):
            self.on_device.copy_(self.on_cpu, non_blocking=True)
            self.arrived = torch.cuda.Event()
            self.arrived.record(self.stream)

    def fetch(self) -> torch.Tensor:
        """The tensor back on its device, ready for the compute stream."""
        self.prefetch()
        if self.arrived is not None:
            torch.cuda.current_stream(self.device).wait_event(self.arrived)
        tensor, self.on_device, self.arrived = self.on_device, None, None  # backward owns it now
        return tensor


@functools.lru_cache(maxsize=None)
def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream a GPU for the copies of offloaded activations."""
    return torch.cuda.Stream(device)
