"""Notebook 01b's two checks beside the probed run: the failure run (is the group left in a `finally`?) and
TODO 1's choose_device on pretend GPUs (what a machine without GPUs can judge of the device)."""
from __future__ import annotations

import torch


def failure_check(reports: list[dict | None]) -> str | None:
    """The failure run (make_optimizer raising on purpose): it must fail with that error and still leave the group."""
    if not any(report and (report.get("error") or {}).get("type") == "InjectedFailure" for report in reports):
        return ("the failure run (the given make_optimizer raising on purpose) did not fail with InjectedFailure: "
                "build the optimizer with the given make_optimizer, inside the try, and let its error propagate.")
    kept = [report["rank"] for report in reports if report and not report.get("group_destroyed")]
    if kept:
        return (f"when training raised, rank(s) {kept} still held the process group at exit: "
                "dist.destroy_process_group() belongs in the `finally:`, so it runs whether the try ended or raised.")
    return None


PRETEND = ((1, 2, 2, "nccl"), (3, 4, 2, "gloo"))  # (LOCAL_RANK, ranks on this machine, GPUs, the backend then)


def pretend_gpus_check(choose_device) -> str | None:
    """choose_device(local_rank, None) on a machine with 2 pretend GPUs: torch.cuda's count and set_device are
    stand-ins, so no CUDA call is made. RANK is set apart from LOCAL_RANK, so a GPU chosen from RANK shows."""
    import os
    from unittest import mock
    for local_rank, local_world, gpus, backend in PRETEND:
        chosen = []
        environment = {"LOCAL_RANK": str(local_rank), "RANK": str(local_rank + 3), "LOCAL_WORLD_SIZE": str(local_world)}
        with mock.patch.object(torch.cuda, "device_count", return_value=gpus), \
                mock.patch.object(torch.cuda, "is_available", return_value=True), \
                mock.patch.object(torch.cuda, "set_device", side_effect=chosen.append), \
                mock.patch.dict(os.environ, environment):
            got = choose_device(local_rank, None)
        wanted = torch.device("cuda", local_rank % gpus)
        said = f"LOCAL_RANK {local_rank} ({local_world} ranks, {gpus} GPUs)"
        picked = [torch.device("cuda", c) if isinstance(c, int) else torch.device(c) for c in chosen]
        if not picked:
            return f"{said}: torch.cuda.set_device was never called, so every rank would use GPU 0."
        if picked[-1] != wanted:
            return (f"{said}: set_device({picked[-1]}), expected {wanted}: the GPU is local_rank % gpus. GPUs are "
                    "numbered per machine, so LOCAL_RANK, not RANK.")
        if tuple(got) != (backend, wanted):
            return f"{said}: returned {got}, expected ({backend!r}, {wanted!r})."
    return None
