"""Timing on any device: host timers that wait for queued GPU work first."""
from __future__ import annotations

import time
from contextlib import contextmanager


def synchronize(device) -> None:
    """Wait for queued GPU work so a host timer measures it (no-op on the CPU)."""
    import torch
    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def timed(device=None):
    """`with timed(device) as t: ...` then t["s"] holds seconds, GPU work included."""
    result = {"s": float("nan")}
    synchronize(device)
    start = time.perf_counter()
    try:
        yield result
    finally:
        synchronize(device)
        result["s"] = time.perf_counter() - start
