"""Checker for notebook 01b's exercise: your whole DDP script, launched by path on ranks and compared with one process."""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DistributedSampler

from labsrc.core.exercises import ExerciseFailed, passed, solutions_root
from labsrc.core.rank_output import rank_prefix
from labsrc.lessons.dp_vs_ddp.script_runs import failure_verdict, launch_script

NODES = 3  # the second run: 3 simulated nodes of one rank (a world size other than 2, RANK != LOCAL_RANK)
LOSS_TOLERANCE = 1e-4  # |DDP - one process| per epoch: float rounding of the all-reduce, far below a changed step
PARAMETER_TOLERANCE = 1e-4  # largest |checkpoint - one process's final weights|


def course_script():
    """The course's reference script (solutions/ddp_script.py) as a module: its data, model and constants."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("course_ddp_script", solutions_root() / "ddp_script.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class Reference:
    """One process training on each step's whole global batch (the union of the ranks' batches)."""

    epoch_losses: list[float]
    """Per epoch: the mean loss over every sample of the epoch (what rank 0 should log)."""
    rank_losses: list[list[float]]
    """[rank][epoch]: the mean loss over that rank's own samples."""
    state: dict
    """The final weights (a state_dict on the CPU)."""


def rank_shards(dataset, world_size: int, seed: int, epoch: int) -> list[list[int]]:
    """[rank] -> the dataset indices DistributedSampler gives that rank in `epoch` (shuffled, padded evenly)."""
    shards = []
    for rank in range(world_size):
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    return shards


def reference_run(world_size: int, reshuffle: bool = True) -> Reference:
    """Train the course's model in this one process on the global batches world_size DDP ranks would see.

    reshuffle=False replays epoch 0's order every epoch: what ranks see when set_epoch is never called.
    """
    course = course_script()
    dataset, model = course.make_dataset(), course.make_model()
    optimizer = course.make_optimizer(model)
    features, labels = dataset.tensors
    batch = course.BATCH_PER_RANK
    epoch_losses, rank_losses = [], [[] for _ in range(world_size)]
    for epoch in range(course.EPOCHS):
        shards = rank_shards(dataset, world_size, course.SEED, epoch if reshuffle else 0)
        sums = torch.zeros(world_size, dtype=torch.float64)
        for start in range(0, len(shards[0]), batch):
            parts = [torch.tensor(shard[start:start + batch]) for shard in shards]
            indices = torch.cat(parts)
            optimizer.zero_grad()
            per_sample = torch.nn.functional.cross_entropy(model(features[indices]), labels[indices], reduction="none")
            per_sample.mean().backward()  # the global batch's mean: what DDP's averaged gradient equals
            optimizer.step()
            sums += per_sample.detach().double().view(world_size, -1).sum(dim=1)
        samples = len(shards[0])
        for rank in range(world_size):
            rank_losses[rank].append(float(sums[rank] / samples))
        epoch_losses.append(float(sums.sum() / (samples * world_size)))
    return Reference(epoch_losses, rank_losses, {k: v.detach().clone() for k, v in model.state_dict().items()})


def read_reports(folder: Path, world_size: int) -> list[dict]:
    """[rank] -> the rank<r>.json each rank wrote; ExerciseFailed naming the ranks that wrote none."""
    missing = [r for r in range(world_size) if not (Path(folder) / f"rank{r}.json").is_file()]
    if missing:
        raise ExerciseFailed(f"rank(s) {missing} wrote no report: every rank must call write_report(report, "
                             "args.report_dir) at the very end of main, after destroy_process_group.")
    return [json.loads((Path(folder) / f"rank{r}.json").read_text()) for r in range(world_size)]


def run_verdict(reports: list[dict], world_size: int, backend: str, gpus: int, timeout_s: float) -> str | None:
    """The process group (size, backend, timeout), the DDP wrapping and the device of every rank, from the ranks'
    own reports. gpus: GPUs per machine (0 on the CPU); timeout_s: the script's TIMEOUT."""
    for rank, report in enumerate(reports):
        if report.get("world_size") != world_size or report.get("backend") != backend:
            return (f"rank {rank} ran in a group of {report.get('world_size')} with {report.get('backend')}, "
                    f"expected {world_size} with {backend}: init_process_group(backend, timeout=...) with the "
                    "backend chosen for the device (--backend when given).")
        timeout = report.get("group_timeout_s")
        if timeout is not None and abs(timeout - timeout_s) > 1e-3:
            return (f"rank {rank}'s process group gives up on a collective after {timeout:g} s, not TIMEOUT "
                    f"({timeout_s:g} s): init_process_group(backend, timeout=TIMEOUT). Without it a hung collective "
                    "waits torch's default, 30 minutes with gloo and 10 with NCCL.")
        if not report.get("group_destroyed"):
            return (f"rank {rank} never destroyed its process group: call dist.destroy_process_group() in a "
                    "`finally:` so it runs even when training fails.")
        local = report.get("local_rank", rank)
        if gpus and (report.get("cuda_device") != local % gpus or report.get("device_ids") != [local % gpus]):
            return (f"rank {rank} (LOCAL_RANK {local}) used GPU {report.get('cuda_device')} with device_ids "
                    f"{report.get('device_ids')}, expected GPU {local % gpus}: the GPU is numbered on its machine, "
                    "so torch.cuda.set_device(LOCAL_RANK % gpus) before any CUDA work, and "
                    "DDP(model, device_ids=[that GPU]), not RANK (the rank over every machine).")
    checksums = [report["parameter_checksum"] for report in reports]
    unwrapped = [rank for rank, report in enumerate(reports) if not report.get("wrapped_in_ddp")]
    if unwrapped:
        drift = f"the ranks' final parameters differ (checksums {checksums}): " if len(set(checksums)) > 1 else ""
        return (f"{drift}rank(s) {unwrapped} did not wrap the model in DistributedDataParallel, so gradients are "
                "not averaged over the ranks and each rank's parameters drift on its own shard. Wrap it: "
                "model = DistributedDataParallel(model, device_ids=...).")
    if len(set(checksums)) > 1:
        return (f"the ranks' final parameters differ (checksums {checksums}): every rank must take the same "
                "step from the same averaged gradient; no rank may step on its own (no_sync) or skip a step.")
    return None


def epochs_verdict(reports: list[dict], course, reference: Reference, world_size: int) -> str | None:
    """The logged (all-reduced) loss and sample count of every epoch against the one-process reference."""
    if any(len(report["epochs"]) != course.EPOCHS for report in reports):
        return f"every rank should record {course.EPOCHS} epochs; got {[len(r['epochs']) for r in reports]}."
    local = [[epoch["local_loss"] for epoch in report["epochs"]] for report in reports]
    if world_size > 1 and all(row == local[0] for row in local):
        return ("every rank saw the same samples (their own losses are equal to the last digit): give the "
                "DataLoader a DistributedSampler(dataset) so each rank trains on its own shard.")
    logged = [[epoch["loss"] for epoch in report["epochs"]] for report in reports]
    if any(row != logged[0] for row in logged):
        return ("the logged loss differs between ranks: it is each rank's own, not all-reduced. dist.all_reduce "
                "the (summed loss, sample count) pair over the ranks, then divide, before rank 0 prints it.")
    samples = [epoch["samples"] for epoch in reports[0]["epochs"]]
    if any(count != len(course.make_dataset()) for count in samples):
        return (f"the ranks together went through {samples} samples per epoch; the dataset has "
                f"{len(course.make_dataset())}: each rank trains on its own shard, and the count is all-reduced.")
    gaps = [abs(a - b) for a, b in zip(logged[0], reference.epoch_losses)]
    if max(gaps) <= LOSS_TOLERANCE:
        return None
    unshuffled = reference_run(world_size, reshuffle=False).epoch_losses
    if gaps[0] <= LOSS_TOLERANCE and max(abs(a - b) for a, b in zip(logged[0], unshuffled)) <= LOSS_TOLERANCE:
        return ("epoch 0 matches one process, the later epochs match one process that replays epoch 0's order: "
                "call sampler.set_epoch(epoch) at the start of every epoch so each epoch is shuffled anew.")
    epoch = gaps.index(max(gaps))
    return (f"epoch {epoch}'s loss {logged[0][epoch]:.6f} differs from one process training on the same global "
            f"batches ({reference.epoch_losses[epoch]:.6f}): keep the given data, model, optimizer and constants, "
            "and let DDP average the gradients (no extra scaling of the loss).")


def logging_verdict(output: list[str], world_size: int, nnodes: int = 1) -> str | None:
    """Only rank 0 prints: the launcher tags every line a rank prints with that rank (and its node)."""
    per_node = world_size // nnodes
    prefixes = [rank_prefix(rank, rank // per_node if nnodes > 1 else None) for rank in range(world_size)]
    printed = [[line for line in output if line.startswith(prefixes[rank])] for rank in range(world_size)]
    if not printed[0]:
        return "rank 0 printed nothing: print the all-reduced loss of every epoch on rank 0."
    chatty = [rank for rank in range(1, world_size) if printed[rank]]
    if chatty:
        return (f"rank(s) {chatty} printed too (e.g. {printed[chatty[0]][0]!r}): log only on rank 0, "
                "`if rank == 0: print(...)`, so each line appears once.")
    return None


def checkpoint_verdict(folder: Path, reports: list[dict], reference: Reference, gpus: int = 0) -> str | None:
    """The checkpoint: written once by rank 0, read only after, loadable on the CPU, equal to the final model."""
    path = folder / "checkpoint.pt"
    if not path.is_file():
        return f"no checkpoint at {path}: rank 0 saves the model's state_dict to args.checkpoint."
    saves = [(rank, time) for rank, report in enumerate(reports) for event, time in report["events"] if event == "saved"]
    if [rank for rank, _ in saves] != [0]:
        return (f"the checkpoint was written by rank(s) {[rank for rank, _ in saves]}: write it once, on rank 0 "
                "(`if rank == 0:`), and note(report, 'saved') right after torch.save.")
    loads = [(rank, time) for rank, report in enumerate(reports) for event, time in report["events"] if event == "loading"]
    if len(loads) != len(reports):
        return "every rank loads the checkpoint back: note(report, 'loading') then torch.load(..., map_location=...)."
    early = [rank for rank, time in loads if time < saves[0][1]]
    if early:
        return (f"rank(s) {early} began reading the checkpoint before rank 0 had finished writing it: put "
                "dist.barrier() between rank 0's torch.save and every rank's torch.load.")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any failure to load is the learner's to see
        return f"the checkpoint does not load on the CPU with map_location='cpu': {error}"
    if sorted(state) != sorted(reference.state):
        return (f"the checkpoint's keys {sorted(state)} are not the model's {sorted(reference.state)}: save the "
                "unwrapped model's weights, model.module.state_dict() (DDP's own keys start with 'module.').")
    gap = max(float((state[k].float() - reference.state[k]).abs().max()) for k in reference.state)
    if gap > PARAMETER_TOLERANCE:
        return (f"the checkpoint differs from one process's final weights by {gap:.3g}: save after the last "
                "epoch, the trained model.")
    for rank, report in enumerate(reports):
        loaded, local = report.get("loaded_device"), report.get("local_rank", rank)
        expected = f"cuda:{local % gpus}" if gpus else "cpu"
        if loaded is None:
            return (f"rank {rank} recorded no device for what torch.load gave back: call note_loaded(report, state) "
                    "right after torch.load.")
        if loaded != expected:
            return (f"rank {rank}'s torch.load put the checkpoint on {loaded}, not on its own device {expected}: "
                    "torch.load restores each tensor onto the device it was saved from (rank 0's GPU); pass "
                    "map_location=device.")
    read_back = {report.get("checkpoint_checksum") for report in reports}
    if read_back != {reports[0]["parameter_checksum"]}:
        return (f"the ranks read back checksums {sorted(map(str, read_back))}, not the final model's "
                f"{reports[0]['parameter_checksum']}: every rank loads args.checkpoint after the barrier.")
    return None


def run_verdicts(script: Path, world_size: int, backend: str, gpus: int, timeout: float, nnodes: int = 1):
    """Launch the script on world_size ranks (over nnodes simulated nodes) and judge its reports; its first
    verdict (or None) and the rank 0 report."""
    course = course_script()
    reference = reference_run(world_size)
    with tempfile.TemporaryDirectory(prefix="ddp_script_") as folder:
        result = launch_script(script, world_size, backend, Path(folder), timeout, nnodes)
        reports = read_reports(Path(folder), world_size)
        for verdict in (run_verdict(reports, world_size, backend, gpus, course.TIMEOUT.total_seconds()),
                        epochs_verdict(reports, course, reference, world_size),
                        logging_verdict(result.output, world_size, nnodes),
                        checkpoint_verdict(Path(folder), reports, reference, gpus)):
            if verdict:
                return verdict, reports[0]
    gap = max(abs(e["loss"] - b) for e, b in zip(reports[0]["epochs"], reference.epoch_losses))
    return None, {**reports[0], "gap": gap}


def check_ddp_script(script, world_size: int | None = None, timeout: float = 120.0) -> None:
    """Launch `script` by path three ways and compare it with one process (see the notebook): on the plan's ranks
    and backend; on one rank with describe() raising (is the group destroyed in a finally?); and on 3 ranks as 3
    simulated nodes of one rank each (gloo), where RANK differs from LOCAL_RANK and a world size written
    into the script shows."""
    from labsrc.core.plan import make_plan
    plan = make_plan()
    world_size = world_size or plan.world_size
    gpus = torch.cuda.device_count() if plan.device == "cuda" else 0
    script = Path(script).expanduser().resolve()
    if not script.is_file():
        raise ExerciseFailed(f"no script at {script}.")
    verdict, first = run_verdicts(script, world_size, plan.backend, gpus, timeout)
    if verdict:
        raise ExerciseFailed(verdict)
    with tempfile.TemporaryDirectory(prefix="ddp_script_failure_") as folder:  # one rank shows it, at least cost
        verdict = failure_verdict(script, 1, plan.backend, Path(folder), timeout)
    if verdict:
        raise ExerciseFailed(verdict)
    verdict, _ = run_verdicts(script, NODES, "gloo", gpus, timeout, nnodes=NODES)
    if verdict:
        raise ExerciseFailed(f"on {NODES} simulated nodes of one rank each (RANK 0-{NODES - 1}, LOCAL_RANK 0 on "
                             f"each): {verdict}")
    unjudged = ("" if gpus > 1 else " Not judged here: map_location (" +
                ("on the CPU every load lands on the CPU" if not gpus else "one GPU: every rank's device is cuda:0")
                + "); a machine with 2+ GPUs checks it.")
    timed = first.get("group_timeout_s") is not None
    if not timed:
        unjudged += (" Not judged: the group's timeout (describe() could not read it: this torch's process group "
                     "has no backend options._timeout, a private attribute).")
    passed(f"{script.name} on {world_size} {plan.backend} ranks: each rank trained on its own shard, the logged loss "
           f"equals one process on the global batch within {first['gap']:.1e} every epoch, parameters are "
           "identical, only rank 0 printed, " + ("the group times out after TIMEOUT, " if timed else "") +
           "rank 0's checkpoint, read back by every rank after the barrier onto its own device, is the final model; "
           f"with training raising, the group was still destroyed (finally); and the same on {NODES} simulated "
           f"nodes.{unjudged}")
