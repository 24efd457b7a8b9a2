"""Deck 05's figures: underflow, the loss-scale trace, mode costs and AMP + DDP from a ci run; the loss-scale loop."""
from __future__ import annotations

from makers.diagrams import arrow, box, canvas, diamond


def scale_loop_diagram():
    """One fp16 training step with GradScaler: scale, backward, unscale, check, then step or skip."""
    figure, axes = canvas(13, 5.6, "GradScaler, every optimizer step (scale S, growth_interval k, back-off 0.5)")
    steps = [("autocast forward\nloss", "compute"), ("scaler.scale(loss)\nloss x S", "process"),
             ("backward\ngradients x S", "compute"), ("scaler.unscale_(opt)\ngradients / S", "process"),
             ("clip_grad_norm_\n(on true gradients)", "process")]
    for index, (text, kind) in enumerate(steps):
        box(axes, 0.2 + 2.1 * index, 3.9, 1.8, 0.9, text, kind=kind, fontsize=8)
        if index:
            arrow(axes, (0.2 + 2.1 * index - 0.3, 4.35), (0.2 + 2.1 * index, 4.35))
    diamond(axes, 11.6, 4.35, 2.3, 1.4, "scaler.step(opt):\ninf or NaN in\nany gradient?", fontsize=8)
    arrow(axes, (10.0, 4.35), (10.45, 4.35))
    box(axes, 10.2, 1.9, 2.7, 0.9, "optimizer.step skipped\n(parameters unchanged)", kind="bad", fontsize=8)
    arrow(axes, (11.6, 3.65), (11.6, 2.8), "yes", offset=(0.25, 0))
    box(axes, 5.0, 1.9, 3.8, 0.9, "optimizer.step()\non the unscaled gradients", kind="compute",
        fontsize=8)
    arrow(axes, (10.9, 3.9), (8.8, 2.6), "no", offset=(0.1, 0.1))
    box(axes, 3.0, 0.2, 6.0, 0.8, "scaler.update(): S <- S x 0.5 after an inf/NaN,\nS <- S x 2 after k clean steps in a row", kind="process", fontsize=8)
    arrow(axes, (6.9, 1.9), (6.9, 1.0))
    arrow(axes, (10.2, 2.1), (9.0, 0.8))
    arrow(axes, (3.0, 0.6), (1.1, 3.9), curve=-0.3)
    return figure


def make(save):
    from labsrc import launch
    from labsrc.lessons.mixed_precision import precision
    from labsrc.core.plan import make_plan
    from labsrc.lessons.mixed_precision.lab import AmpStep, ModeCost
    from labsrc.lessons.mixed_precision import plots
    plan = make_plan()
    save("underflow", plots.underflow_bars(precision.underflow(device=plan.device)).figure)
    experiment = precision.scaler_experiment(device=plan.device)
    save("scale_trace", plots.scale_trace(experiment["trace"], experiment["expected"]).figure)
    result = launch.run("mixed_precision", nproc=plan.world_size, timeout=300)
    save("mode_costs", plots.mode_costs(result.of(ModeCost, rank=0))[0].figure)
    save("amp_ddp", plots.amp_ddp_losses(result.of(AmpStep, rank=0)).figure)
    save("scale_loop", scale_loop_diagram(), measured=False)
