"""Deck 06's figures: step split, scaling, learning rates and the extrapolation from a ci run; the scaling model."""
from __future__ import annotations

from makers.diagrams import PALETTE

GPUS = (1, 2, 4, 8, 16, 32, 64)


def scaling_model_diagram(compute_s: float, gradient_bytes: int, workload: str):
    """Per GPU count, the model's step: compute, then the ring all-reduce (performance_scaling/scaling.py)."""
    import matplotlib.pyplot as plt
    from labsrc.lessons.performance_scaling import scaling
    rows = scaling.extrapolate(compute_s, gradient_bytes, list(GPUS))["ring"]
    figure, axes = plt.subplots(figsize=(9, 3.8))
    for index, row in enumerate(sorted(rows, key=lambda r: r["gpus"])):
        talk = row["step_s"] - compute_s
        axes.barh(index, 1000 * compute_s, color=PALETTE["compute"], edgecolor="#374151")
        axes.barh(index, 1000 * talk, left=1000 * compute_s, color=PALETTE["communication"], edgecolor="#374151")
        axes.text(1000 * row["step_s"], index, f"  efficiency {100 * row['efficiency']:.0f}%", va="center",
                  fontsize=8)
    axes.set_yticks(range(len(GPUS)), [f"{n} GPU{'s' if n > 1 else ''}" for n in GPUS])
    axes.invert_yaxis()
    axes.set_xlabel("predicted step time (ms)")
    axes.set_xlim(0, 1000 * max(r["step_s"] for r in rows) * 1.3)
    axes.set_title(f"Step = compute + ring all-reduce (NVLink inside a node, 8 NICs per node across): {workload}",
                   fontsize=9)
    axes.legend(["compute (fixed batch per GPU)", "all-reduce of the gradients"], loc="upper right", fontsize=8)
    return figure


def resnet_on_h100() -> tuple[float, int]:
    """ResNet-18 at batch 512, bf16, on an H100 at an assumed 40% MFU: (compute seconds, gradient bytes)."""
    import torch
    from labsrc.lessons.performance_scaling import scaling
    from labsrc.training import benchmark
    from labsrc.training.models import build_model
    with torch.device("meta"):
        model = build_model("resnet18")
        flops = benchmark.count_flops(model, torch.randn(512, 3, 32, 32), torch.randint(10, (512,)), "bf16")
    peak = benchmark.PEAK_TFLOPS["H100 SXM"]["bf16"]
    return scaling.compute_s_from_flops(flops, peak, 0.4), scaling.gradient_bytes(model)


def scaling_run(profile, plan, steps: int) -> tuple[dict, dict]:
    """Strong and weak scaling, 1 rank against the plan's world size, as notebook 06 measures them."""
    from labsrc import launch
    from labsrc.lessons.performance_scaling import scaling
    from labsrc.core.world import RankContext
    from labsrc.lessons.performance_scaling.lab import Scaling, measure
    one_rank = RankContext(0, 0, 1, plan.device, "none")
    single = measure(one_rank, profile, plan.global_batch, steps=steps, ddp=False)["step_s"]
    result = launch.run("performance_scaling", nproc=plan.world_size, timeout=300,
                        batches=(plan.per_rank_batch, plan.global_batch), steps=steps)
    records = result.of_kind(Scaling.KIND)
    small = scaling.rank_mean(records, plan.per_rank_batch)
    large = scaling.rank_mean(records, plan.global_batch)
    return (scaling.strong_scaling({1: single, plan.world_size: small["step_s"]}),
            scaling.weak_scaling({1: single, plan.world_size: large["step_s"]}))


def make(save):
    from labsrc import bench
    from labsrc.lessons.performance_scaling import scaling
    from labsrc.core.plan import make_plan
    from labsrc.core.reference import load_reference
    from labsrc.lessons.performance_scaling import plots
    plan = make_plan()
    profile = plan.profile
    flags = (f"--model {profile.model} --batch-size {profile.global_batch} --image-size {profile.image_size} "
             "--precision fp32 --steps 5 --warmup 2")
    configurations = {"data on device": "", "channels_last": "--channels-last", "DataLoader": "--data loader"}
    runs = {name: bench.run_in_process(f"{flags} {extra}") for name, extra in configurations.items()}
    save("step_gantt", plots.step_gantt(runs).figure)
    save("scaling", plots.scaling_curves(*scaling_run(profile, plan, 2 * profile.repeats))[0].figure)
    schedules = {f"{n} rank(s), effective batch {profile.global_batch * n}":
                 [scaling.warmup_lr(step, profile.lr, scaling.scaled_lr(
                     profile.lr, profile.global_batch, profile.global_batch * n), 10) for step in range(30)]
                 for n in (1, 2, 4, 8)}
    save("lr_schedules", plots.lr_schedules(schedules).figure, measured=False)
    split = runs["data on device"]["split"]
    measured = sum(split[phase] for phase in ("forward_s", "backward_s", "optimizer_s"))
    resnet = resnet_on_h100()
    workloads = {f"measured here ({profile.model}, cpu)": (measured, runs["data on device"]["gradient_bytes"]),
                 "ResNet-18, H100 bf16 at 40% MFU (assumed)": resnet}
    predictions = {name: scaling.extrapolate(c, b, list(GPUS)) for name, (c, b) in workloads.items()}
    save("extrapolation", plots.extrapolation(predictions, load_reference("performance_scaling")).figure)
    save("scaling_model", scaling_model_diagram(*resnet, "ResNet-18 on H100 (bf16, 40% MFU assumed)"),
         measured=False)
