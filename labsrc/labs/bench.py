"""The benchmark on n ranks under torchrun (`python -m labsrc.bench --world-size n` launches this)."""
from __future__ import annotations

import argparse

from labsrc.core.lab import run_lab


def bench_lab(ctx, records, options) -> dict:
    from labsrc.bench import run_benchmark
    result = run_benchmark(ctx, options)
    records.write("bench", images_per_s=result["images_per_s"], **result["split"])
    return {"result": result}


def main(argv=None):
    from labsrc.bench import parser
    options = parser().parse_args(argv)
    options = argparse.Namespace(**vars(options), backend=None, seed=0, run_dir=None, pg_timeout_s=300.0)
    return run_lab("bench", bench_lab, options)


if __name__ == "__main__":
    main()
