"""Checkers for notebook 12's exercises: diagnose a failed run from its evidence; fix a collective only rank 0 joins."""
from __future__ import annotations

from typing import Callable

import torch

from labsrc.core.exercises import ExerciseFailed, on_ranks, passed

CAUSES = ("collective_mismatch", "rank_missing_from_barrier", "unused_parameters", "rank_died",
          "skipped_collective", "port_in_use", "world_size_mismatch")

# Evidence as notebook 12's cases leave it on torch 2.14.1 (exception class, its first line, each rank's fate,
# how long the failing call waited against its timeout), with the cause a reader should name.
EVIDENCE = (
    ({"exception": "RuntimeError", "fates": {0: "raised RuntimeError", 1: "raised RuntimeError"},
      "message": "Detected mismatch between collectives on ranks. Rank 0 is running collective: "
                 "CollectiveFingerPrint(SequenceNumber=0, OpType=ALLREDUCE, TensorShape=[4], ...",
      "waited_s": 0.02, "timeout_s": 4.0}, "collective_mismatch"),
    ({"exception": "RuntimeError", "fates": {0: "raised RuntimeError", 1: "finished"},
      "message": "[Rank 0]: Ranks 1 failed to pass monitoredBarrier in 3000 ms",
      "waited_s": 3.0, "timeout_s": 3.0}, "rank_missing_from_barrier"),
    ({"exception": "RuntimeError", "fates": {0: "raised RuntimeError", 1: "raised RuntimeError"},
      "message": "Expected to have finished reduction in the prior iteration before starting a new one.",
      "waited_s": 0.01, "timeout_s": 4.0}, "unused_parameters"),
    ({"exception": "RuntimeError", "fates": {0: "raised RuntimeError", 1: "vanished"},
      "message": "[../gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:28066.",
      "waited_s": 0.001, "timeout_s": 8.0}, "rank_died"),
    ({"exception": "RuntimeError", "fates": {0: "raised RuntimeError", 1: "finished"},
      "message": "[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation",
      "waited_s": 3.0, "timeout_s": 3.0}, "skipped_collective"),
    ({"exception": "DistNetworkError", "fates": {},
      "message": "The server socket has failed to listen on any local network address. port: 33411, "
                 "useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use",
      "waited_s": 0.0, "timeout_s": 60.0}, "port_in_use"),
    ({"exception": "DistStoreError", "fates": {0: "raised DistStoreError", 1: "raised DistStoreError"},
      "message": "wait timeout after 4000ms, keys: /default_pg/0//cpu//0/2",
      "waited_s": 4.0, "timeout_s": 4.0}, "world_size_mismatch"),
)

HINTS = {
    "collective_mismatch": "TORCH_DISTRIBUTED_DEBUG=DETAIL compared fingerprints and found ranks in different collectives",
    "rank_missing_from_barrier": "monitored_barrier names the ranks that never arrived",
    "unused_parameters": "DDP's reducer waited for gradients some parameters never produce",
    "rank_died": "one rank left no exit note and no error (a signal), the others lost their peer",
    "skipped_collective": "one rank waited its whole timeout in a collective while the other finished",
    "port_in_use": "the rendezvous store could not listen: EADDRINUSE",
    "world_size_mismatch": "initialisation's store waited for more ranks than were started (a DistStoreError)",
}


def check_diagnose(diagnose: Callable[[dict], str]) -> None:
    """diagnose(evidence dict) -> one of CAUSES, for every failure the notebook's cases leave."""
    for evidence, cause in EVIDENCE:
        answer = diagnose(dict(evidence))
        if answer not in CAUSES:
            raise ExerciseFailed(f"return one of {CAUSES}, not {answer!r}.")
        if answer != cause:
            raise ExerciseFailed(
                f"for {evidence['exception']} '{evidence['message'][:70]}...' with fates {evidence['fates']} "
                f"you said {answer!r}, but it is {cause!r}: {HINTS[cause]}.")
    passed(f"all {len(EVIDENCE)} failures diagnosed: {', '.join(cause for _, cause in EVIDENCE)}")


def _mean_loss_rank(ctx, mean_loss: Callable) -> str | None:
    local = float(ctx.rank + 1) * 2.0  # rank r's loss: 2, 4, ...
    expected = sum(2.0 * (r + 1) for r in range(ctx.world_size)) / ctx.world_size
    answer = mean_loss(ctx, local)
    value = float(answer.item() if isinstance(answer, torch.Tensor) else answer)
    if abs(value - local) < 1e-6 and ctx.world_size > 1:
        return f"you returned this rank's own loss {local}: all ranks must all_reduce it, then divide."
    if abs(value - expected * ctx.world_size) < 1e-6:
        return f"you returned the sum {value}: divide by the world size ({ctx.world_size}) for the mean."
    if abs(value - expected) > 1e-6:
        return f"expected the mean loss {expected}, got {value}."
    return None


def check_mean_loss(mean_loss: Callable, world_size: int = 2, timeout_s: float = 10.0) -> None:
    """mean_loss(ctx, loss float) -> the mean over ranks, on every rank; on forked gloo ranks, bounded by timeout_s."""
    try:
        on_ranks(_mean_loss_rank, world_size, args=(mean_loss,), timeout_s=timeout_s)
    except ExerciseFailed as exc:
        # gloo's words when the peer returned without joining, or our own for a hang
        if any(sign in str(exc) for sign in ("gave no result", "Connection closed by peer", "Connection reset by peer")):
            raise ExerciseFailed(
                f"a rank waited in a collective its peer never joined (it hung, or lost the peer when that one "
                f"returned; bounded here by {timeout_s:g} s). Every rank must call all_reduce; keep only the "
                f"printing under `if ctx.rank == 0`.") from None
        raise
    passed(f"every one of {world_size} ranks got the mean loss, and no rank was left waiting")
