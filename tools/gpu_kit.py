"""The wheelhouse the GPU truth kit carries (make gpu-kit): the wheels the course needs beyond the GPU machine's
image, for its Python (3.12, manylinux x86_64), downloaded from PyPI here and installed offline there.

    python tools/gpu_kit.py [--python-version 3.12] [--dest .gpu-kit/wheels]

The course's requirements are resolved with their dependencies; every package the image already holds
(tools/gpu_image_packages.txt) is left out, and so are those only the browser tests and Lab itself need.
"""
import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGE_PACKAGES = ROOT / "tools" / "gpu_image_packages.txt"
LIMIT_BYTES = 40 * 2**20
# The image brings torch, torchvision, numpy and matplotlib at its own versions; Lab and playwright serve only a
# browser, which that machine has not; nbmake runs the notebooks on an ipykernel.
NOT_CARRIED = {"torch", "torchvision", "numpy", "matplotlib", "jupyterlab", "playwright"}
# Wheels taken without their dependencies: each needs torch, which pip would otherwise fetch for the GPU machine's
# Python (gigabytes, CUDA libraries included), and otherwise only what the image holds (torchdata: requests, urllib3).
WITHOUT_DEPENDENCIES = {"torchdata"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux_2_12_x86_64", "manylinux2010_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64", "any")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(path: Path = IMAGE_PACKAGES) -> set[str]:
    return {normalize(line.strip()) for line in path.read_text().splitlines()
            if line.strip() and not line.startswith("#")}


def wheel_name(path: Path) -> str:
    """The distribution a wheel file holds (its file name up to the version)."""
    return normalize(path.name.split("-")[0])


def course_requirements(path: Path = ROOT / "requirements.txt") -> list[str]:
    wanted = []
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and normalize(re.split(r"[=<>!~ ]", line)[0]) not in NOT_CARRIED:
            wanted.append(line)
    return wanted


def build(dest: Path, python_version: str) -> list[Path]:
    image = image_packages()
    abi = "cp" + python_version.replace(".", "")
    with tempfile.TemporaryDirectory() as scratch:
        command = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--only-binary=:all:",
                   "--python-version", python_version, "--implementation", "cp", "--abi", abi, "--abi", "abi3",
                   "--abi", "none", "-d", scratch]
        for platform in PLATFORMS:
            command += ["--platform", platform]
        wanted = course_requirements()
        alone = [r for r in wanted if normalize(re.split(r"[=<>!~ ]", r)[0]) in WITHOUT_DEPENDENCIES]
        subprocess.run(command + [r for r in wanted if r not in alone], check=True)
        if alone:
            subprocess.run(command + ["--no-deps"] + alone, check=True)
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        kept = []
        for wheel in sorted(Path(scratch).glob("*.whl")):
            if wheel_name(wheel) not in image:
                kept.append(Path(shutil.copy2(wheel, dest)))
    size = sum(p.stat().st_size for p in kept)
    if size > LIMIT_BYTES:
        raise SystemExit(f"the wheelhouse is {size / 2**20:.1f} MiB, over its {LIMIT_BYTES / 2**20:.0f} MiB limit "
                         "(64 MiB travel with the working tree): leave out what the GPU run does not need")
    (dest.parent / "python-version").write_text(python_version + "\n")
    print(f"{len(kept)} wheels, {size / 2**20:.1f} MiB, for Python {python_version} in {dest}")
    return kept


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python-version", default="3.12")
    parser.add_argument("--dest", type=Path, default=ROOT / ".gpu-kit" / "wheels")
    args = parser.parse_args(argv)
    build(args.dest, args.python_version)
    return 0


if __name__ == "__main__":
    sys.exit(main())
