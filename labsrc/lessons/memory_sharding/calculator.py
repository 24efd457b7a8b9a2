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
The activation formula is the paper's GPT layer (4h GELU MLP, LayerNorm, dropout); a Llama layer (SwiGLU with a
wider MLP, RMSNorm, no dropout) differs in the constants. Embedding, output layer and loss are left out.
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

    def parameters(self) -> int:
        head_dim = self.hidden // self.heads
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        layer = attention + 3 * self.hidden * self.ffn + 2 * self.hidden
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * layer + embeddings + self.hidden


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


def model_state_bytes(parameters: float, data_parallel: int, stage: int, layout: str = "zero") -> dict[str, float]:
    """Bytes per rank of parameters, gradients, optimizer state for `parameters` on this rank, ZeRO over dp ranks."""
    parameter, gradient, optimizer = LAYOUTS[layout]
    return {"parameters": parameter * parameters / (data_parallel if stage >= 3 else 1),
            "gradients": gradient * parameters / (data_parallel if stage >= 2 else 1),
            "optimizer": optimizer * parameters / (data_parallel if stage >= 1 else 1)}


def activation_bytes_per_layer(sequence: int, micro_batch: int, hidden: int, heads: int, tensor_parallel: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none") -> float:
    """Korthikanti et al. 2022, section 4, in 16-bit: bytes one layer keeps for backward, on one rank."""
    s, b, h, a, t = sequence, micro_batch, hidden, heads, tensor_parallel
    if recompute == "full":
        return 2 * s * b * h / (t if sequence_parallel else 1)
    attention_scores = 0 if recompute == "selective" else 5 * a * s / h
    if sequence_parallel:
        return s * b * h / t * (34 + attention_scores)
    return s * b * h * (10 + 24 / t + attention_scores / t)


def per_rank(setup: Setup) -> dict[str, float]:
    """Bytes on one GPU (the first pipeline stage, the fullest) for `setup`."""
    setup.validate()
    model = setup.model
    model_parallel = setup.tensor_parallel * setup.pipeline_parallel
    states = model_state_bytes(model.parameters() / model_parallel, setup.data_parallel, setup.zero_stage,
                               setup.layout)
    per_layer = activation_bytes_per_layer(setup.sequence, setup.micro_batch, model.hidden, model.heads,
                                           setup.tensor_parallel, setup.sequence_parallel, setup.recompute)
    layers_kept = model.layers  # 1F1B: L/p layers x p micro-batches in flight on the first stage
    states["activations"] = per_layer * layers_kept
    states["total"] = sum(states.values())
    return states


def table(setups: list[Setup], gpu: str = "H100 80GB") -> str:
    """A plain-text table, one row per set-up, in GB per GPU, and whether it fits the GPU."""
    capacity = GPUS[gpu]
    lines = [f"{'model':13} {'GPUs':>4} {'ZeRO':>4} {'TP':>2} {'PP':>2} {'SP':>3} {'mb':>3} {'seq':>5} "
             f"{'recompute':9} {'params':>7} {'grads':>7} {'optim':>7} {'activ':>7} {'total':>7}  "
             f"(GB per GPU) {gpu}"]
    for setup in setups:
        row = per_rank(setup)
        cells = " ".join(f"{row[key] / 1e9:7.1f}" for key in ("parameters", "gradients", "optimizer", "activations",
                                                              "total"))
        lines.append(f"{setup.model.name:13} {setup.gpus:4} {setup.zero_stage:4} {setup.tensor_parallel:2} "
                     f"{setup.pipeline_parallel:2} {'yes' if setup.sequence_parallel else 'no':>3} "
                     f"{setup.micro_batch:3} {setup.sequence:5} {setup.recompute:9} {cells}  "
                     f"{'fits' if row['total'] <= capacity else 'does not fit'}")
    return "\n".join(lines)


def stage_sweep(setup: Setup) -> list[Setup]:
    """The same set-up at ZeRO stages 0-3."""
    return [replace(setup, zero_stage=stage) for stage in range(4)]
