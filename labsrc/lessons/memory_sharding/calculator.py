"""Will it fit? Bytes per GPU for a transformer: parameters, gradients, optimizer state and activations.

    setup = Setup(PRESETS["7B"], gpus=8, zero_stage=3, micro_batch=1, sequence=4096, recompute="selective")
    per_rank(setup)   # {"parameters": ..., "gradients": ..., "optimizer": ..., "activations": ..., "total": ...}

Sources of every formula:
- Model states: Rajbhandari et al. 2020 (ZeRO), section 3.1: mixed-precision Adam keeps 2 (bf16/fp16 parameter)
  + 2 (its gradient) + 12 (fp32 master, momentum, variance) = 16 bytes per parameter; stage 1 divides the 12 by the
  data-parallel degree, stage 2 also the gradient, stage 3 also the parameter (section 5, Figure 1).
- Gradients accumulated in fp32 (Megatron-LM's `main_grad`; the Ultra-Scale Playbook, "Memory usage in mixed
  precision"): 2 + 4 + 12 = 18 bytes, or 20 where the bf16 gradient is kept beside the fp32 one.
- Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  section 4 and Table 2: per GPT layer in 16-bit, s b h (34 + 5 a s / h) bytes; with tensor parallelism t,
  s b h (10 + 24/t + 5 a s / (h t)); with sequence parallelism too, s b h / t (34 + 5 a s / h); selective
  recomputation (section 5: attention's QK^T, softmax, dropout and product with V recomputed) drops the
  5 a s / h term; full recomputation keeps only each layer's input, 2 s b h. Under sequence parallelism that
  input is itself cut along the sequence, so it is divided by t here (this module's reading; Table 2 lists
  2 s b h). With 1F1B pipelining over p stages the first stage keeps p micro-batches of its L/p layers: L
  layers' worth whatever p (section 4.2.3).
- Fused attention (FlashAttention, torch's scaled_dot_product_attention): the 5 a s / h term (softmax output
  2 a s^2 b, dropout mask a s^2 b, dropout output 2 a s^2 b; Korthikanti section 4.1) is never stored; backward
  recomputes it block by block (Dao et al. 2022, arXiv 2205.14135, section 3.1). The single fp32 log-sum-exp per
  row is FlashAttention-2's (Dao 2023, arXiv 2307.08691, section 3.1.1; FlashAttention-1 kept two statistics).
  That removes the 5 a s / h term with no recompute policy; the kernel keeps its output (already in the 34) and
  one fp32 log-sum-exp per row and head, 4 a s b bytes. Checked on torch's CPU kernel in the lesson.
- The logits and the loss (the output layer, on the last pipeline stage): the 16-bit logits, 2 s b V bytes, live
  while the loss is computed, and the fp32 log-softmax the cross-entropy keeps for backward, 4 s b V bytes; under
  tensor parallelism both are cut by vocabulary (Megatron's vocab-parallel cross-entropy, torch's loss_parallel).
- ZeRO-3's working set: besides its shards, a rank holds the unit it computes with gathered in full, the next unit
  gathered ahead of time (FSDP2's implicit prefetch, torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py),
  and in backward that unit's unsharded gradient before the reduce-scatter: 2 x 2 + g bytes per parameter of the
  largest unit (a layer, or the embedding where the vocabulary is large), g the layout's gradient bytes.
  Not counted: the root unit (embedding, final norm, head) stays gathered from forward to the end of backward
  under fully_shard's default, its head gradient unsharded until the final reduce-scatter, and an fp32
  reduce_dtype copies each gradient at 4 bytes a parameter (_fsdp_state.py, _fsdp_collectives.py). For 7B that
  adds roughly 2-3 GB (about 3.6 GB in all, not 1.2 GB): the zero3 column is a lower bound.
The activation formula is the paper's GPT layer (4h GELU MLP, LayerNorm, dropout); a Llama layer (SwiGLU with a
wider MLP, RMSNorm, no dropout) differs in the constants.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelShape:
    """A Llama-style decoder: grouped-query attention, SwiGLU MLP (three matrices), RMSNorm."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    """The MLP's inner width."""
    vocab: int
    tied: bool
    """The output head shares the embedding's matrix."""
    source: str

    def layer_parameters(self) -> int:
        """One decoder layer: q and o (h x h), k and v (h x kv_heads head_dim), three MLP matrices, two norms."""
        head_dim = self.hidden // self.heads
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        return attention + 3 * self.hidden * self.ffn + 2 * self.hidden

    def parameters(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * self.layer_parameters() + embeddings + self.hidden


PRESETS = {  # shapes from each model's config.json on the Hugging Face Hub
    "1B": ModelShape("Llama 3.2 1B", 16, 2048, 32, 8, 8192, 128256, True, "meta-llama/Llama-3.2-1B config.json"),
    "7B": ModelShape("Llama 2 7B", 32, 4096, 32, 32, 11008, 32000, False, "meta-llama/Llama-2-7b-hf config.json"),
    "70B": ModelShape("Llama 2 70B", 80, 8192, 64, 8, 28672, 32000, False, "meta-llama/Llama-2-70b-hf config.json"),
}

GPUS = {"A100 40GB": 40e9, "A100 80GB": 80e9, "H100 80GB": 80e9, "H200 141GB": 141e9, "RTX 4090 24GB": 24e9}
"""The data sheet's figure read as decimal GB (1e9 bytes, the unit the table prints): a conservative bound. The
memory itself comes in binary units (an A100 or H100 "80GB" holds 80 GiB, 85.9e9 bytes), of which the CUDA
context and the caching allocator's fragmentation take some."""

LAYOUTS = {  # bytes per parameter: (parameter, gradient, optimizer state)
    "zero": (2, 2, 12),             # ZeRO paper: bf16 parameter and gradient, fp32 master + Adam's two moments
    "fp32 grads": (2, 4, 12),       # gradients accumulated in fp32 (Megatron main_grad): 18
    "bf16 + fp32 grads": (2, 6, 12),  # the bf16 gradient kept beside the fp32 one: 20
}

RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("sdpa", "eager")
"""sdpa: a fused kernel (FlashAttention, scaled_dot_product_attention) that stores no s x s tensor; eager: the
paper's softmax(QK^T) with dropout, every s x s tensor kept for backward."""


@dataclass(frozen=True)
class Setup:
    """One training set-up; every field is what a launcher or config would name."""

    model: ModelShape
    gpus: int
    zero_stage: int = 0
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    sequence_parallel: bool = False
    micro_batch: int = 1
    sequence: int = 4096
    recompute: str = "none"
    layout: str = "zero"
    attention: str = "sdpa"

    @property
    def data_parallel(self) -> int:
        return self.gpus // (self.tensor_parallel * self.pipeline_parallel)

    def validate(self) -> None:
        model_parallel = self.tensor_parallel * self.pipeline_parallel
        if self.gpus < 1 or self.gpus % model_parallel:
            raise ValueError(f"{self.gpus} GPUs do not split into tensor x pipeline = {model_parallel} groups: "
                             f"choose a multiple of {model_parallel}.")
        if self.model.heads % self.tensor_parallel or self.model.kv_heads % self.tensor_parallel:
            raise ValueError(f"tensor parallel {self.tensor_parallel} must divide the {self.model.heads} heads and "
                             f"{self.model.kv_heads} key/value heads of {self.model.name}.")
        if self.model.layers % self.pipeline_parallel:
            raise ValueError(f"pipeline parallel {self.pipeline_parallel} must divide {self.model.layers} layers.")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage {self.zero_stage}: choose 0 (plain data parallel), 1, 2 or 3.")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute {self.recompute!r}: choose one of {RECOMPUTE}.")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r}: choose one of {tuple(LAYOUTS)}.")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention {self.attention!r}: choose one of {ATTENTION}.")


def model_state_bytes(parameters: float, data_parallel: int, stage: int, layout: str = "zero") -> dict[str, float]:
    """Bytes per rank of parameters, gradients, optimizer state for `parameters` on this rank, ZeRO over dp ranks."""
    parameter, gradient, optimizer = LAYOUTS[layout]
    return {"parameters": parameter * parameters / (data_parallel if stage >= 3 else 1),
            "gradients": gradient * parameters / (data_parallel if stage >= 2 else 1),
            "optimizer": optimizer * parameters / (data_parallel if stage >= 1 else 1)}


def activation_bytes_per_layer(sequence: int, micro_batch: int, hidden: int, heads: int, tensor_parallel: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none",
                               attention: str = "eager") -> float:
    """Korthikanti et al. 2022, section 4, in 16-bit: bytes one layer keeps for backward, on one rank.
    attention="sdpa": a fused kernel keeps no s x s tensor (no 5as/h term) but a fp32 log-sum-exp, 4 a s b."""
    s, b, h, a, t = sequence, micro_batch, hidden, heads, tensor_parallel
    if recompute == "full":
        return 2 * s * b * h / (t if sequence_parallel else 1)
    fused = attention == "sdpa"
    attention_scores = 0 if recompute == "selective" or fused else 5 * a * s / h
    log_sum_exp = 4 * a * s * b / t if fused and recompute == "none" else 0  # heads are split over t ranks
    if sequence_parallel:
        return s * b * h / t * (34 + attention_scores) + log_sum_exp
    return s * b * h * (10 + 24 / t + attention_scores / t) + log_sum_exp


def logit_bytes(sequence: int, micro_batch: int, vocab: int, tensor_parallel: int = 1) -> float:
    """The output layer's peak: 16-bit logits (2 s b V) alive while the loss keeps its fp32 log-softmax (4 s b V);
    cut by vocabulary over the tensor-parallel ranks."""
    return 6 * sequence * micro_batch * vocab / tensor_parallel


def gathered_unit_bytes(model: ModelShape, tensor_parallel: int = 1, layout: str = "zero") -> float:
    """ZeRO-3's working set: the largest unit gathered (16-bit), the next one prefetched, and the unit's unsharded
    gradient before its reduce-scatter (the layout's gradient bytes)."""
    parameter, gradient, _ = LAYOUTS[layout]
    largest_unit = max(model.layer_parameters(), model.vocab * model.hidden) / tensor_parallel
    return (2 * parameter + gradient) * largest_unit


def per_rank(setup: Setup) -> dict[str, float]:
    """Bytes on one GPU (the first pipeline stage, the fullest) for `setup`: model states, activations, logits
    (on the one stage when there is no pipeline; the last stage holds them, with L/p layers of one micro-batch)
    and ZeRO-3's gathered units."""
    setup.validate()
    model = setup.model
    model_parallel = setup.tensor_parallel * setup.pipeline_parallel
    states = model_state_bytes(model.parameters() / model_parallel, setup.data_parallel, setup.zero_stage,
                               setup.layout)
    per_layer = activation_bytes_per_layer(setup.sequence, setup.micro_batch, model.hidden, model.heads,
                                           setup.tensor_parallel, setup.sequence_parallel, setup.recompute,
                                           setup.attention)
    layers_kept = model.layers  # 1F1B: L/p layers x p micro-batches in flight on the first stage
    states["activations"] = per_layer * layers_kept
    states["logits"] = (logit_bytes(setup.sequence, setup.micro_batch, model.vocab, setup.tensor_parallel)
                        if setup.pipeline_parallel == 1 else 0.0)
    states["gathered"] = (gathered_unit_bytes(model, setup.tensor_parallel, setup.layout)
                          if setup.zero_stage == 3 and setup.data_parallel > 1 else 0.0)
    states["total"] = sum(states.values())
    return states


def table(setups: list[Setup], gpu: str = "H100 80GB") -> str:
    """A plain-text table, one row per set-up, in GB per GPU, and whether it fits the GPU."""
    capacity = GPUS[gpu]
    lines = [f"{'model':13} {'GPUs':>4} {'ZeRO':>4} {'TP':>2} {'PP':>2} {'SP':>3} {'mb':>3} {'seq':>5} "
             f"{'recompute':9} {'attn':5} {'params':>7} {'grads':>7} {'optim':>7} {'activ':>7} {'logits':>7} {'zero3':>7} {'total':>7}  "
             f"(GB per GPU) {gpu}"]
    for setup in setups:
        row = per_rank(setup)
        cells = " ".join(f"{row[key] / 1e9:7.1f}" for key in ("parameters", "gradients", "optimizer", "activations",
                                                              "logits", "gathered", "total"))
        lines.append(f"{setup.model.name:13} {setup.gpus:4} {setup.zero_stage:4} {setup.tensor_parallel:2} "
                     f"{setup.pipeline_parallel:2} {'yes' if setup.sequence_parallel else 'no':>3} "
                     f"{setup.micro_batch:3} {setup.sequence:5} {setup.recompute:9} {setup.attention:5} {cells}  "
                     f"{'fits' if row['total'] <= capacity else 'does not fit'}")
    return "\n".join(lines)


def stage_sweep(setup: Setup) -> list[Setup]:
    """The same set-up at ZeRO stages 0-3."""
    return [replace(setup, zero_stage=stage) for stage in range(4)]
