"""Reference solutions of notebook 05's exercises (a GradScaler step by hand; clipping after unscale_)."""
import torch


def scaled_step(model, optimizer, loss, state):
    """Scale, backward, unscale, then skip and back off on inf/NaN, or step and grow after growth_interval clean steps.

    state: {"scale": float, "growth_interval": int, "clean_steps": int}, updated in place.
    """
    (loss * state["scale"]).backward()
    gradients = [p.grad for p in model.parameters() if p.grad is not None]
    for gradient in gradients:
        gradient.div_(state["scale"])
    if not all(torch.isfinite(gradient).all() for gradient in gradients):
        state["scale"] *= 0.5  # back off, skip the step, restart the count
        state["clean_steps"] = 0
        return
    optimizer.step()
    state["clean_steps"] += 1
    if state["clean_steps"] == state["growth_interval"]:
        state["scale"] *= 2.0
        state["clean_steps"] = 0


def clip_after_unscale(model, optimizer, scaler, loss, max_norm):
    """One fp16 step with GradScaler whose gradient is clipped to max_norm in true (unscaled) units."""
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
