"""Notebook 01b's small checks: one TODO of your_ddp_script.py at a time, each function alone on forked gloo ranks.

Each check runs your function once its TODO is written. Until then it runs the reference solution's and says so
loudly, so the notebook runs unattended. TODOs 2, 4 and 8 live in main(): the whole run checks them.
"""
from __future__ import annotations

import contextlib
import io
import pickle
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from labsrc.core.exercises import ExerciseFailed, passed
from labsrc.core.forked import RankError, run_ranks
from labsrc.lessons.dp_vs_ddp.script_reference import (LOSS_TOLERANCE, course_script, load_script, reference_path,
                                                       reference_run, todos_left)
from labsrc.lessons.dp_vs_ddp.script_side_checks import pretend_gpus_check

SAVE_PAUSE_S = 0.5  # after torch.save, as a large checkpoint takes to write: a missing barrier shows every time
SHARES = ((3.0, 2), (10.0, 3), (2.0, 5))  # (summed loss, samples) on ranks 0, 1, 2: uneven on purpose


def pick(script, todo: int) -> Path:
    """Your script if its TODO `todo` is written, else the reference, said loudly."""
    if todo in todos_left(script):
        reference = reference_path(needed_for=f"TODO {todo} in {Path(script).name} still raises NotImplementedError")
        print(f"REFERENCE SOLUTION checked, not yours: TODO {todo} in {Path(script).name} still raises "
              "NotImplementedError.")
        return reference
    try:
        load_script(script)
    except Exception as error:  # noqa: BLE001 - a script that does not even load is the learner's to see
        raise ExerciseFailed(f"{Path(script).name} does not load: {type(error).__name__}: {error}") from None
    return Path(script).resolve()


def on_ranks(function, world_size: int, args: tuple, timeout_s: float) -> list:
    """[rank] -> what function(ctx, *args) returned on forked gloo ranks; ExerciseFailed if a rank raised or hung."""
    try:
        return run_ranks(function, world_size, args, timeout_s=timeout_s)
    except RankError as error:
        raise ExerciseFailed(f"your function raised, or a rank waited in a collective the others never joined (an "
                             f"all_reduce or a barrier inside `if rank == 0:`):\n{error}") from None


def check_device(script) -> None:
    """TODO 1, choose_device: GPU local_rank % gpus, set before any CUDA work (on 2 pretend GPUs, no CUDA needed)."""
    problem = pretend_gpus_check(load_script(pick(script, 1)).choose_device)
    if problem:
        raise ExerciseFailed(f"TODO 1: {problem}")
    passed("TODO 1: with 2 GPUs, LOCAL_RANK 1 sets GPU 1 (NCCL); with 4 ranks on 2 GPUs, LOCAL_RANK 3 sets GPU 1 "
           "(gloo). RANK was set to another number each time.")


def loader_rank(ctx, path: str) -> dict:
    module = load_script(path)
    try:
        sampler, loader = module.make_loader(module.make_dataset())
    except ValueError as error:  # DistributedSampler refuses a rank outside the world size it was given
        if "Invalid rank" not in str(error):
            raise
        return {"refused": str(error)}
    return {"distributed": isinstance(sampler, DistributedSampler), "used": loader.sampler is sampler,
            "batch": loader.batch_size, "indices": [int(i) for i in sampler]}


def check_loader(script) -> list[list[int]]:
    """TODO 3, make_loader: on 2 and then 3 ranks, disjoint shards covering the dataset. Returns the 2 ranks' shards."""
    path, course = pick(script, 3), course_script()
    shards = {}
    for world_size in (2, 3):
        got = on_ranks(loader_rank, world_size, (str(path),), timeout_s=60)
        refused = [rank for rank, value in enumerate(got) if "refused" in value]
        if refused:
            raise ExerciseFailed(f"TODO 3: on {world_size} ranks the sampler refused rank {refused[0]} "
                                 f"({got[refused[0]]['refused']}): num_replicas or rank is written into make_loader. "
                                 "Let DistributedSampler(dataset) read both from the process group.")
        if not all(rank["distributed"] and rank["used"] for rank in got):
            raise ExerciseFailed("TODO 3: make_loader must return (a DistributedSampler, a DataLoader built with "
                                 "sampler=that sampler). Without it every rank walks the whole dataset.")
        if any(rank["batch"] != course.BATCH_PER_RANK for rank in got):
            raise ExerciseFailed(f"TODO 3: the DataLoader's batch_size is {got[0]['batch']}, not BATCH_PER_RANK.")
        every = sorted(index for rank in got for index in rank["indices"])
        if every != list(range(course.DATASET_SIZE)):
            raise ExerciseFailed(f"TODO 3: on {world_size} ranks the shards are not disjoint pieces of the dataset: "
                                 "let DistributedSampler(dataset) read the rank and world size from the group.")
        shards[world_size] = [rank["indices"] for rank in got]
    passed("TODO 3: on 2 ranks and on 3, each rank gets its own shard, and together they cover the dataset once.")
    return shards[2]


def summed_mean(loss_sum: float, count: int, device) -> float:
    """The loss over every rank's samples (what TODO 6 computes), for checking train while TODO 6 is still to do."""
    totals = torch.tensor([loss_sum, count], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def train_rank(ctx, path: str, with_reference_mean: bool) -> dict:
    module, course = load_script(path), course_script()
    if with_reference_mean:
        module.global_mean = summed_mean
    dataset = course.make_dataset()
    sampler = DistributedSampler(dataset, shuffle=True, seed=course.SEED)
    loader = DataLoader(dataset, batch_size=course.BATCH_PER_RANK, sampler=sampler)
    calls, set_epoch = [], sampler.set_epoch
    sampler.set_epoch = lambda epoch: (calls.append(epoch), set_epoch(epoch))[1]
    model = DistributedDataParallel(course.make_model())
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        history = module.train(model, loader, sampler, torch.device("cpu"), ctx.rank)
    return {"calls": calls, "history": history, "printed": printed.getvalue()}


def check_train(script) -> None:
    """TODO 5, set_epoch in train: on 2 ranks, each epoch reshuffled, and the training equal to one process's."""
    path = pick(script, 5)
    with_reference_mean = 6 in todos_left(path)
    got = on_ranks(train_rank, 2, (str(path), with_reference_mean), timeout_s=60)
    epochs = course_script().EPOCHS
    if got[0]["calls"] != list(range(epochs)):
        raise ExerciseFailed(f"TODO 5: sampler.set_epoch was called with {got[0]['calls']}, expected "
                             f"{list(range(epochs))}: once at the start of each epoch.")
    reference = reference_run(2)
    gap = max(abs(a - b) for a, b in zip(got[0]["history"], reference.epoch_losses))
    if gap > LOSS_TOLERANCE and all(abs(a - b) <= LOSS_TOLERANCE for a, b in zip(got[0]["history"],
                                                                              reference.rank_losses[0])):
        raise ExerciseFailed("TODO 6: train's losses on rank 0 are its own shard's, not the loss over all samples: "
                             "global_mean must return the all-reduced sum divided by the all-reduced count.")
    if gap > LOSS_TOLERANCE:
        raise ExerciseFailed(f"TODO 5: the epochs' losses differ from one process's by {gap:.2g}: call set_epoch "
                             "before the epoch's first batch, not after it.")
    if got[1]["printed"]:
        raise ExerciseFailed(f"train: rank 1 printed {got[1]['printed'].splitlines()[0]!r}: print on rank 0 only.")
    helper = " (with a stand-in global_mean: TODO 6 is still to do)" if with_reference_mean else ""
    passed(f"TODO 5: set_epoch(0) to set_epoch({epochs - 1}), each before its epoch; 2 ranks trained as one "
           f"process on the global batch (loss within {gap:.0e}){helper}.")


def mean_rank(ctx, path: str) -> float:
    loss_sum, count = SHARES[ctx.rank]
    return float(load_script(path).global_mean(loss_sum, count, torch.device("cpu")))


def check_global_mean(script) -> None:
    """TODO 6, global_mean: on 2 and 3 ranks holding unequal numbers of samples, the mean over every sample."""
    path = pick(script, 6)
    for world_size in (2, 3):
        shares = SHARES[:world_size]
        got = on_ranks(mean_rank, world_size, (str(path),), timeout_s=30)
        right = sum(s for s, _ in shares) / sum(n for _, n in shares)
        if all(abs(value - right) < 1e-9 for value in got):
            continue
        own = [s / n for s, n in shares]
        said = f"on {world_size} ranks holding {shares} (summed loss, samples), ranks returned {got}, expected {right:g}"
        if all(abs(value - mine) < 1e-9 for value, mine in zip(got, own)):
            raise ExerciseFailed(f"TODO 6: {said}: each rank's own mean. all_reduce the [sum, count] tensor first.")
        if all(abs(value - sum(own) / world_size) < 1e-9 for value in got):
            raise ExerciseFailed(f"TODO 6: {said}: the mean of the ranks' means, which weighs a rank with 2 samples "
                                 "like one with 3. Add up the sums and the counts, then divide.")
        raise ExerciseFailed(f"TODO 6: {said}: sum [loss_sum, count] over the ranks, then return sum / count.")
    passed("TODO 6: on 2 and 3 ranks with unequal sample counts, every rank gets the mean over all samples "
           "(2.6 on 2 ranks, where the mean of the ranks' means would be 2.42).")


def checkpoint_rank(ctx, path: str, file: str) -> dict:
    module, course = load_script(path), course_script()
    model = DistributedDataParallel(course.make_model())
    if ctx.rank == 1:
        with torch.no_grad():  # rank 1 drifts, so reading the checkpoint back must bring it to rank 0's weights
            for parameter in model.parameters():
                parameter.add_(1.0)
    events, save, load = [], torch.save, torch.load

    def timed_save(obj, f, *args, **kwargs):
        save(obj, f, *args, **kwargs)
        time.sleep(SAVE_PAUSE_S)
        events.append({"event": "saved", "time": time.time(), "keys": sorted(obj) if isinstance(obj, dict) else []})

    def timed_load(f, *args, **kwargs):
        events.append({"event": "loading", "time": time.time(), "mapped": kwargs.get("map_location", args[0] if args else None) is not None})
        try:
            return load(f, *args, **kwargs)
        except (FileNotFoundError, EOFError, RuntimeError, pickle.UnpicklingError) as error:
            events[-1]["failed"] = type(error).__name__  # a file that was missing or half written
            raise

    torch.save, torch.load = timed_save, timed_load
    raised = None
    try:
        module.save_and_reload(model, file, torch.device("cpu"), ctx.rank)
    except Exception as error:  # noqa: BLE001 - said after the file's writers and keys are judged
        raised = f"{type(error).__name__}: {str(error)[:300]}"
    finally:
        torch.save, torch.load = save, load
    return {"events": events, "raised": raised, "checksum": float(sum(p.detach().double().sum() for p in model.module.parameters()))}


def check_save_and_reload(script, folder) -> None:
    """TODO 7, save_and_reload on 2 ranks: one writer, a barrier, map_location, the weights back in every model."""
    path = pick(script, 7)
    got = on_ranks(checkpoint_rank, 2, (str(path), str(Path(folder) / "checkpoint_check.pt")), timeout_s=60)
    saves = [(rank, e) for rank, r in enumerate(got) for e in r["events"] if e["event"] == "saved"]
    loads = [(rank, e) for rank, r in enumerate(got) for e in r["events"] if e["event"] == "loading"]
    failed = [(rank, e["failed"]) for rank, e in loads if "failed" in e]
    if failed:
        raise ExerciseFailed(f"TODO 7: rank {failed[0][0]} could not read the checkpoint ({failed[0][1]}): it read "
                             "before rank 0 had finished writing. dist.barrier() between the save and the loads.")
    if [rank for rank, _ in saves] != [0]:
        raise ExerciseFailed(f"TODO 7: written by rank(s) {[rank for rank, _ in saves]}: write it once, on rank 0.")
    if any(key.startswith("module.") for key in saves[0][1]["keys"]):
        raise ExerciseFailed("TODO 7: the keys start with 'module.': save model.module.state_dict(), the unwrapped "
                             "model, so that the file loads into a plain model.")
    raised = [(rank, r["raised"]) for rank, r in enumerate(got) if r["raised"]]
    if raised and "state_dict" in raised[0][1] and "module." in raised[0][1]:
        raise ExerciseFailed("TODO 7: the file holds the unwrapped model's keys, and model is the DDP wrapper: "
                             f"load into model.module, the unwrapped model ({raised[0][1][:120]}...).")
    if raised:
        raise ExerciseFailed(f"TODO 7: save_and_reload raised on rank {raised[0][0]}: {raised[0][1]}")
    if sorted(rank for rank, _ in loads) != [0, 1]:
        raise ExerciseFailed("TODO 7: every rank reads the checkpoint back once, with torch.load.")
    early = [rank for rank, e in loads if e["time"] < saves[0][1]["time"]]
    if early:
        raise ExerciseFailed(f"TODO 7: rank(s) {early} began reading before rank 0 had finished writing: "
                             "dist.barrier() between the save and the loads.")
    if not all(e["mapped"] for _, e in loads):
        raise ExerciseFailed("TODO 7: torch.load without map_location puts each tensor back on the device it was "
                             "saved from, rank 0's GPU: pass map_location=device.")
    if got[0]["checksum"] != got[1]["checksum"]:
        raise ExerciseFailed("TODO 7: rank 1's model does not hold rank 0's weights after the call: "
                             "model.module.load_state_dict(state).")
    passed("TODO 7: rank 0 alone wrote the unwrapped weights; both ranks read after the barrier, with "
           "map_location, and rank 1's drifted model came back to rank 0's weights.")
