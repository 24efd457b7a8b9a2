"""Checker for notebook 10b's exercise: resume from the snapshot on disk, whatever the restart counter says.

    check_resume(resume_or_start)   # resume_or_start(run, path) -> the step to start from

The notebook's story, with the learner's function at every start: a two-rank job trains and snapshots; a node is lost
and the survivor (TORCHELASTIC_RESTART_COUNT 1) resumes alone at world size 1, trains on and snapshots; the node
returns and the job re-forms at world size 2: the survivor's rank reads 1, the returning node's new agent 0. Then the
starts with nothing to resume (the first, counter 0; failures before the first snapshot, counter 1 and 2), and a
snapshot cut short mid-write, which must not pass for "no snapshot".

Every start is a fresh Training in this process (no process group: a rank-1 run of world size 2 is built as the
re-formed job would build it), and each is compared right after the learner's function with what
eft.load_snapshot leaves, RNG included (re-seeded from (seed, step, rank) since the world size changed).
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

import torch

from labsrc.core.exercises import ExerciseFailed, on_ranks, passed
from labsrc.core.processes import environment_set
from labsrc.core.world import RankContext
from labsrc.lessons.elastic_fault_tolerance.resume import (Setup, Training, fingerprint, load_snapshot,
                                                           part_fingerprints, save_snapshot)

SETUP = Setup(samples=48, global_batch=8, epochs=2)
"""6 steps an epoch, 12 in all."""
STEPS_BEFORE = 8
"""Steps the two-rank job takes before its snapshot: into epoch 1, 16 of its 48 samples (a step that is neither the
steps left nor a place in the epoch, so that only the snapshot's step passes)."""
STEPS_ALONE = 2
"""Steps the survivor takes alone before its own snapshot (of step 10), the one the re-formed job resumes from."""
COUNTER = "TORCHELASTIC_RESTART_COUNT"
STATE = ("model", "optimizer", "scheduler", "scaler", "sampler", "rng", "step")
"""What must be as eft.load_snapshot leaves it (or, with no snapshot, as built)."""


def _train_and_snapshot(ctx, path: str) -> None:
    """On 2 forked gloo ranks: STEPS_BEFORE steps, then the lab's snapshot (rank 0 writes it, both ranks' RNG)."""
    run = Training.build(ctx, SETUP)
    for _ in range(STEPS_BEFORE):
        run.step()
    save_snapshot(run, path)
    return None


def _built(rank: int = 0, world_size: int = 1) -> Training:
    return Training.build(RankContext(rank, rank, world_size, torch.device("cpu"), "gloo"), SETUP)


def _state(run: Training) -> dict[str, str]:
    """The parts' fingerprints; the RNG is this process's, so take it right after the start it belongs to."""
    return {part: value for part, value in part_fingerprints(run).items() if part in STATE}


def _loaded(path: Path, rank: int = 0, world_size: int = 1) -> tuple[Training, dict[str, str]]:
    run = _built(rank, world_size)
    load_snapshot(run, path)
    return run, _state(run)


def _start(resume_or_start: Callable, path: Path, counter: str, what: str, rank: int = 0,
           world_size: int = 1) -> tuple[Training, int, dict[str, str]]:
    """The learner's function on a freshly built run, with TORCHELASTIC_RESTART_COUNT=counter: (run, step, state)."""
    run = _built(rank, world_size)
    with environment_set({COUNTER: counter}):
        try:
            step = resume_or_start(run, path)
        except FileNotFoundError as error:
            if path.exists():
                raise ExerciseFailed(f"{what}: the snapshot was at path ({path.name}), and your function raised "
                                     f"{error!r}: load the file at path itself.") from None
            raise ExerciseFailed(f"{what}: there is no snapshot yet, and your function raised {error!r}: when no "
                                 f"file is there, start from step 0 with the fresh state.") from None
    state = _state(run)
    if isinstance(step, bool) or not isinstance(step, int):
        raise ExerciseFailed(f"{what}: return the step to start from (an int), not {step!r}.")
    return run, step, state


def _only_the_learning_rate(run: Training, snapshot: Training) -> bool:
    """Whether run's optimizer is the snapshot's but for its learning rate (scaled to the world size, say)."""
    state, theirs = run.optimizer.state_dict(), snapshot.optimizer.state_dict()
    rates = [group["lr"] for group in state["param_groups"]]
    if rates == [group["lr"] for group in theirs["param_groups"]]:
        return False
    state["param_groups"] = [{**group, "lr": their["lr"]} for group, their in zip(state["param_groups"],
                                                                                 theirs["param_groups"])]
    return fingerprint(state) == fingerprint(theirs)


def _resumed(what: str, run: Training, step: int, got: dict, expected: dict, fresh: dict, snapshot: Training,
             writers: int) -> None:
    """The learner's start must hold what load_snapshot left in `snapshot`'s run, and return its step."""
    done = snapshot.steps_done
    if {part: got[part] for part in STATE if part != "rng"} == {part: fresh[part] for part in STATE if part != "rng"}:
        raise ExerciseFailed(f"{what}: the snapshot of step {done} was on disk, and your function started from "
                             f"scratch. Did it trust the counter (or the rank)? Every rank decides from the file: "
                             f"this one would train other weights than its peers, or hang when their step counts "
                             f"differ.")
    wrong = [part for part in STATE if got[part] != expected[part]]
    if wrong:
        hints = []
        if "optimizer" in wrong and _only_the_learning_rate(run, snapshot):
            hints.append(f"the learning rate is {run.optimizer.param_groups[0]['lr']:g}, the snapshot's "
                         f"{snapshot.optimizer.param_groups[0]['lr']:g}: the global batch stays "
                         f"{SETUP.global_batch} at any world size, so the learning rate stays too")
        if "rng" in wrong:
            hints.append(f"the snapshot holds the RNG streams of the {writers} rank(s) that wrote it, and at world "
                         f"size {run.ctx.world_size} none of them is this rank's: eft.load_snapshot re-seeds the RNG "
                         f"from (seed, step, rank)")
        raise ExerciseFailed(f"{what}: after your function, {', '.join(wrong)} "
                             f"{'differs' if len(wrong) == 1 else 'differ'} from what eft.load_snapshot(run, path) "
                             f"leaves (it puts every part back)" + "".join(f"; {hint}" for hint in hints) + ".")
    if step != done:
        raise ExerciseFailed(f"{what}: the snapshot is of step {done}; your function returned {step} (return "
                             f"run.steps_done after loading: the steps done, where training goes on).")


def _rest_of_epoch(what: str, runs: list[Training], snapshot: Training) -> None:
    """The resumed ranks train to the end of the epoch (global batch unchanged): with the steps before the snapshot,
    every sample once."""
    epoch, position = snapshot.sampler.epoch, snapshot.sampler.position
    trained = snapshot.sampler.order(epoch)[:position].tolist()
    seen = []
    while runs[0].steps_done < (epoch + 1) * SETUP.steps_per_epoch:
        for run in runs:
            seen += run.step()[1]
    if sorted(trained + seen) != list(range(SETUP.samples)):
        raise ExerciseFailed(f"{what}: after the resume, epoch {epoch} did not see each sample once (before the "
                             f"snapshot: {sorted(trained)}; after it, at world size {len(runs)}: {sorted(seen)}). The "
                             f"global batch stays {SETUP.global_batch} sample ids a step at any world size, each rank "
                             f"taking its share of it.")


def check_resume(resume_or_start: Callable) -> None:
    """resume_or_start(run, path) -> int: load the snapshot at path into run if one is there and return its step;
    otherwise leave run as built and return 0 (a file there that will not load is an error, not 'none'). Whatever
    TORCHELASTIC_RESTART_COUNT says, on every rank."""
    with tempfile.TemporaryDirectory() as folder:
        two_ranks, alone = Path(folder) / "snapshot.pt", Path(folder) / "snapshot-alone.pt"
        missing, torn = Path(folder) / "none.pt", Path(folder) / "torn.pt"
        on_ranks(_train_and_snapshot, 2, (str(two_ranks),), timeout_s=60)

        # the node is lost: the survivor resumes alone from the 2-rank snapshot
        what = "the survivor, alone at world size 1 after the lost node (TORCHELASTIC_RESTART_COUNT 1)"
        snapshot, expected = _loaded(two_ranks)
        fresh = _state(_built())
        run, step, got = _start(resume_or_start, two_ranks, "1", what)
        _resumed(what, run, step, got, expected, fresh, snapshot, 2)
        _rest_of_epoch(what, [run], snapshot)

        # it trains on alone and snapshots; the node returns and the job re-forms at world size 2
        for _ in range(STEPS_ALONE):
            snapshot.step()
        save_snapshot(snapshot, alone)
        runs = []
        for rank, counter, what in ((0, "1", "the survivor's rank 0 of the re-formed 2-rank job (its agent's "
                                             "TORCHELASTIC_RESTART_COUNT 1)"),
                                    (1, "0", "the returning node's rank 1 of the re-formed 2-rank job (its new "
                                             "agent's TORCHELASTIC_RESTART_COUNT 0)")):
            snapshot, expected = _loaded(alone, rank, 2)
            fresh = _state(_built(rank, 2))
            run, step, got = _start(resume_or_start, alone, counter, what, rank, 2)
            _resumed(what, run, step, got, expected, fresh, snapshot, 1)
            runs.append(run)
        _rest_of_epoch("the re-formed 2-rank job", runs, snapshot)

        # nothing to resume from
        for counter, what in (("0", "the first start (TORCHELASTIC_RESTART_COUNT 0, no snapshot)"),
                              ("1", "a restart before the first snapshot (TORCHELASTIC_RESTART_COUNT 1, no "
                                    "snapshot)"),
                              ("2", "a second restart before the first snapshot (TORCHELASTIC_RESTART_COUNT 2, no "
                                    "snapshot)")):
            fresh = _state(_built())
            run, step, got = _start(resume_or_start, missing, counter, what)
            changed = [part for part in STATE if got[part] != fresh[part]]
            if step != 0 or changed:
                raise ExerciseFailed(f"{what}: nothing to resume from, so the run must start at step 0 with the "
                                     f"state it was built with (and the RNG as seeded); your function returned "
                                     f"{step} and changed {', '.join(changed) or 'nothing'}.")

        # a snapshot cut short mid-write is there, but will not load
        torn.write_bytes(two_ranks.read_bytes()[:two_ranks.stat().st_size // 2])
        what = "a snapshot cut short mid-write (TORCHELASTIC_RESTART_COUNT 1)"
        run, raised = _built(), object()
        with environment_set({COUNTER: "1"}):
            try:
                step = resume_or_start(run, torn)
            except Exception:  # noqa: BLE001 - any error let through is right: the start must not go on
                step = raised
        if step is not raised:
            raise ExerciseFailed(f"{what}: the file at path is there but will not load (eft.load_snapshot raises "
                                 f"SnapshotCorrupt), and your function returned {step!r}. A snapshot that will not "
                                 f"load is not 'no snapshot': starting over would lose the job's progress and set "
                                 f"this rank apart from its peers. Let the error through (catch FileNotFoundError "
                                 f"at most).")
    passed(f"with the counter at 0, 1 or 2 alike, your function resumed from the snapshot whenever one was there: "
           f"the survivor alone from the 2-rank snapshot of step {STEPS_BEFORE}, both ranks of the re-formed job from "
           f"the survivor's of step {STEPS_BEFORE + STEPS_ALONE}, each epoch then seeing every sample once at the same "
           f"global batch; it started fresh when there was none and let a torn one fail")
