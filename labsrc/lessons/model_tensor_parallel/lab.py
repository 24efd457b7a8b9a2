"""Layers split across ranks: the naive split, Megatron's column/row-parallel blocks, torch's tensor parallel API, the cost.

    python -m labsrc.launch --nproc 2 model_tensor_parallel
    torchrun --nproc-per-node 2 -m labsrc.lessons.model_tensor_parallel.lab --hidden 128
Every experiment runs in this one launch; every result is compared with the unsplit model on the same rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from labsrc.core.lab import run_lab
from labsrc.core.options import LabOptions, positive
from labsrc.core.runs import Record
from labsrc.core.world import RequestError
from labsrc.lessons.model_tensor_parallel import cost, dtensor as library, layers as tp, naive


@dataclass
class Options(LabOptions):
    """Sizes of the naive split, of the Megatron blocks and of the cost comparison."""

    hidden: int = 64
    """Width of the Megatron blocks (the MLP's inner width is 4 * hidden); divisible by heads."""
    heads: int = 4
    """Attention heads; each rank computes heads / world_size of them."""
    batch: int = 4
    """Sequences per step in the block checks."""
    seq: int = 16
    """Tokens per sequence; divisible by the world size for sequence parallelism."""
    naive_layers: int = 4
    """Linear+Tanh layers of the naively split model (at least one per rank)."""
    naive_hidden: int = 384
    """Width of the naively split model's layers (big enough that computing shows on the timeline)."""
    naive_batch: int = 128
    """Samples per step of the naive split."""
    naive_steps: int = 4
    """Forward+backward steps on the busy timeline."""
    cost_hidden: int = 256
    """Width of the blocks in the tensor- vs data-parallel cost comparison."""
    cost_blocks: int = 2
    """MLP blocks in the cost comparison."""
    cost_tokens: tuple[int, ...] = (16, 256, 4096)
    """Tokens per step (batch x sequence) compared; the crossover is near 4 * cost_hidden."""
    repeats: int = 10
    """Timed rounds over every all-reduce size, interleaved (the fastest of each size counts)."""

    def validate(self) -> None:
        super().validate()
        for name in ("hidden", "heads", "batch", "seq", "naive_layers", "naive_hidden", "naive_batch",
                     "naive_steps", "cost_hidden", "cost_blocks", "repeats"):
            positive(name, getattr(self, name))
        for tokens in self.cost_tokens:
            positive("cost_tokens", tokens)
        if self.hidden % self.heads:
            raise RequestError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads}).")


@dataclass
class NaiveCheck(Record):
    """One naive step's gradients on this rank's layers against the unsplit model's same layers."""

    KIND: ClassVar[str] = "naive_check"
    grad_error: float
    loss_error: float
    first_layer: int
    last_layer: int


@dataclass
class BusyInterval(Record):
    """A stretch of computing (forward or backward) of one naive step; seconds on the machine's monotonic clock."""

    KIND: ClassVar[str] = "busy"
    step: int
    phase: str
    start: float
    end: float


@dataclass
class BlockCheck(Record):
    """A hand-written tensor-parallel block against its dense original: errors, all-reduce payload, memory."""

    KIND: ClassVar[str] = "block_check"
    block: str
    output_error: float
    input_grad_error: float
    weight_grad_error: float
    tolerance: float
    forward_calls: int
    backward_calls: int
    forward_bytes: int
    backward_bytes: int
    expected_forward_bytes: int
    expected_backward_bytes: int
    ring_bytes_sent: float
    shard_bytes: int
    dense_bytes: int
    replicated_bytes: int


@dataclass
class ShardLayout(Record):
    """Which part of a dense weight this rank holds: rows (dim 0) or columns (dim 1) [start, stop) of a (out, in)
    weight, located by value in the dense weight; dim, start and stop are -1 when the shard is no such block."""

    KIND: ClassVar[str] = "shard"
    block: str
    parameter: str
    style: str
    dense_shape: list
    shard_shape: list
    dim: int
    start: int
    stop: int


@dataclass
class LibraryCheck(Record):
    """torch.distributed.tensor.parallel against the hand-written version or the dense model."""

    KIND: ClassVar[str] = "library_check"
    check: str
    against: str
    error: float
    tolerance: float


@dataclass
class Skipped(Record):
    """An experiment this launch could not run, and why."""

    KIND: ClassVar[str] = "skipped"
    experiment: str
    reason: str


@dataclass
class LinkPoint(Record):
    """One measured dist.all_reduce: payload bytes and the fastest repeat's seconds."""

    KIND: ClassVar[str] = "link_point"
    bytes: int
    seconds: float


@dataclass
class CostRow(Record):
    """Communication of one step of tensor or data parallelism: bytes, modelled and measured seconds."""

    KIND: ClassVar[str] = "cost"
    tokens: int
    scheme: str
    messages: int
    bytes: int
    predicted_s: float
    nvlink_s: float
    measured_s: float


def naive_experiments(ctx, records, options: Options) -> None:
    stack = naive.make_stack(options.naive_layers, options.naive_hidden, ctx.device, options.seed)
    stage = naive.stage_of(stack, ctx.rank, ctx.world_size)
    x = tp.make_input(options.naive_batch, 1, options.naive_hidden, ctx.device, options.seed + 1).squeeze(1)
    target = tp.make_input(options.naive_batch, 1, options.naive_hidden, ctx.device, options.seed + 2).squeeze(1)
    errors = naive.stage_gradient_errors(stack, stage, x, target, ctx.rank, ctx.world_size)
    first, last = naive.stage_bounds(options.naive_layers, ctx.rank, ctx.world_size)
    records.write(NaiveCheck(errors["grad_error"], errors["loss_error"], first, last))
    for busy in naive.busy_timeline(stage, x, target, ctx.rank, ctx.world_size, options.naive_steps):
        records.write(BusyInterval(busy.step, busy.phase, busy.start, busy.end))


def block_experiments(ctx, records, options: Options) -> None:
    if options.heads % ctx.world_size:
        raise RequestError(f"{options.heads} heads do not split over {ctx.world_size} ranks: "
                           f"use heads that world_size divides.")
    x = tp.make_input(options.batch, options.seq, options.hidden, ctx.device, options.seed + 3)
    expected = tp.expected_payload_bytes(options.batch, options.seq, options.hidden)
    for block, parallel_class in (("mlp", tp.TensorParallelMLP), ("attention", tp.TensorParallelAttention)):
        dense = tp.make_dense(block, options.hidden, options.heads, ctx.device, options.seed)
        traffic = tp.Traffic()
        parallel = parallel_class(dense, ctx.rank, ctx.world_size, traffic)
        result = tp.compare_with_dense(dense, parallel, x, ctx.rank, ctx.world_size)
        records.write(BlockCheck(
            block, result["output_error"], result["input_grad_error"], result["weight_grad_error"],
            tp.tolerance(result["output_scale"]), traffic.calls["forward"], traffic.calls["backward"],
            traffic.payload_bytes["forward"], traffic.payload_bytes["backward"], expected["forward"],
            expected["backward"], tp.ring_bytes_sent(traffic.total_bytes, ctx.world_size),
            tp.parameter_bytes(parallel), tp.parameter_bytes(dense), tp.replicated_bytes(parallel)))
        write_shards(records, block, dense, parallel)


def write_shards(records, block: str, dense, parallel) -> None:
    """One ShardLayout record per weight of the block: where this rank's shard really sits in the dense weight,
    found by comparing values (dim -1 when it is no contiguous block of it). The layout figure draws these."""
    dense_layers = dict(dense.named_children())
    for name, layer in parallel.named_children():
        if not isinstance(layer, (tp.ColumnParallelLinear, tp.RowParallelLinear)):
            continue
        style = "column" if isinstance(layer, tp.ColumnParallelLinear) else "row"
        dense_weight, shard = dense_layers[name].weight.detach(), layer.weight.detach()
        found = tp.locate_shard(dense_weight, shard, first_dim=0 if style == "column" else 1)
        dim, start, stop = found if found else (-1, -1, -1)
        records.write(ShardLayout(block, name, style, list(dense_weight.shape), list(shard.shape), dim, start, stop))


def library_device(ctx):
    """Where the DTensor checks run: the ranks' GPU under NCCL; under gloo, CPU tensors (the setting the CI
    checks run in), also when gloo ranks share a GPU."""
    return ctx.device if ctx.backend == "nccl" else torch.device("cpu")


def library_experiments(ctx, records, options: Options) -> None:
    device = library_device(ctx)
    if device != ctx.device:
        print(f"torch tensor parallel checks run on {device}: gloo ranks share {ctx.device}")
    x = tp.make_input(options.batch, options.seq, options.hidden, device, options.seed + 3)
    tolerance = tp.tolerance(float(x.abs().max()))
    result = library.compare_with_handwritten(tp.make_dense("mlp", options.hidden, options.heads, device,
                                                            options.seed), x, ctx.rank, ctx.world_size)
    records.write(LibraryCheck("colwise_rowwise", "handwritten", result["output_vs_handwritten"], tolerance))
    records.write(LibraryCheck("colwise_rowwise_grad", "handwritten", result["grad_vs_handwritten"], tolerance))
    records.write(LibraryCheck("colwise_rowwise", "dense", result["output_vs_dense"], tolerance))
    if options.seq % ctx.world_size:
        records.write(Skipped("sequence_parallel", f"seq {options.seq} does not split over {ctx.world_size} ranks"))
    else:
        dense = tp.make_dense("mlp", options.hidden, options.heads, device, options.seed)
        result = library.compare_sequence_parallel(dense, x, ctx.rank, ctx.world_size)
        records.write(LibraryCheck("sequence_parallel", "dense", result["output_error"], tolerance))
        gradient_tolerance = tp.tolerance(result["gradient_scale"])
        records.write(LibraryCheck("sequence_parallel_input_grad", "dense", result["input_grad_error"],
                                   gradient_tolerance))
        for name, error in result["grad_errors"].items():
            against = "dense (Partial all-reduced)" if name in result["partial_gradients"] else "dense"
            records.write(LibraryCheck(f"sequence_parallel_grad {name}", against, error, gradient_tolerance))
    if ctx.world_size >= 4 and ctx.world_size % 2 == 0 and options.batch % (ctx.world_size // 2) == 0:
        dense = tp.make_dense("mlp", options.hidden, options.heads, device, options.seed)
        result = library.compare_two_dimensional(dense, x, ctx.rank, ctx.world_size)
        records.write(LibraryCheck("two_dimensional_grad", "dense", result["grad_error"], result["tolerance"]))
    else:
        records.write(Skipped("two_dimensional", f"a (data x tensor) mesh needs 4+ ranks in pairs and a batch the "
                                                 f"data axis divides; this launch has {ctx.world_size}"))


def cost_experiments(ctx, records, options: Options) -> dict:
    sizes = sorted({4 * 2 ** k for k in range(6, 22, 3)})
    fitted, points = cost.fit_link(sizes, ctx.device, options.repeats)
    for nbytes, seconds in points.items():
        records.write(LinkPoint(nbytes, seconds))
    rows = cost.compare(list(options.cost_tokens), options.cost_hidden, options.cost_blocks, ctx.world_size,
                        fitted, ctx.device, options.repeats)
    for row in rows:
        records.write(CostRow(**row))
    return {"alpha_s": fitted.alpha_s, "beta_s_per_byte": fitted.beta_s_per_byte, "r2": fitted.r2,
            "crossover_tokens": cost.crossover_tokens(options.cost_hidden)}


def model_tensor_parallel_lab(ctx, records, options: Options) -> dict:
    steps = ("naive split", "Megatron blocks", "torch tensor parallel", "cost")
    records.progress(0, len(steps), unit="experiments")
    naive_experiments(ctx, records, options)
    records.progress(1, len(steps), unit="experiments")
    block_experiments(ctx, records, options)
    records.progress(2, len(steps), unit="experiments")
    library_experiments(ctx, records, options)
    records.progress(3, len(steps), unit="experiments")
    link = cost_experiments(ctx, records, options)
    records.progress(4, len(steps), unit="experiments")
    return {"link": link, "hidden": options.hidden, "heads": options.heads, "batch": options.batch,
            "seq": options.seq, "tokens": options.batch * options.seq,
            "cost_hidden": options.cost_hidden, "cost_blocks": options.cost_blocks, "experiments": list(steps)}


def main(argv=None):
    return run_lab("model_tensor_parallel", model_tensor_parallel_lab, Options, argv)


if __name__ == "__main__":
    main()
