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


def test_fused_attention_drops_the_score_term_llama_2_7b_at_4k():
    """Llama 2 7B: s = 4096, b = 1, h = 4096, a = 32, L = 32, no recomputation.
    Eager (the paper): sbh (34 + 5as/h) = 4096 * 4096 * (34 + 5 * 32 * 4096 / 4096) = 16,777,216 * 194
    = 3,254,779,904 bytes a layer; x 32 = 104,152,956,928 (the 104 GB of the unfused count).
    Fused (sdpa): 16,777,216 * 34 = 570,425,344, plus the log-sum-exp 4 a s b = 4 * 32 * 4096 = 524,288:
    570,949,632 a layer; x 32 = 18,270,388,224 (about 18 GB, what a FlashAttention run keeps)."""
    model = calculator.PRESETS["7B"]
    eager = calculator.per_rank(calculator.Setup(model, gpus=1, attention="eager"))
    fused = calculator.per_rank(calculator.Setup(model, gpus=1))  # sdpa is the default
    assert eager["activations"] == 104_152_956_928
    assert fused["activations"] == 18_270_388_224
    # Selective recomputation removes the same term, with no log-sum-exp kept: 570,425,344 x 32 = 18,253,611,008.
    assert calculator.per_rank(calculator.Setup(model, gpus=1, recompute="selective"))["activations"] == 18_253_611_008


def test_logits_and_loss_llama_2_7b_and_llama_3_2_1b():
    """6 s b V: 16-bit logits (2 sbV) live while the loss keeps its fp32 log-softmax (4 sbV).
    7B: 6 * 4096 * 1 * 32000 = 786,432,000 bytes. 1B (V = 128,256): 6 * 4096 * 128,256 = 24,576 * 128,256 = 3,152,019,456
    (the 2.10 GB log-softmax + 1.05 GB of bf16 logits measured for that preset). TP 8 cuts them by vocabulary:
    786,432,000 / 8 = 98,304,000. With a pipeline they sit on the last stage, not on the first one reported."""
    assert calculator.per_rank(calculator.Setup(calculator.PRESETS["7B"], gpus=1))["logits"] == 786_432_000
    assert calculator.per_rank(calculator.Setup(calculator.PRESETS["1B"], gpus=1))["logits"] == 3_152_019_456
    assert calculator.per_rank(calculator.Setup(calculator.PRESETS["7B"], gpus=8, tensor_parallel=8))["logits"] == 98_304_000
    assert calculator.per_rank(calculator.Setup(calculator.PRESETS["7B"], gpus=8, pipeline_parallel=4))["logits"] == 0


def test_zero3_holds_two_gathered_units_and_one_unsharded_gradient():
    """7B layer: q, o 2 * 4096^2 = 33,554,432; k, v (32 kv heads of 128) 2 * 4096 * 4096 = 33,554,432; MLP
    3 * 4096 * 11008 = 135,266,304; norms 2 * 4096 = 8,192: 202,383,360 parameters, more than the embedding
    (32000 * 4096 = 131,072,000). Working set (2 * 2 + 2) * 202,383,360 = 1,214,300,160 bytes; with fp32
    gradients (2 * 2 + 4) * 202,383,360 = 1,619,066,880.
    1B: layer 2 * 2048^2 + 2 * 2048 * 512 + 3 * 2048 * 8192 + 4096 = 60,821,504 < embedding 128,256 * 2048
    = 262,668,288, so the embedding is the largest unit: 6 * 262,668,288 = 1,576,009,728.
    Stages 0-2 gather nothing; neither does stage 3 on one data-parallel rank."""
    seven, one = calculator.PRESETS["7B"], calculator.PRESETS["1B"]
    assert seven.layer_parameters() == 202_383_360 and one.layer_parameters() == 60_821_504
    assert calculator.per_rank(calculator.Setup(seven, gpus=8, zero_stage=3))["gathered"] == 1_214_300_160
    assert calculator.per_rank(calculator.Setup(seven, gpus=8, zero_stage=3, layout="fp32 grads"))["gathered"] == 1_619_066_880
    assert calculator.per_rank(calculator.Setup(one, gpus=8, zero_stage=3))["gathered"] == 1_576_009_728
    assert calculator.per_rank(calculator.Setup(seven, gpus=8, zero_stage=2))["gathered"] == 0
    assert calculator.per_rank(calculator.Setup(seven, gpus=1, zero_stage=3))["gathered"] == 0


def test_tensor_parallel_without_sequence_parallel_keeps_the_replicated_part():
    """Korthikanti Table 2, TP only: sbh (10 + 24/t + 5as/(ht)): the 10 sbh of norms and dropouts stay whole on
    each rank. GPT-3 175B layer, s = 2048, b = 1, h = 12288, a = 96, t = 8, eager:
    25,165,824 * (10 + 3 + 5 * 96 * 2048 / (12288 * 8)) = 25,165,824 * 23 = 578,813,952 bytes (not 1/8 of
    sbh (34 + 5as/h) = 25,165,824 * 114 = 2,868,903,936, which would be 358,612,992)."""
    tp = calculator.activation_bytes_per_layer(2048, 1, 12288, 96, 8, False, "none", "eager")
    assert tp == 578_813_952
    assert calculator.activation_bytes_per_layer(2048, 1, 12288, 96, 1, False, "none", "eager") == 2_868_903_936
