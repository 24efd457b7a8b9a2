"""The GPU's measured ceilings, for reading the bench's figures against: a device-to-device copy (bytes read plus
bytes written per second) and large matrix products (bf16, and fp32 inputs in the tf32 mode), each the median of
timed repeats after warm-ups, on random data. Without a GPU it writes {"cuda": false} and says so."""
import argparse
import json
import statistics
import subprocess

import torch


def timed_ms(fn, repeats: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def probe() -> dict:
    if not torch.cuda.is_available():
        return {"cuda": False, "reason": "no CUDA GPU visible", "torch": torch.__version__}
    props = torch.cuda.get_device_properties(0)
    record = {"cuda": True, "torch": torch.__version__, "cuda_version": torch.version.cuda,
              "device_name": props.name, "memory_bytes": props.total_memory,
              "multiprocessors": props.multi_processor_count}
    try:
        record["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as error:
        record["nvidia_smi"] = f"unavailable: {error}"
    n_bytes = 2 * 1024**3
    src = torch.rand(n_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = timed_ms(lambda: dst.copy_(src))
    record["copy"] = {"bytes_moved": 2 * n_bytes, "ms": ms, "tb_per_s": 2 * n_bytes / (ms / 1e3) / 1e12,
                      "unit_note": "bytes read plus bytes written"}
    del src, dst
    n = 8192
    flops = 2 * n**3
    for name, dtype, tf32 in (("bf16", torch.bfloat16, False), ("tf32", torch.float32, True)):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        a, b = torch.randn(n, n, device="cuda", dtype=dtype), torch.randn(n, n, device="cuda", dtype=dtype)
        ms = timed_ms(lambda: a @ b)
        record[f"matmul_{name}"] = {"shape": [n, n, n], "ms": ms, "tflop_per_s": flops / (ms / 1e3) / 1e12}
    torch.backends.cuda.matmul.allow_tf32 = False
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    record = probe()
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
