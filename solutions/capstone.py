"""Reference solution of notebook 13's exercise (the scaled warm-up + cosine learning-rate schedule)."""
import math


def learning_rate(step, base_lr, base_batch, global_batch, warmup_steps, total_steps, end_lr):
    """The rate at 0-based step: ramp min(base_lr, peak) -> peak over warmup_steps, then cosine peak -> end_lr."""
    peak = base_lr * global_batch / base_batch
    if step < warmup_steps:
        first = min(base_lr, peak)
        return first + (peak - first) * step / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - 1 - warmup_steps))
    return end_lr + (peak - end_lr) * 0.5 * (1 + math.cos(math.pi * progress))
