"""Notebook 01b's checker passes the reference DDP script and names each planted mistake (one torchrun launch each)."""
from pathlib import Path

import pytest

from labsrc.core.exercises import ExerciseFailed, solutions_root
from labsrc.exercises import ddp_script as checker

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
    checker.check_ddp_script(SOLUTION, world_size=2)
    assert "passed" in capsys.readouterr().out


NO_SAMPLER = ("loader = DataLoader(dataset, batch_size=BATCH_PER_RANK, sampler=sampler)",
              "loader = DataLoader(dataset, batch_size=BATCH_PER_RANK, shuffle=True, "
              "generator=torch.Generator().manual_seed(SEED))")
NO_ALL_REDUCE = ("        dist.all_reduce(totals, op=dist.ReduceOp.SUM, async_op=True).wait(TIMEOUT)\n", "")
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
