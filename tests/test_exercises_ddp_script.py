"""Notebook 01b's checker passes the reference DDP script and names each planted mistake (one torchrun launch each)."""
from pathlib import Path

import pytest
import torch

from labsrc.core.exercises import ExerciseFailed, solutions_root
from labsrc.lessons.dp_vs_ddp import script_exercises as checker
from labsrc.lessons.dp_vs_ddp.script_runs import failure_verdict

SOLUTION = solutions_root() / "ddp_script.py"


def planted(tmp_path: Path, *edits: tuple[str, str]) -> Path:
    """The reference script with each (old, new) edit made once; a missing `old` fails the test, not the checker."""
    text = SOLUTION.read_text()
    for old, new in edits:
        assert text.count(old) == 1, f"the solution changed: {old!r} is no longer there once"
        text = text.replace(old, new)
    path = tmp_path / "wrong_ddp_script.py"
    path.write_text(text)
    return path


def test_reference_replays_epoch_zero_without_set_epoch():
    shuffled, replayed = checker.reference_run(2), checker.reference_run(2, reshuffle=False)
    assert shuffled.epoch_losses[0] == replayed.epoch_losses[0]
    assert all(abs(a - b) > 10 * checker.LOSS_TOLERANCE
               for a, b in zip(shuffled.epoch_losses[1:], replayed.epoch_losses[1:]))


@pytest.mark.slow
def test_the_solution_passes(capsys):
    checker.check_ddp_script(SOLUTION, world_size=2)  # 2 ranks, a failure run, 3 simulated nodes
    assert "passed" in capsys.readouterr().out


NO_SAMPLER = ("loader = DataLoader(dataset, batch_size=BATCH_PER_RANK, sampler=sampler)",
              "loader = DataLoader(dataset, batch_size=BATCH_PER_RANK, shuffle=True, "
              "generator=torch.Generator().manual_seed(SEED))")
NO_ALL_REDUCE = ("        dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # bounded by the group's timeout, like every "
                 "collective\n", "")
EVERY_RANK_SAVES = ("    if rank == 0:\n        torch.save", "    if True:\n        torch.save")
NO_BARRIER = ("    dist.barrier()  # nobody reads before rank 0 has finished writing\n", "")
SLOW_DISK = ("        torch.save(model.module.state_dict(), path)",
             "        time.sleep(1.0)  # a slow disk: rank 0 is still writing when the others read\n"
             "        torch.save(model.module.state_dict(), path)")
NO_SET_EPOCH = ("        sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank\n", "")
NO_DDP = [("        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == \"cuda\" "
           "else None)\n", ""),
          ("torch.save(model.module.state_dict(), path)", "torch.save(model.state_dict(), path)"),
          ("model.module.load_state_dict(state)", "model.load_state_dict(state)")]

CPU_DEVICE_IDS = ("device_ids=[device.index] if device.type == \"cuda\" else None",
                  "device_ids=[int(os.environ[\"LOCAL_RANK\"])]")


@pytest.mark.slow
@pytest.mark.parametrize("edits, named", [
    ([NO_SAMPLER], "every rank saw the same samples.*DistributedSampler"),
    ([NO_ALL_REDUCE], "not all-reduced"),
    ([EVERY_RANK_SAVES], r"written by rank\(s\) \[0, 1\]"),
    ([NO_BARRIER, SLOW_DISK], "rank 1 could not read the checkpoint.*dist.barrier"),
    ([NO_SET_EPOCH], "set_epoch"),
    (NO_DDP, "parameters differ.*did not wrap the model in DistributedDataParallel"),
    ([CPU_DEVICE_IDS], "DDP refused device_ids: for a model on the CPU it must be None"),
], ids=["no-sampler", "no-all-reduce", "every-rank-saves", "no-barrier", "no-set-epoch", "no-ddp", "cpu-device-ids"])
def test_each_planted_mistake_is_named(tmp_path, edits, named):
    with pytest.raises(ExerciseFailed, match=named):
        checker.check_ddp_script(planted(tmp_path, *edits), world_size=2)


def given_part(lines: list[str]) -> list[str]:
    """The lines between the "# ---- given" and "# ---- the distributed part" banners of a DDP script."""
    start = next(index for index, line in enumerate(lines) if line.startswith("# ---- given"))
    end = next(index for index, line in enumerate(lines) if line.startswith("# ---- the distributed part"))
    return lines[start + 1:end]


def test_the_learners_file_gives_the_solutions_helpers_unchanged():
    """The helpers given to the learner in notebooks/your_ddp_script.py are the reference's, line for line."""
    template = (Path(__file__).resolve().parents[1] / "notebooks" / "your_ddp_script.py").read_text().splitlines()
    given = given_part(template)
    assert len(given) > 50 and given == given_part(SOLUTION.read_text().splitlines()), \
        "the helpers given to the learner drifted from solutions/ddp_script.py: copy the changed lines over"


NO_TIMEOUT = ("dist.init_process_group(backend, timeout=TIMEOUT, **init)", "dist.init_process_group(backend, **init)")
DESTROY_NOT_IN_FINALLY = ("        checkpoint_round_trip(model, args.checkpoint, device, rank, report)\n    finally:\n"
                          "        dist.destroy_process_group()\n",
                          "        checkpoint_round_trip(model, args.checkpoint, device, rank, report)\n"
                          "        dist.destroy_process_group()\n    finally:\n        pass\n")
TWO_REPLICAS = ("DistributedSampler(dataset, shuffle=True, seed=SEED)",
                "DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=SEED)")


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(torch._C._distributed_c10d.Backend, "options"),
                    reason="this torch does not expose a backend's options, so describe() cannot read the timeout")
def test_a_group_without_timeout_is_named(tmp_path):
    """Shows at any world size, so on one rank: the group reports torch's default (1800 s with gloo), not TIMEOUT."""
    verdict, _ = checker.run_verdicts(planted(tmp_path, NO_TIMEOUT), 1, "gloo", 0, 120.0)
    assert verdict and "not TIMEOUT" in verdict and "1800" in verdict


@pytest.mark.slow
def test_destroy_outside_finally_is_named_by_the_failure_run(tmp_path):
    """Passes a run that ends well; the failure run (describe raising, one rank) catches it."""
    verdict = failure_verdict(planted(tmp_path, DESTROY_NOT_IN_FINALLY), 1, "gloo", tmp_path / "run", 120.0)
    assert verdict and "belongs in a `finally:`" in verdict


@pytest.mark.slow
def test_a_world_size_written_into_the_script_fails_on_three_nodes(tmp_path):
    """num_replicas=2 passes on 2 ranks; on 3 simulated nodes the sampler refuses rank 2."""
    with pytest.raises(ExerciseFailed, match=r"on 3 ranks the sampler refused rank 2.*written into the script"):
        checker.run_verdicts(planted(tmp_path, TWO_REPLICAS), 3, "gloo", 0, 120.0, nnodes=3)


def good_report(rank: int, local_rank: int, device: int) -> dict:
    return {"rank": rank, "local_rank": local_rank, "world_size": 2, "backend": "gloo", "group_timeout_s": 60.0,
            "group_destroyed": True, "cuda_device": device, "device_ids": [device], "wrapped_in_ddp": True,
            "parameter_checksum": 1.0}


def test_the_gpu_is_judged_by_local_rank_not_rank():
    """Two nodes of one GPU-rank each: rank 1 is LOCAL_RANK 0 on its node, so GPU 0, not GPU 1."""
    right = [good_report(0, 0, 0), good_report(1, 0, 0)]
    assert checker.run_verdict(right, 2, "gloo", 2, 60.0) is None
    by_rank = [good_report(0, 0, 0), good_report(1, 0, 1)]
    assert "expected GPU 0" in checker.run_verdict(by_rank, 2, "gloo", 2, 60.0)


def test_a_load_without_map_location_is_named_on_gpus(tmp_path):
    """What rank 1 records on 2 GPUs when torch.load has no map_location: rank 0's cuda:0 (GPU-only, so judged here
    from the records; test_no_map_location_on_two_gpus runs it for real)."""
    reference = checker.reference_run(2)
    torch.save(reference.state, tmp_path / "checkpoint.pt")
    reports = [{**good_report(r, r, r), "events": [["saved", 1.0]] * (r == 0) + [["loading", 2.0]],
                "checkpoint_checksum": 1.0, "loaded_device": "cuda:0"} for r in (0, 1)]
    verdict = checker.checkpoint_verdict(tmp_path, reports, reference, gpus=2)
    assert "rank 1's torch.load put the checkpoint on cuda:0, not on its own device cuda:1" in verdict
    reports[1]["loaded_device"] = None
    assert "recorded no device" in checker.checkpoint_verdict(tmp_path, reports, reference, gpus=2)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: on one GPU or the CPU every load lands "
                    "on the rank's own device anyway")
def test_no_map_location_on_two_gpus(tmp_path):
    no_map = ("torch.load(path, map_location=device, weights_only=True)", "torch.load(path, weights_only=True)")
    with pytest.raises(ExerciseFailed, match="map_location=device"):
        checker.check_ddp_script(planted(tmp_path, no_map), world_size=2)


def test_the_blank_variant_gives_the_solutions_helpers_unchanged():
    """notebooks/your_ddp_script_blank.py: the same given helpers, and nothing of the distributed part."""
    blank = (Path(__file__).resolve().parents[1] / "notebooks" / "your_ddp_script_blank.py").read_text()
    assert given_part(blank.splitlines()) == given_part(SOLUTION.read_text().splitlines())
    mine = blank.split("# ---- the distributed part")[1]
    assert not any(call in mine for call in ("init_process_group", "DistributedSampler(", "DistributedDataParallel(",
                                             "all_reduce", "barrier", "set_epoch"))
