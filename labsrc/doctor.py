"""`python -m labsrc.doctor [--json] [--gpus N --cpus N]`: what this machine (or a simulated one) can run, and why not."""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
import torch.distributed as dist

from labsrc.core import leases
from labsrc.core.hardware import Hardware, detect, simulated
from labsrc.core.plan import make_plan
from labsrc.core.profiles import PROFILE_ENV, ProfileError, pick_profile
from labsrc.core.world import max_cpu_ranks
from labsrc.nodes import network

LESSONS = ("00_setup", "01_dp_vs_ddp", "01b_your_ddp_script", "02_collectives", "03_data_loading",
           "04_ddp_internals", "05_mixed_precision", "06_performance_scaling", "06b_across_nodes",
           "07_model_tensor_parallel", "08_pipeline_parallel", "09_memory_sharding", "09b_fsdp_in_practice",
           "10_elastic_fault_tolerance", "10b_elastic_membership",
           "11_async_parameter_server", "12_debugging_clinic", "13_capstone")
# Lessons whose lab always runs gloo ranks on the CPU, whatever the GPUs, and why.
CPU_ONLY = {
    "09_memory_sharding": "its small models and byte counts stay on the CPU",
    "09b_fsdp_in_practice": "its forked gloo ranks and small models stay on the CPU",
    "11_async_parameter_server": "a server receives from any source, which NCCL cannot do",
}


def gpu_report(hardware: Hardware, measured: bool) -> list[dict]:
    """One entry per GPU: details CUDA reports when measured here, else the simulated name only."""
    if not measured:
        return [{"index": index, "name": hardware.gpu_name, "simulated": True} for index in range(hardware.gpus)]
    gpus = []
    for index in range(hardware.gpus):
        props = torch.cuda.get_device_properties(index)
        gpus.append({"index": index, "name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                     "capability": f"{props.major}.{props.minor}",
                     "bf16": torch.cuda.is_bf16_supported() if index == 0 else None})
    return gpus


def backends_report(hardware: Hardware, measured: bool) -> dict:
    """Which process-group backends work; a simulated machine is assumed to have a CUDA build of torch."""
    available = dist.is_available()
    nccl_built = available and (dist.is_nccl_available() or not measured)
    return {
        "distributed": available,
        "gloo": available and dist.is_gloo_available(),
        "nccl": nccl_built and hardware.gpus > 0,
        "nccl_built": nccl_built,
        "mpi": available and dist.is_mpi_available(),
    }


def nccl_report(hardware: Hardware, backends: dict) -> dict:
    if hardware.gpus >= 2 and backends["nccl"]:
        return {"possible": True, "why": f"{hardware.gpus} GPUs: one NCCL rank per GPU, up to {hardware.gpus} ranks"}
    if hardware.gpus == 1:
        return {"possible": False, "why": "one GPU: NCCL refuses two ranks on one GPU; gloo ranks share it"}
    return {"possible": False, "why": "no CUDA GPU visible" + ("" if backends["nccl_built"]
                                                               else " and this torch has no NCCL")}


def plan_report(hardware: Hardware, profile) -> dict:
    """The plan every multi-rank lesson follows on this hardware (labsrc.core.plan.make_plan)."""
    plan = make_plan(hardware, profile)
    return {"world_size": plan.world_size, "backend": plan.backend, "device": plan.device,
            "global_batch": plan.global_batch, "per_rank_batch": plan.per_rank_batch, "reason": plan.reason}


def lab_scales(plan: dict | None, profile_name: str, gpus: int) -> dict:
    """For each lesson: the scale this machine runs it at, in words."""
    if plan is None:
        return {lesson: "cannot plan without a profile" for lesson in LESSONS}
    where = {"cuda": f"{gpus} GPU(s)" + (" shared" if plan["world_size"] > gpus else ""),
             "cpu": "the CPU"}[plan["device"]]
    scale = {lesson: f"{profile_name} profile, {plan['world_size']} {plan['backend']} ranks on {where}"
             for lesson in LESSONS}
    for lesson, why in CPU_ONLY.items():
        scale[lesson] = f"{profile_name} profile, gloo ranks on the CPU ({why})"
    scale["11_async_parameter_server"] = scale["11_async_parameter_server"].replace("gloo ranks", "3+ gloo ranks")
    scale["10b_elastic_membership"] = f"{profile_name} profile, two simulated nodes of one rank each on this machine"
    if gpus < 2:
        scale["01_dp_vs_ddp"] += " (DataParallel timing needs 2+ GPUs: shown, not timed)"
    return scale


def emulated_nodes_report(measured: bool) -> dict:
    """Can runs here give each node its own network namespace and a shaped link (labsrc.nodes.network)?"""
    if not measured:
        return {"ok": None, "how": "", "reason": "not probed: this is a simulated machine"}
    found = network.availability()
    return {"ok": found.ok, "how": found.how, "reason": found.reason}


def pool_report(environ) -> dict | None:
    """The class server's pool (LABSRC_POOL_DIR): its slots, who holds each since when, who waits; None if unset."""
    try:
        pool = leases.configured(environ)
    except leases.PoolError as exc:
        return {"error": str(exc)}
    return None if pool is None else leases.status(pool)


def format_pool(pool: dict) -> list[str]:
    if "error" in pool:
        return [f"pool: ERROR {pool['error']}"]
    held = [s for s in pool["slots"] if s["held"]]
    lines = [f"pool (CPU cores and the plan above count one run's share): {pool['directory']}: {pool['gpus']} GPU(s){' (fake)' if pool['fake_gpus'] else ''}, at most "
             f"{pool['gpus_per_run']} per run; {len(pool['cores'])} core(s), {pool['cores_per_run']} per run; "
             f"{len(held)} of {len(pool['slots'])} slot(s) leased, {len(pool['waiting'])} run(s) waiting"]
    for slot in held:
        since = time.strftime("%H:%M:%S", time.localtime(slot["since"])) if "since" in slot else "?"
        lines.append(f"  {slot['name']}: {slot.get('user', '?')} (pid {slot.get('pid', '?')}, since {since}, "
                     f"{slot.get('label', '')})")
    for place, ticket in enumerate(pool["waiting"], 1):
        need = leases.Need(**ticket.get("need", {}))
        since = time.strftime("%H:%M:%S", time.localtime(ticket.get("since", 0)))
        lines.append(f"  waiting #{place}: {ticket.get('user', '?')} (pid {ticket.get('pid', '?')}, since {since}, "
                     f"{ticket.get('label', '')}) for {need.describe()}")
    return lines


def report(hardware: Hardware | None = None, environ: dict | None = None) -> dict:
    """The doctor's findings for this machine, or for `hardware` given by hand (then LABSRC_PROFILE is ignored)."""
    measured = hardware is None
    hardware = detect() if measured else hardware
    environ = (os.environ if measured else {}) if environ is None else environ
    try:
        profile, reason = pick_profile(environ, hardware=hardware)
        profile_name, profile_error, plan = profile.name, None, plan_report(hardware, profile)
    except ProfileError as exc:
        profile_name, reason, profile_error, plan = None, str(exc), str(exc), None
    backends = backends_report(hardware, measured)
    import torchvision
    return {
        "simulated": not measured, "python": platform.python_version(), "platform": platform.platform(),
        "torch": torch.__version__, "torchvision": torchvision.__version__, "cuda_build": torch.version.cuda,
        "cpu_cores": hardware.cpus, "max_cpu_ranks": max_cpu_ranks(hardware.cpus),
        "gpus": gpu_report(hardware, measured), "backends": backends,
        "profile": profile_name, "profile_reason": reason, "profile_error": profile_error, "plan": plan,
        "multi_rank_nccl": nccl_report(hardware, backends),
        "emulated_nodes": emulated_nodes_report(measured),
        "pool": pool_report(environ),
        "labs": lab_scales(plan, profile_name or "?", hardware.gpus),
    }


def format_report(data: dict) -> str:
    lines = [("SIMULATED machine (no measurement): " if data["simulated"] else "")
             + f"torch {data['torch']} (CUDA build {data['cuda_build']}), torchvision {data['torchvision']}, "
             f"Python {data['python']}",
             f"CPU cores: {data['cpu_cores']} (at most {data['max_cpu_ranks']} CPU ranks)"]
    if data["gpus"]:
        lines += [f"GPU {g['index']}: {g['name']}" + ("" if g.get("simulated") else
                                                     f", {g['memory_gib']} GiB, sm_{g['capability']}")
                  for g in data["gpus"]]
    else:
        lines.append("GPUs: none visible (CUDA unavailable)")
    lines.append("backends: " + ", ".join(k for k in ("gloo", "nccl", "mpi") if data["backends"][k]))
    if data["profile"]:
        lines.append(f"profile: {data['profile']} ({data['profile_reason']})")
        plan = data["plan"]
        lines.append(f"plan: {plan['world_size']} {plan['backend']} ranks on {plan['device']}, global batch "
                     f"{plan['global_batch']} ({plan['reason']})")
    else:
        lines.append(f"profile: ERROR {data['profile_error']}")
    verdict = "yes" if data["multi_rank_nccl"]["possible"] else "no"
    lines.append(f"multi-rank NCCL: {verdict}: {data['multi_rank_nccl']['why']}")
    emulated = data["emulated_nodes"]
    verdict = {True: f"yes, {emulated['how']}", False: "no", None: "unknown"}[emulated["ok"]]
    lines.append(f"emulated nodes (own network stack and shaped link per node): {verdict}: {emulated['reason']}")
    if data["pool"] is not None:
        lines += format_pool(data["pool"])
    lines.append("labs:")
    lines += [f"  {lab}: {scale}" for lab, scale in data["labs"].items()]
    return "\n".join(lines)


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, Hardware | None]:
    """The options and the simulated hardware they ask for (None: this machine); bad values exit with status 2."""
    parser = argparse.ArgumentParser(prog="python -m labsrc.doctor", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--gpus", type=int, default=None,
                        help=f"report for a simulated machine with this many GPUs ({PROFILE_ENV} is then ignored)")
    parser.add_argument("--cpus", type=int, default=None, help="CPU cores of the simulated machine (default 16)")
    parser.add_argument("--gpu-name", default=None, help="GPU name of the simulated machine")
    options = parser.parse_args(argv)
    if options.gpus is None:
        if options.cpus is not None or options.gpu_name is not None:
            parser.error("--cpus and --gpu-name describe a simulated machine: add --gpus N (0 for none).")
        return options, None
    if options.gpus < 0:
        parser.error(f"--gpus must be 0 or more (got {options.gpus}).")
    if options.cpus is not None and options.cpus < 1:
        parser.error(f"--cpus must be 1 or more (got {options.cpus}).")
    if options.gpu_name is not None and (options.gpus == 0 or not options.gpu_name.strip()):
        parser.error("--gpu-name needs --gpus 1 or more and a non-empty name.")
    extra = {"gpu_name": options.gpu_name} if options.gpu_name else {}
    return options, simulated(options.gpus, cpus=options.cpus or 16, **extra)


def main(argv: list[str] | None = None, hardware: Hardware | None = None) -> int:
    options, asked = parse(argv)
    data = report(hardware or asked)
    print(json.dumps(data, indent=2) if options.json else format_report(data))
    return 0 if data["profile"] and not (data["pool"] or {}).get("error") else 2


if __name__ == "__main__":
    sys.exit(main())
