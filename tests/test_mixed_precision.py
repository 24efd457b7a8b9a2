"""Mixed precision claims: formats, underflow cured by GradScaler, the scale trace, unscale_ before clipping, bytes, AMP + DDP."""
import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from labsrc.core import runs
from labsrc.core.forked import run_ranks
from labsrc.core.profiles import PROFILES
from labsrc.core.world import RequestError
from labsrc.launch import RunResult
from labsrc.lessons.dp_vs_ddp import sync
from labsrc.lessons.mixed_precision import costs, formats, plots, precision, under_ddp
from labsrc.lessons.mixed_precision.lab import (AccumulationVariant, AmpStep, GradientBytes, ModeCost, Options,
                                                SkippedMode, micro_batch_size, mixed_precision_lab, modes_for)
from labsrc.training.models import TinyCNN


def test_formats_differ_where_they_should():
    table = formats.format_table()
    assert table["fp16"]["max"] == 65504.0 and table["bf16"]["max"] > 3e38  # bf16: fp32's 8 exponent bits
    assert table["bf16"]["smallest_normal"] == table["fp32"]["smallest_normal"] == 2.0**-126
    assert table["bf16"]["eps"] == 2**-7 and table["fp16"]["eps"] == 2**-10
    assert table["bf16"]["1 + 2^-9"] == 1.0 and table["fp16"]["1 + 2^-9"] == 1 + 2**-9
    assert table["fp16"]["70000"] == float("inf") and table["bf16"]["70000"] == 70144.0
    assert table["fp16"]["1e-8"] == 0.0 and table["bf16"]["1e-8"] > 0


def test_format_ranges_reach_down_to_the_smallest_subnormal():
    ranges = formats.format_ranges()
    assert ranges["fp16"]["smallest_subnormal"] == 2.0**-24 and ranges["fp16"]["smallest_normal"] == 2.0**-14
    assert ranges["bf16"]["smallest_subnormal"] == 2.0**-133 and ranges["fp32"]["smallest_subnormal"] == 2.0**-149
    assert torch.tensor(ranges["fp16"]["smallest_subnormal"], dtype=torch.float16).item() == 2.0**-24  # representable
    assert torch.tensor(ranges["fp16"]["smallest_subnormal"] / 2.1, dtype=torch.float16).item() == 0.0  # below half: 0


def test_the_concept_figures_draw_from_measured_numbers():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    ranges = formats.format_ranges()
    ax = plots.format_ranges(ranges, {"1e-8": 1e-8})
    assert [label.get_text().split()[0] for label in ax.get_yticklabels()] == ["fp32", "bf16", "fp16"]
    gradients = precision.small_loss_gradients(None, 1e-6)
    ax = plots.gradients_on_fp16_line(gradients, 2.0**16, ranges["fp16"])
    assert ax.get_xscale() == "log" and len(ax.patches) > 3
    matplotlib.pyplot.close("all")


def test_bf16_rounds_about_eight_times_coarser_than_fp16():
    bf16, fp16 = formats.rounding_error(torch.bfloat16), formats.rounding_error(torch.float16)
    assert formats.rounding_error(torch.float32) == 0.0
    assert 4 < bf16 / fp16 < 16  # three fewer mantissa bits: 2^3


def test_grad_scaler_recovers_what_fp16_loses():
    lost = precision.underflow()
    assert lost["fp32"]["lost_fraction"] == 0.0 and lost["fp32"]["zero_fraction"] < 0.05
    assert lost["fp16, no scaling"]["zero_fraction"] == 1.0
    assert lost["fp16 + GradScaler"]["lost_fraction"] < 0.01
    assert lost["fp16 + GradScaler"]["relative_error"] < 1e-2
    assert lost["bf16, no scaling"]["lost_fraction"] < 0.01


def test_expected_scales_follow_the_rule():
    assert precision.expected_scales(7, {3}, 8.0, 2) == [8, 8, 16, 16, 8, 8, 16]


def test_scaler_skips_exactly_the_overflowing_steps_and_follows_the_rule():
    trace = precision.scaler_trace(steps=12, overflow_steps=(5,), growth_interval=2)
    assert [r["step"] for r in trace if r["skipped"]] == [5]
    assert [r["step"] for r in trace if not r["parameters_changed"]] == [5]
    assert [r["scale"] for r in trace] == precision.expected_scales(12, (5,), 2.0**10, 2)


def test_clip_sees_exactly_scale_times_the_norm_without_unscale():
    clip = precision.clipping_with_and_without_unscale(scale=2.0**8)
    true_norm = clip["with unscale_"]["norm_seen_by_clip"]
    assert true_norm > clip["max_norm"]  # clipping engages
    assert clip["without unscale_"]["norm_seen_by_clip"] == 2.0**8 * true_norm
    assert clip["with unscale_"]["norm_applied"] == pytest.approx(clip["max_norm"], rel=1e-4)
    assert clip["without unscale_"]["norm_applied"] == pytest.approx(clip["max_norm"] / 2.0**8, rel=1e-4)


def _message_bytes_on_rank(ctx):
    images, labels = torch.randn(8, 3, 16, 16), torch.randint(10, (8,))
    return {mode: under_ddp.message_bytes(TinyCNN, images, labels, mode)
            for mode in under_ddp.MESSAGE_MODES}


def test_autocast_all_reduces_fp32_gradients_and_only_compression_or_bf16_parameters_halve_them():
    counted = run_ranks(_message_bytes_on_rank, world_size=2)[0]
    full = 4 * counted["fp32"]["gradient_elements"]
    assert all(c["equals_torch_hook"] for c in counted.values())
    for mode in ("fp32", "bf16 autocast", "fp16 autocast + GradScaler"):
        assert counted[mode]["bytes_per_step"] == [full, full] and set(counted[mode]["bytes_by_dtype"]) == {"float32"}
    for mode in ("fp32 + bf16_compress_hook", "bf16 parameters"):
        assert counted[mode]["bytes_per_step"] == [full // 2] * 2 and set(counted[mode]["bytes_by_dtype"]) == {"bfloat16"}


def test_float32_matmul_precision_is_restored():
    before = torch.get_float32_matmul_precision()
    with formats.float32_matmul_precision("high" if before == "highest" else "highest"):
        assert torch.get_float32_matmul_precision() != before
    assert torch.get_float32_matmul_precision() == before
    assert formats.tf32_unavailable("cpu") and set(formats.tf32_settings()) >= {
        "torch.backends.cuda.matmul.allow_tf32", "torch.backends.cudnn.allow_tf32"}


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_autocast_saves_the_same_elements_in_half_the_bytes(mode):
    images, labels = torch.randn(8, 3, 16, 16), torch.randint(10, (8,))
    fp32 = costs.saved_activation_bytes(TinyCNN(), images, labels, "fp32")
    half = costs.saved_activation_bytes(TinyCNN(), images, labels, mode)
    sixteen_bit = half["bfloat16" if mode == "bf16" else "float16"]
    assert half["elements"] == fp32["elements"]
    assert fp32["total"] - half["total"] == sixteen_bit  # each 16-bit element saved 2 of its 4 bytes


def test_mode_costs_report_every_mode():
    images, labels = torch.randn(8, 3, 16, 16), torch.randint(10, (8,))
    per_mode = costs.mode_costs(TinyCNN, images, labels, ["fp32", "bf16", "fp16"], steps=2)
    assert set(per_mode) == {"fp32", "bf16", "fp16"} and all(len(c["step_times_s"]) == 2 for c in per_mode.values())
    assert all(len(c["losses"]) == 3 for c in per_mode.values())
    first = {mode: c["losses"][0] for mode, c in per_mode.items()}  # the same model and batch: agree to 16-bit precision
    assert abs(first["bf16"] - first["fp32"]) < 0.05 * first["fp32"] and abs(first["fp16"] - first["fp32"]) < 0.01 * first["fp32"]
    assert per_mode["bf16"]["activation_bytes"] < per_mode["fp32"]["activation_bytes"]
    assert per_mode["fp32"]["loss_scales"] == [] and len(per_mode["fp16"]["loss_scales"]) == 3


def test_fp16_keeps_one_grad_scaler_across_its_steps():
    images, labels = torch.randn(8, 3, 16, 16), torch.randint(10, (8,))
    per_mode = costs.mode_costs(TinyCNN, images, labels, ["fp16"], steps=4, growth_interval=1)
    scales = per_mode["fp16"]["loss_scales"]
    assert scales[0] == 2.0**16  # GradScaler's default init_scale
    assert len(set(scales)) > 1, f"the loss scale never moved ({scales}): a fresh GradScaler every step?"
    assert scales == precision.expected_scales(5, per_mode["fp16"]["skipped_steps"], 2.0**16, 1)


def test_mode_costs_restore_the_tf32_settings():
    previous = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    images, labels = torch.randn(4, 3, 16, 16), torch.randint(10, (4,))
    try:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True
        costs.mode_costs(TinyCNN, images, labels, ["tf32", "fp32"], steps=1)
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (False, True)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


def test_options_reject_bad_values_with_what_to_do():
    assert Options.make(micro_steps=4).to_argv() == ["--micro-steps", "4"]
    for bad in ({"micro_steps": 0}, {"timed_steps": -1}, {"amp_steps": -2}, {"micro_step": 2}):
        with pytest.raises(RequestError):
            Options.make(**bad)
    with pytest.raises(SystemExit) as exit_status:
        Options.parse(["--micro-steps", "0"])
    assert exit_status.value.code == 2
    with pytest.raises(RequestError, match="micro_steps <= 32"):
        micro_batch_size(PROFILES["ci"], world_size=2, micro_steps=64)


def _lab_on_rank(ctx, run_dir):
    writer = runs.RecordWriter(run_dir, ctx.rank)
    try:
        return mixed_precision_lab(ctx, writer, Options.make(profile="ci", timed_steps=1, amp_steps=3))
    finally:
        writer.close()


def test_lab_writes_typed_records_that_read_back(tmp_path):
    summary = run_ranks(_lab_on_rank, world_size=2, args=(tmp_path,))[0]
    result = RunResult("mixed_precision", 2, tmp_path, 0, 0.0, summary, runs.read_records(tmp_path))
    rows = result.of(ModeCost, rank=0)
    assert [c.mode for c in rows] == ["fp32", "bf16", "fp16"] and all(len(c.losses) == 2 for c in rows)
    assert [s.mode for s in result.of(SkippedMode, rank=1)] == ["tf32"]
    steps = result.of(AmpStep)
    assert [s.step for s in steps] == [0, 1, 2] * 2 and all(s.parameter_spread == 0.0 for s in steps)
    assert all(s.allreduce_syncs == 1 for s in steps), "no_sync on all but the last micro-batch: one all-reduce per step"
    assert all(s.allreduced_bytes == s.gradient_bytes > 0 for s in steps), "every gradient byte once per step"
    assert all(s.gradient_gap is not None and s.gradient_gap < 0.05 for s in steps), \
        "the accumulated gradient (each micro-loss / k) is the mean of the micro-batches' gradients"
    assert {b.mode for b in result.of(GradientBytes, rank=0)} == set(under_ddp.MESSAGE_MODES)
    for mine, theirs in zip(result.of(AmpStep, rank=0), result.of(AmpStep, rank=1)):
        assert mine.mean_loss == theirs.mean_loss == pytest.approx((mine.loss + theirs.loss) / 2)
    assert summary["micro_steps"] == 2 and set(summary["modes"]) == {"fp32", "bf16", "fp16"}
    variants = {v.variant: v for v in result.of(AccumulationVariant, rank=0)}
    assert list(variants) == list(under_ddp.ACCUMULATION_VARIANTS)
    assert variants["correct"].allreduce_syncs == 1 and variants["correct"].gradient_gap < 0.05
    assert variants["no no_sync"].allreduce_syncs == 2 and variants["no no_sync"].gradient_gap < 0.05
    assert variants["no no_sync"].allreduced_bytes == 2 * variants["no no_sync"].gradient_bytes
    assert variants["loss not divided by k"].gradient_gap == pytest.approx(1.0, abs=0.05)


def test_cpu_modes_name_why_tf32_is_skipped():
    modes, skipped = modes_for(torch.device("cpu"))
    assert modes == ["fp32", "bf16", "fp16"] and "tf32" in skipped


def _amp_ddp_training(ctx, mode: str, steps: int = 6, micro_steps: int = 2):
    torch.manual_seed(0)
    model = DDP(TinyCNN(batch_norm=False))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=mode == "fp16")
    generator = torch.Generator().manual_seed(ctx.rank)  # each rank its own data
    images = torch.randn(micro_steps * 8, 3, 8, 8, generator=generator)
    labels = torch.randint(10, (micro_steps * 8,), generator=generator)
    micro_batches = list(zip(images.chunk(micro_steps), labels.chunk(micro_steps)))
    losses, spreads = [], []
    for _ in range(steps):
        losses.append(under_ddp.accumulation_step(model, optimizer, scaler, micro_batches, ctx.device, mode).item())
        spreads.append(sync.spread_across_ranks(list(model.parameters())))
    return losses, spreads, scaler.get_scale() if scaler.is_enabled() else None


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_amp_under_ddp_with_accumulation_keeps_ranks_identical_and_learns(mode):
    results = run_ranks(_amp_ddp_training, world_size=2, args=(mode,))
    for losses, spreads, _ in results:
        assert spreads == [0.0] * len(spreads)
        assert losses[-1] < losses[0]
    assert results[0][2] == results[1][2]  # one loss scale on every rank


def _accumulation_checks(ctx, mode: str, micro_steps: int, steps: int = 3):
    """(all-reduces, gradient gap) per step of accumulation_step under DDP, with a counting comm hook."""
    torch.manual_seed(0)
    model = DDP(TinyCNN())
    counter = under_ddp.CountingHook()
    model.register_comm_hook(None, counter.hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=mode == "fp16")
    generator = torch.Generator().manual_seed(ctx.rank)
    checks = []
    for _ in range(steps):
        micro_batches = [(torch.randn(8, 3, 16, 16, generator=generator), torch.randint(10, (8,), generator=generator))
                         for _ in range(micro_steps)]
        before, counter.syncs = copy.deepcopy(model.module), 0
        under_ddp.accumulation_step(model, optimizer, scaler, micro_batches, ctx.device, mode)
        reference = under_ddp.micro_batch_mean_gradient(before, micro_batches, ctx.device, mode)
        checks.append((counter.syncs, under_ddp.gradient_gap(model, reference)))
    return checks


def _variants(ctx, mode: str, micro_steps: int):
    generator = torch.Generator().manual_seed(ctx.rank)
    micro_batches = [(torch.randn(8, 3, 16, 16, generator=generator), torch.randint(10, (8,), generator=generator))
                     for _ in range(micro_steps)]
    return under_ddp.accumulation_variants(TinyCNN, micro_batches, ctx.device, mode)


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_the_two_accumulation_mistakes_show_in_the_probes(mode):
    k = 3
    for rows in run_ranks(_variants, world_size=2, args=(mode, k)):
        by = {r["variant"]: r for r in rows}
        assert by["correct"]["allreduce_syncs"] == 1 and by["correct"]["gradient_gap"] < 0.05
        assert by["no no_sync"]["allreduce_syncs"] == k, "without no_sync every micro-batch all-reduces"
        assert by["no no_sync"]["gradient_gap"] < 0.05, "yet the gradient is still the mean"
        assert by["loss not divided by k"]["gradient_gap"] == pytest.approx(k - 1, abs=0.1), "k x the mean gradient"


def test_underflow_starts_at_the_logits_and_bf16_is_coarser_per_element():
    at_logits = precision.logit_gradient()
    assert at_logits.abs().max() < 2.0**-25 < 2.0**16 * at_logits.abs().min()
    lost = precision.underflow()
    assert lost["bf16, no scaling"]["median_error"] > 5 * lost["fp16 + GradScaler"]["median_error"]


def test_tf32_settings_survive_the_newer_api():
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip("this torch has no fp32_precision API")
    run_ranks(_set_new_tf32_api_and_read, world_size=1)  # in a child process: the setting sticks for the process


def _set_new_tf32_api_and_read(ctx):
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    settings = formats.tf32_settings()
    assert settings["torch.backends.cuda.matmul.fp32_precision"] == "tf32" and "one API" in settings["note"]


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_accumulation_all_reduces_once_and_applies_the_mean_micro_batch_gradient(mode):
    for checks in run_ranks(_accumulation_checks, world_size=2, args=(mode, 3)):
        assert [syncs for syncs, _ in checks] == [1, 1, 1], "no_sync on the first k-1 micro-batches: one all-reduce"
        assert all(gap is not None and gap < 0.05 for _, gap in checks), f"each micro-loss divided by k: {checks}"


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible here)")


@needs_gpu
def test_cuda_fp16_underflow_and_unscale_ratio():
    device = torch.device("cuda", 0)
    lost = precision.underflow(device=device)
    assert lost["fp16, no scaling"]["zero_fraction"] == 1.0 and lost["fp16 + GradScaler"]["lost_fraction"] < 0.01
    clip = precision.clipping_with_and_without_unscale(scale=2.0**8, device=device)
    assert clip["without unscale_"]["norm_seen_by_clip"] == 2.0**8 * clip["with unscale_"]["norm_seen_by_clip"]


@needs_gpu
def test_cuda_modes_report_peak_memory_and_timing():
    device = torch.device("cuda", 0)
    modes, skipped = modes_for(device)
    assert modes[0] == "fp32" and modes[-1] == "fp16" and set(modes) | set(skipped) == {"fp32", "tf32", "bf16", "fp16"}
    images, labels = torch.randn(32, 3, 16, 16, device=device), torch.randint(10, (32,), device=device)
    before = torch.backends.cuda.matmul.allow_tf32
    per_mode = costs.mode_costs(TinyCNN, images, labels, modes, steps=2)
    assert all(c["peak_memory_bytes"] > 0 and c["step_s"] > 0 for c in per_mode.values())
    assert torch.backends.cuda.matmul.allow_tf32 is before  # mode_costs restores the tf32 setting


@needs_gpu
def test_cuda_tf32_matmul_is_coarser_and_restores_the_setting():
    reason = formats.tf32_unavailable("cuda")
    if reason:
        pytest.skip(reason)
    before = torch.get_float32_matmul_precision()
    matmul = formats.tf32_matmul("cuda", size=2048, repeats=3)
    assert matmul["tf32"]["relative_error"] > 10 * matmul["fp32"]["relative_error"]
    assert torch.get_float32_matmul_precision() == before


def test_the_tf32_switch_works_after_the_newer_fp32_precision_api_was_used():
    """torch refuses to read allow_tf32 once fp32_precision was set in a process; loop.tf32 then sets that API
    (and puts it back). In a child process: the refusal lasts for the whole process."""
    import subprocess
    import sys
    code = ("import torch\nfrom labsrc.training.loop import tf32\n"
            "torch.backends.cuda.matmul.fp32_precision = 'ieee'\n"
            "with tf32(True):\n    inside = torch.backends.cuda.matmul.fp32_precision\n"
            "print(inside, torch.backends.cuda.matmul.fp32_precision)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["tf32", "ieee"]
