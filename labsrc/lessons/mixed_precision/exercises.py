"""Checkers for notebook 05's exercises: a GradScaler step written by hand, and clipping after unscale_."""
from __future__ import annotations

from typing import Callable

import torch
from torch.nn import functional as F

from labsrc.core.exercises import ExerciseFailed, passed
from labsrc.lessons.mixed_precision.precision import gradient_norm, small_model, toy_batch

INIT_SCALE = 2.0**8
GROWTH_INTERVAL = 2
FORWARD_OVERFLOW_STEPS = (3, 4)  # an input x 1e5 overflows fp16 in the forward: the loss and gradients inf/NaN
BACKWARD_OVERFLOW_STEPS = (10,)  # a finite loss x 2^16: only the scaled gradients overflow fp16, in backward
OVERFLOW_STEPS = FORWARD_OVERFLOW_STEPS + BACKWARD_OVERFLOW_STEPS
STEPS = 14  # clean runs of 3, 5 and 3 steps: a run longer than 2 x GROWTH_INTERVAL tests the count's restart
BACKWARD_OVERFLOW_FACTOR = 2.0**16
MAX_NORM = 0.1  # below the true gradient norm of the first batch (about 0.3): clipping must engage
CLIP_SCALE = 2.0**12


def fp16_loss(model: torch.nn.Module, step: int, overflow: bool, factor: float = 1.0) -> torch.Tensor:
    """factor x cross-entropy of batch `step` under fp16 autocast on the CPU (a 0-dim fp32 tensor); overflow
    multiplies the input by 1e5. A large factor keeps the loss finite while its scaled gradients overflow."""
    images, labels = toy_batch(seed=step)
    if overflow:
        images = images * 1e5
    with torch.amp.autocast(device_type="cpu", dtype=torch.float16):
        return F.cross_entropy(model(images), labels) * factor


def scaled_step_loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    """The loss check_scaled_step hands over at `step`: clean, overflowing in forward, or only in backward."""
    factor = BACKWARD_OVERFLOW_FACTOR if step in BACKWARD_OVERFLOW_STEPS else 1.0
    return fp16_loss(model, step, step in FORWARD_OVERFLOW_STEPS, factor)


def _snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _changed(before: list[torch.Tensor], model: torch.nn.Module) -> bool:
    return any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def _update_norm(before: list[torch.Tensor], model: torch.nn.Module) -> float:
    """Norm of the parameters' change over one step: lr x the norm of the gradient the optimizer applied."""
    return torch.linalg.vector_norm(torch.cat([(p.detach() - b).reshape(-1)
                                               for b, p in zip(before, model.parameters())])).item()


def _close(value: float, target: float, tolerance: float = 0.01) -> bool:
    return abs(value - target) <= tolerance * abs(target)


def _update_verdict(step: int, learner: float, reference: float, scale: float) -> str:
    """Name why the learner's update differs from GradScaler's (learner, reference: norms of the change)."""
    if reference and _close(learner / reference, scale):
        return (f"step {step}: the update is {scale:g}x (the loss scale) too large: optimizer.step() ran on "
                "gradients still multiplied by the scale. Unscale first: divide every .grad by the scale before "
                "optimizer.step().")
    if reference and _close(learner / reference, 1 / scale):
        return (f"step {step}: the update is {scale:g}x (the loss scale) too small: the gradients were divided by "
                "the scale, but the loss was never multiplied by it before backward().")
    return f"step {step}: the parameters differ from torch.amp.GradScaler's after the same step."


def _overflow_verdict(step: int, stepped: bool, scale: float, expected: float) -> str | None:
    """At a step whose gradients hold inf/NaN: the optimizer must be skipped and the scale halved."""
    if stepped and scale == expected:
        return (f"step {step}: you backed off (halved the scale) without skipping: the gradients held inf/NaN, yet "
                "optimizer.step() ran and the parameters changed. Skip optimizer.step() when any gradient is not "
                "finite.")
    if stepped:
        return (f"step {step}: not skipping on inf/NaN: the gradients held inf/NaN and optimizer.step() ran anyway. "
                "Check every gradient (not the loss: a finite loss can still overflow in backward) with "
                "torch.isfinite; if any is not finite, skip the step and halve the scale.")
    if scale != expected:
        return (f"step {step}: skipped the step but did not back off: the scale is {scale:g}, GradScaler's is "
                f"{expected:g}. Multiply the scale by 0.5 at every overflow (and restart the clean-step count).")
    return None


def _scale_verdict(step: int, scale: float, expected: float) -> str | None:
    if scale > expected:
        return (f"step {step}: growing too early: your scale is {scale:g}, GradScaler's {expected:g}. Double the "
                f"scale only after growth_interval ({GROWTH_INTERVAL}) clean steps in a row, counting from 0 again "
                "after every growth and every overflow.")
    if scale < expected:
        return (f"step {step}: the scale did not grow: yours is {scale:g}, GradScaler's {expected:g}. Double it after "
                f"growth_interval ({GROWTH_INTERVAL}) clean steps in a row, and restart the count from 0 after each "
                "growth (a count left running past growth_interval never equals it again).")
    return None


def check_scaled_step(scaled_step: Callable) -> None:
    """scaled_step(model, optimizer, loss, state) against torch.amp.GradScaler, step by step.

    state: {"scale": float, "growth_interval": int, "clean_steps": int}, kept across calls. The same
    model trains twice from the same start, once with GradScaler and once with scaled_step, over
    STEPS batches of which OVERFLOW_STEPS overflow fp16 (in the forward at FORWARD_OVERFLOW_STEPS; at
    BACKWARD_OVERFLOW_STEPS the loss is finite and only its scaled gradients overflow); after each step the parameters and the
    scale must equal GradScaler's (scales are powers of two, so unscaling is exact).
    """
    reference_model, model = small_model(), small_model()
    reference_optimizer = torch.optim.SGD(reference_model.parameters(), lr=0.05)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    state = {"scale": INIT_SCALE, "growth_interval": GROWTH_INTERVAL, "clean_steps": 0}
    for step in range(STEPS):
        overflow = step in OVERFLOW_STEPS
        reference_before, before, scale_used = _snapshot(reference_model), _snapshot(model), scaler.get_scale()
        reference_optimizer.zero_grad(set_to_none=True)
        scaler.scale(scaled_step_loss(reference_model, step)).backward()
        scaler.step(reference_optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scaled_step(model, optimizer, scaled_step_loss(model, step), state)
        verdict = _step_verdict(step, overflow, before, model, reference_before, reference_model, scale_used,
                                float(state["scale"]), scaler.get_scale())
        if verdict:
            raise ExerciseFailed(verdict)
    passed(f"{STEPS} steps with overflows at {list(OVERFLOW_STEPS)}: the same parameters and the same loss scale as "
           f"torch.amp.GradScaler after every step ({INIT_SCALE:g} -> {scaler.get_scale():g})")


def _step_verdict(step, overflow, before, model, reference_before, reference_model, scale_used, scale,
                  expected) -> str | None:
    stepped = _changed(before, model)
    if overflow:
        return _overflow_verdict(step, stepped, scale, expected)
    if not stepped:
        return f"step {step}: every gradient was finite, yet the parameters did not change: call optimizer.step()."
    if not all(torch.allclose(p, q, rtol=1e-5, atol=1e-7) for p, q in zip(model.parameters(),
                                                                        reference_model.parameters())):
        return _update_verdict(step, _update_norm(before, model), _update_norm(reference_before, reference_model),
                               scale_used)
    return _scale_verdict(step, scale, expected)


def _clip_step(clip_after_unscale: Callable, model, optimizer, scaler, loss) -> None:
    try:
        clip_after_unscale(model, optimizer, scaler, loss, MAX_NORM)
    except RuntimeError as error:
        if "update()" in str(error) or "after step()" in str(error):  # GradScaler's stage checks
            raise ExerciseFailed(f"torch says \"{error}\": call scaler.update() at the end of every step, after "
                                 "scaler.step(optimizer).") from None
        raise
    except AssertionError as error:
        if "_scale is None" in str(error):  # GradScaler was asked to unscale or step a loss it never scaled
            raise ExerciseFailed("the loss was never scaled: GradScaler has no scale to undo. Start the step with "
                                 "scaler.scale(loss).backward(), not loss.backward().") from None
        raise


def check_clip_after_unscale(clip_after_unscale: Callable) -> None:
    """clip_after_unscale(model, optimizer, scaler, loss, max_norm): one fp16 step, clipped in true units.

    A clean step must move the parameters by lr x max_norm (the true norm, about 0.3, is above
    max_norm 0.1); then a step whose gradients overflow must leave them unchanged and halve the scale.
    """
    model, lr = small_model(), 0.1
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu", init_scale=CLIP_SCALE)
    before = _snapshot(model)
    _clip_step(clip_after_unscale, model, optimizer, scaler, fp16_loss(model, 0, overflow=False))
    verdict = _clip_verdict(_update_norm(before, model) / lr, _true_norm())
    if verdict:
        raise ExerciseFailed(verdict)
    before, scale_before = _snapshot(model), scaler.get_scale()
    _clip_step(clip_after_unscale, model, optimizer, scaler, fp16_loss(model, 1, overflow=True))
    if _changed(before, model):
        raise ExerciseFailed("with inf/NaN gradients the parameters changed: step with scaler.step(optimizer), "
                             "which skips optimizer.step() when unscale_ found inf or NaN, not optimizer.step().")
    if scaler.get_scale() != scale_before * 0.5:
        raise ExerciseFailed(f"after an overflow the scale is {scaler.get_scale():g}, expected {scale_before * 0.5:g}: "
                             "call scaler.update() after scaler.step(optimizer).")
    passed(f"the update had norm max_norm = {MAX_NORM} in true units, and the overflowing step was skipped with the "
           "scale halved")


def _true_norm() -> float:
    model = small_model()
    fp16_loss(model, 0, overflow=False).backward()
    return gradient_norm(model)


def _clip_verdict(applied: float, true_norm: float) -> str | None:
    """applied: norm of the gradient the optimizer applied (from the parameters' change / lr)."""
    if _close(applied, MAX_NORM, 1e-3):
        return None
    if applied == 0.0:
        return "the parameters did not change: the step must end with scaler.step(optimizer) and scaler.update()."
    if _close(applied, MAX_NORM / CLIP_SCALE):
        return (f"the update's norm is max_norm / {CLIP_SCALE:g} (the loss scale): clip_grad_norm_ clipped the scaled "
                "gradients. Call scaler.unscale_(optimizer) before clip_grad_norm_.")
    if _close(applied, true_norm):
        return (f"the update's norm is the true gradient norm {true_norm:.3f}, above max_norm {MAX_NORM}: nothing was "
                "clipped. Call clip_grad_norm_(model.parameters(), max_norm) after unscale_ and before scaler.step.")
    if _close(applied, CLIP_SCALE * MAX_NORM) or _close(applied, CLIP_SCALE * true_norm):
        return (f"the update is {CLIP_SCALE:g}x (the loss scale) too large: the optimizer stepped on scaled gradients. "
                "Unscale with scaler.unscale_(optimizer) and step with scaler.step(optimizer).")
    return f"the update's norm is {applied:.4g}, expected max_norm = {MAX_NORM} (in true units)."
