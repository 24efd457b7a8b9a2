"""The latency-bandwidth (alpha-beta) model: time = alpha + bytes * beta, fitted and used.

Two kinds of AlphaBeta, never mixed up:
- a whole-collective fit (`fit`): time of one dist.all_reduce of S bytes on the n ranks it was measured
  on, T(S) = a + S b. Valid as is, at that n only.
- a per-message link (`ring_link`, or a datasheet's figures): alpha and beta of one message between two
  neighbours; the ring formula turns it into a collective's time at any n.
The ring all-reduce sends 2(n-1) messages of S/n bytes one after the other, so T(S) = 2(n-1) alpha +
2(n-1)/n S beta; `ring_link` inverts exactly that, and the two agree at the n that was measured.

algbw and busbw follow nccl-tests (doc/PERFORMANCE.md there): algbw = bytes / time; busbw = algbw times
a factor that makes it comparable to the link's bandwidth: 2(n-1)/n for all_reduce, (n-1)/n for
reduce_scatter and all_gather, 1 for broadcast, reduce and send/recv.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "send_recv": lambda n: 1.0,
}


@dataclass(frozen=True)
class AlphaBeta:
    """time_s(bytes) = alpha_s + bytes * beta_s_per_byte, with the fit's R^2 on the points it came from.

    A fit keeps what least squares found, negative values included: a negative beta means the timings
    did not grow with the bytes, and hiding that behind a clamp would make "beta > 0" a check that cannot fail.
    """

    alpha_s: float
    beta_s_per_byte: float
    r2: float

    def time_s(self, nbytes: float) -> float:
        return self.alpha_s + nbytes * self.beta_s_per_byte

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return 1.0 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else float("inf")


def fit(nbytes: Sequence[float], seconds: Sequence[float]) -> AlphaBeta:
    """Least-squares fit weighted by 1/time, so small (latency-bound) and large messages count alike.

    Relative errors matter here: times span several decades, and an unweighted fit would let the
    largest message decide everything. R^2 is computed on log(time) for the same reason.
    """
    import numpy as np
    x = np.asarray(nbytes, dtype=float)
    y = np.asarray(seconds, dtype=float)
    if len(x) < 2 or len(set(x.tolist())) < 2:
        raise ValueError("an alpha-beta fit needs at least two different message sizes")
    weights = 1.0 / y
    design = np.stack([np.ones_like(x), x], axis=1) * weights[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, y * weights, rcond=None)
    alpha, beta = float(alpha), float(beta)
    predicted = alpha + beta * x
    if (predicted <= 0).any():
        return AlphaBeta(alpha, beta, float("-inf"))  # predicts a non-positive time: explains nothing
    log_y, log_p = np.log(y), np.log(predicted)
    total = float(((log_y - log_y.mean()) ** 2).sum())
    r2 = 1.0 - float(((log_y - log_p) ** 2).sum()) / total if total > 0 else 1.0
    return AlphaBeta(alpha, beta, r2)


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth in bytes/s: the message size over the time the collective took."""
    return nbytes / seconds


def busbw(collective: str, nbytes: float, seconds: float, world_size: int) -> float:
    """Bus bandwidth in bytes/s (nccl-tests' definition): algbw times the collective's bus factor."""
    return algbw(nbytes, seconds) * BUS_FACTORS[collective](world_size)


def ring_link(collective: AlphaBeta, world_size: int) -> AlphaBeta:
    """The per-message link behind a whole all-reduce fit measured on world_size ranks, assuming a ring.

    T(S) = a + S b = 2(n-1) alpha + 2(n-1)/n S beta  gives  alpha = a / (2(n-1)), beta = b n / (2(n-1)).
    """
    if world_size < 2:
        raise ValueError("an all-reduce on one rank sends no message: fit it on two or more ranks")
    steps = 2 * (world_size - 1)
    return AlphaBeta(collective.alpha_s / steps, collective.beta_s_per_byte * world_size / steps, collective.r2)


def ring_allreduce_time_s(nbytes: float, world_size: int, link: AlphaBeta) -> float:
    """Ring all-reduce over per-message links `link`: 2(n-1) steps, each one message of nbytes/n."""
    if world_size <= 1:
        return 0.0
    steps = 2 * (world_size - 1)
    return steps * link.time_s(nbytes / world_size)


def fit_sweep(timings: dict, statistic=min) -> dict[str, AlphaBeta]:
    """{algorithm: AlphaBeta} fitted on statistic(repeats) of each point of a sweep.

    timings: {(algorithm, size in float32 elements): {"seconds": [per-call seconds of each repeat], ...}},
    as labsrc.techniques.collectives.sweep returns it.
    """
    points: dict[str, list] = {}
    for (name, size), timing in timings.items():
        points.setdefault(name, []).append((4 * size, statistic(timing["seconds"])))
    return {name: fit(*zip(*sorted(pairs))) for name, pairs in points.items()}
