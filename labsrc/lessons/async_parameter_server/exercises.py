"""Checkers for notebook 11's exercises: the bounded-staleness admission check, and local SGD's averaging step."""
from __future__ import annotations

import datetime
from typing import Callable

import torch
import torch.distributed as dist

from labsrc.core.exercises import ExerciseFailed, on_ranks, passed
from labsrc.lessons.async_parameter_server import analysis, local_sgd as local, server as ps

PROBLEM = ps.Problem(features=8, samples=256, batch=8, seed=5)
CASES = [(server, gradient, bound) for bound in (0, 1, 3) for server in range(6) for gradient in range(server + 1)]
"""Every reachable case: a gradient's version is one the server handed out, so it never exceeds the server's. On
these `abs(server - gradient) <= bound` is the right answer too (it only differs where no run can go)."""


def _admit_verdict(admit: Callable) -> str | None:
    """What the learner's admit gets wrong over every (server_version, gradient_version, bound) case, in words."""
    wrong = []
    for server, gradient, bound in CASES:
        got = admit(server, gradient, bound)
        if not isinstance(got, (bool, torch.Tensor)) and got not in (0, 1):
            return f"admit must return True or False, not {got!r}."
        if bool(got) != (server - gradient <= bound):
            wrong.append((server, gradient, bound))
    if not wrong:
        return None
    if all(server - gradient == bound for server, gradient, bound in wrong):
        server, gradient, bound = wrong[0]
        return (f"a gradient exactly {bound} updates old (server version {server}, gradient version {gradient}) "
                f"was rejected with bound {bound}: the bound is the largest staleness admitted, so use <=.")
    admitted = [case for case in wrong if case[0] - case[1] > case[2]]
    if admitted:
        server, gradient, bound = admitted[0]
        return (f"a gradient {server - gradient} updates old (server version {server}, gradient version {gradient}) "
                f"was admitted with bound {bound}: staleness is server_version - gradient_version, and it must not "
                "exceed the bound.")
    server, gradient, bound = wrong[0]
    return (f"a gradient {server - gradient} updates old (server version {server}, gradient version {gradient}) was "
            f"rejected with bound {bound}: staleness is server_version - gradient_version, and it is admitted while "
            "it is at most the bound.")


def _bounded_rank(ctx, admit: Callable, bound: int) -> str | None:
    """On forked ranks: a bounded server using the learner's admit; rank 0 checks staleness and the replay."""
    settings = ps.Settings("bounded", (1, 2), 40, 0.2, bound, (0.001, 0.006), 0.3, 30.0)
    data = ps.make_data(PROBLEM)
    result = ps.run(ctx.rank, data, PROBLEM, settings, admit)
    if ctx.rank != 0:
        return None
    applied = [u for u in result["updates"] if u["applied"]]
    worst = max(u["staleness"] for u in applied)
    if worst > bound:
        return f"the server applied a gradient {worst} updates old with bound {bound}."
    replayed = analysis.replay(data, PROBLEM, "bounded", settings.lr, 2, result["updates"])
    if not torch.equal(replayed, result["parameters"]):
        return "the server's parameters differ from a replay of its own records."
    return None


def check_admit(admit: Callable, bound: int = 1) -> None:
    """admit(server_version, gradient_version, bound) -> bool: True when the gradient is at most bound updates old.

    Checked on a table of versions, then inside a bounded parameter server on 3 forked gloo ranks.
    """
    verdict = _admit_verdict(admit)
    if verdict:
        raise ExerciseFailed(verdict)
    on_ranks(_bounded_rank, 3, (admit, bound), timeout_s=60)
    passed(f"every staleness from 0 to 5 judged right for bounds 0, 1, 3; on 3 ranks the server applied nothing "
           f"staler than {bound} and its parameters replay bit for bit")


SERVER_OUT_TIMEOUT_S = 3.0
"""The wait given to average() in the sub-group case: an all_reduce that waits for the excluded rank fails in it."""


def _average_rank(ctx, average: Callable, without_server: bool) -> str | None:
    """On one rank: distinct parameters in, the mean over the group's ranks out, in place; then local SGD with it.

    without_server: as in the lab, rank 0 is left out: the group is ranks 1.. (dist.new_group), and rank 0 only
    waits; an answer that ignores `group` divides by the wrong count or waits for rank 0, which never joins.
    """
    members = list(range(1, ctx.world_size)) if without_server else list(range(ctx.world_size))
    if not without_server:
        return _average_verdict(ctx, average, None, members)
    group = dist.new_group(members)
    done = dist.new_group(list(range(ctx.world_size)), timeout=datetime.timedelta(seconds=60))
    # rank 0 stays alive but joins nothing on the default group, so an all_reduce there waits for it and times out;
    # a barrier on a group of its own then tells rank 0 the workers are done.
    verdict = _average_verdict(ctx, average, group, members) if ctx.rank in members else None
    dist.barrier(group=done)
    return verdict


def _average_verdict(ctx, average: Callable, group, members: list) -> str | None:
    without_server = group is not None
    generator = torch.Generator().manual_seed(ctx.rank)
    mine = torch.randn(6, generator=generator)
    everyone = [torch.randn(6, generator=torch.Generator().manual_seed(r)) for r in members]
    mean, total = torch.stack(everyone).mean(0), torch.stack(everyone).sum(0)
    parameters = mine.clone()
    try:
        returned = average(parameters, group, SERVER_OUT_TIMEOUT_S if without_server else 30.0)
    except Exception as exc:  # noqa: BLE001  the learner's collective failed: name the likely cause
        if not without_server:
            raise
        return (f"averaging over the group of ranks {members} (rank 0, the server, is not in it) raised "
                f"{type(exc).__name__}: pass group=group to the collective, or it waits for every rank.")
    if torch.allclose(parameters, mean, atol=1e-6):
        return _local_sgd_verdict(ctx, average, group, members)
    if torch.equal(parameters, mine):
        if isinstance(returned, torch.Tensor) and torch.allclose(returned, mean, atol=1e-6):
            return ("you returned the mean but left `parameters` as it was: average in place (all_reduce works in "
                    "place, then .div_), the training loop keeps using the tensor it passed in.")
        return "parameters are unchanged: every worker kept its own; the workers must all_reduce them."
    if torch.allclose(parameters, total, atol=1e-5):
        return (f"you left the sum of the {len(members)} workers' parameters: divide by the number of workers "
                "(dist.get_world_size(group)).")
    for count in range(1, 9):
        if count != len(members) and torch.allclose(parameters, total / count, atol=1e-5):
            where = (f" (the group is ranks {members} of {ctx.world_size}: dist.get_world_size() without the "
                     "group counts the server too)" if without_server and count == ctx.world_size else "")
            return (f"you divided by {count}, but {len(members)} workers took part{where}: use "
                    "dist.get_world_size(group), not a fixed number.")
    return f"expected the mean over ranks, got values {float((parameters - mean).abs().max()):.3g} away from it."


def _local_sgd_verdict(ctx, average: Callable, group, members: list) -> str | None:
    data = ps.make_data(PROBLEM)
    worker = members.index(ctx.rank) + 1
    theirs = local.local_sgd(worker, data, PROBLEM, 12, 4, 0.2, group, 30.0, average)
    reference = local.local_sgd(worker, data, PROBLEM, 12, 4, 0.2, group)
    if not torch.allclose(theirs["parameters"], reference["parameters"], atol=1e-6):
        return "local SGD with your averaging ends elsewhere than with the reference averaging."
    return None


def check_average_parameters(average_parameters: Callable) -> None:
    """average_parameters(parameters (features,), group, timeout_s): in place, the mean over the group's ranks.

    Run on 2 and then 3 forked gloo ranks (group None: all of them), then on 3 ranks with the group of ranks 1
    and 2 (rank 0 left out, as the lab leaves out its server).
    """
    for world_size, without_server in ((2, False), (3, False), (3, True)):
        on_ranks(_average_rank, world_size, (average_parameters, without_server), timeout_s=60)
    passed("on 2 and 3 ranks, and on a group of 2 of 3 ranks (the server left out), every worker holds the mean of "
           "its group's parameters, in place, and local SGD with your averaging matches the reference")
