"""A stand-in for the GPU machine's image, for rehearsing the GPU truth kit on a machine without one: a venv whose
only packages are those the image holds (tools/gpu_image_packages.txt), linked from the running interpreter's
environment. The kit's wheels must then bring everything else, as they must there.

    python tools/fake_gpu_image.py DEST      (then IMAGE_PYTHON=DEST/bin/python tools/gpu_truth.sh --dry ...)
"""
import importlib.metadata as metadata
import subprocess
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_kit import image_packages, normalize  # noqa: E402


def make(dest: Path) -> Path:
    """DEST/bin/python: a venv seeing only the image's packages (those of them installed here)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True)
    base_pip = Path(sysconfig.get_paths()["purelib"])
    shelf = dest / "image-site"
    shelf.mkdir(exist_ok=True)
    wanted = image_packages() | {"pip"}
    for dist in metadata.distributions():
        if normalize(dist.metadata["Name"]) not in wanted:
            continue
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            source, link = base_pip / top, shelf / top
            if source.exists() and not link.exists() and top != "__pycache__":
                link.symlink_to(source)
    site = subprocess.run([str(dest / "bin" / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "_image.pth").write_text(str(shelf) + "\n")
    return dest / "bin" / "python"


if __name__ == "__main__":
    print(make(Path(sys.argv[1]).resolve()))
