"""The benchmark command: documented options, valid JSON on a CPU and under torchrun, FLOPs, compile fallback."""
import json

import pytest
import torch
from torch import nn

from labsrc import bench
from labsrc.training import benchmark
from labsrc.training.models import build_model

PHASES = {"data_s", "forward_s", "backward_s", "communication_s", "optimizer_s", "step_s"}
SMALL = ["--image-size", "8", "--batch-size", "8", "--steps", "2", "--warmup", "1"]


def test_help_documents_every_option(capsys):
    with pytest.raises(SystemExit) as exit_code:
        bench.main(["--help"])
    text = capsys.readouterr().out
    assert exit_code.value.code == 0 and text.startswith("usage: python -m labsrc.bench")
    for action in bench.parser()._actions:
        for flag in action.option_strings:
            assert flag in text, f"{flag} missing from --help"
        assert action.help, f"{action.option_strings} has no help"


def test_run_writes_valid_json(tmp_path):  # on the CPU here; on the GPU where one is visible
    out = tmp_path / "result.json"
    assert bench.main([*SMALL, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    split = result["split"]
    assert set(split) == PHASES and split["communication_s"] == 0.0 and not result["ddp"]
    assert split["step_s"] == pytest.approx(sum(v for k, v in split.items() if k != "step_s"))
    assert result["images_per_s"] == pytest.approx(8 / split["step_s"])
    assert len(result["steps"]) == 2 and result["config"]["batch_size"] == 8
    on_gpu = torch.cuda.is_available()
    assert result["provenance"]["torch"] == torch.__version__
    assert result["provenance"]["device"] == ("cuda:0" if on_gpu else "cpu")
    if on_gpu:  # the peak is looked up by the GPU's name (None for a GPU the table lacks)
        assert result["peak_memory_kind"] == "CUDA allocated" and result["peak_memory_bytes"] > 0
        assert (result["mfu"] is None) == (result["peak_tflops"] is None)
    else:
        assert result["mfu"] is None and result["peak_tflops"] is None
        assert result["peak_memory_kind"].startswith("process peak RSS") and result["peak_memory_bytes"] > 2**20


def test_world_size_two_runs_under_torchrun_with_ddp(tmp_path, monkeypatch):
    monkeypatch.setenv("LABSRC_RUNS", str(tmp_path / "runs"))
    out = tmp_path / "result.json"
    assert bench.main([*SMALL, "--world-size", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["ddp"] and "no_sync" in result["communication_method"]
    assert set(result["split"]) == PHASES and result["split"]["communication_s"] >= 0.0
    assert all("local_backward_s" in row for row in result["steps"]), "DDP steps time backward without sync too"
    assert result["images_per_s"] == pytest.approx(2 * 8 / result["split"]["step_s"])


def test_flops_of_a_linear_layer_are_six_batch_in_out():
    model = nn.Sequential(nn.Linear(32, 8, bias=False))
    flops = benchmark.count_flops(model, torch.randn(4, 32), torch.randint(8, (4,)), "fp32")
    assert flops == 6 * 4 * 32 * 8 - 2 * 4 * 32 * 8  # the first layer needs no gradient for its input


def test_a_step_counts_the_backward_about_twice_the_forward():
    """MFU's numerator is forward + backward: a weight gradient and an input gradient per layer, each as large as the forward."""
    model = nn.Sequential(nn.Linear(32, 8, bias=False))
    images, labels = torch.randn(4, 32), torch.randint(8, (4,))
    assert benchmark.count_forward_flops(model, images, labels, "fp32") == 2 * 4 * 32 * 8
    with torch.device("meta"):
        cnn = build_model("tiny_cnn")
    images, labels = torch.randn(8, 3, 16, 16, device="meta"), torch.randint(10, (8,), device="meta")
    forwards = benchmark.count_flops(cnn, images, labels, "fp32") / benchmark.count_forward_flops(cnn, images, labels, "fp32")
    assert 2 < forwards <= 3, f"a step should be 2 to 3 forwards in FLOPs (the first layer has no input gradient): {forwards}"


def test_flops_counted_on_meta_equal_flops_computed():
    torch.manual_seed(0)
    images, labels = torch.randn(4, 3, 8, 8), torch.randint(10, (4,))
    real = benchmark.count_flops(build_model("tiny_cnn"), images, labels, "fp32")
    with torch.device("meta"):
        model = build_model("tiny_cnn")
    counted = benchmark.count_flops(model, images.to("meta"), labels.to("meta"), "bf16")
    assert counted == real > 0


def test_compile_failure_falls_back_to_eager(capsys):
    model = nn.Linear(4, 2)
    same, compiled, reason = benchmark.compile_or_fallback(model, True, "no_such_backend", torch.randn(2, 4))
    assert same is model and not compiled and "no_such_backend" in reason
    assert "falling back to eager" in capsys.readouterr().out


def test_compile_that_works_is_used():
    model = nn.Linear(4, 2)
    result, compiled, reason = benchmark.compile_or_fallback(model, True, "eager", torch.randn(2, 4))
    assert compiled and reason == "compiled" and result is not model
    torch.testing.assert_close(result(torch.ones(1, 4)), model(torch.ones(1, 4)))


def test_peak_lookup():
    assert benchmark.peak_tflops(torch.device("cpu"), "bf16") is None
    assert benchmark.peak_tflops(torch.device("cpu"), "bf16", given=1.5) == 1.5
    assert benchmark.lookup_peak("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert benchmark.lookup_peak("NVIDIA H100 PCIe", "tf32") == 378.0
    assert benchmark.lookup_peak("NVIDIA H100 NVL", "bf16") == 835.5
    assert benchmark.lookup_peak("NVIDIA H200", "fp32") == 67.0
    assert benchmark.lookup_peak("NVIDIA A100-SXM4-80GB", "tf32") == 156.0
    assert benchmark.lookup_peak("Tesla T4", "bf16") is None


def test_in_process_run_matches_the_command_line_options():
    result = bench.run_in_process(" ".join(SMALL) + " --channels-last --data loader")
    assert result["config"]["channels_last"] and result["config"]["data"] == "loader" and result["world_size"] == 1
    with pytest.raises(ValueError, match="main"):
        bench.run_in_process(["--world-size", "2"])


def test_timed_steps_bring_images_to_the_memory_format():
    seen = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1)

        def forward(self, images):
            seen.append(images.is_contiguous(memory_format=torch.channels_last))
            return self.conv(images).mean((2, 3))

    model = Probe().to(memory_format=torch.channels_last)
    batches = iter([(torch.randn(2, 3, 4, 4), torch.randint(4, (2,)))] * 3)  # NCHW, as a DataLoader gives them
    rows = benchmark.timed_steps(model, batches, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"),
                                   "fp32", steps=2, warmup=1, memory_format=torch.channels_last)
    assert seen == [True, True, True] and len(rows) == 2
    assert set(rows[0]) == {"data_s", "forward_s", "backward_s", "optimizer_s"}


@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "0"], "batch_size must be more than 0"), (["--world-size", "0"], "world_size must be more than 0"),
    (["--steps", "0"], "steps must be more than 0"), (["--warmup", "-1"], "warmup must be 0 or more"),
    (["--rounds", "0"], "rounds must be more than 0"), (["--peak-tflops", "0"], "peak_tflops must be more than 0"),
    (["--num-workers", "-2"], "num_workers must be 0 or more"), (["--num-workers", "2"], "add --data loader"),
    (["--image-size", "2"], "image_size must be at least 4"), (["--model", "vgg"], "model 'vgg' is unknown"),
    (["--precision", "fp8"], "precision 'fp8' is unknown"), (["--data", "disk"], "data 'disk' is unknown"),
    (["--backend", "mpi"], "backend 'mpi' is unknown"), (["--batch-size", "many"], "invalid int value"),
    (["--compare-loop", "--world-size", "2"], "drop world_size and ddp"),
    (["--world-size", "64"], "CPU ranks"), (["--backend", "nccl", "--world-size", "2"], "NCCL needs CUDA GPUs"),
])
def test_bad_options_exit_2_before_any_work(argv, message, capsys):
    from labsrc.core.hardware import simulated
    with pytest.raises(SystemExit) as exit_code:
        bench.main(argv, hardware=simulated(gpus=0, cpus=2))
    assert exit_code.value.code == 2 and message in capsys.readouterr().err


def test_out_that_is_a_folder_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_code:
        bench.main([*SMALL, "--out", str(tmp_path)])
    assert exit_code.value.code == 2 and "is a folder" in capsys.readouterr().err


def test_command_line_bad_value_exits_2_without_traceback():
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "labsrc.bench", "--batch-size", "0"], capture_output=True, text=True)
    assert done.returncode == 2 and "batch_size must be more than 0" in done.stderr
    assert "Traceback" not in done.stderr


def test_device_and_rank_limit_follow_the_given_hardware():
    from labsrc.core.hardware import simulated
    from labsrc.lessons.performance_scaling.lab_bench import Options
    assert bench.device_for(simulated(gpus=2)) == torch.device("cuda", 0)
    assert bench.device_for(simulated(gpus=0)) == torch.device("cpu")
    bench.check_request(Options.make(world_size=8), simulated(gpus=8))  # one NCCL rank per GPU: fine
    with pytest.raises(ValueError, match="CPU ranks"):
        bench.check_request(Options.make(world_size=8), simulated(gpus=0, cpus=2))


def test_ddp_at_world_size_one_runs_in_a_world_of_one():
    import torch.distributed as dist
    result = bench.measure(bench.Options.make(image_size=8, batch_size=8, steps=2, warmup=1, ddp=True),
                           bench.detect())
    assert result["ddp"] and result["world_size"] == 1 and not dist.is_initialized()
    assert all("local_backward_s" in row for row in result["steps"])
