"""``trainer.devices`` and ``trainer.num_nodes`` read in one place: the forms Lightning takes, refused
otherwise naming the field, and the processes they make as Lightning counts them."""

from __future__ import annotations

import os

import pytest

from aiayn.errors import FieldError
from aiayn.machine import Devices


@pytest.mark.parametrize(
    ("devices", "count", "indices"),
    [(8, 8, None), ("2", 2, None), ([0, 3], 2, (0, 3)), ("0,1,2", 3, (0, 1, 2)), ("1,", 1, (1,)),
     ("auto", None, None), (-1, None, None), ("-1", None, None)],
)  # fmt: skip
def test_the_forms_lightning_takes_give_the_devices_they_name(
    devices: object, count: int | None, indices: object
) -> None:
    parsed = Devices.parse(devices)
    assert (parsed.count, parsed.indices, parsed.nodes) == (count, indices, 1)
    assert parsed.every == (devices in (-1, "-1"))


@pytest.mark.parametrize(
    ("devices", "nodes", "field"),
    [(0, 1, "devices"), ("0", 1, "devices"), (-2, 1, "devices"), (True, 1, "devices"), ([], 1, "devices"),
     ([0, -1], 1, "devices"), ("gpu", 1, "devices"), (2.5, 1, "devices"), (1, 0, "num_nodes"),
     (1, "two", "num_nodes")],
)  # fmt: skip
def test_anything_else_is_refused_naming_the_field(devices: object, nodes: object, field: str) -> None:
    with pytest.raises(FieldError) as refused:
        Devices.parse(devices, nodes)
    assert refused.value.field == field and "\n" not in str(refused.value)


def test_the_processes_of_a_run_are_counted_as_lightning_counts_them() -> None:
    assert Devices.parse(2, 3).world_size("cpu") == 6
    assert Devices.parse([0, 5]).world_size("gpu") == 2
    assert Devices.parse("auto").per_node("cpu") == 1  # Lightning's CPU "auto" is one device
    assert Devices.parse(-1).per_node("cpu") == os.cpu_count()  # ... and -1 one process per core
    assert Devices.parse("auto").per_node("auto") == 1  # no GPU here
    several = [Devices.parse(d, n).several for d, n in ((1, 1), ("auto", 1), (2, 1), (-1, 1), (1, 2), ("0,1", 1))]
    assert several == [False, False, True, True, True, True]
