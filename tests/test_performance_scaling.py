"""Scaling arithmetic and the benchmark of the course's own loop."""
import argparse

import pytest
import torch

from labsrc.lessons.performance_scaling import scaling
from labsrc.techniques.alpha_beta import AlphaBeta, fit, ring_allreduce_time_s


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


def test_ring_model_is_the_plain_ring_inside_a_node_and_uses_every_nic_across_nodes():
    nvlink, nic = scaling.NVLINK, scaling.INFINIBAND
    for n in (2, 4, 8):
        assert scaling.ring_time_s(1e8, n) == ring_allreduce_time_s(1e8, n, nvlink)
    two_nodes = scaling.ring_time_s(1e9, 16)
    latency = 2 * 14 * nvlink.alpha_s + 2 * 1 * nic.alpha_s
    bandwidth = 2 * 7 / 8 * 1e9 * nvlink.beta_s_per_byte + 2 * 1 / 2 * 1e9 * nic.beta_s_per_byte / 8
    assert two_nodes == pytest.approx(latency + bandwidth)
    one_nic = scaling.ring_time_s(1e9, 16, nics_per_node=1)
    assert one_nic - two_nodes == pytest.approx(7 * 1e9 * nic.beta_s_per_byte / 8), "8 NICs carry 8x the bytes"


def test_tree_model_is_a_chain_in_each_node_and_two_trees_across_nodes_over_every_nic():
    nvlink, nic = scaling.NVLINK, scaling.INFINIBAND
    two_nodes = scaling.tree_time_s(1e9, 16)
    latency = 2 * (7 * nvlink.alpha_s + 1 * nic.alpha_s)  # reduce up, broadcast down: 7 NVLink hops, 1 tree level
    bandwidth = 2 * 1e9 * nvlink.beta_s_per_byte + 2 * 1e9 * nic.beta_s_per_byte / 8
    assert two_nodes == pytest.approx(latency + bandwidth)
    one_nic = scaling.tree_time_s(1e9, 16, nics_per_node=1)
    assert one_nic - two_nodes == pytest.approx(7 * 2 * 1e9 * nic.beta_s_per_byte / 8), "8 NICs carry 8x the bytes"


def test_tree_latency_grows_with_log2_of_the_nodes_and_ring_latency_with_the_gpus():
    def latency(model, gpus):
        return model(0.0, gpus)
    for gpus in (16, 32, 64, 128):
        assert latency(scaling.ring_time_s, 2 * gpus) - latency(scaling.ring_time_s, gpus) \
            > 2 * (gpus - 1) * scaling.NVLINK.alpha_s
        step = latency(scaling.tree_time_s, 2 * gpus) - latency(scaling.tree_time_s, gpus)
        assert step == pytest.approx(2 * scaling.INFINIBAND.alpha_s), "one more tree level per doubling"


def test_ring_wins_large_messages_on_few_nodes_and_tree_small_messages_on_many():
    assert scaling.algorithm_times(4.5e7, 16)["faster"] == "ring"
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
