"""Each lesson's "Take it home" block runs as a file of its own under torchrun, without the course's package.

A notebook's markdown cell that opens with ``## Take it home`` holds one fenced Python block: the plain-torch
pattern a learner pastes into their own script. Here every such block is written to a file and started with
``torchrun --standalone --nproc-per-node=2`` (all of them at once, so the test costs one torchrun start-up), and
each must exit 0 within its timeout."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Take it home"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
TIMEOUT_S = 240  # 2 ranks of every lesson at once on 2 cores: each takes a few seconds alone


def take_home_blocks() -> dict[str, str]:
    """{notebook stem: the Python block of its "Take it home" cell}."""
    blocks = {}
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        for cell in cells:
            text = "".join(cell["source"])
            if cell["cell_type"] == "markdown" and text.startswith(HEADING):
                found = BLOCK.findall(text)
                assert len(found) == 1, f"{path.name}: its '{HEADING}' cell should hold one python block, not {len(found)}"
                blocks[path.stem] = found[0]
    return blocks


def test_every_take_home_block_is_plain_torch():
    blocks = take_home_blocks()
    assert blocks, f"no notebook has a '{HEADING}' cell"
    for name, code in blocks.items():
        assert "labsrc" not in code, f"{name}: a take-home script runs without the course's package"
        compile(code, f"{name}_take_home.py", "exec")


def test_every_take_home_block_runs_under_torchrun_on_two_ranks(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    environment["OMP_NUM_THREADS"] = "1"
    started = {}
    for name, code in take_home_blocks().items():
        script = tmp_path / f"{name}_take_home.py"
        script.write_text(code)
        log = (tmp_path / f"{name}.log").open("w")
        started[name] = subprocess.Popen([str(torchrun), "--standalone", "--nproc-per-node=2", str(script)],
                                         cwd=tmp_path, env=environment, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
    deadline = time.monotonic() + TIMEOUT_S
    failed = {}
    try:
        for name, process in started.items():
            try:
                code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = f"still running after {TIMEOUT_S} s"
            if code != 0:
                failed[name] = f"{code}: " + (tmp_path / f"{name}.log").read_text()[-1500:]
    finally:
        for process in started.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    assert not failed, "take-home scripts that did not exit 0:\n" + "\n\n".join(
        f"{name} ({why})" for name, why in failed.items())
