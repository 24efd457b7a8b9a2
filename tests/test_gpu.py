"""GPU paths: ranks sharing one GPU through gloo, one NCCL rank per GPU. Skipped, with the reason, without GPUs."""
import pytest
import torch

from labsrc import launch
from labsrc.core.world import gpu_count

needs_gpu = pytest.mark.skipif(gpu_count() < 1, reason="needs a CUDA GPU (none visible here)")
needs_two_gpus = pytest.mark.skipif(gpu_count() < 2, reason="NCCL needs one GPU per rank: 2+ GPUs required")


@needs_gpu
def test_two_gloo_ranks_share_one_gpu_with_cuda_tensors():
    result = launch.run("setup", nproc=2, backend="gloo", timeout=120, echo=False)
    assert result.summary["sum"] == 3
    assert all(r["device"].startswith("cuda") for r in result.of_kind("context"))


@needs_two_gpus
def test_nccl_one_rank_per_gpu():
    result = launch.run("setup", nproc=2, timeout=120, echo=False)
    assert result.summary["backend"] == "nccl" and result.summary["sum"] == 3


@needs_gpu
def test_nccl_refuses_more_ranks_than_gpus_before_starting():
    from labsrc.core.world import RequestError
    with pytest.raises(RequestError, match="one GPU per rank"):
        launch.run("setup", nproc=gpu_count() + 1, backend="nccl")
