"""Mixed precision claims: formats, underflow cured by scaling, the scaler trace, unscale_ before clipping, bytes."""
import torch

from labsrc import precision
from labsrc.models import TinyCNN


def test_formats_differ_where_they_should():
    table = precision.format_table()
    assert table["fp16"]["max"] == 65504.0 and table["bf16"]["eps"] == 2**-7 and table["fp16"]["eps"] == 2**-10
    assert table["fp16"]["1e-8"] == 0.0 and table["bf16"]["1e-8"] > 0


def test_loss_scaling_recovers_what_fp16_loses():
    lost = precision.underflow()
    assert lost["fp16, no scaling"]["lost_fraction"] > 0.5
    assert lost["fp16, loss scaled"]["lost_fraction"] < 0.01


def test_scaler_skips_exactly_the_overflowing_steps_and_halves():
    trace = precision.scaler_trace(steps=12, overflow_steps=(5,), growth_interval=2)
    assert [r["step"] for r in trace if r["skipped"]] == [5]
    assert trace[6]["scale"] == trace[5]["scale"] / 2
    assert trace[2]["scale"] == 2 * trace[0]["scale"]


def test_clip_sees_scale_times_the_norm_without_unscale():
    clip = precision.clipping_with_and_without_unscale(scale=2.0**8)
    ratio = clip["without unscale_"]["norm_seen_by_clip"] / clip["with unscale_"]["norm_seen_by_clip"]
    assert abs(ratio - 2.0**8) / 2.0**8 < 1e-2


def test_bf16_keeps_half_the_activation_bytes():
    images, labels = torch.randn(8, 3, 16, 16), torch.randint(10, (8,))
    fp32 = precision.saved_activation_bytes(TinyCNN(), images, labels, "fp32")
    bf16 = precision.saved_activation_bytes(TinyCNN(), images, labels, "bf16")
    assert 0 < bf16 < 0.75 * fp32


def test_mode_costs_report_every_mode():
    images, labels = torch.randn(8, 3, 16, 16), torch.randint(10, (8,))
    costs = precision.mode_costs(TinyCNN, images, labels, ["fp32", "bf16"], steps=2)
    assert set(costs) == {"fp32", "bf16"} and all(c["step_s"] > 0 for c in costs.values())
