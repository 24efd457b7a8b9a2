"""`make lab` serves the repository root, opens the README rendered, offers the kernels the notebooks name (and
only those) and no news pop-up: read from the command make builds, as JupyterLab would parse it."""
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from traitlets.config import Application

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import notebook_format  # noqa: E402


@pytest.fixture(scope="module")
def lab_config():
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    dry_run = subprocess.run(["make", "-n", "-o", ".venv/.stamp-installed", "lab"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    command = next(line for line in dry_run.splitlines() if "jupyter lab" in line)
    flags = [word for word in shlex.split(command) if word.startswith("--") and "=" in word]
    app = Application()
    app.parse_command_line(flags)
    return app.config


def test_lab_serves_the_repository_root_and_opens_the_readme(lab_config):
    assert Path(lab_config.ServerApp.root_dir) == ROOT
    assert lab_config.LabApp.default_url == "/lab/tree/README.md" and (ROOT / "README.md").exists()


def test_lab_offers_exactly_the_kernels_the_notebooks_name(lab_config):
    named = {notebook_format.kernel_for(path)["name"] for path in notebook_format.course_notebooks(ROOT)}
    assert set(lab_config.KernelSpecManager.allowed_kernelspecs) == named == {"labsrc", "labsrc-tf"}
    assert lab_config.MappingKernelManager.default_kernel_name == notebook_format.COURSE_KERNEL["name"]


def test_lab_settings_open_markdown_rendered_and_ask_no_news(lab_config):
    settings = Path(lab_config.LabApp.app_settings_dir)
    overrides = json.loads((settings / "overrides.json").read_text())
    page_config = json.loads((settings / "page_config.json").read_text())
    assert overrides["@jupyterlab/docmanager-extension:plugin"]["defaultViewers"]["markdown"] == "Markdown Preview"
    assert overrides["@jupyterlab/apputils-extension:notification"] == {"checkForUpdates": False, "fetchNews": "false"}
    assert page_config["disabledExtensions"]["@jupyterlab/apputils-extension:announcements"] is True
