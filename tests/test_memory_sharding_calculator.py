"""The memory calculator against its sources (the ZeRO paper's figures, published model sizes) and against
bytes measured in the lesson (model states held on ranks; activations saved by a GPT layer)."""
import pytest
import torch

from labsrc.core.forked import run_ranks
from labsrc.lessons.memory_sharding import calculator, memory, zero_runs as runs
from labsrc.lessons.memory_sharding.transformer import GPTLayer
from labsrc.lessons.memory_sharding.zero import Traffic


def test_presets_have_the_published_parameter_counts():
    assert calculator.PRESETS["7B"].parameters() == 6_738_415_616
    assert calculator.PRESETS["70B"].parameters() == 68_976_648_192
    assert calculator.PRESETS["1B"].parameters() == pytest.approx(1.236e9, rel=1e-3)


@pytest.mark.parametrize("stage, gigabytes", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_papers_figure_1(stage, gigabytes):
    """ZeRO paper, Figure 1: Psi = 7.5B, 64 data-parallel ranks, K = 12."""
    states = calculator.model_state_bytes(7.5e9, 64, stage)
    assert sum(states.values()) / 1e9 == pytest.approx(gigabytes, rel=0.02)


def test_fp32_gradient_layouts_cost_18_and_20_bytes():
    assert sum(calculator.model_state_bytes(1, 1, 0, "fp32 grads").values()) == 18
    assert sum(calculator.model_state_bytes(1, 1, 0, "bf16 + fp32 grads").values()) == 20


@pytest.mark.parametrize("tensor, pipeline", [(8, 1), (1, 4), (8, 4)])
def test_model_parallel_degrees_divide_each_gpus_model_states(tensor, pipeline):
    """TP cuts every weight matrix over t ranks (Megatron splits the embedding by vocabulary too), PP gives each stage
    L/p layers: t x p fewer bytes per GPU at the same data-parallel degree (per_rank spreads the embedding and head
    evenly over the stages, where a real first and last stage hold them)."""
    base = calculator.Setup(calculator.PRESETS["70B"], gpus=8, zero_stage=1)
    split = calculator.per_rank(calculator.Setup(calculator.PRESETS["70B"], gpus=8 * tensor * pipeline, zero_stage=1,
                                                 tensor_parallel=tensor, pipeline_parallel=pipeline))
    for category in ("parameters", "gradients", "optimizer"):
        assert split[category] == pytest.approx(calculator.per_rank(base)[category] / (tensor * pipeline), rel=1e-12)


def test_activation_variants_agree_where_they_must():
    plain = calculator.activation_bytes_per_layer(2048, 1, 4096, 32)
    assert plain == calculator.activation_bytes_per_layer(2048, 1, 4096, 32, 1, True)  # t = 1: SP changes nothing
    assert calculator.activation_bytes_per_layer(2048, 1, 4096, 32, 8, True, "selective") == 2048 * 4096 * 34 / 8
    assert calculator.activation_bytes_per_layer(2048, 1, 4096, 32, 8, True, "full") == 2 * 2048 * 4096 / 8


@pytest.mark.parametrize("s, b, h, a", [(32, 2, 64, 4), (64, 1, 128, 8), (16, 4, 64, 2)])
def test_korthikanti_formula_against_a_measured_gpt_layer(s, b, h, a):
    """Saved-tensor hooks count what a bf16 GPT layer keeps. The CPU's dropout keeps its mask in bf16 (2 bytes),
    where the paper counts 1 byte (CUDA's fused dropout keeps a bool): one byte more per mask element, 2sbh + as^2b."""
    layer = GPTLayer(h, a).to(torch.bfloat16)
    x = torch.randn(s, b, h, dtype=torch.bfloat16, requires_grad=True)
    measured = memory.saved_activation_bytes(layer, lambda: layer(x))
    formula = calculator.activation_bytes_per_layer(s, b, h, a)
    masks_in_bf16 = 2 * s * b * h + a * s * s * b
    assert measured == pytest.approx(formula + masks_in_bf16, rel=0.01)


def _held(ctx, stage):
    batches = runs.make_batches(2, 8)
    return runs.sharded_optimizer_run(ctx, stage, 2, 32, batches, 0.01, Traffic(), dtype=torch.bfloat16)["held"]


@pytest.mark.parametrize("stage", [1, 2])
def test_model_states_against_bytes_held_on_ranks(stage):
    parameters = memory.count_parameters(memory.deep_mlp(2, 32))
    expected = calculator.model_state_bytes(parameters, 2, stage)
    for held in run_ranks(_held, 2, (stage,)):
        for category, value in expected.items():
            assert held[category] == pytest.approx(value, rel=0.02), (category, held, expected)


def test_bad_setups_say_what_to_change():
    with pytest.raises(ValueError, match="multiple of 8"):
        calculator.per_rank(calculator.Setup(calculator.PRESETS["7B"], gpus=12, tensor_parallel=8))
    with pytest.raises(ValueError, match="recompute"):
        calculator.per_rank(calculator.Setup(calculator.PRESETS["7B"], gpus=8, recompute="some"))
