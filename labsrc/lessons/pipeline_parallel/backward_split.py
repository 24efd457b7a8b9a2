"""The backward split in two, as zero-bubble schedules need it: B, the gradient of the stage's input (the upstream
stage waits for it), and W, the gradients of the weights (nobody waits for them). Modelled on torch's
torch/distributed/pipelining/_backward.py (stage_backward_input, stage_backward_weight): B also keeps the gradient
of each weighted layer's output, so W starts from there and never walks the chain of layers again."""
from __future__ import annotations

from collections import Counter

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


def forward_keeping_layer_outputs(module: nn.Module, stage_input: torch.Tensor):
    """(output, [(layer, its output)]) for every layer of module that holds parameters of its own."""
    layer_outputs = []
    keep = lambda layer, _args, output: layer_outputs.append((layer, output))   # noqa: E731
    hooks = [layer.register_forward_hook(keep) for layer in module.modules()
             if next(layer.parameters(recurse=False), None) is not None]
    try:
        return module(stage_input), layer_outputs
    finally:
        for hook in hooks:
            hook.remove()


def backward_input(stage_input, output, gradient, layer_outputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """B: the gradient of the stage's input, and of each weighted layer's output (kept for W).

    autograd computes only what leads to the tensors asked for: no weight gradient is computed here."""
    asked = [stage_input] + [layer_output for _, layer_output in layer_outputs]
    gradients = torch.autograd.grad(output, asked, gradient, retain_graph=True)   # W still needs the layers' inputs
    return gradients[0], list(gradients[1:])


def backward_weight(layer_outputs, layer_gradients) -> None:
    """W: each layer's weight gradients from its own output's gradient (kept by B), one layer at a time.

    Asking for one layer's parameters only, autograd runs that layer's backward node and nothing upstream of it:
    for a Linear, weight.grad += dY^T X and bias.grad += sum(dY), one matrix product."""
    for (layer, layer_output), layer_gradient in zip(layer_outputs, layer_gradients):
        torch.autograd.backward(layer_output, layer_gradient, inputs=list(layer.parameters(recurse=False)))


class CountingOps(TorchDispatchMode):
    """Counts the aten operators run inside it (the backward's too), and the FLOPs of its matrix products."""

    def __init__(self):
        super().__init__()
        self.ops, self.matmul_flops = Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if name in ("mm", "addmm"):
            left, right = args[-2], args[-1]
            self.matmul_flops += 2 * left.shape[0] * left.shape[1] * right.shape[1]
        return func(*args, **(kwargs or {}))


def backward_work(module: nn.Module, micro_batch: torch.Tensor) -> dict[str, CountingOps]:
    """One micro-batch through module, its backward counted three ways: "whole" (one backward), "B" and "W" (the
    split above, on a copy). Every output's gradient is ones; the input needs a gradient, as a received one does."""
    import copy
    counted = {}
    whole, split = copy.deepcopy(module), copy.deepcopy(module)
    stage_input = micro_batch.clone().requires_grad_()
    output = whole(stage_input)
    with CountingOps() as counted["whole"]:
        output.backward(torch.ones_like(output))
    stage_input = micro_batch.clone().requires_grad_()
    output, layer_outputs = forward_keeping_layer_outputs(split, stage_input)
    with CountingOps() as counted["B"]:
        _, layer_gradients = backward_input(stage_input, output, torch.ones_like(output), layer_outputs)
    with CountingOps() as counted["W"]:
        backward_weight(layer_outputs, layer_gradients)
    for mine, expected in zip(split.parameters(), whole.parameters()):
        torch.testing.assert_close(mine.grad, expected.grad)
    return counted
