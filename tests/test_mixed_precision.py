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
from labsrc.lessons.mixed_precision import precision, under_ddp
from labsrc.lessons.mixed_precision.lab import (AmpStep, GradientBytes, ModeCost, Options, SkippedMode,
                                                micro_batch_size, mixed_precision_lab, modes_for)
from labsrc.training.models import TinyCNN


def test_formats_differ_where_they_should():
    table = precision.format_table()
    assert table["fp16"]["max"] == 65504.0 and table["bf16"]["max"] > 3e38  # bf16: fp32's 8 exponent bits
    assert table["bf16"]["smallest_normal"] == table["fp32"]["smallest_normal"] == 2.0**-126
    assert table["bf16"]["eps"] == 2**-7 and table["fp16"]["eps"] == 2**-10
    assert table["bf16"]["1 + 2^-9"] == 1.0 and table["fp16"]["1 + 2^-9"] == 1 + 2**-9
    assert table["fp16"]["70000"] == float("inf") and table["bf16"]["70000"] == 70144.0
    assert table["fp16"]["1e-8"] == 0.0 and table["bf16"]["1e-8"] > 0


def test_bf16_rounds_about_eight_times_coarser_than_fp16():
    bf16, fp16 = precision.rounding_error(torch.bfloat16), precision.rounding_error(torch.float16)
    assert precision.rounding_error(torch.float32) == 0.0
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
    with precision.float32_matmul_precision("high" if before == "highest" else "highest"):
        assert torch.get_float32_matmul_precision() != before
    assert torch.get_float32_matmul_precision() == before
    assert precision.tf32_unavailable("cpu") and set(precision.tf32_settings()) >= {
        "torch.backends.cuda.matmul.allow_tf32", "torch.backends.cudnn.allow_tf32"}


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_autocast_saves_the_same_elements_in_half_the_bytes(mode):
    images, labels = torch.randn(8, 3, 16, 16), torch.randint(10, (8,))
    fp32 = precision.saved_activation_bytes(TinyCNN(), images, labels, "fp32")
    half = precision.saved_activation_bytes(TinyCNN(), images, labels, mode)
    sixteen_bit = half["bfloat16" if mode == "bf16" else "float16"]
    assert half["elements"] == fp32["elements"]
    assert fp32["total"] - half["total"] == sixteen_bit  # each 16-bit element saved 2 of its 4 bytes


def test_mode_costs_report_every_mode():
    images, labels = torch.randn(8, 3, 16, 16), torch.randint(10, (8,))
    costs = precision.mode_costs(TinyCNN, images, labels, ["fp32", "bf16", "fp16"], steps=2)
    assert set(costs) == {"fp32", "bf16", "fp16"} and all(len(c["step_times_s"]) == 2 for c in costs.values())
    assert all(len(c["losses"]) == 3 for c in costs.values())
    first = {mode: c["losses"][0] for mode, c in costs.items()}  # the same model and batch: agree to 16-bit precision
    assert abs(first["bf16"] - first["fp32"]) < 0.05 * first["fp32"] and abs(first["fp16"] - first["fp32"]) < 0.01 * first["fp32"]
    assert costs["bf16"]["activation_bytes"] < costs["fp32"]["activation_bytes"]
    assert costs["fp32"]["loss_scales"] == [] and len(costs["fp16"]["loss_scales"]) == 3


def test_fp16_keeps_one_grad_scaler_across_its_steps():
    images, labels = torch.randn(8, 3, 16, 16), torch.randint(10, (8,))
    costs = precision.mode_costs(TinyCNN, images, labels, ["fp16"], steps=4, growth_interval=1)
    scales = costs["fp16"]["loss_scales"]
    assert scales[0] == 2.0**16  # GradScaler's default init_scale
    assert len(set(scales)) > 1, f"the loss scale never moved ({scales}): a fresh GradScaler every step?"
    assert scales == precision.expected_scales(5, costs["fp16"]["skipped_steps"], 2.0**16, 1)


def test_mode_costs_restore_the_tf32_settings():
    previous = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    images, labels = torch.randn(4, 3, 16, 16), torch.randint(10, (4,))
    try:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True
        precision.mode_costs(TinyCNN, images, labels, ["tf32", "fp32"], steps=1)
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
    costs = result.of(ModeCost, rank=0)
    assert [c.mode for c in costs] == ["fp32", "bf16", "fp16"] and all(len(c.losses) == 2 for c in costs)
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
    costs = precision.mode_costs(TinyCNN, images, labels, modes, steps=2)
    assert all(c["peak_memory_bytes"] > 0 and c["step_s"] > 0 for c in costs.values())
    assert torch.backends.cuda.matmul.allow_tf32 is before  # mode_costs restores the tf32 setting


@needs_gpu
def test_cuda_tf32_matmul_is_coarser_and_restores_the_setting():
    reason = precision.tf32_unavailable("cuda")
    if reason:
        pytest.skip(reason)
    before = torch.get_float32_matmul_precision()
    matmul = precision.tf32_matmul("cuda", size=2048, repeats=3)
    assert matmul["tf32"]["relative_error"] > 10 * matmul["fp32"]["relative_error"]
    assert torch.get_float32_matmul_precision() == before
