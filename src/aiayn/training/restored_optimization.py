"""The optimization a checkpoint restores, checked against the run's own before Lightning applies it: the
optimizer's parameter groups and moments, the learning-rate schedule's position and decay, and the fp16
gradient scaler (:class:`~aiayn.training.restored_state.RestoredState` calls these)."""

from __future__ import annotations

import math
from typing import Any

import pytorch_lightning as pl
import torch

from aiayn.errors import CheckpointError, is_number, whole
from aiayn.training.saved_state import COUNT_LIMIT, Fields, shape_of, short
from aiayn.training.schedule import SCHEDULE_FIELDS

# Adam's switches that change the update rule: a checkpoint must hold aiayn's values (it writes no others).
# AdamW's weight_decay (decoupled_weight_decay) is a setting instead, optim.weight_decay: this run's.
ADAM_RULE = ("weight_decay", "amsgrad", "maximize", "decoupled_weight_decay")
SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def check_optimization(checkpoint: dict[str, Any], field: Fields, module: pl.LightningModule) -> None:
    """The optimizer states and schedules of ``checkpoint`` against a fresh optimizer and schedule of
    ``module``: the same groups and parameters, Adam's rule unchanged; the switches that only pick an
    implementation (fused, foreach ...) become this run's. The settings (learning rate, betas, eps, the
    schedule) are this run's anyway (:meth:`~aiayn.training.module.TranslationModule.on_load_checkpoint`)."""
    fresh = module.configure_optimizers()
    optimizer, scheduler = fresh["optimizer"], fresh["lr_scheduler"]["scheduler"]
    expected = optimizer.state_dict()["param_groups"]
    states = field.sequence("optimizer_states", checkpoint.get("optimizer_states", []), length=1)
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    for i, state in enumerate(states):
        state = field.mapping(f"optimizer_states[{i}]", state, keys=("state", "param_groups"))
        _check_groups(field, f"optimizer_states[{i}].param_groups", state["param_groups"], expected)
        _check_moments(field, f"optimizer_states[{i}].state", state["state"], parameters)
    schedules = field.sequence("lr_schedulers", checkpoint.get("lr_schedulers", []), length=1)
    for i, schedule in enumerate(schedules):
        _check_schedule_state(field, f"lr_schedulers[{i}]", schedule, scheduler.state_dict())


def _check_groups(field: Fields, name: str, groups: Any, expected: list[dict[str, Any]]) -> None:
    """The optimizer's parameter groups against this run's (``expected``): as many, each over the same
    parameters, Adam's rule unchanged; their settings and switches become this run's, in place."""
    groups = field.sequence(name, groups)
    if {len(groups), len(expected)} == {1, 2}:  # Adam's one group against AdamW's two
        raise CheckpointError(
            f"checkpoint {field.path}: its optimizer has {len(groups)} parameter group(s), this run's "
            f"{len(expected)}: optim.weight_decay > 0 trains decayed and undecayed parameters apart, 0 "
            "all together; resume with the optim.weight_decay of the run that wrote it (0 or not)"
        )
    field.sequence(name, groups, len(expected))
    for j, (group, own) in enumerate(zip(groups, expected, strict=True)):
        group_name = f"{name}[{j}]"
        group = _with_defaults(field, group_name, group, own, essential=("params", "lr", "betas", "eps"))
        for key in ADAM_RULE:
            if key == "weight_decay" and own["decoupled_weight_decay"]:
                field.number(f"{group_name}.{key}", group[key], minimum=0)  # replaced by this run's below
            elif type(group[key]) is not type(own[key]) or group[key] != own[key]:
                raise field.error(f"{group_name}.{key}", group[key], f"is not aiayn's ({own[key]})")
        params = group["params"]
        if not isinstance(params, list) or not all(whole(index, 0) for index in params) or params != own["params"]:
            raise field.error(
                f"{group_name}.params",
                f"{len(field.sequence(f'{group_name}.params', group['params']))} entries",
                f"are not this model's {len(own['params'])} parameters",
            )
        for key in ("lr", "initial_lr", "eps"):
            field.number(f"{group_name}.{key}", group[key])
        group.update({key: value for key, value in own.items() if key not in (*ADAM_RULE, "lr", "params")})
        group["weight_decay"] = own["weight_decay"]


def _check_moments(field: Fields, name: str, moments: Any, parameters: list[torch.Tensor]) -> None:
    """Adam's moments, each of a parameter of this model and its shape, finite (the second one >= 0), with
    a step count."""
    moments = field.mapping(name, moments)
    for index, moment in moments.items():
        if not whole(index, 0) or index >= len(parameters):
            raise field.error(name, index, "is not a parameter of this model")
        moment = field.mapping(f"{name}[{index}]", moment, keys=("step", "exp_avg", "exp_avg_sq"))
        for key in ("exp_avg", "exp_avg_sq"):
            if not isinstance(moment[key], torch.Tensor) or moment[key].shape != parameters[index].shape:
                raise field.error(
                    f"{name}[{index}].{key}",
                    shape_of(moment[key]),
                    f"is not its parameter's shape {tuple(parameters[index].shape)}",
                )
            # Adam divides by sqrt(exp_avg_sq): a NaN or a negative one turns every weight into NaN.
            lowest = 0 if key == "exp_avg_sq" else -math.inf
            if not (torch.isfinite(moment[key]).all() and (moment[key] >= lowest).all()):
                raise field.error(
                    f"{name}[{index}].{key}",
                    "its values",
                    "are not Adam's moments (non-finite, or a negative second moment)",
                )
        step = moment["step"]
        if not isinstance(step, torch.Tensor) or step.numel() != 1 or not 0 <= float(step) < COUNT_LIMIT:
            raise field.error(f"{name}[{index}].step", shape_of(step), "is not a step count")


def _check_schedule_state(field: Fields, name: str, schedule: Any, own: dict[str, Any]) -> None:
    """The learning-rate scheduler's state against this run's (``own``): its position and its schedules'
    fields (:func:`_check_schedule`); its settings become this run's, in place."""
    schedule = _with_defaults(field, name, schedule, own, essential=("last_epoch", "_step_count", "lr_lambdas"))
    field.count(f"{name}.last_epoch", schedule["last_epoch"])
    field.count(f"{name}._step_count", schedule["_step_count"])
    lambdas = field.sequence(f"{name}.lr_lambdas", schedule["lr_lambdas"], len(own["lr_lambdas"]))
    for j, stored in enumerate(lambdas):
        _check_schedule(field, f"{name}.lr_lambdas[{j}]", stored, schedule["last_epoch"])
    # Settings, not position: this run's (base_lrs multiplies every learning rate of the schedule).
    keys = ("base_lrs", "_is_initial", "_get_lr_called_within_step")
    schedule.update({key: own[key] for key in keys if key in own})


def _check_schedule(field: Fields, name: str, stored: Any, last_epoch: int) -> None:
    """A schedule's saved attributes: only fields of aiayn's schedules (the settings among them are
    replaced by this run's); the decay a decaying schedule placed, which a resumed run keeps, either
    none or steps from ``decay_start`` (done by ``last_epoch``, when it was placed) to a later ``decay_end``,
    and where a time-bound run last projected that end again: ``anchor_step`` between them, the share
    ``anchor_progress`` of the decay done by then."""
    stored = field.mapping(name, stored)
    for key in sorted(map(str, set(stored) - SCHEDULE_FIELDS)):
        raise field.error(f"{name}.{key}", "present", "is not a field of aiayn's learning-rate schedules")
    start, end = stored.get("decay_start"), stored.get("decay_end")
    if start is None and end is None:
        return
    for key, value in (("decay_start", start), ("decay_end", end)):
        if value is None:
            raise field.error(f"{name}.{key}", None, "is missing where the other end of the decay is set")
        field.count(f"{name}.{key}", value)
    if start > last_epoch:
        raise field.error(f"{name}.decay_start", start, f"lies beyond the schedule's step last_epoch={last_epoch}")
    if end <= start:
        raise field.error(f"{name}.decay_end", end, f"does not come after decay_start={start}")
    if stored.get("decay_start_seconds") is not None:
        field.number(f"{name}.decay_start_seconds", stored["decay_start_seconds"], 0.0)
    anchor = stored.get("anchor_step")
    if anchor is None:
        return
    if not start <= field.count(f"{name}.anchor_step", anchor) <= last_epoch or anchor >= end:
        allowed = f"must lie from decay_start={start} to last_epoch={last_epoch}, before decay_end={end}"
        raise field.error(f"{name}.anchor_step", anchor, allowed)
    progress = field.number(f"{name}.anchor_progress", stored.get("anchor_progress"), 0.0)
    if progress >= 1.0:
        raise field.error(f"{name}.anchor_progress", progress, "must lie in [0, 1): the share of the decay done")


def check_scaler(state: Any, field: Fields) -> None:
    """The fp16 gradient scaler's state: positive finite numbers (a zero or NaN scale breaks every step)."""
    state = field.mapping("MixedPrecision", state)
    for key, value in state.items():
        if key not in SCALER_KEYS:
            raise field.error(f"MixedPrecision.{short(key)}", "present", "is not a gradient scaler setting")
        if key == "_growth_tracker":
            field.count(f"MixedPrecision.{key}", value)
        elif not is_number(value) or value <= 0:
            raise field.error(f"MixedPrecision.{key}", value, "is not a finite number > 0")


def _with_defaults(
    field: Fields, name: str, state: Any, own: dict[str, Any], essential: tuple[str, ...]
) -> dict[str, Any]:
    """``state`` with the keys of ``own`` (a fresh optimizer's group, schedule): a key ``own`` does not
    have is refused; a missing one that is not ``essential`` (a switch added by a newer torch, whose
    default aiayn uses) is filled with this run's value."""
    state = field.mapping(name, state)
    for key in sorted(map(str, set(state) - set(own))):
        raise field.error(f"{name}.{key}", "present", "is not a setting of aiayn's optimizer and schedule")
    for key in own:
        if key not in state:
            if key in essential:
                raise field.error(f"{name}.{key}", "missing", "is in every checkpoint aiayn writes")
            state[key] = own[key]
    return state
