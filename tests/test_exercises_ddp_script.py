"""Notebook 01b's checkers pass the reference DDP script and name each planted mistake: the small checks of one TODO
on forked ranks (fast), and the whole script run under the probe with torchrun (slow, one launch or three each)."""
import dataclasses
import re
from pathlib import Path

import pytest
import torch

from labsrc.core.exercises import ExerciseFailed
from labsrc.lessons.dp_vs_ddp import script_exercises as checker
from labsrc.lessons.dp_vs_ddp import script_todo_exercises as todo_checks
from labsrc.lessons.dp_vs_ddp.script_reference import reference_path, reference_run, todos_left
from labsrc.lessons.dp_vs_ddp.script_runs import probe_run
from labsrc.lessons.dp_vs_ddp.script_side_checks import failure_check
from labsrc.lessons.dp_vs_ddp.script_verdicts import (Expected, checkpoint_check, device_check, group_check, judge,
                                                      metric_call)

SOLUTION = reference_path()
NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def planted(tmp_path: Path, *edits: tuple[str, str], name: str = "wrong_ddp_script.py") -> Path:
    """The reference script with each (old, new) edit made once; a missing `old` fails the test, not the checker."""
    text = SOLUTION.read_text()
    for old, new in edits:
        assert text.count(old) == 1, f"the solution changed: {old!r} is no longer there once"
        text = text.replace(old, new)
    path = tmp_path / name
    path.write_text(text)
    return path


RANK_GPU = ("torch.cuda.set_device(local_rank % gpus)", "torch.cuda.set_device(int(os.environ['RANK']) % gpus)")
NO_SAMPLER = ("""    sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)  # rank and world size come from the group
    return sampler, DataLoader(dataset, batch_size=BATCH_PER_RANK, sampler=sampler)""",
              """    sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)
    return sampler, DataLoader(dataset, batch_size=BATCH_PER_RANK, shuffle=True)""")
TWO_REPLICAS = ("DistributedSampler(dataset, shuffle=True, seed=SEED)",
                "DistributedSampler(dataset, num_replicas=2, rank=dist.get_rank(), shuffle=True, seed=SEED)")
NO_SET_EPOCH = ("        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank\n", "")
SET_EPOCH_LATE = [NO_SET_EPOCH, ("        history.append(global_mean(", "        sampler.set_epoch(epoch)\n"
                                 "        history.append(global_mean(")]
OWN_MEAN = ("    dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # every rank must call it\n", "")
MEAN_OF_MEANS = ("""    dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # every rank must call it
    return (totals[0] / totals[1]).item()""", """    mean = totals[0] / totals[1]
    dist.all_reduce(mean)
    return (mean / dist.get_world_size()).item()""")
EVERY_RANK_PRINTS = ("        if rank == 0:\n            print(", "        if True:\n            print(")
EVERY_RANK_SAVES = ("    if rank == 0:\n        torch.save", "    if True:\n        torch.save")
NO_BARRIER = ("    dist.barrier()  # nobody reads before rank 0 has finished writing\n", "")
NO_MAP = ("torch.load(path, map_location=device, weights_only=True)", "torch.load(path, weights_only=True)")
WRAPPED_KEYS = ("torch.save(model.module.state_dict(), path)", "torch.save(model.state_dict(), path)")
NO_DDP = [("        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == \"cuda\" "
           "else None)\n", ""),
          ("torch.save(model.module.state_dict(), path)", "torch.save(model.state_dict(), path)"),
          ("model.module.load_state_dict(state)", "model.load_state_dict(state)")]
CPU_DEVICE_IDS = ("device_ids=[device.index] if device.type == \"cuda\" else None",
                  "device_ids=[int(os.environ[\"LOCAL_RANK\"])]")
NO_TIMEOUT = ("dist.init_process_group(backend, timeout=TIMEOUT, device_id=", "dist.init_process_group(backend, device_id=")
OWN_MEAN_AFTER_REDUCE = ("    return (totals[0] / totals[1]).item()", "    return loss_sum / count")  # all-reduced, unused
MAP_NONE = ("torch.load(path, map_location=device, weights_only=True)", "torch.load(path, map_location=None, weights_only=True)")
LOAD_INTO_WRAPPER = ("model.module.load_state_dict(state)", "model.load_state_dict(state)")
DEVICE_FROM_RANK_RENAMED = [("def choose_device(", "def pick_device("),
                            ("torch.cuda.set_device(local_rank % gpus)", "torch.cuda.set_device(int(os.environ['RANK']) % gpus)"),
                            ("choose_device(local_rank, args.backend)", "pick_device(int(os.environ['RANK']), args.backend)")]
DESTROY_NOT_IN_FINALLY = ("        save_and_reload(model, args.checkpoint, device, rank)\n    finally:\n"
                          "        dist.destroy_process_group()  # also when training failed\n",
                          "        save_and_reload(model, args.checkpoint, device, rank)\n"
                          "        dist.destroy_process_group()\n    finally:\n        pass\n")


# ---- the small checks, one TODO each, on forked ranks ------------------------------------------------------

SMALL_CHECKS = {"check_device": (todo_checks.check_device, RANK_GPU, "LOCAL_RANK, not RANK"),
                "check_loader": (todo_checks.check_loader, TWO_REPLICAS, "sampler refused rank 2.*written into"),
                "check_train": (todo_checks.check_train, NO_SET_EPOCH, r"set_epoch was called with \[\]"),
                "check_train late": (todo_checks.check_train, SET_EPOCH_LATE, "before the epoch's first batch"),
                "check_train own-mean": (todo_checks.check_train, OWN_MEAN_AFTER_REDUCE, "TODO 6: .*its own shard's"),
                "check_global_mean": (todo_checks.check_global_mean, MEAN_OF_MEANS, "mean of the ranks' means"),
                "check_global_mean own": (todo_checks.check_global_mean, OWN_MEAN, "each rank's own mean"),
                "check_save_and_reload": (todo_checks.check_save_and_reload, NO_BARRIER, "dist.barrier"),
                "check_save_and_reload map": (todo_checks.check_save_and_reload, NO_MAP, "map_location=device"),
                "check_save_and_reload keys": (todo_checks.check_save_and_reload, WRAPPED_KEYS, "'module.'"),
                "check_save_and_reload map-none": (todo_checks.check_save_and_reload, MAP_NONE, "map_location=device"),
                "check_save_and_reload wrapper": (todo_checks.check_save_and_reload, LOAD_INTO_WRAPPER,
                                                  "load into model.module")}


def small_check(check, script, tmp_path):
    return check(script, tmp_path) if check is todo_checks.check_save_and_reload else check(script)


@pytest.mark.parametrize("name", sorted({name.split()[0] for name in SMALL_CHECKS}))
def test_each_small_check_passes_the_reference(name, tmp_path, capsys):
    small_check(SMALL_CHECKS[name][0], SOLUTION, tmp_path)
    assert "passed: TODO" in capsys.readouterr().out


@pytest.mark.parametrize("name", SMALL_CHECKS)
def test_each_small_check_names_its_planted_mistake(name, tmp_path):
    check, edits, named = SMALL_CHECKS[name]
    wrong = planted(tmp_path, *(edits if isinstance(edits, list) else [edits]))
    with pytest.raises(ExerciseFailed, match=named):
        small_check(check, wrong, tmp_path)


def test_a_small_check_says_loudly_when_it_checks_the_reference(tmp_path, capsys):
    todo_checks.check_global_mean(NOTEBOOKS / "your_ddp_script.py")
    assert "REFERENCE SOLUTION checked, not yours: TODO 6" in capsys.readouterr().out


def test_where_solutions_are_withheld_a_todo_still_to_do_says_so(tmp_path, monkeypatch):
    from labsrc.lessons.dp_vs_ddp import script_reference
    monkeypatch.setattr(script_reference, "solutions_root", lambda: tmp_path / "withheld")
    assert script_reference.course_script().DATASET_SIZE == 240  # the given part, from the outline
    with pytest.raises(ExerciseFailed, match="TODO 6 .* the reference solution is not on this machine"):
        todo_checks.check_global_mean(NOTEBOOKS / "your_ddp_script.py")
    with pytest.raises(ExerciseFailed, match="untouched, and the reference solution is not on this machine"):
        checker.yours_or_reference(NOTEBOOKS / "your_ddp_script.py", NOTEBOOKS / "your_ddp_script_blank.py")


# ---- the whole script under the probe ------------------------------------------------------------------------

def stages_of(script: Path, tmp_path: Path, world_size: int = 2, nnodes: int = 1):
    run = probe_run(script, world_size, "gloo", tmp_path / "run", 120.0, nnodes=nnodes)
    return run, checker.judged(run, "gloo", 0, nnodes)


@pytest.mark.slow
def test_the_solution_passes(capsys):
    checker.check_ddp_script(SOLUTION, world_size=2)  # 2 ranks, a failure run, 3 simulated nodes
    out = capsys.readouterr().out
    assert "passed" in out and out.count(" ok ") >= 8 and "all 8 TODOs ok" in out


@pytest.mark.slow
@pytest.mark.parametrize("edits, todo, named", [
    ([NO_SAMPLER], 3, "never drew from the DistributedSampler"),
    ([OWN_MEAN], 6, "no all_reduce after epoch 0"),
    ([OWN_MEAN_AFTER_REDUCE], 6, "rank 0 printed .* not the rank's own mean"),
    ([EVERY_RANK_PRINTS], 6, r"rank\(s\) \[1\] printed too"),
    ([EVERY_RANK_SAVES], 7, r"written by rank\(s\) \[0, 1\]"),
    ([NO_BARRIER], 7, "dist.barrier"),
    ([NO_MAP], 7, "without map_location"),
    ([NO_SET_EPOCH], 5, "repeats epoch 0's order.*set_epoch"),
    (NO_DDP, 4, "did not wrap the model in DistributedDataParallel"),
    ([CPU_DEVICE_IDS], 4, "device_ids must be None"),
], ids=["no-sampler", "own-mean", "own-mean-after-all-reduce", "rank-1-prints", "every-rank-saves", "no-barrier", "no-map-location",
        "no-set-epoch", "no-ddp", "cpu-device-ids"])
def test_each_planted_mistake_fails_its_todo(tmp_path, edits, todo, named):
    _, stages = stages_of(planted(tmp_path, *edits), tmp_path)
    failed = [stage for stage in stages if stage.status == "failed"]
    assert failed and failed[0].todo == todo and re.search(named, failed[0].detail), [s.line() for s in stages]


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(torch._C._distributed_c10d.Backend, "options"),
                    reason="this torch does not expose a backend's options, so the probe cannot read the timeout")
def test_a_group_without_timeout_fails_todo_2(tmp_path):
    """Shows at any world size, so on one rank: the group reports torch's default (1800 s with gloo), not TIMEOUT."""
    _, stages = stages_of(planted(tmp_path, NO_TIMEOUT), tmp_path, world_size=1)
    assert stages[1].status == "failed" and "not TIMEOUT" in stages[1].detail and "1800" in stages[1].detail


@pytest.mark.slow
def test_destroy_outside_finally_is_named_by_the_failure_run(tmp_path):
    """Passes a run that ends well; the failure run (make_optimizer raising, one rank) catches it."""
    script = planted(tmp_path, DESTROY_NOT_IN_FINALLY)
    failure = probe_run(script, 1, "gloo", tmp_path / "failure", 120.0, fail=True)
    assert "belongs in the `finally:`" in failure_check(failure.reports)
    assert failure_check(probe_run(SOLUTION, 1, "gloo", tmp_path / "right", 120.0, fail=True).reports) is None


@pytest.mark.slow
def test_a_world_size_written_into_the_script_fails_on_three_nodes(tmp_path):
    """num_replicas=2 passes on 2 ranks; on 3 simulated nodes the sampler refuses rank 2."""
    _, stages = stages_of(planted(tmp_path, TWO_REPLICAS), tmp_path, world_size=3, nnodes=3)
    assert stages[2].status == "failed" and re.search("Invalid rank 2.*written into the script", stages[2].detail)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on GPUs the device is judged from the run itself")
def test_a_gpu_picked_from_rank_outside_choose_device_fails_todo_1_without_gpus(tmp_path):
    """No choose_device to try on pretend GPUs: without a GPU the checker cannot see the pick, so TODO 1 fails and
    asks for choose_device rather than passing unjudged."""
    with pytest.raises(ExerciseFailed, match=r"TODO 1 .*write that function"):
        checker.check_ddp_script(planted(tmp_path, *DEVICE_FROM_RANK_RENAMED), world_size=2)


@pytest.mark.slow
def test_a_half_written_outline_gets_each_todo_judged(tmp_path, capsys):
    """TODOs 1-4 and 8 written, 5-7 not: the stages before TODO 5 are judged from what the ranks did."""
    outline = (NOTEBOOKS / "your_ddp_script.py").read_text()
    solution = SOLUTION.read_text()
    for todo in (1, 2, 3, 4, 8):
        outline = written_todo(outline, solution, todo)
    path = tmp_path / "half_written.py"
    path.write_text(outline)
    assert todos_left(path) == [5, 6, 7]
    with pytest.raises(ExerciseFailed, match=r"TODO 5 \(set_epoch\) is still to do"):
        checker.check_ddp_script(path, world_size=2)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines if " ok " in line] == ["1", "2", "3", "4", "8"], lines


def written_todo(outline: str, solution: str, todo: int) -> str:
    """The outline with TODO `todo`'s lines replaced by the solution's (a TODO's comment, then its raise/pass)."""
    lines = outline.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if f"# TODO {todo}:" in line)
    end = next(i for i in range(start, len(lines)) if "NotImplementedError" in lines[i] or "pass  # TODO" in lines[i])
    answers = {1: "    torch.cuda.set_device(local_rank % gpus)  # before any CUDA work\n"
                  "    return backend, torch.device(\"cuda\", local_rank % gpus)\n",
               2: "    dist.init_process_group(backend, timeout=TIMEOUT, device_id=device if backend == \"nccl\" "
                  "else None)\n",
               3: "    sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)\n"
                  "    return sampler, DataLoader(dataset, batch_size=BATCH_PER_RANK, sampler=sampler)\n",
               4: "        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == \"cuda\" "
                  "else None)\n",
               8: "        dist.destroy_process_group()\n"}
    assert answers[todo].strip().splitlines()[0].strip() in solution
    if todo == 8:  # the `pass  # TODO 8` line is the whole TODO
        start = end
    return "".join(lines[:start] + [answers[todo]] + lines[end + 1:])


# ---- the verdicts alone, on notes written by hand --------------------------------------------------------------

EXPECT = Expected(world_size=2, backend="gloo", gpus=2, timeout_s=60.0, epochs=3, dataset_size=240, seed=0)


def notes(rank: int, local_rank: int, device: int, **more) -> dict:
    return {"rank": rank, "local_rank": local_rank, "set_device": [device], "ddp": {"device_ids": [device]}, **more}


def test_the_gpu_is_judged_by_local_rank_not_rank():
    """Two nodes of one GPU-rank each: rank 1 is LOCAL_RANK 0 on its node, so GPU 0, not GPU 1."""
    assert device_check([notes(0, 0, 0), notes(1, 0, 0)], [], None, None, EXPECT) is None
    assert "expected GPU 0" in device_check([notes(0, 0, 0), notes(1, 0, 1)], [], None, None, EXPECT)


def test_a_load_onto_the_wrong_gpu_is_named(tmp_path):
    """What rank 1 notes on 2 GPUs when the checkpoint lands on rank 0's GPU (judged here from notes; the real run is
    test_no_map_location_on_two_gpus)."""
    reference = reference_run(2)
    torch.save(reference.state, tmp_path / "checkpoint.pt")
    reports = [notes(r, r, r, events=[{"event": "saved", "time": 1.0}] * (r == 0) +
                     [{"event": "loading", "time": 2.0, "map_location": f"cuda:{r}"}],
                     loaded={"device": "cuda:0", "checksum": 1.0}) for r in (0, 1)]
    verdict = checkpoint_check(reports, [], tmp_path / "checkpoint.pt", reference, EXPECT)
    assert "rank 1 loaded the checkpoint onto cuda:0, not cuda:1" in verdict


def test_the_metric_is_the_all_reduce_of_the_dataset_count_not_a_later_barrier():
    """A small all_reduce used as a barrier after the epoch's metric is not taken for the metric."""
    metric = {"after": [300.0, 240.0]}
    assert metric_call([metric, {"after": [2.0]}], 240) is metric
    assert metric_call([{"after": [1.0, 7.0]}], 240) == {"after": [1.0, 7.0]}  # no right count: the last, judged


def test_an_nccl_group_without_device_id_fails_todo_2():
    group = {"world_size": 2, "backend": "nccl", "timeout_s": 60.0, "device_id": None}
    reports = [{"rank": r, "group": group} for r in (0, 1)]
    nccl = dataclasses.replace(EXPECT, backend="nccl")
    assert "without device_id" in group_check(reports, [], None, None, nccl)
    assert group_check([{"rank": r, "group": {**group, "device_id": f"cuda:{r}"}} for r in (0, 1)], [], None, None,
                       nccl) is None


def test_a_run_that_stopped_at_a_todo_is_judged_up_to_it():
    reports = [{"rank": r, "local_rank": r, "group": {"world_size": 2, "backend": "gloo", "timeout_s": 60.0},
                "sampler": {"num_replicas": 2, "rank": r}, "shards": [], "exited": True, "group_destroyed": True,
                "error": {"type": "NotImplementedError", "message": "TODO 4: DDP", "todo": 4}} for r in (0, 1)]
    stages = judge(reports, [], None, None, dataclasses.replace(EXPECT, gpus=0), todos_left=[4])
    assert [stage.status for stage in stages] == ["not judged", "ok", "ok", "not written", "not reached",
                                                  "not reached", "not reached", "ok"]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: on one GPU or the CPU every load lands "
                    "on the rank's own device anyway")
def test_no_map_location_on_two_gpus(tmp_path):
    with pytest.raises(ExerciseFailed, match="map_location=device"):
        checker.check_ddp_script(planted(tmp_path, NO_MAP), world_size=2)


# ---- the files a learner starts from -----------------------------------------------------------------------------

def given_part(lines: list[str]) -> list[str]:
    """The lines between the "# ---- given" and "# ---- the distributed part" banners of a DDP script."""
    start = next(index for index, line in enumerate(lines) if line.startswith("# ---- given"))
    end = next(index for index, line in enumerate(lines) if line.startswith("# ---- the distributed part"))
    return lines[start + 1:end]


def test_the_learners_file_gives_the_solutions_helpers_unchanged():
    """The helpers given to the learner in notebooks/your_ddp_script.py are the reference's, line for line."""
    given = given_part((NOTEBOOKS / "your_ddp_script.py").read_text().splitlines())
    assert len(given) > 20 and given == given_part(SOLUTION.read_text().splitlines()), \
        "the helpers given to the learner drifted from solutions/ddp_script.py: copy the changed lines over"
    assert todos_left(NOTEBOOKS / "your_ddp_script.py") == list(range(1, 9))


def test_the_blank_variant_gives_the_solutions_helpers_unchanged():
    """notebooks/your_ddp_script_blank.py: the same given helpers, and nothing of the distributed part."""
    blank = (NOTEBOOKS / "your_ddp_script_blank.py").read_text()
    assert given_part(blank.splitlines()) == given_part(SOLUTION.read_text().splitlines())
    mine = blank.split("# ---- the distributed part")[1]
    assert not any(call in mine for call in ("init_process_group(", "DistributedSampler(", "DistributedDataParallel(",
                                             "all_reduce(", "barrier(", "set_epoch("))


def test_the_scripts_are_plain_torch():
    """What a learner takes away imports torch only: the checker watches from outside."""
    for path in (SOLUTION, NOTEBOOKS / "your_ddp_script.py", NOTEBOOKS / "your_ddp_script_blank.py"):
        assert "labsrc" not in path.read_text(), path
