"""The number formats measured: fp32, bf16 and fp16's range and precision, and TF32's switches, error and speed."""
from __future__ import annotations

import contextlib
import statistics

import torch

from labsrc.training.timing import timed

FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def format_table() -> dict[str, dict]:
    """Range and precision of each format, and three numbers stored in it that show the difference."""
    table = {}
    for name, dtype in FORMATS.items():
        info = torch.finfo(dtype)
        table[name] = {
            "bits": info.bits, "max": info.max, "smallest_normal": info.tiny, "eps": info.eps,
            "1 + 2^-9": torch.tensor(1 + 2**-9, dtype=dtype).item(),  # needs 9 mantissa bits
            "70000": torch.tensor(70000.0, dtype=dtype).item(),  # fp16 tops out at 65504
            "1e-8": torch.tensor(1e-8, dtype=dtype).item(),  # below fp16's smallest subnormal (6e-8)
        }
    return table


def rounding_error(dtype: torch.dtype, size: int = 4096, seed: int = 0) -> float:
    """Mean relative error of storing size standard-normal fp32 values in dtype (precision, measured)."""
    values = torch.randn(size, generator=torch.Generator().manual_seed(seed))
    return ((values.to(dtype).float() - values).abs() / values.abs()).mean().item()


def format_ranges() -> dict[str, dict[str, float]]:
    """Per format, from torch.finfo: the smallest subnormal, the smallest normal, the largest value, and eps.

    Below the smallest normal a format has subnormals: numbers that trade precision bits for range, down to
    smallest_normal x eps (fp16: 2^-14 x 2^-10 = 2^-24, about 6e-8). Below half of that a value rounds to 0.
    """
    ranges = {}
    for name, dtype in FORMATS.items():
        info = torch.finfo(dtype)
        ranges[name] = {"smallest_subnormal": info.tiny * info.eps, "smallest_normal": info.tiny, "max": info.max,
                        "eps": info.eps}
    return ranges


def tf32_settings() -> dict[str, object]:
    """The two TF32 switches the lab's fp32 and tf32 modes flip, as torch reports them in this process.

    Defaults since torch 1.12: matmul False, cuDNN True. torch.set_float32_matmul_precision("high") sets the
    matmul switch too. Recent torch also has a newer API (torch.backends.cuda.matmul.fp32_precision = "tf32");
    once a process has used it, torch refuses to read the old switches (RuntimeError), so the newer API's
    settings are reported instead, with a note. Use one API or the other, not both.
    """
    try:
        return {"torch.backends.cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                "torch.backends.cudnn.allow_tf32": torch.backends.cudnn.allow_tf32}
    except RuntimeError:  # torch: "you have used mix of the legacy and new APIs"
        return {"torch.backends.cuda.matmul.fp32_precision": torch.backends.cuda.matmul.fp32_precision,
                "torch.backends.cudnn.conv.fp32_precision": torch.backends.cudnn.conv.fp32_precision,
                "note": "this process set TF32 with the newer fp32_precision API, so torch will not read the "
                        "allow_tf32 switches (the lab flips those): use one API or the other"}


def tf32_unavailable(device) -> str | None:
    """Why TF32 cannot be measured on device (None: it can)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "TF32 is a mode of NVIDIA tensor cores; this device is not a CUDA GPU"
    if torch.cuda.get_device_capability(device)[0] < 8:
        return "TF32 needs an Ampere or newer GPU (compute capability 8.0); this one is older"
    return None


@contextlib.contextmanager
def float32_matmul_precision(precision: str):
    """torch.set_float32_matmul_precision(precision) inside the block ("highest": no TF32, "high": TF32),
    the previous setting restored after."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def tf32_matmul(device, size: int = 4096, repeats: int = 10, seed: int = 0) -> dict[str, dict]:
    """An fp32 (size, size) @ (size, size) matmul with TF32 off ("highest") and on ("high").

    Per setting: the largest error against the float64 product, relative to its mean magnitude, and the
    median seconds of repeats matmuls (after one warm-up), timed by the course's device-synchronised timer.
    """
    device = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    left, right = (torch.randn(size, size, generator=generator, dtype=torch.float64).to(device) for _ in range(2))
    exact, left32, right32 = left @ right, left.float(), right.float()
    results = {}
    for name, precision in (("fp32", "highest"), ("tf32", "high")):
        with float32_matmul_precision(precision):
            product = left32 @ right32
            seconds = []
            for _ in range(repeats):
                with timed(device) as timer:
                    left32 @ right32
                seconds.append(timer["s"])
        error = ((product.double() - exact).abs().max() / exact.abs().mean()).item()
        results[name] = {"relative_error": error, "step_s": statistics.median(seconds)}
    return results
