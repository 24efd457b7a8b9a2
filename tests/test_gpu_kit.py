"""The GPU truth kit, rehearsed without a GPU: the wheelhouse holds what the GPU machine's image lacks and nothing it
has, and tools/gpu_truth.sh runs its stages over a stand-in image (only the image's packages) in its dry mode."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import fake_gpu_image  # noqa: E402
import gpu_kit  # noqa: E402

NEEDED = {"nbmake", "ipykernel", "ipywidgets", "nbformat", "nbclient", "jupyter-client", "pyzmq", "tornado"}


def _build(dest: Path, version: str) -> list[Path]:
    try:
        return gpu_kit.build(dest, version)
    except subprocess.CalledProcessError as error:  # an offline machine cannot build the kit: said, not failed
        pytest.skip(f"pip download failed ({error}): building the wheelhouse needs PyPI")


@pytest.fixture(scope="module")
def kit_here(tmp_path_factory) -> Path:
    """The wheelhouse for this machine's Python, as the rehearsal installs it."""
    folder = tmp_path_factory.mktemp("kit")
    _build(folder / "wheels", f"{sys.version_info.major}.{sys.version_info.minor}")
    return folder


def test_the_wheelhouse_for_the_gpu_machine_brings_what_its_image_lacks(tmp_path):
    wheels = _build(tmp_path / "wheels", "3.12")
    names = {gpu_kit.wheel_name(w) for w in wheels}
    assert NEEDED <= names, f"missing: {NEEDED - names}"
    for wheel in wheels:  # pure, stable-ABI or CPython 3.12 builds for x86-64 Linux
        tags = wheel.name.removesuffix(".whl").split("-")[-3:]
        assert tags[2] == "any" or "x86_64" in tags[2], wheel.name
        assert tags[1] in ("none", "abi3", "cp312"), wheel.name
    assert sum(w.stat().st_size for w in wheels) <= gpu_kit.LIMIT_BYTES
    assert (tmp_path / "python-version").read_text().strip() == "3.12"


def test_the_image_list_names_the_packages_the_kit_relies_on():
    image = gpu_kit.image_packages()
    assert {"torch", "torchvision", "numpy", "matplotlib", "pytest", "psutil", "cloudpickle"} <= image


def test_the_kit_rehearses_every_stage_over_a_stand_in_image(kit_here, tmp_path):
    python = fake_gpu_image.make(tmp_path / "image")
    stand_in = subprocess.run([str(python), "-c", "import torch, matplotlib\ntry:\n import nbmake\nexcept ImportError:"
                               "\n print('no nbmake')"], capture_output=True, text=True)
    assert stand_in.stdout.strip() == "no nbmake", "the stand-in must lack what the wheelhouse brings"
    work = tmp_path / "work"
    env = {**os.environ, "GPU_KIT": str(kit_here), "IMAGE_PYTHON": str(python), "GPU_TRUTH_VENV": str(tmp_path / "venv"),
           "GPU_TRUTH_WORK": str(work), "NB_FILTER": "01b_your_ddp_script.ipynb", "NB_JOBS": "1",
           "GPU_TESTS": "tests/test_gpu.py", "OUT": str(tmp_path), "REPORT_DIR": str(tmp_path / "report")}
    env.pop("LABSRC_PROFILE", None)
    stages = ["setup", "doctor", "probe", "tests", "notebooks", "bench", "capstone", "report", "pack"]
    done = subprocess.run(["bash", str(ROOT / "tools" / "gpu_truth.sh"), "--dry", *stages], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    ran = [json.loads(line) for line in (work / "stages.jsonl").read_text().splitlines()]
    assert [(s["stage"], s["rc"]) for s in ran] == [(stage, 0) for stage in stages]
    report = json.loads(next((tmp_path / "report").glob("*.json")).read_text())
    assert report["dry_run"] and report["torch"].startswith(__import__("torch").__version__.split("+")[0])
    assert [(c["name"].split("::")[-1], c["outcome"]) for c in report["notebooks"]["ci"]["cases"]] == \
        [("01b_your_ddp_script.ipynb", "passed")]
    assert report["tests"]["counts"]["failed"] == 0 and report["tests"]["counts"]["skipped"] >= 1  # no GPU here
    assert report["bench"] and report["bench"][0]["images_per_s"]["value"] > 0
    assert report["capstone"]["steps"] > 0 and report["ceilings"] == {"cuda": False, "reason": "no CUDA GPU visible",
                                                                       "torch": __import__("torch").__version__}
    assert (tmp_path / "gpu-truth-work.tgz").stat().st_size > 0
