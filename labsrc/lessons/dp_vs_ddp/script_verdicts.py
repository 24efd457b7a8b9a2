"""Notebook 01b's verdicts on a probed run of a DDP script: one stage per TODO, each judged from the ranks' notes.

A stage is "ok", "failed", "not written" (its TODO still raises NotImplementedError), "not reached" (the run stopped
before it) or "not judged" (this machine cannot show it). The notes are what script_probe wrote for each rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import re

import torch

from labsrc.core.rank_output import rank_prefix
from labsrc.lessons.dp_vs_ddp.script_reference import LOSS_TOLERANCE, PARAMETER_TOLERANCE, Reference, rank_shards

TITLES = {1: "device from LOCAL_RANK", 2: "process group", 3: "each rank its shard", 4: "DDP wrapper",
          5: "set_epoch", 6: "metric all-reduced", 7: "checkpoint", 8: "group left in finally"}
RECORD_OF = {2: "group", 3: "sampler", 4: "ddp", 5: "shards", 6: "all_reduce", 7: "loaded"}  # a stage's first note


@dataclass
class Stage:
    todo: int
    status: str
    detail: str = ""

    @property
    def title(self) -> str:
        return TITLES[self.todo]

    def line(self) -> str:
        mark = {"ok": "ok", "failed": "FAILED", "not written": "to do", "not reached": "-", "not judged": "?"}
        return f"TODO {self.todo}  {self.title:<22} {mark[self.status]:<6} {self.detail}".rstrip()


@dataclass
class Expected:
    """What a right script shows in this run."""

    world_size: int
    backend: str
    gpus: int  # GPUs per machine; 0 on the CPU
    timeout_s: float  # the script's TIMEOUT
    epochs: int
    dataset_size: int
    seed: int
    nnodes: int = 1


def stop_point(report: dict) -> int | None:
    """The TODO where this rank's run stopped (None: it ran to the end): the TODO an error names, else the first
    stage with no note (a rank that raised elsewhere, or hung)."""
    error = report.get("error")
    if report.get("exited") and error is None:
        return None
    if error and error.get("todo"):
        return error["todo"]
    missing = [stage for stage, key in RECORD_OF.items() if not report.get(key)]
    return missing[0] if missing else 8


def error_hint(report: dict, world_size: int) -> str:
    """What a rank's error says about the script, with the usual cause."""
    error = report.get("error")
    if error is None:
        return ("the run did not end by itself (its processes were ended): a rank waits in a collective the others "
                "never join, e.g. an all_reduce or a barrier inside `if rank == 0:`.")
    kind, message = error["type"], error["message"]
    hint = ""
    if kind == "ValueError" and "device_ids" in message:
        hint = " For a model on the CPU, device_ids must be None; [device.index] is for a model on one GPU."
    elif kind == "ValueError" and "Invalid rank" in message:
        hint = (f" On {world_size} ranks the sampler refused this rank: num_replicas or rank is written into the "
                "script. Let DistributedSampler(dataset) read both from the process group.")
    elif kind == "RuntimeError" and "state_dict" in message and "module." in message:
        hint = " The file holds the unwrapped model's keys: load into model.module, the unwrapped model."
    elif report["rank"] != 0 and kind in ("FileNotFoundError", "EOFError", "UnpicklingError", "RuntimeError"):
        hint = " It read the checkpoint before rank 0 had finished writing it: dist.barrier() between save and load."
    where = f" ({error['line']})" if error.get("line") else ""
    return f"rank {report['rank']} raised {kind}{where}: {message[:300]}.{hint}"


def judge(reports: list[dict | None], output: list[str], checkpoint: Path, reference: Reference,
          expect: Expected, todos_left: list[int] = ()) -> list[Stage]:
    """The eight stages of one probed run, in TODO order. todos_left: the TODOs the script's outline still has."""
    if None in reports:
        missing = reports.index(None)
        return [Stage(todo, "failed", f"rank {missing} wrote no notes: it failed before its script started (see "
                                      "the run's log).") if todo == 2 else Stage(todo, "not reached") for todo in TITLES]
    stops = [stop_point(report) for report in reports]
    stop = min((point for point in stops if point is not None), default=None)
    stopper = reports[stops.index(stop)] if stop is not None else None
    left_group = all(report.get("exited") and report.get("group") for report in reports)
    stages = []
    for todo in TITLES:
        if todo in todos_left:
            stages.append(Stage(todo, "not written", "still a TODO"))
        elif todo == 1 and not expect.gpus:
            stages.append(Stage(1, "not judged", "no GPU here"))
        elif stop is not None and todo == stop:
            stages.append(Stage(todo, "failed", error_hint(stopper, expect.world_size)))
        elif stop is not None and todo > stop and not (todo == 8 and left_group):
            stages.append(Stage(todo, "not reached"))
        else:
            problem = CHECKS[todo](reports, output, checkpoint, reference, expect)
            stages.append(Stage(todo, "failed", problem) if problem else Stage(todo, "ok", DONE[todo](expect)))
    return stages


def device_check(reports, output, checkpoint, reference, expect) -> str | None:
    for report in reports:
        local, used = report["local_rank"], (report.get("set_device") or [None])[-1]
        if used != local % expect.gpus:
            return (f"rank {report['rank']} (LOCAL_RANK {local}) set GPU {used}, expected GPU {local % expect.gpus}: "
                    "torch.cuda.set_device(local_rank % gpus) before any CUDA work. GPUs are numbered per machine.")
    return None


def group_check(reports, output, checkpoint, reference, expect) -> str | None:
    for report in reports:
        group = report["group"]
        if not group:
            return f"rank {report['rank']} never joined a process group: dist.init_process_group(backend, ...)."
        if group["world_size"] != expect.world_size or group["backend"] != expect.backend:
            return (f"rank {report['rank']} joined a group of {group['world_size']} with {group['backend']}, expected "
                    f"{expect.world_size} with {expect.backend}: init_process_group(backend, timeout=TIMEOUT).")
        if group["timeout_s"] is not None and abs(group["timeout_s"] - expect.timeout_s) > 1e-3:
            return (f"rank {report['rank']}'s group waits {group['timeout_s']:g} s for a collective, not TIMEOUT "
                    f"({expect.timeout_s:g} s): pass timeout=TIMEOUT. Without it a hung collective waits 30 minutes "
                    "with gloo and 10 with NCCL.")
        if expect.backend == "nccl" and group.get("device_id") is None:
            return (f"rank {report['rank']} joined an NCCL group without device_id: init_process_group(backend, "
                    "timeout=TIMEOUT, device_id=device) binds the group to this rank's GPU and connects at once.")
    return None


def shard_check(reports, output, checkpoint, reference, expect) -> str | None:
    if not all(report.get("sampler") for report in reports):
        return ("a rank has no DistributedSampler, so every rank walks the whole dataset: give the DataLoader "
                "sampler=DistributedSampler(dataset).")
    if not all(report.get("shards") for report in reports):
        if any(stop_point(report) is None or stop_point(report) > 5 for report in reports):
            return ("the ranks trained, but their DataLoader never drew from the DistributedSampler, so every rank "
                    "walked the whole dataset: DataLoader(dataset, batch_size=..., sampler=sampler).")
        wrong = [r["rank"] for r in reports if (r["sampler"]["num_replicas"], r["sampler"]["rank"]) != (
            expect.world_size, r["rank"])]
        return (f"the sampler of rank(s) {wrong} splits for another world size or rank: DistributedSampler(dataset) "
                "reads both from the process group.") if wrong else None
    first = [report["shards"][0]["indices"] for report in reports]
    seen = sorted(index for shard in first for index in shard)
    if seen != list(range(expect.dataset_size)):
        return (f"the ranks' first shards are not disjoint pieces of the dataset ({len(set(seen))} distinct samples "
                f"of {expect.dataset_size}, {len(seen)} in all): DistributedSampler(dataset) with no rank written in.")
    return None


def ddp_check(reports, output, checkpoint, reference, expect) -> str | None:
    for report in reports:
        local = report["local_rank"]
        wanted = [local % expect.gpus] if expect.gpus else None
        if not report["ddp"]:
            return (f"rank {report['rank']} did not wrap the model in DistributedDataParallel, so its gradients are "
                    "not averaged over the ranks: model = DistributedDataParallel(model, device_ids=...).")
        if report["ddp"]["device_ids"] != wanted:
            return (f"rank {report['rank']} gave DDP device_ids={report['ddp']['device_ids']}, expected {wanted}: "
                    "[device.index] on a GPU, None on the CPU.")
    checksums = [report.get("parameter_checksum") for report in reports]
    if None not in checksums and len(set(checksums)) > 1:
        return (f"the ranks' final weights differ (checksums {checksums}): every rank must step with the averaged "
                "gradient that DDP computes in backward().")
    return None


def epoch_check(reports, output, checkpoint, reference, expect) -> str | None:
    dataset = range(expect.dataset_size)
    for report in reports:
        orders = [shard["indices"] for shard in report["shards"]]
        if len(orders) != expect.epochs and stop_point(report) is None:  # a rank that stopped: its epochs so far
            return f"rank {report['rank']} went through its shard {len(orders)} times, not EPOCHS ({expect.epochs})."
        for epoch, order in enumerate(orders):
            if order != rank_shards(dataset, expect.world_size, expect.seed, epoch)[report["rank"]]:
                if epoch and order == orders[0]:
                    return (f"epoch {epoch} repeats epoch 0's order on rank {report['rank']}: call "
                            "sampler.set_epoch(epoch) at the start of every epoch.")
                return (f"rank {report['rank']}'s order in epoch {epoch} is not DistributedSampler(dataset, "
                        f"shuffle=True, seed=SEED) after set_epoch({epoch}).")
    return None


def metric_call(calls: list[dict], dataset_size: int) -> dict | None:
    """Of one rank's small all_reduces in an epoch, the one of [summed loss, sample count]: the last whose count is
    the dataset's (a later small all_reduce, say one used as a barrier, is skipped), else the last."""
    counted = [c for c in calls if len(c["after"]) >= 2 and round(c["after"][1]) == dataset_size]
    return (counted or calls or [None])[-1]


def printed_numbers(output: list[str], prefix: str) -> list[tuple[float, float]]:
    """(value, half its last printed digit) for each decimal number in the lines with this prefix."""
    return [(float(match[0]), 0.5 * 10.0 ** -len(match[1])) for line in output if line.startswith(prefix)
            for match in re.finditer(r"-?\d+\.(\d+)", line)]


def printed_losses(output: list[str], prefix: str, losses: list[float]) -> list[tuple[float, float] | None]:
    """Per epoch, the number rank 0 printed closest to one process's loss, with its rounding (None: none printed)."""
    numbers = printed_numbers(output, prefix)
    return [min(numbers, key=lambda n: abs(n[0] - loss)) if numbers else None for loss in losses]


def metric_check(reports, output, checkpoint, reference, expect) -> str | None:
    for epoch in range(expect.epochs):
        calls = [metric_call([c for c in report["all_reduce"] if c["epochs_begun"] == epoch + 1], expect.dataset_size)
                 for report in reports]
        if None in calls:
            return (f"no all_reduce after epoch {epoch} on some rank: the loss rank 0 prints must be all-reduced, "
                    "one float64 tensor [summed loss, sample count] per epoch (global_mean).")
        totals = calls[0]["after"]
        if len(totals) < 2 or any(call["after"] != totals for call in calls):
            return (f"epoch {epoch}'s all_reduce gave {totals}: expected [summed loss, sample count], the same "
                    "on every rank.")
        if round(totals[1]) != expect.dataset_size:
            return (f"epoch {epoch}'s all-reduced count is {totals[1]:g} samples, not the dataset's "
                    f"{expect.dataset_size}: add up each rank's own count, not the world size or the batches.")
        gap = abs(totals[0] / totals[1] - reference.epoch_losses[epoch])
        if gap > LOSS_TOLERANCE:
            return (f"epoch {epoch}'s loss over all samples is {totals[0] / totals[1]:.6f}, one process on the same "
                    f"global batches has {reference.epoch_losses[epoch]:.6f}: keep the given data, model and "
                    "optimizer, and let DDP average the gradients (no extra scaling of the loss).")
    per_node = expect.world_size // expect.nnodes
    prefixes = [rank_prefix(rank, rank // per_node if expect.nnodes > 1 else None) for rank in range(len(reports))]
    for epoch, (loss, shown) in enumerate(zip(reference.epoch_losses,
                                              printed_losses(output, prefixes[0], reference.epoch_losses))):
        if shown is None or abs(shown[0] - loss) > shown[1] + LOSS_TOLERANCE:
            said = "no decimal number" if shown is None else f"{shown[0]:g} at the closest"
            return (f"for epoch {epoch} rank 0 printed {said}, but the loss over all samples is {loss:.4f}: print "
                    "the all-reduced sum divided by the all-reduced count (what global_mean returns), not the "
                    "rank's own mean.")
    chatty = [rank for rank in range(1, len(reports)) if any(line.startswith(prefixes[rank]) for line in output)]
    if chatty:
        return f"rank(s) {chatty} printed too: print only on rank 0 (`if rank == 0:`), so each line appears once."
    return None


def checkpoint_check(reports, output, checkpoint, reference, expect) -> str | None:
    saves = [(r["rank"], e["time"]) for r in reports for e in r["events"] if e["event"] == "saved"]
    if [rank for rank, _ in saves] != [0]:
        return (f"the checkpoint was written by rank(s) {[rank for rank, _ in saves]}: write it once, on rank 0. "
                "Every rank holds the same weights, and writers racing on one file can corrupt it.")
    loads = [(r, e) for r in reports for e in r["events"] if e["event"] == "loading"]
    if sorted(report["rank"] for report, _ in loads) != [r["rank"] for r in reports] or not all(
            r["loaded"] for r in reports):
        return "every rank reads the checkpoint back once: torch.load(path, map_location=device, weights_only=True)."
    early = [report["rank"] for report, event in loads if event["time"] < saves[0][1]]
    if early:
        return (f"rank(s) {early} began reading before rank 0 had finished writing: put dist.barrier() between "
                "rank 0's torch.save and every rank's torch.load.")
    unmapped = [report["rank"] for report, event in loads if event["map_location"] is None]
    if unmapped:
        return (f"rank(s) {unmapped} called torch.load without map_location: it restores each tensor onto the "
                "device it was saved from, rank 0's GPU. Pass map_location=device.")
    for report in reports:
        wanted = f"cuda:{report['local_rank'] % expect.gpus}" if expect.gpus else "cpu"
        if report["loaded"]["device"] != wanted:
            return f"rank {report['rank']} loaded the checkpoint onto {report['loaded']['device']}, not {wanted}."
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    if sorted(state) != sorted(reference.state):
        return (f"the checkpoint's keys {sorted(state)[:3]}... are not the model's: save model.module.state_dict(), "
                "the unwrapped model (DDP's own keys start with 'module.').")
    gap = max(float((state[k].float() - reference.state[k]).abs().max()) for k in reference.state)
    if gap > PARAMETER_TOLERANCE:
        return f"the checkpoint differs from one process's final weights by {gap:.3g}: save after the last epoch."
    return None


def exit_check(reports, output, checkpoint, reference, expect) -> str | None:
    kept = [report["rank"] for report in reports if not report.get("group_destroyed")]
    if kept:
        return (f"rank(s) {kept} still held the process group at exit: call dist.destroy_process_group() in the "
                "`finally:`, so that it runs whether training ended or raised.")
    return None


CHECKS = {1: device_check, 2: group_check, 3: shard_check, 4: ddp_check, 5: epoch_check, 6: metric_check,
          7: checkpoint_check, 8: exit_check}
DONE = {
    1: lambda e: "each rank on GPU LOCAL_RANK % gpus",
    2: lambda e: f"{e.world_size} {e.backend} ranks, collectives time out after {e.timeout_s:g} s",
    3: lambda e: f"{e.world_size} disjoint shards of {e.dataset_size // e.world_size} samples",
    4: lambda e: "every rank wrapped; their weights are identical",
    5: lambda e: f"a new shuffle in each of the {e.epochs} epochs",
    6: lambda e: "rank 0 alone printed the loss over all samples, one process's",
    7: lambda e: "rank 0 wrote the trained model; all read it after the barrier",
    8: lambda e: "the group was left on every rank",
}
