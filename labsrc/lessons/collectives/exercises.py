"""Checkers for notebook 02's exercises: a ring all-reduce written from send/recv, and its alpha-beta time."""
from __future__ import annotations

import contextlib
import itertools
import math
from typing import Callable

import torch
import torch.distributed as dist

from labsrc.core.exercises import ExerciseFailed, on_ranks, passed
from labsrc.techniques import alpha_beta
from labsrc.techniques.collectives import rank_values

WORLD_SIZES = (2, 3, 4)
"""On 2 ranks left and right are the same rank, so a ring turned backwards only shows on 3 or more."""
CORRECT_OFFSETS = {"reduce": (0, -1), "gather": (1, 0)}
"""Step s, rank r: reduce-scatter sends chunk (r - s) and adds into (r - s - 1); all-gather sends (r + 1 - s), stores (r - s)."""
SCHEDULE = ("at reduce-scatter step s rank r sends chunk (r - s) and adds what arrives into chunk (r - s - 1); "
            "at all-gather step s it sends chunk (r + 1 - s) and stores what arrives in chunk (r - s)")


def ring_sizes(world_size: int) -> list[int]:
    """(N,) sizes to try: one n divides first (where mistakes are diagnosed), then sizes it does not divide."""
    return [4 * world_size, 4 * world_size + 1, max(1, world_size - 1), 1000 * world_size + 3]


def simulate_ring(inputs: list[torch.Tensor], direction: int = 1, offsets: dict | None = None,
                  gather: bool = True, combine: str = "sum", gather_adds: bool = False) -> list[torch.Tensor] | None:
    """Every rank's (N,) tensor after a ring schedule run on inputs[r] (N,), without any communication.

    direction 1: send to rank + 1, receive from rank - 1 (-1 the other way round); offsets: the chunk
    indices relative to (r - s) of each phase; gather False stops after the reduce-scatter; combine
    "mean" halves each addition; gather_adds adds in the all-gather instead of storing. None where the
    schedule pairs chunks of different sizes (it would raise).
    """
    world_size, offsets = len(inputs), offsets or CORRECT_OFFSETS
    chunks = [list(tensor.clone().tensor_split(world_size)) for tensor in inputs]
    phases = ["reduce", "gather"] if gather else ["reduce"]
    for phase in phases:
        send_offset, receive_offset = offsets[phase]
        for step in range(world_size - 1):
            sent = [chunks[rank][(rank - step + send_offset) % world_size].clone() for rank in range(world_size)]
            for rank in range(world_size):
                target, arriving = chunks[rank][(rank - step + receive_offset) % world_size], sent[
                    (rank - direction) % world_size]
                if target.shape != arriving.shape:
                    return None
                if phase == "gather" and gather_adds:
                    target.add_(arriving)
                elif phase == "gather":
                    target.copy_(arriving)
                elif combine == "sum":
                    target.add_(arriving)
                else:
                    target.add_(arriving).div_(2)
    return [torch.cat(rank_chunks) for rank_chunks in chunks]


def _matches(candidate, rank: int, got: torch.Tensor, expected: torch.Tensor) -> bool:
    return candidate is not None and torch.equal(candidate[rank], got) and not torch.equal(got, expected)


def _off_by_one(inputs, rank, got, expected) -> str | None:
    """The phase whose chunk indices, shifted by one, give what this rank got; None if no shift does."""
    shifts = {"reduce": [(a, b) for a in (-1, 0, 1) for b in (-2, -1, 0)],
              "gather": [(a, b) for a in (0, 1, 2) for b in (-1, 0, 1)]}
    for reduce, gather in itertools.product(shifts["reduce"], shifts["gather"]):
        if _matches(simulate_ring(inputs, offsets={"reduce": reduce, "gather": gather}), rank, got, expected):
            return "reduce-scatter" if reduce != CORRECT_OFFSETS["reduce"] else "all-gather"
    return None


def diagnose_ring(inputs: list[torch.Tensor], rank: int, got: torch.Tensor) -> str:
    """What is wrong with `got`, rank's (N,) result of an all-reduce of inputs (one (N,) tensor per rank)."""
    world_size, expected = len(inputs), torch.stack(inputs).sum(0)
    if torch.equal(got, inputs[rank]):
        return ("the tensor is unchanged: write the sum into it in place (chunk.add_, chunk.copy_ on views from "
                "tensor.view(-1).tensor_split(n)); rebinding a name or returning a new tensor changes nothing.")
    if torch.allclose(got * world_size, expected) or _matches(simulate_ring(inputs, combine="mean"), rank, got,
                                                              expected):
        return ("you divide instead of summing (you got the mean, or halves at each step): all_reduce with "
                "SUM adds the chunks as they arrive. Averaging is the caller's job (DDP divides each gradient by n "
                "before it all-reduces), not this function's.")
    if _matches(simulate_ring(inputs, gather=False), rank, got, expected):
        return (f"the all-gather phase is missing: only chunk {(rank + 1) % world_size} holds the full sum on this "
                "rank. After the n-1 reduce-scatter steps, run n-1 more steps that pass the finished chunks on "
                "and store (copy_, not add_) what arrives.")
    if _matches(simulate_ring(inputs, gather_adds=True), rank, got, expected):
        return ("the all-gather adds what arrives: the chunks that arrive there are already complete sums, so "
                "store them (chunk.copy_), do not add them to what the chunk held.")
    if _matches(simulate_ring(inputs, direction=-1), rank, got, expected):
        return ("wrong neighbour direction: you send to rank - 1 and receive from rank + 1, but your chunk "
                "indices are those of a ring that sends to the right. Send to (rank + 1) % n and receive from "
                "(rank - 1) % n.")
    phase = _off_by_one(inputs, rank, got, expected)
    if phase:
        return (f"a chunk index is off by one in the {phase}: the chunk that arrives is added to (or stored in) "
                f"the wrong chunk. The schedule: {SCHEDULE}.")
    wrong = [index for index, (mine, right) in enumerate(zip(got.tensor_split(world_size),
                                                           expected.tensor_split(world_size)))
             if not torch.equal(mine, right)]
    return (f"chunks {wrong} (of tensor_split into {world_size}) differ from dist.all_reduce by up to "
            f"{float((got - expected).abs().max()):.3g}. The schedule: {SCHEDULE}.")


@contextlib.contextmanager
def _all_reduce_forbidden():
    """dist.all_reduce raises while the learner's function runs: the ring must be written from send/recv."""
    def refuse(*args, **kwargs):
        raise ExerciseFailed("you called dist.all_reduce: write the ring from send/recv (dist.batch_isend_irecv).")
    original, dist.all_reduce = dist.all_reduce, refuse
    try:
        yield
    finally:
        dist.all_reduce = original


def _ring_rank(ctx, ring_all_reduce: Callable) -> str | None:
    """On one rank: the learner's ring on every size against dist.all_reduce; all ranks stop at the first failure."""
    for index, size in enumerate(ring_sizes(ctx.world_size)):
        got = rank_values(ctx.rank, size, "cpu")
        expected = got.clone()
        dist.all_reduce(expected)
        with _all_reduce_forbidden():
            ring_all_reduce(got, ctx.rank, ctx.world_size)
        verdict = None
        if not torch.equal(got, expected):
            inputs = [rank_values(rank, size, "cpu") for rank in range(ctx.world_size)]
            verdict = f"size {size} on {ctx.world_size} ranks: {diagnose_ring(inputs, ctx.rank, got)}"
            if index > 0:
                verdict += (f" (Size {ring_sizes(ctx.world_size)[0]}, which {ctx.world_size} divides, was right: cut "
                            "the tensor with tensor_split(n), chunks that differ by at most one element.)")
        failed = torch.tensor([verdict is not None], dtype=torch.int32)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)  # every rank stops together, so none waits on a peer
        if failed.item():
            return verdict
    return None


def _failure_hint(text: str) -> str:
    """What to look at when the learner's ring raised (an exception) or hung (no result before the timeout)."""
    if "IndexError" in text:
        return ("An index out of range: tensor.chunk(n) can give FEWER than n chunks (2 elements on 3 ranks give "
                "2 chunks); tensor.tensor_split(n) always gives n, some of them empty.")
    hung = ("gave no result", "timed out", "connection closed", "connection reset")
    if any(sign in text.lower() for sign in hung):  # a peer that timed out closes its connections too
        return ("A rank waited for a message that never came: does every rank receive from the neighbour that "
                "sends to it (send to (rank + 1) % n, receive from (rank - 1) % n)? Did every rank call a blocking "
                "dist.send before its dist.recv? A gloo send waits for the matching receive, so that deadlocks "
                "at any size: post both at once with dist.batch_isend_irecv, and bound every wait by a timeout.")
    return "Your function raised: the traceback above shows where."


def check_ring_all_reduce(ring_all_reduce: Callable, world_sizes=WORLD_SIZES, timeout_s: float = 60.0) -> None:
    """ring_all_reduce(tensor (N,) float32, rank, world_size) sums the tensor over ranks in place, from send/recv.

    Run on forked gloo ranks for each world size, on sizes n divides and sizes it does not (fewer elements
    than ranks included), compared exactly with dist.all_reduce (the inputs' sums are exact in float32).
    """
    for world_size in world_sizes:
        try:
            on_ranks(_ring_rank, world_size, (ring_all_reduce,), timeout_s=timeout_s)
        except ExerciseFailed as failure:
            text = str(failure)
            if text.startswith("rank ") or "you called dist.all_reduce" in text:
                raise
            raise ExerciseFailed(f"on {world_size} ranks: {text}\n{_failure_hint(text)}") from None
    passed(f"the ring equals dist.all_reduce on {', '.join(map(str, world_sizes))} ranks, for sizes n divides "
           "and sizes it does not")


PREDICTION_CASES = (  # (alpha s, beta s/byte, bytes, ranks): links and messages of several scales
    (5e-6, 1 / 25e9, 64e6, 8), (20e-6, 1 / 12.5e9, 1e6, 4), (1e-4, 1e-9, 4e3, 2), (2e-6, 1 / 100e9, 1e9, 64),
)
PREDICTION_MISTAKES = {
    "n instead of n-1": lambda a, b, s, n: 2 * n * (a + s / n * b),
    "forgets one of the 2 phases": lambda a, b, s, n: (n - 1) * (a + s / n * b),
    "sends the whole message at every step": lambda a, b, s, n: 2 * (n - 1) * (a + s * b),
    "pays alpha once": lambda a, b, s, n: a + 2 * (n - 1) / n * s * b,
    "sends 2 x nbytes": lambda a, b, s, n: 2 * (n - 1) * a + 2 * s * b,
    "counts the bytes of one phase": lambda a, b, s, n: 2 * (n - 1) * a + (n - 1) / n * s * b,
}
PREDICTION_HINTS = {
    "n instead of n-1": "a ring of n ranks takes n-1 steps per phase, not n: 2(n-1) messages in all.",
    "forgets one of the 2 phases": "the reduce-scatter's n-1 steps are followed by the all-gather's n-1 steps, "
                                   "2(n-1) in all.",
    "sends the whole message at every step": "each step sends one chunk, nbytes / n, not the whole message.",
    "pays alpha once": "every one of the 2(n-1) steps is a message, and every message pays alpha.",
    "sends 2 x nbytes": "2 x nbytes is only the limit for large n: each rank sends 2(n-1) chunks of nbytes / n, "
                        "2(n-1)/n x nbytes.",
    "counts the bytes of one phase": "both phases send: n-1 chunks of nbytes / n in the reduce-scatter and n-1 "
                                     "more in the all-gather.",
}


def check_predict_time(predict_time: Callable) -> None:
    """predict_time(alpha, beta, nbytes, n) -> seconds of a ring all-reduce over per-message links.

    Compared with labsrc.techniques.alpha_beta.ring_allreduce_time_s, relative tolerance 1e-6 (floating point only).
    """
    for alpha, beta, nbytes, n in PREDICTION_CASES:
        expected = alpha_beta.ring_allreduce_time_s(nbytes, n, alpha_beta.AlphaBeta(alpha, beta, 1.0))
        got = predict_time(alpha, beta, nbytes, n)
        if not isinstance(got, (int, float)) or isinstance(got, bool):
            raise ExerciseFailed(f"return a number of seconds, not {type(got).__name__}.")
        if math.isclose(got, expected, rel_tol=1e-6):
            continue
        case = f"alpha {alpha:g} s, beta {beta:g} s/B, {nbytes:g} bytes on {n} ranks: got {got:.4g} s, expected"
        for name, mistake in PREDICTION_MISTAKES.items():
            if math.isclose(got, mistake(alpha, beta, nbytes, n), rel_tol=1e-6):
                raise ExerciseFailed(f"{case} {expected:.4g} s. Your formula {name}: {PREDICTION_HINTS[name]}")
        raise ExerciseFailed(f"{case} {expected:.4g} s: 2(n-1) steps, each one message of nbytes/n bytes.")
    passed(f"the prediction matches the ring formula on all {len(PREDICTION_CASES)} links and sizes")
