"""Every pipeline schedule, hand-written or torch's, gives the unsplit model's gradients; bubble and memory formulas hold."""
import pytest
import torch

from labsrc.core.forked import RankError, run_ranks
from labsrc.core.world import RequestError
from labsrc.lessons.pipeline_parallel import analysis, chunked, experiments, lab, schedules, stages as stages_module
from labsrc.lessons.pipeline_parallel.executor import run_stage
from labsrc.lessons.pipeline_parallel.library import LIBRARY_SCHEDULES, TWO_STAGES_A_RANK, run_library_schedule
from labsrc.lessons.pipeline_parallel.stages import (assert_part_matches, make_batch, make_model, split_model,
                                                     unsplit_gradients)


def _hand_written_matches(ctx, schedule, micro_batches):
    stages = ctx.world_size
    model = make_model(8, 2 * stages, seed=3)
    inputs, targets = make_batch(12, 8, seed=3)
    reference = unsplit_gradients(model, inputs, targets)
    part = split_model(model, stages)[ctx.rank]
    m = schedules.effective_micro_batches(schedule, micro_batches)
    actions = schedules.actions_for(schedule, ctx.rank, stages, m)
    run_stage(part[1], actions, ctx.rank, stages, inputs, targets, m, timeout_s=20)
    assert_part_matches(part, reference)
    return len(actions)


@pytest.mark.parametrize("stages,micro_batches", [(2, 4), (3, 3), (2, 6)])
@pytest.mark.parametrize("schedule", ["naive", "gpipe", "1f1b"])
def test_hand_written_schedule_gradients_equal_unsplit(schedule, stages, micro_batches):
    counts = run_ranks(_hand_written_matches, stages, args=(schedule, micro_batches))
    assert counts == [2 * schedules.effective_micro_batches(schedule, micro_batches)] * stages


def _library_matches(ctx, schedule, micro_batches):
    stages = 2 * ctx.world_size if schedule in TWO_STAGES_A_RANK else ctx.world_size
    model = make_model(8, 2 * ctx.world_size, seed=5)
    inputs, targets = make_batch(8, 8, seed=5)
    reference = unsplit_gradients(model, inputs, targets)
    held = run_library_schedule(schedule, split_model(model, stages), ctx.rank, ctx.world_size, inputs, targets,
                                micro_batches)
    for part in held:
        assert_part_matches(part, reference)
    return [list(blocks) for blocks, _ in held]


@pytest.mark.parametrize("schedule", LIBRARY_SCHEDULES)
def test_torch_pipelining_gradients_equal_unsplit(schedule):
    held = run_ranks(_library_matches, 2, args=(schedule, 4))
    expected = {"interleaved_1f1b": [[[0], [2]], [[1], [3]]],   # round-robin: rank r holds stages r and r + p
                "interleaved_zero_bubble": [[[0], [2]], [[1], [3]]],
                "zbv_zero_bubble": [[[0], [3]], [[1], [2]]]}     # a V: rank r holds stages r and 2p - 1 - r
    assert held == expected.get(schedule, [[[0, 1]], [[2, 3]]])


def test_hand_written_and_torch_agree():
    hand = run_ranks(experiments.hand_written_error, 2, args=("1f1b", 4))
    torch_ = run_ranks(experiments.library_error, 2, args=("1f1b", 4))
    assert max(hand) < 1e-6 and max(torch_) < 1e-6


def test_checks_count_backwards_and_name_a_send_never_received():
    right = run_ranks(experiments.hand_written_check, 2, args=("gpipe", 4))
    assert [r["backwards"] for r in right] == [[4], [4]] and all(abs(r["scale"] - 1) < 1e-5 for r in right)
    with pytest.raises(RankError, match="gradient of micro-batch 3 to rank 0, which did not receive it"):
        run_ranks(experiments.hand_written_check, 2, args=(_first_stage_skips_a_backward, 4),
                  kwargs={"timeout_s": 2.0}, timeout_s=30)
    library = run_ranks(experiments.library_check, 2, args=("interleaved_1f1b", 4))
    assert [r["backwards"] for r in library] == [[4, 4], [4, 4]]


def test_gradient_scale_is_the_factor_between_gradients():
    model = make_model(8, 2)
    inputs, targets = make_batch(4, 8)
    reference = unsplit_gradients(model, inputs, targets)
    part = split_model(model, 1)[0]
    (4 * torch.nn.functional.mse_loss(part[1](inputs), targets)).backward()   # a loss not divided by m = 4
    assert stages_module.gradient_scale([part], reference) == pytest.approx(4.0, rel=1e-5)


def _first_stage_skips_a_backward(stage, stages, micro_batches):
    actions = schedules.gpipe_actions(stage, stages, micro_batches)
    return [a for a in actions if a != ("B", micro_batches - 1)] if stage == 0 else actions


def _skips_last(stage, stages, micro_batches):
    actions = schedules.gpipe_actions(stage, stages, micro_batches)
    return [a for a in actions if a[1] != micro_batches - 1] if stage == 1 else actions


def test_a_stage_that_skips_a_micro_batch_fails_within_its_timeout():
    with pytest.raises(RankError, match="micro-batch 3 from rank 1, which never sent it"):
        run_ranks(experiments.hand_written_error, 2, args=(_skips_last, 4), kwargs={"timeout_s": 2.0},
                  timeout_s=30)


@pytest.mark.parametrize("stages,micro_batches", [(2, 1), (2, 8), (4, 3), (4, 8), (3, 5)])
@pytest.mark.parametrize("backward", [1.0, 2.0])
def test_ideal_gpipe_and_1f1b_bubble_is_the_formula(stages, micro_batches, backward):
    for schedule in ("gpipe", "1f1b"):
        lists = [schedules.actions_for(schedule, s, stages, micro_batches) for s in range(stages)]
        idle = schedules.idle_fractions(schedules.simulate(lists, 1.0, backward))
        assert idle == pytest.approx([schedules.bubble_formula(stages, micro_batches)] * stages)


def test_schedule_lists_are_valid_and_1f1b_keeps_at_most_p_minus_stage():
    for stages, m in [(2, 4), (4, 8), (4, 2)]:
        for stage in range(stages):
            for schedule in ("gpipe", "1f1b"):
                assert schedules.schedule_problems(schedules.actions_for(schedule, stage, stages, m), stage, m) == []
            assert schedules.peak_in_flight(schedules.gpipe_actions(stage, stages, m)) == m
            assert schedules.peak_in_flight(schedules.one_f_one_b_actions(stage, stages, m)) == min(m, stages - stage)
    assert schedules.schedule_problems([("B", 0), ("F", 0)], 1, 1) == ["micro-batch 0's backward comes before its forward on stage 1"]


def test_simulate_reports_stages_waiting_on_each_other():
    with pytest.raises(ValueError, match="wait on each other"):
        schedules.simulate([[("F", 0), ("B", 0)], [("B", 0), ("F", 0)]])


def test_saved_activation_peaks_follow_the_schedule():
    peaks = run_ranks(experiments.saved_tensor_peak, 2, args=("gpipe", 6))
    peaks += run_ranks(experiments.saved_tensor_peak, 2, args=("1f1b", 6))
    records = [lab.MemoryPeak(schedule=s, micro_batches=6, stage=r, stages=2, **peak)
               for s, pair in (("gpipe", peaks[:2]), ("1f1b", peaks[2:])) for r, peak in enumerate(pair)]
    table = analysis.activation_peaks(records)
    assert {key: row["micro_batches_alive"] for key, row in table.items()} == {
        ("gpipe", 0): 6, ("gpipe", 1): 6, ("1f1b", 0): 2, ("1f1b", 1): 1}


def _timed(ctx):
    return experiments.timed_schedule(ctx, "gpipe", 3, width=16, blocks_per_stage=1, micro_batch_size=4,
                                      box_s=0.01)


def test_timed_schedule_records_every_box_in_list_order():
    timeline = run_ranks(_timed, 2)
    for events in timeline:
        assert [(e["action"], e["micro_batch"]) for e in events] == schedules.gpipe_actions(0, 2, 3)
        assert all(e["end"] - e["start"] >= 0.01 for e in events)
    assert timeline[1][0]["start"] >= timeline[0][0]["end"]   # stage 1's F0 needs stage 0's F0 first


def _timing(repeat, stage, start, end):
    return lab.ActionTiming(schedule="gpipe", micro_batches=1, repeat=repeat, stage=stage, action="F", micro_batch=0,
                            start=start, end=end)


def test_bubble_sweep_keeps_the_repeat_with_the_shortest_span():
    timings = [_timing(0, 0, 0.0, 1.0), _timing(0, 1, 1.5, 2.5),     # span 2.5, idle 0.6
               _timing(1, 0, 0.0, 1.0), _timing(1, 1, 1.0, 2.0),     # span 2.0, idle 0.5: kept
               _timing(2, 0, 0.0, 2.0), _timing(2, 1, 2.0, 3.0)]     # span 3.0, idle 0.5
    sweep = analysis.bubble_sweep(timings)[1]
    assert sweep["kept"] == 1 and sweep["spans"] == [2.5, 2.0, 3.0]
    assert sweep["measured"] == pytest.approx(0.5) and sweep["formula"] == pytest.approx(0.5)


def _shifted(timeline, lag, stretch):
    """A timeline as a loaded machine stretches it: every time times `stretch`, stage s a further s x lag late."""
    return [[{**e, "start": (e["start"] + s * lag) * stretch, "end": (e["end"] + s * lag) * stretch} for e in events]
            for s, events in enumerate(timeline)]


@pytest.mark.parametrize("schedule,stages,micro_batches", [("gpipe", 2, 8), ("1f1b", 3, 4), ("gpipe", 4, 3)])
def test_the_order_replayed_counts_the_bubble_and_a_lagging_stage_still_overlaps(schedule, stages, micro_batches):
    ideal = analysis.ideal_timeline(schedule, stages, micro_batches, 0.04)
    loaded = _shifted(ideal, 0.012, 3.0)   # each hop 12 ms late, everything 3 x as long
    assert analysis.replayed_idle(loaded) == pytest.approx(schedules.bubble_formula(stages, micro_batches))
    scheduled = analysis.overlap_share(analysis.replay(loaded))
    assert scheduled == pytest.approx(analysis.overlap_share(ideal))
    assert analysis.overlap_share(loaded) >= scheduled / 2   # what notebook 08 asserts


def test_stages_that_take_turns_fail_the_count_or_the_overlap():
    one_at_a_time = [[a for j in range(4) for a in (("F", j), ("B", j))] for _ in range(2)]
    timeline = schedules.simulate(one_at_a_time, 1.0, 1.0)
    assert analysis.replayed_idle(timeline) == pytest.approx(0.5) and analysis.overlap_share(timeline) == 0.0
    # GPipe's order, but each box waits for the other stage's to end (ranks in lockstep): the count holds, the
    # clock shows no overlap
    lockstep, clock = [[], []], 0.0
    for position in range(8):
        for stage in range(2):
            kind, j = schedules.gpipe_actions(stage, 2, 4)[position]
            lockstep[stage].append({"action": kind, "micro_batch": j, "start": clock, "end": clock + 1.0})
            clock += 1.0
    assert analysis.replayed_idle(lockstep) == pytest.approx(schedules.bubble_formula(2, 4))
    assert analysis.overlap_share(lockstep) == 0.0 < analysis.overlap_share(analysis.replay(lockstep))


@pytest.mark.parametrize("schedule", chunked.CHUNKED_SCHEDULES)
def test_chunked_orders_replayed_give_their_formulas(schedule):
    timeline = _shifted(chunked.ideal_timeline(schedule, 2, 4, 0.04), 0.005, 2.0)
    assert analysis.replayed_idle(timeline) == pytest.approx(chunked.bubble_formula(schedule, 2, 4))


@pytest.mark.parametrize("values,message", [
    ({"micro_batches": (0, 2)}, "micro_batches"),
    ({"check_micro_batches": 3}, "must divide check_batch"),
    ({"repeats": 0}, "repeats"),
])
def test_options_refuse_what_cannot_run(values, message):
    with pytest.raises(RequestError, match=message):
        lab.Options.make(**values)


def test_lab_launch_records_every_experiment():
    from labsrc import launch
    result = launch.run("pipeline_parallel", nproc=2, timeout=240, echo=False, micro_batches=(1, 2), repeats=1,
                        box_ms=5, memory_micro_batches=4)
    checks = result.of(lab.GradientCheck)
    assert len(checks) == 2 * 10 and max(c.max_error for c in checks) < 1e-6
    # torch's zero-bubble schedules: stage 0 runs W as a full backward (hook fires, m); later stages add dw to
    # weight.grad directly (stage_backward_weight), past the hook: 0
    from labsrc.lessons.pipeline_parallel import library
    for c in checks:
        if c.schedule.endswith("zero_bubble") and c.implementation != "hand-written":
            held = library.stages_held(c.schedule, c.rank, 2)
            assert list(c.backwards) == [c.micro_batches if i == 0 else 0 for i in held], (c.schedule, c.rank, c.backwards)
        else:
            assert set(c.backwards) == {c.micro_batches}, (c.schedule, c.rank, c.backwards)
    assert {(m.schedule, m.stage) for m in result.of(lab.StepMessages)} == {
        (s, r) for s in ("interleaved_1f1b", "zero_bubble") for r in (0, 1)}
    assert not result.of(lab.ScheduleProblem) and not result.of(lab.Skipped)
    peaks = result.of(lab.ChunkedMemoryPeak)
    assert len(peaks) == 4 and all(p.peak_bytes == p.expected_bytes > 0 for p in peaks)
    sweep = analysis.bubble_sweep(result.of(lab.ActionTiming))
    assert sorted(sweep) == [1, 2]
    assert analysis.timeline_of(result.of(lab.ActionTiming), "1f1b", 4)[0][0]["action"] == "F"
    assert {(p.schedule, p.stage) for p in result.of(lab.MemoryPeak)} == {(s, r) for s in ("gpipe", "1f1b") for r in (0, 1)}
    progress = result.of_kind("progress", rank=0)
    total = lab.step_count(lab.Options.make(micro_batches=(1, 2), repeats=1, memory_micro_batches=4))
    assert [p["step"] for p in progress] == list(range(total + 1)), "the bar should move once per pipeline step"
    assert {p["unit"] for p in progress} == {lab.PROGRESS_UNIT} and progress[1]["t"] < progress[-1]["t"] / 2, \
        "the first step's report should come early, not with the last"


@pytest.mark.parametrize("ranks,chunks,micro_batches", [(2, 2, 4), (4, 2, 8), (2, 3, 4)])
def test_ideal_interleaved_bubble_is_its_formula(ranks, chunks, micro_batches):
    lists = [chunked.interleaved_actions(r, ranks, chunks, micro_batches) for r in range(ranks)]
    timeline = chunked.simulate(lists, chunks * ranks, {"F": 1 / chunks, "B": 1 / chunks})
    assert sum(schedules.idle_fractions(timeline)) / ranks == pytest.approx(
        chunked.interleaved_bubble(ranks, chunks, micro_batches))


@pytest.mark.parametrize("stages,micro_batches", [(2, 4), (4, 8), (3, 3)])
def test_ideal_zero_bubble_is_its_formula_and_runs_w_after_b(stages, micro_batches):
    timeline = chunked.simulate(chunked.zero_bubble_lists(stages, micro_batches), stages, {"F": 1, "B": 1, "W": 1})
    assert sum(schedules.idle_fractions(timeline)) / stages == pytest.approx(
        chunked.zero_bubble_bubble(stages, micro_batches))
    assert chunked.w_before_b(timeline) == []


def test_chunk_order_that_cannot_run_is_named():
    lists = [[(k, j, vs if k == "F" else (vs + 2) % 4) for k, j, vs in chunked.interleaved_actions(r, 2, 2, 4)]
             for r in range(2)]   # each backward on the wrong chunk
    with pytest.raises(ValueError, match="wait on each other forever"):
        chunked.simulate(lists, 4, {"F": 1, "B": 1})


@pytest.mark.parametrize("schedule", chunked.CHUNKED_SCHEDULES)
def test_hand_written_chunked_gradients_equal_unsplit(schedule):
    for report in run_ranks(experiments.chunked_check, 2, args=(schedule, 4)):
        assert report["max_error"] < 1e-6 and abs(report["scale"] - 1) < 1e-5
        assert report["backwards"] == [4] * (2 if schedule == "interleaved_1f1b" else 1)


def test_w_before_its_b_still_gives_gradients_but_is_named_on_the_timeline():
    timeline = [[{"action": "W", "micro_batch": 0, "virtual_stage": 0, "start": 0.0, "end": 1.0},
                 {"action": "B", "micro_batch": 0, "virtual_stage": 0, "start": 1.0, "end": 2.0}]]
    assert chunked.w_before_b(timeline) == ["W of micro-batch 0 on virtual stage 0 started before its B ended"]


def test_interleaved_needs_m_a_multiple_of_p():
    assert lab.runnable("interleaved_1f1b", 3, 4) and lab.runnable("interleaved_1f1b", 2, 4) is None
    assert lab.runnable("zero_bubble", 3, 4) is None


def test_saved_activations_of_a_split_backward_are_freed_at_their_w():
    """One stage, no messages: with B and W split, a micro-batch's activations leave the meter at its W (a meter
    holding the saved output itself kept the graph alive in a cycle, and the names bound in the executor kept the
    last one alive into the next forward), so the measured peak is what the list says, for W's early or late."""
    from labsrc.lessons.pipeline_parallel import chunked
    from labsrc.lessons.pipeline_parallel.chunked_executor import run_chunks
    from labsrc.lessons.pipeline_parallel.executor import SavedTensorMeter
    from labsrc.lessons.pipeline_parallel.stages import full_batch_loss, make_batch, make_model, split_model
    module = split_model(make_model(64, 2, 0), 1, torch.device("cpu"))[0][1]
    m = 4
    inputs, targets = make_batch(8 * m, 64, 0, torch.device("cpu"))
    one = SavedTensorMeter(module)
    with torch.autograd.graph.saved_tensors_hooks(one.pack, one.unpack):
        full_batch_loss(module(inputs[:8].clone().requires_grad_()), targets[:8])   # the one stage is the last
    eager = [action for j in range(m) for action in (("F", j, 0), ("B", j, 0), ("W", j, 0))]
    late = [("F", j, 0) for j in range(m)] + [("B", j, 0) for j in range(m)] + [("W", j, 0) for j in range(m)]
    for actions in (eager, late):
        meter = SavedTensorMeter(module)
        run_chunks({0: module}, actions, 1, 1, inputs, targets, m, meter=meter)
        assert meter.peak == chunked.kept_bytes_peak(actions, {0: one.peak})
        assert meter.alive == 0


@pytest.mark.parametrize("blocks", [1, 4])
def test_split_backward_does_one_backwards_work(blocks):
    """B + W run exactly the matrix products and Tanh backwards of one whole backward, and W runs no Tanh
    backward (a W that walked back through the stage again would recompute the chain: 2L - 1 products, not L)."""
    from labsrc.lessons.pipeline_parallel.backward_split import backward_work
    counted = backward_work(make_model(16, blocks), torch.randn(4, 16))
    for op in ("mm", "addmm", "tanh_backward"):
        assert counted["B"].ops[op] + counted["W"].ops[op] == counted["whole"].ops[op], op
    assert counted["B"].matmul_flops + counted["W"].matmul_flops == counted["whole"].matmul_flops
    assert counted["W"].ops["tanh_backward"] == 0 and counted["W"].ops["mm"] == blocks


@pytest.mark.parametrize("stages", range(2, 9))
def test_zero_bubble_keeps_zb_h1_memory(stages):
    """ZB-H1 keeps at most p micro-batches (Qi et al. 2023): min(m, p) at its peak on every stage, not m."""
    for m in range(1, 3 * stages + 1):
        peaks = [chunked.in_flight_peak(actions) for actions in chunked.zero_bubble_lists(stages, m)]
        assert peaks == [min(m, stages)] * stages, (stages, m, peaks)


@pytest.mark.parametrize("ranks,chunks,micro_batches", [(2, 2, 4), (2, 2, 8), (4, 2, 8), (4, 2, 16), (3, 3, 6)])
def test_interleaved_warmup_and_peak_are_narayanans(ranks, chunks, micro_batches):
    """Narayanan et al. 2021 §2.2: rank r warms up with 2(p-1-r) + (v-1)p forwards, so it keeps one more at its
    peak (for m > p)."""
    for rank in range(ranks):
        actions = chunked.interleaved_actions(rank, ranks, chunks, micro_batches)
        warmup = 2 * (ranks - 1 - rank) + (chunks - 1) * ranks
        assert [kind for kind, _, _ in actions[:warmup + 1]] == ["F"] * warmup + ["F"]
        assert actions[warmup + 1][0] == "B"
        assert chunked.in_flight_peak(actions) == warmup + 1


def test_executor_step_with_b_and_w_does_one_backwards_work():
    """run_chunks itself, one stage: [F, B, W] per micro-batch runs the matrix products of [F, B], no more."""
    from labsrc.lessons.pipeline_parallel.chunked_executor import step_work
    step = step_work(make_model(16, 3), *make_batch(8, 16), 2)
    for op in ("mm", "addmm", "tanh_backward"):
        assert step["split"].ops[op] == step["whole"].ops[op], op
    assert step["split"].matmul_flops == step["whole"].matmul_flops


@pytest.mark.parametrize("ranks", [2, 3, 4, 8])
def test_interleaved_order_is_torchs(ranks):
    """The hand-written interleaved lists equal torch's own ScheduleInterleaved1F1B order (schedules.py)."""
    for micro_batches in (ranks, 2 * ranks, 3 * ranks):
        lists, _ = chunked.chunked_lists("interleaved_1f1b", ranks, micro_batches)
        assert [list(map(tuple, l)) for l in lists] == chunked.torch_interleaved_order(ranks, 2, micro_batches)
