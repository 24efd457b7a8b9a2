"""The benchmark command: documented options, valid JSON on a CPU, FLOPs counted right, compile falls back."""
import json
import subprocess
import sys

import torch
from torch import nn

from labsrc import bench, bench_steps


def test_help_documents_every_option():
    text = subprocess.run([sys.executable, "-m", "labsrc.bench", "--help"], capture_output=True, text=True,
                          check=True).stdout
    for action in bench.parser()._actions:
        for flag in action.option_strings:
            assert flag in text
        assert action.help, f"{action.option_strings} has no help"


def test_cpu_run_writes_valid_json(tmp_path):
    out = tmp_path / "result.json"
    subprocess.run([sys.executable, "-m", "labsrc.bench", "--image-size", "16", "--batch-size", "16", "--steps", "2",
                    "--warmup", "1", "--out", str(out)], check=True, capture_output=True, text=True)
    result = json.loads(out.read_text())
    assert result["images_per_s"] > 0 and result["split"]["step_s"] > 0
    assert set(result["split"]) == {"data_s", "forward_s", "backward_s", "communication_s", "optimizer_s", "step_s"}
    assert result["provenance"]["torch"] == torch.__version__
    assert result["mfu"] is None and result["peak_memory_kind"].startswith("process peak RSS")


def test_flops_of_a_linear_layer_are_six_batch_in_out():
    model = nn.Sequential(nn.Linear(32, 8, bias=False))
    flops = bench_steps.count_flops(model, torch.randn(4, 32), torch.randint(8, (4,)), "fp32")
    assert flops == 6 * 4 * 32 * 8 - 2 * 4 * 32 * 8  # the first layer needs no gradient for its input


def test_compile_failure_falls_back_to_eager():
    model = nn.Linear(4, 2)
    same, compiled, reason = bench_steps.compile_or_fallback(model, True, "no_such_backend", torch.randn(2, 4))
    assert same is model and not compiled and "no_such_backend" in reason


def test_peak_lookup():
    assert bench_steps.peak_tflops(torch.device("cpu"), "bf16") is None
    assert bench_steps.peak_tflops(torch.device("cpu"), "bf16", given=1.5) == 1.5
