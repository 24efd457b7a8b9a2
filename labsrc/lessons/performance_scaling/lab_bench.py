"""The benchmark on n ranks under torchrun (`python -m labsrc.bench --world-size n` launches this lab).

    launch.run("bench", nproc=2, model="tiny_cnn", image_size=16)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from labsrc.core.lab import run_lab
from labsrc.core.options import LabOptions, positive
from labsrc.core.runs import Record
from labsrc.core.world import RequestError
from labsrc.lessons.performance_scaling.bench import run_benchmark

MODELS = ("tiny_cnn", "resnet18", "resnet50")
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
DATA_PATHS = ("device", "loader")
# The smallest image side whose last feature map keeps 2x2 values per channel, so BatchNorm trains at any batch.
SMALLEST_IMAGE = {"tiny_cnn": 4, "resnet18": 16, "resnet50": 64}


@dataclass
class Options(LabOptions):
    """Images/s, the step split into phases, peak memory, FLOP/s and MFU of one training configuration."""

    model: str = "tiny_cnn"
    """Model to train: tiny_cnn, resnet18 (32x32 CIFAR variant) or resnet50 (torchvision's, 224x224)."""
    batch_size: int = 64
    """Images per step on each rank."""
    image_size: int = 32
    """Side of the square input images."""
    precision: str = "fp32"
    """Math mode: fp32, tf32 (NVIDIA GPUs only), bf16 or fp16 autocast (fp16 adds a GradScaler)."""
    channels_last: bool = False
    """NHWC memory format for model and inputs."""
    compile: bool = False
    """torch.compile the model (falls back to eager, with the reason, when compiling fails)."""
    compile_backend: str = "inductor"
    """torch.compile backend (an unknown one shows the fallback to eager)."""
    data: str = "device"
    """device: the dataset resident on the device; loader: a DataLoader from host memory."""
    num_workers: int = 0
    """DataLoader worker processes (with data loader)."""
    world_size: int = 1
    """Ranks; above 1 the bench runs itself under torchrun with DDP."""
    ddp: bool = False
    """Wrap the model in DDP even at world size 1 (a process group of one)."""
    steps: int = 10
    """Timed steps."""
    warmup: int = 3
    """Untimed steps first (compilation, allocator, caches)."""
    peak_tflops: float | None = None
    """The device's peak TFLOP/s for MFU; unset: looked up for known GPUs, none on a CPU."""
    out: str | None = None
    """JSON file to write the result to; unset: print only."""
    compare_loop: bool = False
    """Instead: time the course's loop against a bare loop, and DDP at world size 1 against none."""
    rounds: int = 15
    """With compare_loop: timed rounds per configuration in alternating order; the fastest counts."""

    def validate(self) -> None:
        super().validate()
        for name, value, allowed in (("model", self.model, MODELS), ("precision", self.precision, PRECISIONS),
                                     ("data", self.data, DATA_PATHS)):
            if value not in allowed:
                raise RequestError(f"option {name} {value!r} is unknown: use one of {', '.join(allowed)}.")
        for name in ("batch_size", "steps", "world_size", "rounds"):
            positive(name, getattr(self, name))
        for name in ("warmup", "num_workers"):
            positive(name, getattr(self, name), allow_zero=True)
        positive("peak_tflops", self.peak_tflops)
        smallest = SMALLEST_IMAGE[self.model]
        if self.image_size < smallest:
            raise RequestError(f"option image_size must be at least {smallest} for {self.model} "
                               f"(got {self.image_size}).")
        if self.num_workers and self.data != "loader":
            raise RequestError("num_workers only matters with data loader: add --data loader or drop it.")
        if self.compare_loop and (self.world_size > 1 or self.ddp):
            raise RequestError("compare_loop runs in this process at world size 1: drop world_size and ddp.")

    @classmethod
    def parser(cls, description: str = ""):
        parser = super().parser(description)
        parser.prog = "python -m labsrc.bench"
        return parser


@dataclass
class BenchResult(Record):
    """One rank's images/s and the median step split into phases (seconds)."""

    KIND: ClassVar[str] = "bench"
    images_per_s: float
    data_s: float
    forward_s: float
    backward_s: float
    communication_s: float
    optimizer_s: float
    step_s: float


def bench_lab(ctx, records, options: Options) -> dict:
    result = run_benchmark(ctx, options)
    records.write(BenchResult(images_per_s=result["images_per_s"], **result["split"]))
    return {"result": result}


def main(argv=None):
    return run_lab("bench", bench_lab, Options, argv)


if __name__ == "__main__":
    main()
