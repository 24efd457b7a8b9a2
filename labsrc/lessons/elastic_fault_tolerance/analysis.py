"""What a restarted or re-formed run's records say: steps kept and replayed, samples seen, time lost, membership.

Every number lesson 10 asserts is computed here from typed records; plots/elastic_fault_tolerance.py only draws.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from labsrc.lessons.elastic_fault_tolerance.lab import Failure, Resume, StateFingerprint, TrainStep


def rank_histories(result) -> dict[int, list[tuple[Resume, list[TrainStep]]]]:
    """{rank: [(a Resume, the resumable TrainSteps that process did), ...]} in the order they happened.

    Each rank's file is read in order, attempt by attempt: a Resume record opens a new process's share. A start
    is told apart by its Resume, not by torchrun's restart count, which a membership change does not raise.
    """
    histories: dict[int, list] = {}
    for attempt in sorted(result.records_by_attempt):
        for rank, rows in result.records_by_attempt[attempt].items():
            for row in rows:
                if row["kind"] == Resume.KIND:
                    histories.setdefault(rank, []).append((Resume.from_dict(row), []))
                elif row["kind"] == TrainStep.KIND and row["run"] == "resumable" and histories.get(rank):
                    histories[rank][-1][1].append(TrainStep.from_dict(row))
    return histories


def starts(result) -> list[list[tuple[Resume, list[TrainStep]]]]:
    """Each start of the group (rank 0's Resume in time order), with every rank's share of it."""
    histories = rank_histories(result)
    groups = [[share] for share in histories.get(0, [])]
    for rank, shares in histories.items():
        for share in shares if rank else []:
            nearest = min(groups, key=lambda g: abs(g[0][0].started_wall - share[0].started_wall))
            nearest.append(share)
    return groups


@dataclass
class Segment:
    """One start of the ranks: the steps it did, which it kept and which the next start replayed."""

    start: int
    world_size: int
    restart_count: int
    resumed_from: int
    reached: int
    """Steps done when this start ended (its last TrainStep)."""
    kept_until: int
    """The next start resumed from here: steps resumed_from+1 .. kept_until count, later ones were redone."""
    first_wall: float
    last_wall: float


def segments(result) -> list[Segment]:
    """One Segment per start of the group, from rank 0's records."""
    groups = starts(result)
    out = []
    for i, group in enumerate(groups):
        resume, done = group[0]
        reached = max((s.step for s in done), default=resume.resumed_from_step)
        kept = groups[i + 1][0][0].resumed_from_step if i + 1 < len(groups) else reached
        walls = [s.wall for s in done] or [resume.started_wall]
        out.append(Segment(i, resume.world_size, resume.restart_count, resume.resumed_from_step, reached, kept,
                           min(walls), max(walls)))
    return out


def kept_steps(result) -> list[TrainStep]:
    """Every rank's TrainSteps that count: each start's steps up to where the next start resumed from."""
    out = []
    for segment, group in zip(segments(result), starts(result)):
        for _, done in group:
            out += [s for s in done if segment.resumed_from < s.step <= segment.kept_until]
    return out


def sample_counts(steps: list[TrainStep]) -> dict[int, Counter]:
    """{epoch: Counter(sample id -> times used)} over the given steps, all ranks together."""
    counts: dict[int, Counter] = {}
    for step in steps:
        counts.setdefault(step.epoch, Counter()).update(step.sample_ids)
    return counts


def lost_and_repeated(counts: dict[int, Counter], samples: int, epochs: int) -> dict[int, dict]:
    """{epoch: {"lost": ids never used, "repeated": ids used more than once}} for epochs 0..epochs-1."""
    report = {}
    for epoch in range(epochs):
        seen = counts.get(epoch, Counter())
        report[epoch] = {"lost": sorted(set(range(samples)) - set(seen)),
                         "repeated": sorted(i for i, n in seen.items() if n > 1)}
    return report


@dataclass
class RestartCost:
    """One restart: what failed, where the run was, where it resumed, what it cost."""

    restart: int
    failure: str
    reached: int
    """Steps done before the failure."""
    resumed_from: int
    steps_replayed: int
    """reached - resumed_from: steps done after the last snapshot, done again."""
    downtime_s: float
    """From the last step before the failure to the first step after the restart."""
    time_lost_s: float
    """From first reaching step `reached` to reaching it again (downtime plus the replayed steps)."""


def restart_costs(result) -> list[RestartCost]:
    parts = segments(result)
    steps = [s for group in starts(result) for s in group[0][1]]  # rank 0's steps, replayed ones included
    failures = [f for a in sorted(result.records_by_attempt) for f in result.of(Failure, attempt=a)]
    costs = []
    for before, after in zip(parts, parts[1:]):
        again = [s.wall for s in steps if s.step == before.reached and s.wall > after.first_wall - 1e-6]
        first = [s.wall for s in steps if s.step == before.reached and s.wall <= before.last_wall + 1e-6]
        kind = next((f.failure for f in failures if f.attempt == before.restart_count
                     and before.first_wall - 1 <= f.wall <= after.first_wall), "membership change")
        lost = (min(again) - min(first)) if again and first else float("nan")
        costs.append(RestartCost(after.start, kind, before.reached, after.resumed_from,
                                 before.reached - after.resumed_from, after.first_wall - before.last_wall, lost))
    return costs


@dataclass
class ResumeCheck:
    """One rank's state right after loading a snapshot, part by part against the uninterrupted run's at that step."""

    attempt: int
    rank: int
    step: int
    differing: list
    """Parts (model, optimizer, scheduler, scaler, sampler, rng, step) whose fingerprints differ; [] when all match."""


def resume_checks(result) -> list[ResumeCheck]:
    """Every loaded resume compared with the reference run's fingerprints of the same rank after the same step."""
    reference = {(p.rank, p.step): p.parts for a in sorted(result.records_by_attempt)
                 for p in result.of(StateFingerprint, rank=None, attempt=a) if p.run == "reference"}
    checks = []
    for attempt in sorted(result.records_by_attempt):
        for resumed in result.of(StateFingerprint, rank=None, attempt=attempt):
            expected = reference.get((resumed.rank, resumed.step))
            if resumed.run != "resumed" or expected is None:
                continue
            differing = [part for part in expected if resumed.parts.get(part) != expected[part]]
            checks.append(ResumeCheck(attempt, resumed.rank, resumed.step, differing))
    return checks
