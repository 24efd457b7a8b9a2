"""The handmade DDPs match torch DDP and single-process training on 2 and 4 gloo ranks; DDP's settings behave as taught."""
import os

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from labsrc.core.forked import run_ranks
from labsrc.core.world import RequestError
from labsrc.lessons.ddp_internals import handmade_ddp, inside_ddp, lab
from labsrc.lessons.ddp_internals.inside_ddp import covered_ms, overlap_ms
from labsrc.training.loop import step as train_step

WIDTH, BATCH, STEPS = 32, 4, 3


def _make(version: str):
    model = inside_ddp.layered_model(layers=3, width=WIDTH)
    if version == "torch":
        return DDP(model)
    if version == "after_backward":
        return handmade_ddp.AllReduceAfterBackward(model)
    return handmade_ddp.BucketedDDP(model, bucket_cap_mb=0.005)  # 5 KiB: several buckets


def _train_all(ctx):
    """Each version trained STEPS SGD steps on this rank's batches: ({version: (grads per step, params)})."""
    trained = {}
    for version in ("torch", "after_backward", "buckets"):
        model = _make(version)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        gradients = []
        for step in range(STEPS):
            train_step(model, None, *lab.rank_batch(ctx.rank, BATCH, WIDTH, step))
            lab.synchronise(model)
            gradients.append([p.grad.clone() for p in model.parameters()])
            optimizer.step()
        trained[version] = (gradients, [p.detach().clone() for p in model.parameters()])
    return trained


def _single_process(world_size: int):
    """One process, one model, every rank's batch at once: (grads per step, params)."""
    model = inside_ddp.layered_model(layers=3, width=WIDTH)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gradients = []
    for step in range(STEPS):
        batches = [lab.rank_batch(rank, BATCH, WIDTH, step) for rank in range(world_size)]
        train_step(model, None, torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
        gradients.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
    return gradients, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("world_size", [2, 4])
def test_handmade_ddp_matches_torch_ddp_and_one_process(world_size):
    single_grads, single_params = _single_process(world_size)
    for trained in run_ranks(_train_all, world_size):
        torch_grads, torch_params = trained["torch"]
        for version in ("after_backward", "buckets"):
            grads, params = trained[version]
            for step in range(STEPS):
                for mine, theirs, alone in zip(grads[step], torch_grads[step], single_grads[step]):
                    torch.testing.assert_close(mine, theirs)
                    torch.testing.assert_close(mine, alone, rtol=1e-5, atol=1e-6)
            for mine, theirs, alone in zip(params, torch_params, single_params):
                torch.testing.assert_close(mine, theirs)
                torch.testing.assert_close(mine, alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world_size", [2, 3])
def test_index_order_keeps_ranks_paired_when_buckets_fill_in_different_orders(world_size):
    outcomes = run_ranks(handmade_ddp.launch_order_outcome, world_size, timeout_s=60)
    assert outcomes[0]["index_order"]["filled"] == [0, 1] and outcomes[1]["index_order"]["filled"] == [1, 0]
    for outcome in outcomes:
        assert outcome["index_order"]["launched"] == [0, 1], "BucketedDDP launches bucket 0, then 1, on every rank"
        assert outcome["index_order"]["max_error"] < 1e-6
        assert outcome["arrival_order"]["launched"] == outcome["arrival_order"]["filled"]
    assert max(o["arrival_order"]["max_error"] for o in outcomes) > 1e-2, "buckets paired across ranks by arrival mix up"


def test_bucket_rule_closes_at_the_cap_in_reverse_order():
    parameters = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 10, 30, 5)]  # 40, 40, 120, 20 bytes
    assert handmade_ddp.assign_buckets(parameters, 50) == [[3, 2], [1, 0]]
    assert handmade_ddp.assign_buckets(parameters, 60) == [[3, 2], [1, 0]], "120 bytes join the bucket whole"
    assert handmade_ddp.assign_buckets(parameters, 80) == [[3, 2], [1, 0]], "40 + 40 reaches 80: it closes"
    assert handmade_ddp.assign_buckets(parameters, 10**6) == [[3, 2, 1, 0]]
    assert handmade_ddp.assign_buckets(parameters, 10**6, first_cap_bytes=10) == [[3], [2, 1, 0]]


def _torch_ddp_bucket_counts(ctx, caps_mb, width):
    parameters = list(inside_ddp.layered_model(layers=3, width=width).parameters())
    rows = []
    for cap in caps_mb:
        model = DDP(inside_ddp.layered_model(layers=3, width=width), **({} if cap is None else {"bucket_cap_mb": cap}))
        counter = inside_ddp.CommCounter()
        model.register_comm_hook(counter, inside_ddp.counting_hook())
        calls = []
        for step in range(3):
            counter.reset()
            train_step(model, None, *lab.rank_batch(ctx.rank, 2, width, step))
            calls.append(counter.calls)
        first_cap, cap_bytes = inside_ddp.torch_ddp_caps(cap)
        predicted = handmade_ddp.assign_buckets(parameters, cap_bytes, first_cap)
        assert counter.buckets(model.module) == predicted, f"cap {cap}: DDP's buckets differ from the predicted ones"
        rows.append((calls, len(predicted), counter.bytes))
    return rows, sum(p.numel() * p.element_size() for p in parameters)


def test_torch_ddp_all_reduces_per_step_equal_the_predicted_buckets():
    small, small_bytes = run_ranks(_torch_ddp_bucket_counts, 2, args=((0.001, 0.005, 0.02, 25.0), WIDTH))[0]
    for calls, predicted, sent in small:
        assert calls[0] == 1, "before the rebuild DDP uses a single bucket"
        assert calls[1:] == [predicted, predicted] and sent == small_bytes
    # Linear(32, 32): 4096 + 128 bytes, head 1280 + 40. 1048 B closes after every weight (4 buckets);
    # 5242 B after the head and the last layer (2); 20971 B holds all 13992 bytes (1).
    assert [predicted for _, predicted, _ in small] == [4, 2, 1, 1]
    # 3 MiB of gradients: left unset, the first bucket is capped at 1 MiB; an explicit 25 MB is one bucket.
    large, _ = run_ranks(_torch_ddp_bucket_counts, 2, args=((None, 25.0), 512))[0]
    assert [(calls[-1], predicted) for calls, predicted, _ in large] == [(2, 2), (1, 1)]


def _bucketed_schedule(ctx):
    model = handmade_ddp.BucketedDDP(inside_ddp.layered_model(layers=3, width=WIDTH), bucket_cap_mb=0.005)
    for step in range(2):
        train_step(model, None, *lab.rank_batch(ctx.rank, BATCH, WIDTH, step))
        model.finish_gradient_sync()
    return len(model.buckets), model.allreduce_calls, [(event.kind, event.index) for event in model.events]


def test_bucketed_version_launches_all_reduces_before_backward_ends():
    buckets, calls, events = run_ranks(_bucketed_schedule, 2)[0]
    launches = [index for kind, index in events if kind == "all_reduce"]
    assert calls == 2 * buckets and launches == list(range(buckets)) and buckets > 1, "one all-reduce per bucket per step"
    assert events.index(("all_reduce", 0)) < events.index(("hook", 0)), "the first bucket must go before the last gradient"


class _UsedBackwards(torch.nn.Module):
    """Layers used in the reverse of their definition order: the *last* bucket fills first in backward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(3))

    def forward(self, inputs):
        for layer in reversed(self.layers):
            inputs = torch.relu(layer(inputs))
        return inputs


def _out_of_order(ctx):
    images, labels = lab.rank_batch(ctx.rank, BATCH, WIDTH)
    bucketed = handmade_ddp.BucketedDDP(_UsedBackwards(), bucket_cap_mb=0.001)
    train_step(bucketed, None, images, labels)
    launches = [event.index for event in bucketed.events if event.kind == "all_reduce"]
    first_hook = bucketed.events[0][:2]
    bucketed.finish_gradient_sync()
    plain = handmade_ddp.AllReduceAfterBackward(_UsedBackwards())
    train_step(plain, None, images, labels)
    plain.sync_gradients()
    return launches, first_hook, [p.grad for p in bucketed.parameters()], [p.grad for p in plain.parameters()]


def test_buckets_are_launched_in_order_even_when_a_later_one_fills_first():
    launches, first_hook, bucketed, plain = run_ranks(_out_of_order, 2)[0]
    assert first_hook in (("hook", 0), ("hook", 1)), "the first layer defined is used last, so its gradient comes first"
    assert launches == [0, 1, 2]
    for mine, reference in zip(bucketed, plain):
        torch.testing.assert_close(mine, reference)


class _Records:
    """Collects the typed records a lab part writes, by kind."""

    def __init__(self):
        self.by_kind = {}

    def write(self, record):
        self.by_kind.setdefault(type(record).KIND, []).append(record)


def _lab_parts(ctx, folder):
    records = _Records()
    lab.accumulation(ctx, records, width=WIDTH, batch=8, micro_steps=3, bucket_cap_mb=0.005)
    lab.settings(ctx, records, width=WIDTH, batch=8)
    lab.overlap(ctx, records, width=WIDTH, batch=8, run_dir=folder, bucket_cap_mb=0.01)
    return records.by_kind


def test_no_sync_unused_parameters_bucket_view_compression_and_overlap(tmp_path):
    found = run_ranks(_lab_parts, 2, args=(str(tmp_path),))[0]
    [accumulation] = found["no_sync"]
    buckets = accumulation.buckets_per_step
    assert buckets > 1 and accumulation.calls_per_micro_step == [0, 0, buckets]
    assert accumulation.calls_with_forward_outside_no_sync == [buckets] * 3
    assert accumulation.vs_large_batch < 1e-6
    unused = {row.setting: row for row in found["unused_parameters"]}
    assert not unused["default"].ok and "Expected to have finished reduction" in unused["default"].error
    assert unused["find_unused_parameters"].ok and unused["static_graph"].ok
    views = {row.as_view: row for row in found["bucket_view"]}
    assert views[True].grads_inside_buckets and not views[False].grads_inside_buckets
    assert views[False].storage_bytes - views[True].storage_bytes == views[False].gradient_bytes > 0
    compression = {row.scheme: row for row in found["compression"]}
    fp32 = compression["fp32"]
    for scheme, dtype in (("fp16", "float16"), ("bf16", "bfloat16")):
        row = compression[scheme]
        assert row.same_as_torch_hook and row.dtypes == [dtype]
        assert row.bytes * 2 == fp32.bytes and row.calls == fp32.calls
        assert 0 < row.max_error < 1e-2
    [profiled] = found["profile"]
    assert os.path.getsize(profiled.trace) > 0
    assert set(inside_ddp.SPAN_LABELS) <= {s["kind"] for s in profiled.spans}
    timeline = overlap_ms(profiled.spans)
    assert timeline["launched"] > 1 and timeline["launched_during_backward"] == timeline["launched"]
    [schedule] = found["handmade_schedule"]
    events = [(e["kind"], e["index"]) for e in schedule.events]
    assert schedule.buckets > 1 and events.index(("all_reduce", 0)) < events.index(("hook", 0))


def test_overlap_counts_launches_by_span_kind():
    spans = [{"kind": "backward", "start": 0.0, "end": 4.0}, {"kind": "allreduce_launched", "start": 1.0, "end": 1.1},
             {"kind": "allreduce_launched", "start": 5.0, "end": 5.1},
             {"kind": "allreduce_running", "start": 1.0, "end": 3.0}, {"kind": "allreduce_running", "start": 2.0, "end": 6.0}]
    timeline = overlap_ms(spans)
    assert (timeline["launched"], timeline["launched_during_backward"], timeline["first_launch"]) == (2, 1, 1.0)
    assert (timeline["running_ms"], timeline["running_ms_during_backward"]) == (5.0, 3.0)


@pytest.mark.parametrize("values, named", [({"parts": ("buckets", "nothing")}, "nothing"), ({"caps_mb": (0.1, 0)}, "caps_mb"),
                                           ({"micro_steps": 0}, "micro_steps"), ({"width": -1}, "width")])
def test_options_refuse_bad_values_naming_them(values, named):
    with pytest.raises(RequestError, match=named):
        lab.Options.make(**values)


def test_options_round_trip_through_the_command_line():
    options = lab.Options.make(caps_mb="0.02 0.2 2", parts="buckets", global_batch=32)
    assert options.caps_mb == (0.02, 0.2, 2.0) and options.parts == ("buckets",)
    assert lab.Options.parse(options.to_argv()) == options


def test_covered_time_counts_overlapping_intervals_once():
    assert covered_ms([(0, 2), (1, 3), (5, 6)]) == 4
    assert covered_ms([(0, 2), (1, 3), (5, 6)], until=2.5) == 2.5
    assert covered_ms([]) == 0
