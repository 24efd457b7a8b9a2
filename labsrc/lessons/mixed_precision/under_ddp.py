"""Mixed precision under DDP: the bytes DDP's gradient all-reduce carries per precision, and accumulation with a GradScaler."""
from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from labsrc.training.loop import autocast

MESSAGE_MODES = {
    # mode: (precision of the forward, dtype the all-reduce carries (None: the bucket's own), parameters' dtype)
    "fp32": ("fp32", None, torch.float32),
    "bf16 autocast": ("bf16", None, torch.float32),
    "fp16 autocast + GradScaler": ("fp16", None, torch.float32),
    "fp32 + bf16_compress_hook": ("fp32", torch.bfloat16, torch.float32),
    "bf16 parameters": ("fp32", None, torch.bfloat16),
}


class CountingHook:
    """A DDP comm hook that all-reduces each gradient bucket as torch's hooks do and counts what it sends.

    wire_dtype None: like default_hooks.allreduce_hook (divide by the world size, all-reduce the bucket's
    own buffer). wire_dtype torch.bfloat16 / torch.float16: like bf16_compress_hook / fp16_compress_hook
    (cast, divide, all-reduce the cast copy, copy back). bytes_by_dtype counts the bytes handed to the
    all-reduce, by dtype name; syncs the backward passes that all-reduced (each hands over one last bucket).
    """

    def __init__(self, wire_dtype: torch.dtype | None = None):
        self.wire_dtype = wire_dtype
        self.bytes_by_dtype: dict[str, int] = {}
        self.syncs = 0
        """Backward passes whose gradients were all-reduced: buckets handed over with bucket.is_last()."""

    def hook(self, process_group, bucket):  # register this bound method; unannotated: DDP checks annotations, which are strings here
        """process_group: None (the default group) or a group; bucket: dist.GradBucket -> Future[Tensor]."""
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        wire = buffer if self.wire_dtype is None else buffer.to(self.wire_dtype)
        wire.div_(dist.get_world_size(group))
        key = str(wire.dtype).replace("torch.", "")
        self.syncs += bucket.is_last()
        self.bytes_by_dtype[key] = self.bytes_by_dtype.get(key, 0) + wire.numel() * wire.element_size()
        future = dist.all_reduce(wire, group=group, async_op=True).get_future()

        def back_into_bucket(done: torch.futures.Future) -> torch.Tensor:
            reduced = done.value()[0]
            if reduced is not buffer:
                buffer.copy_(reduced)
            return buffer

        return future.then(back_into_bucket)


@contextlib.contextmanager
def deterministic_kernels():
    """Deterministic kernels (cuDNN's, and torch's where it has one) for the block: on a GPU two runs of the same
    backward otherwise differ in the last bits (atomic additions in some backward kernels, cuDNN's choice of
    algorithm), and comparing two hooks' results bit for bit would compare those instead. The CPU kernels used
    here are deterministic already: the same bits either way."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield  # an op with no deterministic kernel warns (warn_only): the warning explains a mismatch, if one comes
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]


def _ddp_gradients(make_model, images, labels, mode: str, hook, steps: int) -> tuple[list, list[torch.Tensor]]:
    """Train a DDP copy of make_model() for steps backward passes (no optimizer) in mode with hook registered.

    hook: a CountingHook or torch's hook (None: DDP's default). Returns the bytes counted per step
    (empty for torch's hooks) and the gradients after the last step, as fp32.
    """
    precision, _, parameter_dtype = MESSAGE_MODES[mode]
    model = DDP(make_model().to(device=images.device, dtype=parameter_dtype))
    if hook is not None:
        model.register_comm_hook(None, hook.hook if isinstance(hook, CountingHook) else hook)
    scaler = torch.amp.GradScaler(images.device.type, enabled=precision == "fp16")
    counted = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        if isinstance(hook, CountingHook):
            hook.bytes_by_dtype = {}
        with autocast(images.device, precision):
            loss = F.cross_entropy(model(images.to(parameter_dtype)), labels)
        scaler.scale(loss).backward()
        if isinstance(hook, CountingHook):
            counted.append(dict(hook.bytes_by_dtype))
    return counted, [p.grad.detach().float().clone() for p in model.parameters()]


def message_bytes(make_model, images: torch.Tensor, labels: torch.Tensor, mode: str, steps: int = 2,
                  seed: int = 0) -> dict:
    """The bytes DDP hands to its gradient all-reduce in one backward, in one of MESSAGE_MODES.

    images: (N, C, H, W), labels: (N,), on this rank's device; call on every rank of a process group.
    The same model (seed) is trained once with a CountingHook and once with torch's own hook (default,
    or bf16_compress_hook), and the all-reduced gradients are compared: equal means the counting hook
    sends what torch's does. Returns bytes per step, bytes by dtype (last step), the gradients' element
    count, the parameters' dtype and whether the gradients equal torch's hook's.
    """
    _, wire_dtype, parameter_dtype = MESSAGE_MODES[mode]
    torch_hook = None if wire_dtype is None else default_hooks.bf16_compress_hook
    runs = []
    for hook in (CountingHook(wire_dtype), torch_hook):
        with torch.random.fork_rng(devices=[]), deterministic_kernels():
            torch.manual_seed(seed)
            runs.append(_ddp_gradients(make_model, images, labels, mode, hook, steps))
    (counted, mine), (_, theirs) = runs
    return {"bytes_per_step": [sum(step.values()) for step in counted], "bytes_by_dtype": counted[-1],
            "gradient_elements": sum(g.numel() for g in mine),
            "parameter_dtype": str(parameter_dtype).replace("torch.", ""),
            "equals_torch_hook": all(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True) for a, b in zip(mine, theirs))}


def accumulation_step(model: DDP, optimizer, scaler, micro_batches, device: torch.device,
                      mode: str) -> torch.Tensor:
    """One optimizer step of a DDP model over k micro-batches [(images (B, C, H, W), labels (B,)), ...].

    The first k-1 run forward and backward inside model.no_sync() (gradients pile up locally); the
    last one syncs, so DDP all-reduces the sum once. Each loss is divided by k, so the step uses the
    mean gradient. Returns this rank's loss over its k micro-batches (a 0-dim tensor). mode: "bf16" or
    "fp16" (fp16 needs an enabled GradScaler; bf16 a disabled one).
    """
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[mode]
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=device)
    count = len(micro_batches)
    for index, (images, labels) in enumerate(micro_batches):
        sync = contextlib.nullcontext() if index == count - 1 else model.no_sync()
        with sync:  # forward too: DDP decides in forward whether this backward all-reduces
            with torch.autocast(device_type=device.type, dtype=dtype):
                loss = F.cross_entropy(model(images), labels) / count
            scaler.scale(loss).backward()
        total += loss.detach().float()
    scaler.step(optimizer)
    scaler.update()
    return total


def micro_batch_mean_gradient(module: torch.nn.Module, micro_batches, device: torch.device, mode: str) -> torch.Tensor:
    """The gradient one optimizer step over these micro-batches must apply, computed without accumulating.

    Each micro-batch's mean-loss gradient on its own (fresh .grad every time), averaged over the k micro-batches,
    then over the ranks (all_reduce / world size). That is the large batch's gradient, micro-batch by
    micro-batch: BatchNorm still sees each micro-batch's statistics, as under accumulation. module: a copy of
    the DDP model's module taken before the step. Returns the flat fp32 gradient (all parameters, in order).
    """
    total = None
    for images, labels in micro_batches:
        module.zero_grad(set_to_none=True)
        with autocast(device, mode):
            loss = F.cross_entropy(module(images), labels)
        loss.backward()
        flat = torch.cat([p.grad.detach().float().reshape(-1) for p in module.parameters()])
        total = flat if total is None else total + flat
    total /= len(micro_batches)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total)
        total /= dist.get_world_size()
    return total


def gradient_gap(model: torch.nn.Module, reference: torch.Tensor) -> float | None:
    """Largest |.grad - reference| over the largest |reference|, for the flat gradient of every parameter.

    None when .grad holds inf or NaN (a step the GradScaler skipped: there is nothing to compare).
    """
    grads = torch.cat([p.grad.detach().float().reshape(-1) for p in model.parameters()])
    if not torch.isfinite(grads).all():
        return None
    return ((grads - reference).abs().max() / reference.abs().max()).item()



ACCUMULATION_VARIANTS = ("correct", "no no_sync", "loss not divided by k")
"""accumulation_step itself, and its two mistakes that raise no error."""


def _mistaken_step(model: DDP, optimizer, scaler, micro_batches, device: torch.device, mode: str, variant: str):
    """accumulation_step with one mistake: "no no_sync" (every backward all-reduces) or "loss not divided by k"."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[mode]
    optimizer.zero_grad(set_to_none=True)
    count = len(micro_batches)
    for index, (images, labels) in enumerate(micro_batches):
        quiet = index < count - 1 and variant != "no no_sync"
        with model.no_sync() if quiet else contextlib.nullcontext():
            with torch.autocast(device_type=device.type, dtype=dtype):
                loss = F.cross_entropy(model(images), labels)
                loss = loss if variant == "loss not divided by k" else loss / count
            scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def accumulation_variants(make_model, micro_batches, device: torch.device, mode: str, seed: int = 0) -> list[dict]:
    """One optimizer step over the same micro-batches from the same weights, per ACCUMULATION_VARIANTS.

    Call on every rank of a process group. Per variant: the backward passes that all-reduced, the bytes handed
    to all-reduce (a CountingHook), the model's gradient bytes, and gradient_gap against the mean of the
    micro-batches' gradients (None where the GradScaler skipped the step).
    """
    rows = []
    for variant in ACCUMULATION_VARIANTS:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = DDP(make_model().to(device))
        counter = CountingHook()
        model.register_comm_hook(None, counter.hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler(device.type, enabled=mode == "fp16")
        reference = micro_batch_mean_gradient(copy.deepcopy(model.module), micro_batches, device, mode)
        if variant == "correct":
            accumulation_step(model, optimizer, scaler, micro_batches, device, mode)
        else:
            _mistaken_step(model, optimizer, scaler, micro_batches, device, mode, variant)
        rows.append({"variant": variant, "allreduce_syncs": counter.syncs,
                     "allreduced_bytes": sum(counter.bytes_by_dtype.values()),
                     "gradient_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                     "gradient_gap": gradient_gap(model, reference)})
    return rows
