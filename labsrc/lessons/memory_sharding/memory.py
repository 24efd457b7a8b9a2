"""Where a training step's bytes go: the ZeRO formulas per rank, bytes counted in what a rank holds, activations and checkpointing."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential


@dataclass(frozen=True)
class Layout:
    """Bytes per parameter of a training set-up: model parameters, gradients, optimizer state (K)."""

    key: str
    label: str
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int


# Mixed-precision Adam (ZeRO paper, Rajbhandari et al. 2020, section 3.1): fp16/bf16 parameters 2 and gradients
# 2 bytes; the optimizer keeps an fp32 master copy 4, momentum 4 and variance 4: K = 12.
MIXED = Layout("mixed", "bf16 params + fp32 master Adam (2 + 2 + 12)", 2, 2, 12)
# Plain fp32 Adam: parameters 4, gradients 4, momentum and variance 4 + 4 (no master copy needed): K = 8.
FP32 = Layout("fp32", "fp32 Adam (4 + 4 + 8)", 4, 4, 8)


def per_rank_formula(parameters: int, world_size: int, stage: int, layout: Layout = MIXED) -> dict[str, float]:
    """Bytes per rank for Psi = parameters at ZeRO `stage` (0: DDP, every rank holds everything).

    Stage 1 divides the optimizer state by n, stage 2 also the gradients, stage 3 also the parameters:
    (2 + 2 + 12) Psi -> (2 + 2 + 12/n) Psi -> (2 + (2 + 12)/n) Psi -> (2 + 2 + 12) Psi / n.
    """
    n = world_size
    return {"parameters": layout.parameter_bytes * parameters / (n if stage >= 3 else 1),
            "gradients": layout.gradient_bytes * parameters / (n if stage >= 2 else 1),
            "optimizer": layout.optimizer_bytes * parameters / (n if stage >= 1 else 1)}


def communication_formula(parameters: int, world_size: int, stage: int, element_bytes: int = 4) -> int:
    """Bytes a rank sends per step (ring collectives): DDP and stages 1-2 2(n-1)/n Psi, stage 3 3(n-1)/n Psi.

    Stages 1-2: reduce_scatter + all_gather = one all_reduce. Stage 3 gathers the weights twice (forward,
    backward) and reduce-scatters the gradients once: 1.5 x DDP.
    """
    passes = 3 if stage == 3 else 2
    return passes * parameters * element_bytes * (world_size - 1) // world_size


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def held_bytes(tensors) -> int:
    """Bytes of the tensors' elements."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def storage_bytes(tensors) -> int:
    """Bytes of the memory the tensors live in, each storage once: a view counts its whole buffer, two views of
    one buffer count it once. What a rank really holds, whatever the code meant to keep."""
    storages = {}
    for tensor in tensors:
        if tensor is not None:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def live_storages(extra=()) -> dict[int, int]:
    """{storage address: bytes} of every tensor alive in this process that the garbage collector sees, plus `extra`
    (a parameter's .grad has no Python object until it is read, so pass those). The difference of two calls
    is what was allocated in between and is still alive, wherever the code keeps it."""
    import gc
    storages = {}
    for candidate in [*gc.get_objects(), *extra]:
        if issubclass(type(candidate), torch.Tensor) and candidate.device.type != "meta":  # type(): no proxy warning
            try:
                storage = candidate.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:  # a tensor with no memory of its own (fake, functional), e.g. left by a trace
                continue
    return storages


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in a torch optimizer's state (momentum, variance, step counters)."""
    return held_bytes(v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))


def deep_mlp(depth: int, width: int, inputs: int = 16, outputs: int = 4, seed: int = 0) -> nn.Sequential:
    """(B, inputs) -> (B, outputs): depth blocks of Linear(width, width) + ReLU between two projections."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(inputs, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, outputs))
    torch.random.set_rng_state(generator_state)
    return nn.Sequential(*layers)


def relu_stack(depth: int, width: int, seed: int = 0) -> nn.Sequential:
    """(B, width) -> (B, width): depth blocks of Linear + ReLU, the model the checkpointing sweep cuts into segments."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    torch.random.set_rng_state(generator_state)
    return nn.Sequential(*layers)


def saved_activation_bytes(model: nn.Module, forward) -> int:
    """Bytes autograd saves for backward during forward(), parameters excluded, each storage counted once.

    Counted with saved-tensor hooks, so it works on any device. A ReLU's output saved by the ReLU and by
    the next Linear is one storage, counted once.
    """
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in parameters:
            seen[pointer] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = forward()
    output.float().pow(2).mean().backward()
    return sum(seen.values())


def predicted_saved_units(depth: int, segments: int) -> int:
    """Saved activations, in units of one block's output (B x width), after a checkpoint_sequential forward.

    The first k-1 segments keep only their input (k-1 units); the last segment runs unchecked and keeps its
    input and its n/k ReLU outputs: k + n/k units (k dividing n). Unchecked (k = 1 or k = n): n + 1.
    Smallest at k = sqrt(n): 2 sqrt(n) units.
    """
    if depth % segments:
        raise ValueError(f"{segments} segments do not divide {depth} blocks evenly")
    return segments + depth // segments


def best_segments(depth: int) -> int:
    """The k (dividing depth) that keeps the fewest activations: the divisor nearest sqrt(depth) from k + n/k."""
    return min((k for k in range(1, depth + 1) if depth % k == 0), key=lambda k: (k + depth // k, k))


def checkpoint_sweep(depth: int, width: int, batch: int, segments: list[int], repeats: int = 3,
                     seed: int = 0) -> list[dict]:
    """For each k: saved activation bytes, the prediction, forward+backward seconds, gradient gap to unchecked.

    x (batch, width); k = 0 means no checkpointing. Gradients must be identical: recomputing the same
    forward gives the same numbers.
    """
    model = relu_stack(depth, width, seed)
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(seed + 1))
    unit = batch * width * x.element_size()
    reference = _gradients(model, lambda: model(x))
    rows = []
    for k in [0] + list(segments):
        forward = (lambda: model(x)) if k == 0 else (lambda k=k: checkpoint_sequential(model, k, x, use_reentrant=False))
        saved = saved_activation_bytes(model, forward)
        gradients = _gradients(model, forward)
        gap = max(float((g - r).abs().max()) for g, r in zip(gradients, reference))
        rows.append({"segments": k, "saved_bytes": saved, "unit_bytes": unit,
                     "predicted_bytes": unit * (depth + 1 if k == 0 else predicted_saved_units(depth, k)),
                     "seconds": _fastest(model, forward, repeats), "gradient_gap": gap})
    return rows


def _gradients(model: nn.Module, forward) -> list[torch.Tensor]:
    model.zero_grad()
    forward().pow(2).mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def _fastest(model: nn.Module, forward, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        _gradients(model, forward)
        best = min(best, time.perf_counter() - start)
    return best


def activation_grid(depths: list[int], batches: list[int], width: int) -> list[dict]:
    """Saved activation bytes of the unchecked stack for each (depth, batch): (depth + 1) x batch x width x 4."""
    rows = []
    for depth in depths:
        model = relu_stack(depth, width)
        for batch in batches:
            x = torch.randn(batch, width)
            rows.append({"depth": depth, "batch": batch, "saved_bytes": saved_activation_bytes(model, lambda: model(x)),
                         "predicted_bytes": (depth + 1) * batch * width * 4})
    return rows
