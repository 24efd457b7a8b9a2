"""Checkers for notebook 06's exercises: a step time predicted for n GPUs, ring against tree, and the GPU count at 80%."""
from __future__ import annotations

import math
from typing import Callable

from labsrc.core.exercises import ExerciseFailed, passed
from labsrc.lessons.performance_scaling import scaling
from labsrc.techniques.alpha_beta import AlphaBeta, ring_allreduce_time_s

LINKS = (AlphaBeta(5e-6, 1 / 50e9, float("nan")), AlphaBeta(2e-6, 1 / 450e9, float("nan")))
STEP_CASES = ((0.010, 44.7e6), (0.002, 1e6), (0.050, 4e8), (0.001, 4e8))  # (compute s, gradient bytes)
SIZES = (1e4, 1e6, 1e8)
WORLD_SIZES = (1, 2, 3, 8, 64)
TREE_SIZES = (2, 3, 6, 8, 64)


def close(got, expected: float) -> bool:
    """Equal up to float rounding: these are formulas, so the tolerance is rounding, not noise."""
    return isinstance(got, (int, float)) and math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-15)


def ring_mistakes(nbytes: float, n: int, link: AlphaBeta) -> dict[str, float]:
    """A ring all-reduce's time under each classic slip, keyed by the message that names it."""
    message = link.time_s(nbytes / n)
    return {
        "2n messages instead of 2(n-1): a ring of n ranks takes n-1 steps per phase, not n.": 2 * n * message,
        "only n-1 messages: the all-reduce has two phases (reduce-scatter, then all-gather), 2(n-1) in all.":
            (n - 1) * message,
        "each message carries the whole buffer: in a ring every step sends one chunk of nbytes/n.":
            2 * (n - 1) * link.time_s(nbytes),
        "the latency term is missing: each of the 2(n-1) messages also pays alpha (link.alpha_s), not only "
        "its bytes x beta.": 2 * (n - 1) * nbytes / n * link.beta_s_per_byte,
    }


def _step_verdict(predict: Callable, compute_s: float, nbytes: float, n: int, link: AlphaBeta,
                  overlap: float) -> str | None:
    expected = scaling.predict_step_s(compute_s, nbytes, n, link, overlap)
    got = predict(compute_s, nbytes, n, link, overlap)
    if close(got, expected):
        return None
    communication = ring_allreduce_time_s(nbytes, n, link)
    if close(got, compute_s + communication):
        return "overlap is ignored: overlap x min(compute, communication) of the step is hidden behind backward."
    if close(got, compute_s + communication - overlap * communication):
        return ("you hide overlap x communication; only the shorter of the two can hide behind the other: "
                "subtract overlap x min(compute, communication).")
    for slip, wrong in ring_mistakes(nbytes, n, link).items():
        hidden = min(compute_s, wrong) * overlap
        if n > 1 and close(got, compute_s + wrong - hidden):
            return slip
    if n == 1 and not close(got, compute_s):
        return "one GPU has nobody to talk to: its step is the compute alone."
    return f"expected {expected:.6g} s, got {got!r}."


def check_predict_step_time(predict_step_time: Callable) -> None:
    """predict_step_time(compute_s, gradient_bytes, n, link, overlap) -> seconds, against the lesson's model."""
    for compute_s, nbytes in STEP_CASES:
        for link in LINKS:
            for n in WORLD_SIZES:
                for overlap in (0.0, 0.5, 1.0):
                    verdict = _step_verdict(predict_step_time, compute_s, nbytes, n, link, overlap)
                    if verdict:
                        raise ExerciseFailed(f"compute {compute_s} s, {nbytes:.3g} bytes, n={n}, overlap "
                                             f"{overlap}: {verdict}")
    passed("predict_step_time agrees with the lesson's model for every workload, n, link and overlap")


def _tree_verdict(nbytes: float, n: int, link: AlphaBeta, got) -> str | None:
    expected = scaling.tree_time_s(nbytes, n, 1, nvlink=link, nic=link, nics_per_node=1)
    if close(got, expected):
        return None
    if close(got, 2 * (n - 1) * link.alpha_s + 2 * nbytes * link.beta_s_per_byte):
        return ("the tree's latency grows linearly, 2(n-1) alpha: a double binary tree is ceil(log2 n) hops deep, "
                "crossed once up (reduce) and once down (broadcast): 2 ceil(log2 n) alpha.")
    if close(got, expected / 2):
        return "half the tree's time: count the reduce up the tree AND the broadcast down it."
    if close(got, 2 * math.log2(n) * link.alpha_s + 2 * nbytes * link.beta_s_per_byte):
        return "log2 n hops is not a whole number: a tree's depth is ceil(log2 n)."
    if close(got, 2 * math.floor(math.log2(n)) * link.alpha_s + 2 * nbytes * link.beta_s_per_byte):
        return ("floor(log2 n) rounds are too few when n is not a power of two: each round at most halves the ranks "
                "still holding a partial sum, so n ranks need ceil(log2 n) rounds (3 ranks: 2).")
    return f"tree: expected {expected:.6g} s, got {got!r}."


def check_ring_vs_tree(ring_vs_tree: Callable) -> None:
    """ring_vs_tree(nbytes, n, link) -> {"ring": s, "tree": s}, one GPU per node so every hop uses `link`."""
    for link in LINKS:
        for nbytes in SIZES:
            for n in TREE_SIZES:
                got = ring_vs_tree(nbytes, n, link)
                if not isinstance(got, dict) or set(got) < {"ring", "tree"}:
                    raise ExerciseFailed(f"return a dict with keys 'ring' and 'tree', not {got!r}.")
                where = f"{nbytes:.3g} bytes on n={n}"
                ring = ring_allreduce_time_s(nbytes, n, link)
                if not close(got["ring"], ring):
                    slip = next((s for s, t in ring_mistakes(nbytes, n, link).items() if close(got["ring"], t)),
                                f"ring: expected {ring:.6g} s, got {got['ring']!r}.")
                    raise ExerciseFailed(f"{where}: {slip}")
                verdict = _tree_verdict(nbytes, n, link, got["tree"])
                if verdict:
                    raise ExerciseFailed(f"{where}: {verdict}")
    passed("ring_vs_tree agrees with the lesson's ring and double binary tree for every size, n and link")


def check_largest_world(largest_world: Callable) -> None:
    """largest_world(compute_s, gradient_bytes, link, efficiency) -> the largest n whose predicted efficiency,
    compute / step (one ring, no overlap), is still at least `efficiency`."""
    for compute_s, nbytes in STEP_CASES:
        for efficiency in (0.8, 0.9):
            link = LINKS[0]
            expected = scaling.gpus_above(efficiency, compute_s, nbytes, link)
            got = largest_world(compute_s, nbytes, link, efficiency)
            where = f"compute {compute_s} s, {nbytes:.3g} bytes, efficiency {efficiency}"
            if got == expected:
                continue
            if got == expected + 1:
                raise ExerciseFailed(f"{where}: {got} is the first n BELOW the target (off by one); return the "
                                     "last n that still reaches it.")
            if isinstance(got, int) and got > 1 and compute_s / scaling.predict_step_s(
                    compute_s, nbytes, got, link) < efficiency:
                raise ExerciseFailed(f"{where}: at n={got} the model's efficiency is below {efficiency}.")
            raise ExerciseFailed(f"{where}: expected n={expected}, got {got!r}; efficiency = compute / "
                                 "(compute + ring all-reduce time).")
    passed("the largest GPU count that keeps the predicted efficiency at the target, for each workload")
