"""Pipeline schedules as per-stage action lists [("F", 0), ("F", 1), ("B", 0), ...], checked and timed ideally."""
from __future__ import annotations

Action = tuple[str, int]
"""("F", j): forward of micro-batch j on this stage; ("B", j): its backward."""


def naive_actions(stage: int, stages: int) -> list[Action]:
    """The naive split: the whole batch is one micro-batch, so one stage works while the others wait."""
    return gpipe_actions(stage, stages, micro_batches=1)


def gpipe_actions(stage: int, stages: int, micro_batches: int) -> list[Action]:
    """GPipe: every forward first (F0 F1 ... F(m-1)), then every backward (B0 B1 ... B(m-1)).

    Every stage runs the same list; the pipeline itself staggers them: stage s can start F j only when
    stage s-1 has sent j's activation, and B j only when stage s+1 has sent j's gradient.
    """
    forwards = [("F", j) for j in range(micro_batches)]   # fill: activations of all m kept alive
    backwards = [("B", j) for j in range(micro_batches)]  # drain: each backward frees one micro-batch
    return forwards + backwards


def one_f_one_b_actions(stage: int, stages: int, micro_batches: int) -> list[Action]:
    """1F1B: a few forwards to fill the pipe, then one forward, one backward, ..., then the last backwards.

    Stage s warms up with (p - 1 - s) forwards: as many as are still in flight downstream of it. From then
    on each new forward is followed by the oldest backward, so at most (p - s) micro-batches are alive.
    """
    warmup = min(stages - 1 - stage, micro_batches)
    actions: list[Action] = [("F", j) for j in range(warmup)]        # fill the pipe below this stage
    for j in range(warmup, micro_batches):
        actions.append(("F", j))                                     # one forward ...
        actions.append(("B", j - warmup))                            # ... then the oldest backward
    actions += [("B", j) for j in range(micro_batches - warmup, micro_batches)]  # drain
    return actions


SCHEDULES = {"naive": naive_actions, "gpipe": gpipe_actions, "1f1b": one_f_one_b_actions}


def actions_for(schedule: str, stage: int, stages: int, micro_batches: int) -> list[Action]:
    """The action list of one stage under a named schedule (naive ignores micro_batches: it has one)."""
    if schedule == "naive":
        return naive_actions(stage, stages)
    return SCHEDULES[schedule](stage, stages, micro_batches)


def effective_micro_batches(schedule: str, micro_batches: int) -> int:
    """How many micro-batches a schedule cuts the batch into."""
    return 1 if schedule == "naive" else micro_batches


def schedule_problems(actions: list, stage: int, micro_batches: int) -> list[str]:
    """What is wrong with one stage's list on its own: each F j and B j exactly once, B j after F j."""
    problems = []
    for position, action in enumerate(actions):
        if (not isinstance(action, tuple) or len(action) != 2 or action[0] not in ("F", "B")
                or not isinstance(action[1], int)):
            return [f"action {position} on stage {stage} is {action!r}: use ('F', j) or ('B', j)"]
    for j in range(micro_batches):
        for kind in ("F", "B"):
            count = actions.count((kind, j))
            if count == 0:
                problems.append(f"stage {stage} never runs {kind} of micro-batch {j}")
            elif count > 1:
                problems.append(f"stage {stage} runs {kind} of micro-batch {j} {count} times (once is right)")
        if (("F", j) in actions and ("B", j) in actions
                and actions.index(("B", j)) < actions.index(("F", j))):
            problems.append(f"micro-batch {j}'s backward comes before its forward on stage {stage}")
    extra = sorted({j for _, j in actions if not 0 <= j < micro_batches})
    if extra:
        problems.append(f"stage {stage} names micro-batch(es) {extra}, outside 0..{micro_batches - 1}")
    return problems


def simulate(lists: list[list[Action]], forward_s: float = 1.0, backward_s: float = 1.0) -> list[list[dict]]:
    """The ideal timeline: each action starts as soon as its stage is free and its input has arrived.

    F j on stage s needs F j done on stage s-1; B j needs B j done on stage s+1 (the last stage's B j
    needs its own F j). Communication is free. Returns per stage [{"action", "micro_batch", "start",
    "end"}] in list order; raises ValueError naming the stuck actions when the lists wait on each other.
    """
    stages = len(lists)
    done: dict[tuple[str, int, int], float] = {}
    position = [0] * stages
    free_at = [0.0] * stages
    timeline: list[list[dict]] = [[] for _ in range(stages)]
    while any(position[s] < len(lists[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while position[s] < len(lists[s]):
                kind, j = lists[s][position[s]]
                needs = [("F", j, s - 1)] if kind == "F" and s > 0 else []
                if kind == "B":
                    needs = [("B", j, s + 1)] if s < stages - 1 else [("F", j, s)]
                if any(need not in done for need in needs):
                    break
                start = max([free_at[s]] + [done[need] for need in needs])
                end = start + (forward_s if kind == "F" else backward_s)
                done[(kind, j, s)] = free_at[s] = end
                timeline[s].append({"action": kind, "micro_batch": j, "start": start, "end": end})
                position[s] += 1
                progressed = True
        if not progressed:
            stuck = [f"stage {s} waits at {lists[s][position[s]]}" for s in range(stages)
                     if position[s] < len(lists[s])]
            raise ValueError("the stages wait on each other forever: " + "; ".join(stuck))
    return timeline


def bubble_formula(stages: int, micro_batches: int) -> float:
    """GPipe's idle fraction (p - 1) / (m + p - 1), for any forward/backward time ratio (see notebook 08)."""
    return (stages - 1) / (micro_batches + stages - 1)


def idle_fractions(timeline: list[list[dict]]) -> list[float]:
    """Per stage: 1 - (its busy time) / span, the span running from the first start on any stage to the last end.

    timeline: per stage, dicts with "start" and "end" (seconds or time units).
    """
    first = min(event["start"] for events in timeline for event in events)
    last = max(event["end"] for events in timeline for event in events)
    span = last - first
    return [1.0 - sum(e["end"] - e["start"] for e in events) / span for events in timeline]


def peak_in_flight(actions: list[Action]) -> int:
    """Most micro-batches whose forward has run and whose backward has not, at any point of the list."""
    alive = peak = 0
    for kind, _ in actions:
        alive += 1 if kind == "F" else -1
        peak = max(peak, alive)
    return peak
