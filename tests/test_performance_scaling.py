"""Scaling arithmetic and the benchmark of the course's own loop."""
import argparse

import pytest
import torch

from labsrc.lessons.performance_scaling import scaling
from labsrc.techniques.alpha_beta import AlphaBeta, busbw, fit, ring_allreduce_time_s


def test_strong_and_weak_scaling():
    assert scaling.strong_scaling({1: 10.0, 2: 5.0, 4: 4.0})[4] == {"speedup": 2.5, "efficiency": 0.625}
    assert scaling.weak_scaling({1: 10.0, 4: 12.5})[4] == {"speedup": 3.2, "efficiency": 0.8}


def test_learning_rate_rules():
    assert scaling.scaled_lr(0.1, 256, 1024) == pytest.approx(0.4)
    # Goyal et al.: the ramp starts at the base rate (not peak / warmup_steps) and reaches k x base
    assert [scaling.warmup_lr(s, 0.1, 0.5, 4) for s in range(6)] == pytest.approx(
        [0.1, 0.2, 0.3, 0.4, 0.5, 0.5])


def test_prediction_bounds_and_extrapolation():
    link = AlphaBeta(1e-5, 1e-10, 1.0)
    upper = scaling.predict_step_s(0.01, 4e7, 8, link, overlap=0.0)
    lower = scaling.predict_step_s(0.01, 4e7, 8, link, overlap=1.0)
    assert upper == pytest.approx(0.01 + ring_allreduce_time_s(4e7, 8, link))
    assert lower == pytest.approx(max(0.01, ring_allreduce_time_s(4e7, 8, link)))
    rows = scaling.extrapolate(0.01, 4.5e7, [1, 2, 8, 16, 64])
    assert [r["gpus"] for r in rows["ring"]] == [1, 2, 8, 16, 64] and rows["ring"][0]["efficiency"] == 1.0


def test_ring_model_is_the_plain_ring_inside_a_node():
    for n in (2, 4, 8):
        assert scaling.ring_time_s(1e8, n) == ring_allreduce_time_s(1e8, n, scaling.NVLINK)


def test_ring_model_is_the_flat_ring_over_every_gpu_not_a_hierarchical_one():
    """2 nodes x 8 GPUs (n = 16, N = 2), 1 GB, NVLink 2 us + 450 GB/s, NDR 5 us + 50 GB/s, 8 NICs per node.

    By hand. Latency: 2(n-1) = 30 hops, 2(N-1) = 2 of them over the network: 28 x 2 us + 2 x 5 us = 66 us.
    Bytes: every ring edge carries 2(n-1)/n = 30/16 = 1.875 GB. A GPU's NVLink moves its 1.875 GB at 450 GB/s
    (4.167 ms); the node's 8 rings leave it through 8 NICs, 1.875 GB at 8 x 50 = 400 GB/s (4.6875 ms): the
    NICs set the pace. Total 4.7535 ms.
    The hierarchical charge (the old model: 2(g-1)/g = 1.75 GB over NVLink plus 2(N-1)/N = 1.0 GB over the NICs)
    gives 66 us + 3.889 + 2.5 ms = 6.455 ms, and with one NIC per node 23.96 ms against the flat ring's 37.57 ms:
    its network term, 1.0 GB instead of 1.875, is 47% too fast.
    """
    assert scaling.ring_time_s(1e9, 16) == pytest.approx(4.7535e-3, rel=1e-6)
    assert scaling.ring_time_s(1e9, 16, nics_per_node=1) == pytest.approx(66e-6 + 1.875e9 / 50e9, rel=1e-6)
    assert scaling.ring_time_s(1e9, 16, nics_per_node=1) == pytest.approx(37.566e-3, rel=1e-6)


def test_ring_model_busbw_is_the_bottleneck_bandwidth():
    """nccl-tests: busbw = algbw x 2(n-1)/n, which for a ring is the slowest link's bandwidth, whatever n."""
    free = dict(nvlink=AlphaBeta(0.0, 1 / 450e9, 1.0), nic=AlphaBeta(0.0, 1 / 50e9, 1.0))
    for gpus in (16, 32, 64, 512):
        seconds = scaling.ring_time_s(1e9, gpus, **free)
        assert busbw("all_reduce", 1e9, seconds, gpus) == pytest.approx(400e9), gpus  # 8 NICs x 50 GB/s
        one_nic = scaling.ring_time_s(1e9, gpus, nics_per_node=1, **free)
        assert busbw("all_reduce", 1e9, one_nic, gpus) == pytest.approx(50e9), gpus


def test_ring_model_on_two_nodes_of_two_is_what_a_flat_ring_sends_across():
    """06b's layout: 2 nodes x 2 ranks, a fast inside link, one slow link per node. Flat: each node's link carries
    2(n-1)/n = 1.5 x the bytes; a hierarchical all-reduce would send 2(N-1)/N = 1.0 x."""
    fast, slow = AlphaBeta(0.0, 1 / 2e9, 1.0), AlphaBeta(0.0, 1 / 12.5e6, 1.0)
    seconds = scaling.ring_time_s(64e6, 4, 2, nvlink=fast, nic=slow, nics_per_node=1)
    assert seconds == pytest.approx(1.5 * 64e6 / 12.5e6)


def test_tree_model_is_a_chain_in_each_node_and_two_trees_across_nodes_over_every_nic():
    """2 x 8 GPUs, 1 GB: latency 2 (7 x 2 us + 1 x 5 us) = 38 us. Bytes: 2 GB along the chain per GPU at 450 GB/s
    (4.44 ms), 2 GB out of each node over 8 NICs at 400 GB/s (5 ms), pipelined: the NICs set the pace."""
    assert scaling.tree_time_s(1e9, 16) == pytest.approx(38e-6 + 5e-3, rel=1e-6)
    assert scaling.tree_time_s(1e9, 16, nics_per_node=1) == pytest.approx(38e-6 + 40e-3, rel=1e-6)
    assert scaling.tree_time_s(1e9, 8) == pytest.approx(2 * 7 * 2e-6 + 2e9 / 450e9, rel=1e-6)  # one node: the chain


def test_tree_latency_grows_with_log2_of_the_nodes_and_ring_latency_with_the_gpus():
    def latency(model, gpus):
        return model(0.0, gpus)
    for gpus in (16, 32, 64, 128):
        assert latency(scaling.ring_time_s, 2 * gpus) - latency(scaling.ring_time_s, gpus) \
            > 2 * (gpus - 1) * scaling.NVLINK.alpha_s
        step = latency(scaling.tree_time_s, 2 * gpus) - latency(scaling.tree_time_s, gpus)
        assert step == pytest.approx(2 * scaling.INFINIBAND.alpha_s), "one more tree level per doubling"


def test_ring_wins_large_messages_on_few_nodes_and_tree_small_messages_on_many():
    # 2 x 8 GPUs: the ring's bandwidth term (1.875 S) beats the tree's (2 S) by 0.125 S / 400 GB/s, its latency
    # (66 us) loses to the tree's (38 us) by 28 us: the ring wins above 28 us x 400 GB/s / 0.125 = 89.6 MB
    assert scaling.algorithm_times(1e9, 16)["faster"] == "ring"
    assert scaling.algorithm_times(80e6, 16)["faster"] == "tree"
    assert scaling.algorithm_times(100e6, 16)["faster"] == "ring"
    assert scaling.algorithm_times(1e5, 64)["faster"] == "tree"
    assert scaling.algorithm_times(1e5, 8)["ring"] <= scaling.algorithm_times(1e5, 8)["tree"]
    with pytest.raises(ValueError, match="whole nodes"):
        scaling.ring_time_s(1e6, 12)


def test_gpus_above_is_the_last_count_reaching_the_efficiency():
    link = AlphaBeta(5e-6, 1 / 50e9, float("nan"))
    n = scaling.gpus_above(0.8, 0.01, 4.47e7, link)
    efficiency = [0.01 / scaling.predict_step_s(0.01, 4.47e7, m, link) for m in (n, n + 1)]
    assert 1 < n < 4096 and efficiency[0] >= 0.8 > efficiency[1]


def test_alpha_beta_fit_recovers_its_parameters():
    sizes = [1e3, 1e4, 1e5, 1e6, 1e7]
    fitted = fit(sizes, [3e-5 + s * 2e-10 for s in sizes])
    assert fitted.alpha_s == pytest.approx(3e-5, rel=1e-6) and fitted.bandwidth_bytes_per_s == pytest.approx(5e9)
    assert fitted.r2 == pytest.approx(1.0)


def test_compare_loops_reports_ratios():
    from labsrc.training.compare_loops import compare_loops
    threads = torch.get_num_threads()
    options = argparse.Namespace(model="tiny_cnn", batch_size=8, image_size=8, steps=2)
    result = compare_loops(options, rounds=2)
    assert set(result["seconds_best_round"]) == {"bare loop", "course loop", "course loop + DDP (world size 1)"}
    times = result["seconds_best_round"]
    assert result["course_over_bare"] == times["course loop"] / times["bare loop"]
    assert set(result["cpu_time_ratios"]) == {"course_over_bare", "ddp_world1_over_no_ddp"}
    assert result["intra_op_threads"] == 1 and torch.get_num_threads() == threads, "threads must be restored"


def test_compute_time_from_flops_and_assumed_mfu():
    assert scaling.compute_s_from_flops(989.4e12 * 0.5, 989.4, 0.5) == pytest.approx(1.0)


def _bench_json(world_size: int, step_s: float, batch: int = 64) -> dict:
    return {"world_size": world_size, "split": {"step_s": step_s}, "images_per_s": world_size * batch / step_s,
            "config": {"model": "resnet18", "batch_size": batch, "precision": "bf16"},
            "provenance": {"device_name": "GPU", "world_size_of_run": world_size}}


def test_reference_record_from_bench_runs():
    record = scaling.reference_record([_bench_json(2, 0.125), _bench_json(1, 0.1), _bench_json(8, 0.2)])
    assert [p["gpus"] for p in record["scaling"]] == [1, 2, 8]
    assert [p["efficiency"] for p in record["scaling"]] == pytest.approx([1.0, 0.8, 0.5])
    assert record["per_rank_batch"] == 64 and record["provenance"]["world_size_of_run"] == 1
    assert len(record["runs"]) == 3
    with pytest.raises(ValueError, match="world size 1"):
        scaling.reference_record([_bench_json(2, 0.1)])
    with pytest.raises(ValueError, match="differ"):
        scaling.reference_record([_bench_json(1, 0.1), _bench_json(2, 0.1, batch=32)])


def _measure_on_rank(ctx, per_rank_batch):
    from labsrc.core.profiles import PROFILES
    from labsrc.lessons.performance_scaling.lab import measure
    profile = PROFILES["ci"].replace(image_size=8, num_samples=64)
    return measure(ctx, profile, per_rank_batch, steps=2)


def test_lab_measures_ddp_and_local_steps_on_two_ranks():
    from labsrc.training.models import build_model
    from labsrc.core.forked import run_ranks
    results = run_ranks(_measure_on_rank, 2, args=(8,))
    expected_bytes = 4 * sum(p.numel() for p in build_model("tiny_cnn").parameters())
    for result in results:
        assert result["per_rank_batch"] == 8 and result["gradient_bytes"] == expected_bytes
        assert result["allreduced_bytes"] == result["ddp_steps"] * expected_bytes, "no_sync steps add no bytes"
        assert result["step_s"] > 0 and result["local_step_s"] > 0
        # DDP broadcasts BatchNorm's buffers when the PREVIOUS forward was synced: alternating single steps
        # would put the broadcast into every no_sync step. Timed in blocks, it stays in the DDP steps.
        assert result["no_sync_broadcasts"] == 0, "a timed no_sync step broadcast DDP's buffers"
        assert result["ddp_broadcasts"] == result["timed_steps"], "every timed DDP step broadcasts the buffers once"


def test_figures_draw_every_series():
    import matplotlib
    matplotlib.use("Agg")
    from labsrc.lessons.performance_scaling import plots
    strong = scaling.strong_scaling({1: 1.0, 2: 0.6})
    weak = scaling.weak_scaling({1: 1.0, 2: 1.1})
    speedup, efficiency = plots.scaling_curves(strong, weak)
    assert [line.get_ydata()[-1] for line in speedup.get_lines()] == [2, strong[2]["speedup"], weak[2]["speedup"]]
    last_points = [line.get_ydata()[-1] for line in efficiency.get_lines()]
    assert last_points == [1.0, strong[2]["efficiency"], weak[2]["efficiency"]]
    predictions = {"a": scaling.extrapolate(0.01, 4e7, [1, 8, 16]),
                   "b": scaling.extrapolate(0.02, 4e7, [1, 8, 16])}  # a ring and a tree line each
    points = [{"gpus": 1, "efficiency": 1.0}, {"gpus": 8, "efficiency": 0.9}]
    reference = {"provenance": {"device_name": "GPU"}, "scaling": points}
    ax = plots.extrapolation(predictions, [reference])
    assert len(ax.get_lines()) == 2 * 2 + 1 and list(ax.get_lines()[-1].get_ydata()) == [1.0, 0.9]


def test_prediction_adds_the_communication_measured_at_the_small_batch():
    small = {"step_s": 0.010, "local_step_s": 0.007, "gradient_bytes": 100}
    large = {"step_s": 0.020, "local_step_s": 0.016, "gradient_bytes": 100}
    prediction = scaling.predict_ddp_step(small, large)
    assert prediction["added_s"] == pytest.approx(0.003) and prediction["predicted_s"] == pytest.approx(0.019)
    assert prediction["relative_error"] == pytest.approx(-0.05)


def test_options_refuse_bad_values_before_launch():
    from labsrc.core.world import RequestError
    from labsrc.lessons.performance_scaling.lab import Options
    assert Options.make(batches="4 32", steps=3).to_argv() == ["--batches", "4", "32", "--steps", "3"]
    for bad, message in (({"batches": ()}, "at least one"), ({"batches": (8, 0)}, "batches must be more than 0"),
                         ({"steps": 0}, "steps must be more than 0")):
        with pytest.raises(RequestError, match=message):
            Options.make(**bad)


def test_ring_bytes_figure_labels_every_edge_with_the_flat_share():
    import matplotlib
    matplotlib.use("Agg")
    from labsrc.lessons.performance_scaling import plots
    ring, chart = plots.ring_bytes(2, 2, {"flat": {16: 1.875, 32: 1.9375}, "hierarchical": {16: 1.0, 32: 1.5}})
    labels = [text.get_text() for text in ring.texts if text.get_text().endswith(" S")]
    assert labels == ["1.50 S"] * 4, "4 GPUs in a ring: 4 edges, each carrying 2(n-1)/n = 1.5 S"
    assert [list(line.get_ydata()) for line in chart.get_lines()] == [[1.875, 1.9375], [1.0, 1.5]]
