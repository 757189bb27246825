"""Users' callbacks from either of Lightning's packages. ``pytorch_lightning`` (which aiayn's trainer is) and
``lightning`` (whose ``lightning.pytorch`` holds the same code) define their classes twice, under two
names: the trainer refuses a ``lightning.pytorch`` callback as no callback at all. Such a callback runs
here inside :class:`OtherPackageCallback`, which hands it every hook.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl

from aiayn.errors import FieldError

# Every hook the trainer calls on a callback (Lightning 2.x: setup, teardown and the on_* events).
HOOKS = tuple(
    name
    for name, value in vars(pl.Callback).items()
    if callable(value) and (name.startswith("on_") or name in ("setup", "teardown"))
)


def _forwarded(hook: str) -> Callable[..., Any]:
    def call(self: OtherPackageCallback, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.callback, hook)(*args, **kwargs)

    call.__name__ = hook
    return call


class OtherPackageCallback(pl.Callback):
    """A ``lightning.pytorch`` callback run by a ``pytorch_lightning`` trainer: every hook, its state in the
    checkpoint under its own key."""

    def __init__(self, callback: Any) -> None:
        self.callback = callback

    @property
    def state_key(self) -> str:
        return self.callback.state_key

    def state_dict(self) -> dict[str, Any]:
        return self.callback.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.callback.load_state_dict(state_dict)


for _hook in HOOKS:
    setattr(OtherPackageCallback, _hook, _forwarded(_hook))


def as_callback(callback: Any) -> pl.Callback:
    """``callback`` as the trainer's kind of callback; anything that is no Lightning callback is refused."""
    if isinstance(callback, pl.Callback):
        return callback
    other = sys.modules.get("lightning.pytorch")
    if other is not None and isinstance(callback, other.Callback):
        return OtherPackageCallback(callback)
    raise FieldError(
        "callbacks", type(callback).__name__, "must be Lightning callbacks (pytorch_lightning or lightning.pytorch)"
    )
