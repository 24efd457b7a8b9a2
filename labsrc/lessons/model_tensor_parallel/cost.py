"""When tensor parallelism pays: its per-block all-reduces of activations against data parallelism's one of gradients.

Per step, for `blocks` Megatron blocks (MLP: hidden -> 4 hidden -> hidden) and T = batch * seq tokens:
  tensor parallel: 2 * blocks all-reduces of T * hidden elements each, on the critical path;
  data parallel:   1 all-reduce of every gradient, blocks * (8 hidden^2 + 5 hidden) elements, which DDP
                   overlaps with the backward pass.
The NVLink figure is an input, not a measurement here: NVIDIA's H100 datasheet gives 900 GB/s of NVLink
bandwidth per GPU (both directions together), i.e. 450 GB/s each way; the per-message latency is assumed.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from labsrc.lessons.model_tensor_parallel import layers as tp
from labsrc.techniques import alpha_beta

NVLINK_H100 = alpha_beta.AlphaBeta(alpha_s=5e-6, beta_s_per_byte=1 / 450e9, r2=float("nan"))
"""Assumed link: 450 GB/s one way (NVIDIA H100 SXM datasheet: 900 GB/s NVLink per GPU); 5 us latency assumed."""


def mlp_parameters(hidden: int) -> int:
    """Elements of one MLP block: fc1 (4h x h + 4h) and fc2 (h x 4h + h) = 8h^2 + 5h."""
    return 8 * hidden * hidden + 5 * hidden


def tensor_parallel_messages(tokens: int, hidden: int, blocks: int, element_size: int = 4) -> list[int]:
    """Payload bytes of each all-reduce tensor parallelism makes in one step (forward and backward)."""
    return [tokens * hidden * element_size] * (2 * blocks)


def data_parallel_messages(hidden: int, blocks: int, element_size: int = 4) -> list[int]:
    """Payload bytes of the one gradient all-reduce per step of data parallelism (one bucket, for the model)."""
    return [blocks * mlp_parameters(hidden) * element_size]


def predicted_seconds(messages: list[int], time_of) -> float:
    """Communication seconds of a step: the sum over its all-reduces of time_of(payload bytes)."""
    return sum(time_of(nbytes) for nbytes in messages)


def ring_time(link: alpha_beta.AlphaBeta, world_size: int):
    """time_of(bytes) for a ring all-reduce over links described by `link`."""
    return lambda nbytes: alpha_beta.ring_allreduce_time_s(nbytes, world_size, link)


def crossover_tokens(hidden: int) -> float:
    """Tokens per step at which both move the same payload bytes: 2 T h = 8h^2 + 5h (per block)."""
    return mlp_parameters(hidden) / (2 * hidden)


def time_all_reduce(tensor: torch.Tensor, device) -> float:
    """Seconds of one dist.all_reduce of tensor, all ranks starting together (barrier first)."""
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(tensor, async_op=True).wait(tp.ALL_REDUCE_TIMEOUT)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def time_all_reduces(sizes_bytes: list[int], device, repeats: int) -> dict:
    """{payload bytes: fastest of `repeats` timed all-reduces} on float32 tensors, after one warm-up round.

    The sizes are timed in interleaved rounds, so a burst of load from elsewhere on the machine slows one
    round of every size rather than every repeat of one size.
    """
    tensors = {nbytes: torch.ones(max(1, nbytes // 4), device=device) for nbytes in sorted(set(sizes_bytes))}
    best = dict.fromkeys(tensors, float("inf"))
    for repeat in range(repeats + 1):
        for nbytes, tensor in tensors.items():
            seconds = time_all_reduce(tensor, device)
            if repeat:
                best[nbytes] = min(best[nbytes], seconds)
    return best


def fit_link(sizes_bytes: list[int], device, repeats: int) -> tuple[alpha_beta.AlphaBeta, dict]:
    """alpha-beta fitted to dist.all_reduce on these ranks (the whole collective, not one ring step)."""
    seconds = time_all_reduces(sizes_bytes, device, repeats)
    return alpha_beta.fit(list(seconds), list(seconds.values())), seconds


def compare(tokens_list: list[int], hidden: int, blocks: int, world_size: int, fitted: alpha_beta.AlphaBeta,
            device, repeats: int) -> list[dict]:
    """For each tokens-per-step: bytes, the fitted model's and the NVLink model's seconds, and measured seconds
    (the sum over a step's all-reduces of each one's size timed on the ranks), for tensor and data parallelism."""
    schemes = [(tokens, scheme, messages) for tokens in tokens_list
               for scheme, messages in (("tensor", tensor_parallel_messages(tokens, hidden, blocks)),
                                        ("data", data_parallel_messages(hidden, blocks)))]
    timed = time_all_reduces([nbytes for _, _, messages in schemes for nbytes in messages], device, repeats)
    rows = []
    for tokens, scheme, messages in schemes:
        rows.append({"tokens": tokens, "scheme": scheme, "messages": len(messages), "bytes": sum(messages),
                     "predicted_s": predicted_seconds(messages, fitted.time_s),
                     "nvlink_s": predicted_seconds(messages, ring_time(NVLINK_H100, world_size)),
                     "measured_s": sum(timed[nbytes] for nbytes in messages)})
    return rows
