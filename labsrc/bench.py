"""`python -m labsrc.bench`: images/s, the step split into phases, peak memory, FLOP/s and MFU, written as JSON.

    python -m labsrc.bench --model resnet18 --batch-size 512 --precision bf16 --compile --data device
    python -m labsrc.bench --world-size 2 --model tiny_cnn --image-size 16      # through torchrun
    python -m labsrc.bench --compare-loop                                      # the course loop vs a bare one
    python -m labsrc.bench nodes                    # emulated nodes: the link and the all-reduce models (06b)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from labsrc.core.hardware import Hardware, detect
from labsrc.core.world import RankContext, RequestError, validate_request
from labsrc.lessons.performance_scaling.bench import run_benchmark
from labsrc.lessons.performance_scaling.lab_bench import Options
from labsrc.training import benchmark


def parser():
    """The command line: one flag per field of the bench lab's Options (lessons/performance_scaling/lab_bench.py),
    its help the field's docstring."""
    return Options.parser(__doc__.splitlines()[0])


def device_for(hardware: Hardware) -> torch.device:
    """Where a one-rank bench runs: GPU 0 when there is one, else the CPU."""
    return torch.device("cuda", 0) if hardware.gpus else torch.device("cpu")


def check_request(options: Options, hardware: Hardware) -> None:
    """RequestError, saying what to do, when this machine cannot run options.world_size ranks."""
    validate_request(options.world_size, options.backend, gpus=hardware.gpus, cpu_count=hardware.cpus)
    if options.out and Path(options.out).is_dir():
        raise RequestError(f"option out {options.out!r} is a folder: give a file name such as result.json.")


def run_in_process(flags: list[str] | str, hardware: Hardware | None = None) -> dict:
    """`python -m labsrc.bench <flags>` at world size 1, in this process (a notebook cell); the result as a dict.

    A bad flag value raises RequestError (a ValueError) saying what to do, instead of exiting.
    """
    argv = flags.split() if isinstance(flags, str) else [str(f) for f in flags]
    options = Options.make(**vars(parser().parse_args(argv)))
    if options.world_size > 1 or options.ddp or options.compare_loop:
        raise RequestError("in process the bench runs one rank without DDP: use main() for --world-size, --ddp "
                           "and --compare-loop")
    return run_benchmark(RankContext(0, 0, 1, device_for(hardware or detect()), "none"), options)


def format_result(result: dict) -> str:
    """One line: images/s, the step split, FLOP/s and MFU, peak memory, and whether compiling worked."""
    split = result["split"]
    parts = ", ".join(f"{key[:-2]} {1000 * value:.2f} ms" for key, value in split.items() if key != "step_s")
    mfu = ("MFU n/a (peak unknown: pass --peak-tflops)" if result["mfu"] is None
           else f"MFU {100 * result['mfu']:.1f}%")
    compiled = f"compiled: {result['compiled']}"
    if not result["compiled"] and result["compile_reason"] != "not requested":
        compiled += f" ({result['compile_reason']})"
    return (f"{result['images_per_s']:.0f} images/s on {result['world_size']} rank(s); "
            f"step {1000 * split['step_s']:.2f} ms ({parts}); "
            f"{result['achieved_tflops_per_rank'] * 1000:.1f} GFLOP/s per rank, {mfu}; "
            f"{result['peak_memory_kind']} {result['peak_memory_bytes'] / 2**20:.0f} MiB; {compiled}")


def measure(options: Options, hardware: Hardware) -> dict:
    """The bench's result: under torchrun above world size 1, in a world of one with ddp, else plainly here."""
    if options.world_size > 1:  # DDP across processes: torchrun starts them
        from labsrc import launch
        forwarded = {k: v for k, v in options.changed().items() if k not in ("backend", "profile")}
        outcome = launch.run("bench", nproc=options.world_size, timeout=1800, backend=options.backend,
                             profile=options.profile, **forwarded)
        return outcome.summary["result"]
    if options.ddp:
        with benchmark.world_of_one(device_for(hardware)) as ctx:
            return run_benchmark(ctx, options)
    return run_benchmark(RankContext(0, 0, 1, device_for(hardware), "none"), options)


def main(argv: list[str] | None = None, hardware: Hardware | None = None) -> int:
    """The command; a bad option exits with status 2 and what to do, before any work starts."""
    if (sys.argv[1:] if argv is None else argv)[:1] == ["nodes"]:
        from labsrc.lessons.across_nodes.bench import main as nodes_main
        return nodes_main((sys.argv[1:] if argv is None else argv)[1:])
    options = Options.parse(argv)
    hardware = hardware or detect()
    try:
        check_request(options, hardware)
    except RequestError as exc:
        parser().error(str(exc))
    if options.compare_loop:
        from labsrc.training.compare_loops import compare_loops
        print(json.dumps(compare_loops(options, options.rounds, hardware), indent=2))
        return 0
    result = measure(options, hardware)
    print(format_result(result))
    if options.out:
        out = Path(options.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
