"""Notebook 05's exercise checkers accept the reference solutions and reject planted mistakes, naming them."""
import pytest
import torch

from labsrc.core.exercises import ExerciseFailed, load_solution
from labsrc.lessons.mixed_precision import exercises as checkers


def test_scaled_step_solution_passes(capsys):
    checkers.check_scaled_step(load_solution("mixed_precision", "scaled_step"))
    assert "passed" in capsys.readouterr().out


def _unscaled(model, scale):
    gradients = [p.grad for p in model.parameters() if p.grad is not None]
    for gradient in gradients:
        gradient.div_(scale)
    return all(torch.isfinite(gradient).all() for gradient in gradients)


def _grow(state, interval_reached):
    state["clean_steps"] += 1
    if interval_reached(state):
        state["scale"] *= 2.0
        state["clean_steps"] = 0


def never_skips(model, optimizer, loss, state):
    (loss * state["scale"]).backward()
    _unscaled(model, state["scale"])
    optimizer.step()
    _grow(state, lambda s: s["clean_steps"] == s["growth_interval"])


def backs_off_without_skipping(model, optimizer, loss, state):
    (loss * state["scale"]).backward()
    finite = _unscaled(model, state["scale"])
    optimizer.step()
    if not finite:
        state["scale"] *= 0.5
        state["clean_steps"] = 0
        return
    _grow(state, lambda s: s["clean_steps"] == s["growth_interval"])


def steps_before_unscaling(model, optimizer, loss, state):
    (loss * state["scale"]).backward()
    if not all(torch.isfinite(p.grad).all() for p in model.parameters()):
        state["scale"] *= 0.5
        state["clean_steps"] = 0
        return
    optimizer.step()
    _grow(state, lambda s: s["clean_steps"] == s["growth_interval"])


def _checked_step(model, optimizer, loss, state, interval_reached, reset_on_overflow=True):
    (loss * state["scale"]).backward()
    if not _unscaled(model, state["scale"]):
        state["scale"] *= 0.5
        if reset_on_overflow:
            state["clean_steps"] = 0
        return
    optimizer.step()
    _grow(state, interval_reached)


def grows_every_clean_step(model, optimizer, loss, state):
    _checked_step(model, optimizer, loss, state, lambda s: True)


def keeps_the_count_across_overflows(model, optimizer, loss, state):
    _checked_step(model, optimizer, loss, state, lambda s: s["clean_steps"] == s["growth_interval"],
                  reset_on_overflow=False)


def never_backs_off(model, optimizer, loss, state):
    (loss * state["scale"]).backward()
    if not _unscaled(model, state["scale"]):
        return
    optimizer.step()
    _grow(state, lambda s: s["clean_steps"] == s["growth_interval"])


def never_scales_the_loss(model, optimizer, loss, state):
    loss.backward()
    if not _unscaled(model, state["scale"]):
        state["scale"] *= 0.5
        state["clean_steps"] = 0
        return
    optimizer.step()
    _grow(state, lambda s: s["clean_steps"] == s["growth_interval"])


def never_restarts_the_count_after_growth(model, optimizer, loss, state):
    (loss * state["scale"]).backward()
    if not _unscaled(model, state["scale"]):
        state["scale"] *= 0.5
        state["clean_steps"] = 0
        return
    optimizer.step()
    state["clean_steps"] += 1
    if state["clean_steps"] == state["growth_interval"]:
        state["scale"] *= 2.0  # the count runs on past growth_interval and never equals it again


def checks_the_loss_not_the_gradients(model, optimizer, loss, state):
    (loss * state["scale"]).backward()
    _unscaled(model, state["scale"])
    if not torch.isfinite(loss):
        state["scale"] *= 0.5
        state["clean_steps"] = 0
        return
    optimizer.step()
    _grow(state, lambda s: s["clean_steps"] == s["growth_interval"])


@pytest.mark.parametrize("wrong, named", [
    (never_skips, "not skipping on inf"),
    (never_restarts_the_count_after_growth, "restart the count from 0 after each growth"),
    (checks_the_loss_not_the_gradients, "not the loss: a finite loss can still overflow in backward"),
    (backs_off_without_skipping, "backed off .* without skipping"),
    (steps_before_unscaling, "too large: optimizer.step\\(\\) ran on gradients still multiplied"),
    (grows_every_clean_step, "growing too early"),
    (keeps_the_count_across_overflows, "growing too early"),
    (never_backs_off, "did not back off"),
    (never_scales_the_loss, "loss was never multiplied"),
])
def test_scaled_step_mistakes_are_named(wrong, named):
    with pytest.raises(ExerciseFailed, match=named):
        checkers.check_scaled_step(wrong)


def test_clip_after_unscale_solution_passes(capsys):
    checkers.check_clip_after_unscale(load_solution("mixed_precision", "clip_after_unscale"))
    assert "passed" in capsys.readouterr().out


def clips_scaled_gradients(model, optimizer, scaler, loss, max_norm):
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()


def never_clips(model, optimizer, scaler, loss, max_norm):
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()


def plain_optimizer_step(model, optimizer, scaler, loss, max_norm):
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    scaler.update()


def never_scales_the_loss_before_clipping(model, optimizer, scaler, loss, max_norm):
    loss.backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()


def forgets_update(model, optimizer, scaler, loss, max_norm):
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)


@pytest.mark.parametrize("wrong, named", [
    (clips_scaled_gradients, "clipped the scaled gradients"),
    (never_clips, "nothing was clipped"),
    (plain_optimizer_step, "not optimizer.step\\(\\)"),
    (forgets_update, "scaler.update\\(\\)"),
    (never_scales_the_loss_before_clipping, "the loss was never scaled"),
])
def test_clip_after_unscale_mistakes_are_named(wrong, named):
    with pytest.raises(ExerciseFailed, match=named):
        checkers.check_clip_after_unscale(wrong)
