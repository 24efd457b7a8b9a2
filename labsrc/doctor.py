"""`python -m labsrc.doctor [--json]`: what this machine can run, and why not."""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch
import torch.distributed as dist

from labsrc.core.profiles import ProfileError, pick_profile
from labsrc.core.world import gpu_count, max_cpu_ranks

# (lab, what it needs): "any" runs everywhere on gloo; "2gpu" needs two GPUs for its real version.
LAB_NEEDS = {
    "00_setup": "any", "01_dp_vs_ddp": "any", "02_collectives": "any", "03_data_loading": "any",
    "04_ddp_internals": "any", "05_mixed_precision": "any", "06_performance_scaling": "any",
}


def gpu_report() -> list[dict]:
    gpus = []
    for index in range(gpu_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append({"index": index, "name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                     "capability": f"{props.major}.{props.minor}",
                     "bf16": torch.cuda.is_bf16_supported() if index == 0 else None})
    return gpus


def backends_report() -> dict:
    available = dist.is_available()
    return {
        "distributed": available,
        "gloo": available and dist.is_gloo_available(),
        "nccl": available and dist.is_nccl_available() and gpu_count() > 0,
        "nccl_built": available and dist.is_nccl_available(),
        "mpi": available and dist.is_mpi_available(),
    }


def lab_scales(gpus: int, profile_name: str) -> dict:
    """For each lab: the scale this machine runs it at, in words."""
    scale = {}
    for lab, needs in LAB_NEEDS.items():
        if gpus >= 2:
            scale[lab] = f"{profile_name} profile, NCCL on {gpus} GPUs"
        elif gpus == 1:
            scale[lab] = f"{profile_name} profile; multi-rank parts use gloo on the one GPU"
        else:
            scale[lab] = f"{profile_name} profile, gloo ranks on the CPU"
    if gpus < 2:
        scale["01_dp_vs_ddp"] += " (DataParallel timing needs 2+ GPUs: shown, not timed)"
    return scale


def report() -> dict:
    gpus = gpu_count()
    cores = os.cpu_count() or 1
    try:
        profile, reason = pick_profile(gpu_count=gpus, cpu_count=cores)
        profile_name, profile_error = profile.name, None
    except ProfileError as exc:
        profile_name, reason, profile_error = None, str(exc), str(exc)
    backends = backends_report()
    if gpus >= 2 and backends["nccl"]:
        nccl = {"possible": True, "why": f"{gpus} GPUs: one NCCL rank per GPU, up to {gpus} ranks"}
    elif gpus == 1:
        nccl = {"possible": False, "why": "one GPU: NCCL refuses two ranks on one GPU; use gloo"}
    else:
        nccl = {"possible": False, "why": "no CUDA GPU visible" + (
            "" if backends["nccl_built"] else " and this torch has no NCCL")}
    import torchvision
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "cuda_build": torch.version.cuda,
        "cpu_cores": cores,
        "max_cpu_ranks": max_cpu_ranks(cores),
        "gpus": gpu_report(),
        "backends": backends,
        "profile": profile_name,
        "profile_reason": reason,
        "profile_error": profile_error,
        "multi_rank_nccl": nccl,
        "labs": lab_scales(gpus, profile_name or "?"),
    }


def format_report(data: dict) -> str:
    lines = [
        f"torch {data['torch']} (CUDA build {data['cuda_build']}), torchvision {data['torchvision']}, "
        f"Python {data['python']}",
        f"CPU cores: {data['cpu_cores']} (at most {data['max_cpu_ranks']} CPU ranks)",
    ]
    if data["gpus"]:
        lines += [f"GPU {g['index']}: {g['name']}, {g['memory_gib']} GiB, sm_{g['capability']}"
                  for g in data["gpus"]]
    else:
        lines.append("GPUs: none visible (CUDA unavailable)")
    lines.append("backends: " + ", ".join(k for k in ("gloo", "nccl", "mpi") if data["backends"][k]))
    if data["profile"]:
        lines.append(f"profile: {data['profile']} ({data['profile_reason']})")
    else:
        lines.append(f"profile: ERROR {data['profile_error']}")
    verdict = "yes" if data["multi_rank_nccl"]["possible"] else "no"
    lines.append(f"multi-rank NCCL: {verdict}: {data['multi_rank_nccl']['why']}")
    lines.append("labs:")
    lines += [f"  {lab}: {scale}" for lab, scale in data["labs"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labsrc.doctor", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    options = parser.parse_args(argv)
    data = report()
    print(json.dumps(data, indent=2) if options.json else format_report(data))
    return 0 if data["profile"] else 2


if __name__ == "__main__":
    sys.exit(main())
