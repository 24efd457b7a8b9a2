"""Schedules beyond 1F1B as per-rank action lists of (kind, micro-batch, virtual stage): interleaved 1F1B (v model
chunks per rank) and a zero-bubble schedule (backward split into an input-gradient step B and a weight-gradient
step W), their ideal timelines and their bubble formulas.

Interleaved 1F1B: Narayanan et al. 2021 (arXiv:2104.04473) §2.2.2, the order of Megatron-LM's
forward_backward_pipelining_with_interleaving. Zero bubble: Qi et al. 2023 (arXiv:2401.10241), ZB-H1: the same
F/B order as 1F1B, each W deferred into the time a stage would otherwise wait, at most p micro-batches kept.
"""
from __future__ import annotations

ChunkAction = tuple[str, int, int]
"""("F" | "B" | "W", micro-batch j, virtual stage): rank r holds virtual stages r, r + p, r + 2p, ..."""


def interleaved_actions(rank: int, ranks: int, chunks: int, micro_batches: int) -> list[ChunkAction]:
    """Rank `rank`'s interleaved 1F1B list: chunk c of this rank is virtual stage c·p + rank.

    Forwards go in groups of p micro-batches, chunk 0 then chunk 1 ... for each group; backwards the same
    with the chunks reversed (the last virtual stage first). Warm-up: 2(p - 1 - rank) + (v - 1)·p forwards,
    then one forward, one backward, then the remaining backwards (m must be a multiple of p).
    """
    if micro_batches % ranks:
        raise ValueError(f"interleaved 1F1B runs micro-batches in groups of p = {ranks}: m = {micro_batches} is not "
                         "a multiple of p")
    groups = range(micro_batches // ranks)
    forwards = [(j, c) for g in groups for c in range(chunks) for j in range(g * ranks, (g + 1) * ranks)]
    backwards = [(j, c) for g in groups for c in reversed(range(chunks)) for j in range(g * ranks, (g + 1) * ranks)]
    total = len(forwards)
    warmup = min(2 * (ranks - 1 - rank) + (chunks - 1) * ranks, total)
    actions = [("F", j, c * ranks + rank) for j, c in forwards[:warmup]]
    for step in range(warmup, total):
        (j, c), (k, d) = forwards[step], backwards[step - warmup]
        actions += [("F", j, c * ranks + rank), ("B", k, d * ranks + rank)]
    return actions + [("B", j, c * ranks + rank) for j, c in backwards[total - warmup:]]


def one_f_one_b_order(stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """1F1B's order of F and B on one stage (as schedules.one_f_one_b_actions)."""
    warmup = min(stages - 1 - stage, micro_batches)
    order = [("F", j) for j in range(warmup)]
    for j in range(warmup, micro_batches):
        order += [("F", j), ("B", j - warmup)]
    return order + [("B", j) for j in range(micro_batches - warmup, micro_batches)]


def zero_bubble_lists(stages: int, micro_batches: int) -> list[list[ChunkAction]]:
    """Every stage's ZB-H1 list (Qi et al. 2023, their first handcrafted schedule): 1F1B's F and B (B now the input gradient only), each W
    run when the stage would otherwise wait, or when p micro-batches already wait for their W and the next action
    is a forward: a stage never keeps more than p micro-batches' activations (they go at W), as in 1F1B. Found by
    stepping boxes of 1 through time; W j always comes after B j (it needs the gradient B kept)."""
    orders = [one_f_one_b_order(s, stages, micro_batches) for s in range(stages)]
    finished: dict[tuple[str, int, int], int] = {}
    position, busy_until, waiting_w = [0] * stages, [0] * stages, [[] for _ in range(stages)]
    alive = [0] * stages   # micro-batches whose F has run and whose W has not: their activations are kept
    lists: list[list[ChunkAction]] = [[] for _ in range(stages)]
    now = 0
    while any(position[s] < len(orders[s]) or waiting_w[s] for s in range(stages)):
        for s in range(stages):
            if busy_until[s] > now:
                continue
            if position[s] < len(orders[s]):
                kind, j = orders[s][position[s]]
                need = _need(kind, j, s, stages)
                ready = need is None or finished.get(need, now + 1) <= now
                memory_full = kind == "F" and alive[s] >= stages and waiting_w[s]   # ZB-H1: at most p kept
                if ready and not memory_full:
                    lists[s].append((kind, j, s))
                    finished[(kind, j, s)] = busy_until[s] = now + 1
                    position[s] += 1
                    alive[s] += kind == "F"
                    if kind == "B":
                        waiting_w[s].append(j)
                    continue
            if waiting_w[s]:   # waiting for a message, or memory full: a W fills the slot
                j = waiting_w[s].pop(0)
                lists[s].append(("W", j, s))
                finished[("W", j, s)] = busy_until[s] = now + 1
                alive[s] -= 1
        now += 1
    return lists


def _need(kind: str, j: int, virtual_stage: int, virtual_stages: int):
    """The action (kind, j, virtual stage) that must finish before this one may start (None: nothing)."""
    if kind == "F":
        return ("F", j, virtual_stage - 1) if virtual_stage > 0 else None
    if kind == "B":
        return ("B", j, virtual_stage + 1) if virtual_stage < virtual_stages - 1 else ("F", j, virtual_stage)
    return ("B", j, virtual_stage)


def simulate(lists: list[list[ChunkAction]], virtual_stages: int, box: dict[str, float]) -> list[list[dict]]:
    """The ideal timeline per rank (messages free, each kind of box its length in `box`); raises ValueError
    naming a W listed before its own B, or the stuck actions when the lists wait on each other forever (an order
    that cannot run)."""
    for r, actions in enumerate(lists):
        for kind, j, virtual_stage in actions:
            if kind == "W" and actions.index(("W", j, virtual_stage)) < actions.index(("B", j, virtual_stage)):
                raise ValueError(f"rank {r} runs W of micro-batch {j} on virtual stage {virtual_stage} before its B: "
                                 "W runs after B, once the input gradient has been sent upstream")
    done: dict[tuple, float] = {}
    position, free_at = [0] * len(lists), [0.0] * len(lists)
    timeline: list[list[dict]] = [[] for _ in lists]
    while any(position[r] < len(lists[r]) for r in range(len(lists))):
        progressed = False
        for r, actions in enumerate(lists):
            while position[r] < len(actions):
                kind, j, virtual_stage = actions[position[r]]
                need = _need(kind, j, virtual_stage, virtual_stages)
                if need is not None and need not in done:
                    break
                start = max(free_at[r], done[need] if need else 0.0)
                done[(kind, j, virtual_stage)] = free_at[r] = start + box[kind]
                timeline[r].append({"action": kind, "micro_batch": j, "virtual_stage": virtual_stage,
                                    "start": start, "end": free_at[r]})
                position[r] += 1
                progressed = True
        if not progressed:
            stuck = [f"rank {r} waits at {lists[r][position[r]]}" for r in range(len(lists)) if position[r] < len(lists[r])]
            raise ValueError("the ranks wait on each other forever: " + "; ".join(stuck))
    return timeline


def interleaved_bubble(ranks: int, chunks: int, micro_batches: int) -> float:
    """Idle fraction of interleaved 1F1B with equal F and B: (p-1)/(v·m + p-1); Megatron's form, bubble time over
    compute time, is (p-1)/(v·m) (the same number x with x/(1-x) = (p-1)/(v·m))."""
    return (ranks - 1) / (chunks * micro_batches + ranks - 1)


def zero_bubble_bubble(stages: int, micro_batches: int) -> float:
    """Idle fraction of ZB-H1 with F = B = W boxes, m >= p: (p-1)/(3m + p-1). Qi et al.: the bubble shrinks from
    (p-1)(F + B + W) for 1F1B to (p-1)(F + B - W)."""
    return (stages - 1) / (3 * micro_batches + stages - 1)


def in_flight_peak(actions: list[ChunkAction]) -> int:
    """Most (micro-batch, chunk) forwards whose activations are still kept, at any point of one rank's list:
    until the backward, or until the W when the backward is split (W still needs the stage's saved inputs)."""
    split = any(kind == "W" for kind, _, _ in actions)
    alive = peak = 0
    for kind, _, _ in actions:
        alive += 1 if kind == "F" else -1 if kind == ("W" if split else "B") else 0
        peak = max(peak, alive)
    return peak


def messages_per_step(ranks: int, chunks: int, micro_batches: int) -> int:
    """Point-to-point messages one step sends: each micro-batch crosses v·p - 1 boundaries forward and back."""
    return 2 * micro_batches * (chunks * ranks - 1)


def w_before_b(timeline: list[list[dict]]) -> list[str]:
    """Each W that started before its own B ended on the same virtual stage (measured times), named."""
    wrong = []
    for events in timeline:
        ends = {(e["micro_batch"], e["virtual_stage"]): e["end"] for e in events if e["action"] == "B"}
        for e in events:
            key = (e["micro_batch"], e["virtual_stage"])
            if e["action"] == "W" and (key not in ends or e["start"] < ends[key]):
                wrong.append(f"W of micro-batch {key[0]} on virtual stage {key[1]} started before its B ended")
    return wrong


CHUNKED_SCHEDULES = ("interleaved_1f1b", "zero_bubble")
"""Hand-written schedules run by chunked_executor: interleaved 1F1B with 2 chunks a rank, zero bubble (ZB-H1)."""


def chunked_lists(schedule: str, ranks: int, micro_batches: int, chunks: int = 2) -> tuple[list[list], int]:
    """(every rank's list, virtual stages) of a hand-written chunked schedule."""
    if schedule == "interleaved_1f1b":
        return [interleaved_actions(r, ranks, chunks, micro_batches) for r in range(ranks)], chunks * ranks
    return zero_bubble_lists(ranks, micro_batches), ranks


def ideal_timeline(schedule: str, ranks: int, micro_batches: int, box_s: float) -> list[list[dict]]:
    """The ideal timeline as the lab times it: every F, B and W box box_s long, messages free."""
    lists, virtual_stages = chunked_lists(schedule, ranks, micro_batches)
    return simulate(lists, virtual_stages, {"F": box_s, "B": box_s, "W": box_s})


def bubble_formula(schedule: str, ranks: int, micro_batches: int) -> float:
    """The idle fraction the schedule's formula predicts, as the lab times it (2 chunks; F = B = W)."""
    if schedule == "interleaved_1f1b":
        return interleaved_bubble(ranks, 2, micro_batches)
    return zero_bubble_bubble(ranks, micro_batches)


def kept_bytes_peak(actions: list[ChunkAction], chunk_bytes: dict[int, int]) -> int:
    """The most activation bytes one rank's list keeps at once, if each (micro-batch, chunk) keeps
    chunk_bytes[virtual stage] from its F until its backward (its W when the backward is split)."""
    split = any(kind == "W" for kind, _, _ in actions)
    alive = peak = 0
    for kind, _, virtual_stage in actions:
        if kind == "F":
            alive += chunk_bytes[virtual_stage]
        elif kind == ("W" if split else "B"):
            alive -= chunk_bytes[virtual_stage]
        peak = max(peak, alive)
    return peak


def torch_interleaved_order(ranks: int, chunks: int, micro_batches: int) -> list[list[ChunkAction]]:
    """Every rank's order as torch's own ScheduleInterleaved1F1B computes it (torch/distributed/pipelining/
    schedules.py, `_calculate_single_rank_operations` and `_get_warmup_ops`), with its idle slots dropped.

    An order derived apart from `interleaved_actions`: the notebook compares the two. The method is private
    torch API, called here without building stages (it reads only the four attributes set below)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    rounds = max(1, micro_batches // ranks)
    fake = SimpleNamespace(n_local_stages=chunks, microbatches_per_round=micro_batches // rounds,
                           pp_group_size=ranks, _n_microbatches=micro_batches)
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B"}
    return [[(kinds[action.computation_type.name], action.microbatch_index, action.stage_index)
             for action in ScheduleInterleaved1F1B._calculate_single_rank_operations(fake, rank) if action is not None]
            for rank in range(ranks)]
