"""Checkers for notebook 12's exercises: diagnose a failed run from its evidence; fix a collective only rank 0 joins."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import re
from typing import Callable

import torch

from labsrc.core.exercises import ExerciseFailed, passed
from labsrc.core.forked import RankError, run_ranks

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
    # no debug mode, the two ranks in different collectives (all_reduce, broadcast): every rank waits its timeout
    ({"exception": "RuntimeError", "fates": {0: "raised RuntimeError", 1: "raised RuntimeError"},
      "message": "[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete",
      "waited_s": 3.0, "timeout_s": 3.0}, "collective_mismatch"),
    # NCCL: the watchdog thread found the collective timed out and tore rank 0's process down (SIGABRT, no Python
    # exception, so no error and no exit note: "vanished"); rank 1 had skipped it and finished. The message is the
    # one ProcessGroupNCCL.cpp logs (its wording in torch 2.x; not re-run here, as this evidence needs 2 GPUs).
    ({"exception": "", "fates": {0: "vanished", 1: "finished"},
      "message": "[PG ID 0 PG GUID 0(default_pg) Rank 0] Watchdog caught collective operation timeout: "
                 "WorkNCCL(SeqNum=3, OpType=ALLREDUCE, NumelIn=4, NumelOut=4, Timeout(ms)=3000) ran for 3004 "
                 "milliseconds before timing out.",
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
    "collective_mismatch": "ranks are in different collectives: with TORCH_DISTRIBUTED_DEBUG=DETAIL the fingerprints "
                           "say so at once; without it every rank waits its whole timeout (none finished, unlike a "
                           "skipped collective)",
    "rank_missing_from_barrier": "monitored_barrier names the ranks that never arrived",
    "unused_parameters": "DDP's reducer waited for gradients some parameters never produce",
    "rank_died": "one rank left no exit note and no error (a signal), the others lost their peer",
    "skipped_collective": "one rank waited its whole timeout in a collective while the other finished (on NCCL the "
                          "watchdog then tears the waiting process down: it vanishes, but it did not die on its own)",
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


RANKS_PER_NODE = 2
"""The checker lays its ranks out as on nodes of 2: on 3 ranks, rank 2 is local rank 0 of the second node."""


def _mean_loss_rank(ctx, mean_loss: Callable) -> dict:
    """Rank r's loss is 2(r + 1) + 0.5 (the mean is never a whole number, so `//` or int() shows); the learner's
    answer and what this rank printed (stdout captured). local_rank is r % RANKS_PER_NODE, as across nodes."""
    ctx = dataclasses.replace(ctx, local_rank=ctx.rank % RANKS_PER_NODE)
    local = float(ctx.rank + 1) * 2.0 + 0.5
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        answer = mean_loss(ctx, local)
    value = float(answer.item() if isinstance(answer, torch.Tensor) else answer)
    return {"local": local, "value": value, "printed": printed.getvalue(), "local_rank": ctx.local_rank}


def mean_loss_verdict(results: list[dict]) -> str | None:
    """What is wrong with one world size's results (None: right). Exposed for the tests."""
    world_size = len(results)
    total = sum(result["local"] for result in results)
    expected = total / world_size
    for rank, result in enumerate(results):
        value, local = result["value"], result["local"]
        if abs(value - expected) < 1e-6:
            continue
        if abs(value - local) < 1e-6:
            return f"rank {rank} returned its own loss {local}: all ranks must all_reduce it, then divide."
        if abs(value - total) < 1e-6:
            return f"rank {rank} returned the sum {value}: divide by the world size ({world_size}) for the mean."
        if world_size != 2 and abs(value - total / 2) < 1e-6:
            return (f"on {world_size} ranks rank {rank} returned the sum divided by 2 ({value}): divide by "
                    f"ctx.world_size (or dist.get_world_size()), not a number that is right only on 2 ranks.")
        return f"on {world_size} ranks rank {rank} expected the mean loss {expected}, got {value}."
    talkers = [rank for rank, result in enumerate(results) if rank > 0 and result["printed"].strip()]
    if talkers:
        node_leads = [rank for rank in talkers if results[rank].get("local_rank", rank) == 0]
        if node_leads:
            return (f"on {world_size} ranks laid out {RANKS_PER_NODE} per node, rank(s) {node_leads} printed too: "
                    f"they are local rank 0 of their node. Test ctx.rank (global), not ctx.local_rank.")
        return (f"on {world_size} ranks, rank(s) {talkers} printed too ({results[talkers[0]]['printed'].strip()!r}): "
                f"keep the print under `if ctx.rank == 0`.")
    numbers = [float(n) for n in re.findall(r"-?\d+(?:\.\d+)?", results[0]["printed"])]
    if not any(abs(n - expected) < 5e-3 for n in numbers):
        return (f"on {world_size} ranks rank 0 should print the mean loss {expected:g}; it printed "
                f"{results[0]['printed'].strip()!r}.")
    return None


def check_mean_loss(mean_loss: Callable, world_sizes: tuple[int, ...] = (2, 3), timeout_s: float = 10.0) -> None:
    """mean_loss(ctx, loss float) -> the mean over ranks on every rank, printed by rank 0 only.

    Runs on forked gloo ranks at each world size (a divisor of 2 is right only on 2), each bounded by timeout_s,
    and captures every rank's stdout.
    """
    for world_size in world_sizes:
        try:
            results = run_ranks(_mean_loss_rank, world_size, args=(mean_loss,), timeout_s=timeout_s)
        except RankError as exc:
            # gloo's words when the peer returned without joining, or our own for a hang
            if any(sign in str(exc) for sign in ("gave no result", "Connection closed by peer",
                                                 "Connection reset by peer")):
                raise ExerciseFailed(
                    f"a rank waited in a collective its peer never joined (it hung, or lost the peer when that one "
                    f"returned; bounded here by {timeout_s:g} s). Every rank must call all_reduce; keep only the "
                    f"printing under `if ctx.rank == 0`.") from None
            raise ExerciseFailed(f"your code raised or hung on a rank:\n{exc}") from None
        verdict = mean_loss_verdict(results)
        if verdict:
            raise ExerciseFailed(verdict)
    passed(f"on {' and '.join(map(str, world_sizes))} ranks every rank got the mean loss, only rank 0 printed it, "
           f"and no rank was left waiting")
