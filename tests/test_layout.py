"""The package's layout is its architecture: each layer imports only the layers below it, the model
layer runs without the framework, and every experiment has a run name of its own."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import aiayn
from aiayn.config.compose import compose_run_config, config_dir
from helpers.compose import composed_run

PACKAGE = Path(aiayn.__file__).resolve().parent
# From the inside out; a module may import its own layer and those before it. The leaves (plain
# modules at the top) come first: every layer may use them, and they import no layer.
LAYERS = (
    "errors",
    "extras",
    "files",
    "scoring",
    "machine",
    "model",
    "data",
    "training",
    "export",
    "evaluation",
    "config",
    "experiments",
    "cli",
)
LEAVES = ("errors", "extras", "files", "scoring", "machine")
# Rooms of a layer: sub-packages that hold one concern each, and the only modules of the layer they import.
ROOMS = {
    "experiments": {
        "sweeps": {"aiayn.experiments.sweeps", "aiayn.experiments.results"},  # files, state, trials, runner, placement
        "report": {
            "aiayn.experiments.report",
            "aiayn.experiments.results",  # the one schema of results.json, which the run writes
            "aiayn.experiments.sweeps.state",
            "aiayn.experiments.table3",
        },
    },
}
LIGHTNING = ("pytorch_lightning", "lightning", "lightning_fabric", "torchmetrics")


def layer_of(module: str) -> str:
    """``aiayn.training.callbacks.faults`` → ``training``."""
    return module.split(".")[1]


def imports_of(path: Path, package: str = "aiayn") -> set[str]:
    """The modules of ``package`` a file imports, at its top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {node.module} if node.module.split(".")[0] == package else set()
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == package}
    return found


def modules() -> list[Path]:
    return sorted(path for path in PACKAGE.rglob("*.py") if path.parent != PACKAGE or path.stem != "__init__")


def test_the_top_level_holds_the_layers_and_at_most_six_modules() -> None:
    folders = {path.name for path in PACKAGE.iterdir() if path.is_dir() and path.name != "__pycache__"}
    top = {path.stem for path in PACKAGE.glob("*.py")}
    assert folders - {"conf"} == set(LAYERS) - set(LEAVES)
    assert top == {"__init__", *LEAVES} and len(top) <= 6


@pytest.mark.parametrize("path", modules(), ids=lambda path: str(path.relative_to(PACKAGE)))
def test_a_module_imports_only_its_own_layer_and_those_below(path: Path) -> None:
    own = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
    allowed = set(LAYERS[: LAYERS.index(own) + 1]) - ({own} if own in LEAVES else set())
    wrong = sorted(module for module in imports_of(path) if layer_of(module) not in allowed)
    assert not wrong, f"{own} may import {sorted(allowed)}; {path.name} imports {wrong}"


BELOW_CONFIG = LAYERS[: LAYERS.index("config")]


def config_errors(path: Path) -> list[str]:
    """The first argument of each ``ConfigError(...)`` a module raises, as written."""
    return [
        ast.unparse(node.args[0]) if node.args else ""
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "ConfigError"
    ]


@pytest.mark.parametrize(
    "path",
    [path for path in modules() if path.relative_to(PACKAGE).parts[0].removesuffix(".py") in BELOW_CONFIG],
    ids=lambda path: str(path.relative_to(PACKAGE)),
)
def test_below_the_config_layer_no_module_reads_hydra_or_names_a_key(path: Path) -> None:
    """Each layer checks its own fields (a FieldError, which the config layer names by its key); the
    only ConfigError below it names an environment variable, which no config holds."""
    found = imports_of(path, "hydra") | imports_of(path, "omegaconf")
    keys = [key for key in config_errors(path) if not key.strip("'\"").isupper()]
    assert not found and not keys, (found, keys)


def room_modules() -> list[tuple[str, str, Path]]:
    return [
        (layer, room, path)
        for layer, rooms in ROOMS.items()
        for room in rooms
        for path in sorted((PACKAGE / layer / room).rglob("*.py"))
    ]


def room_id(value: str | Path) -> str:
    return value.name if isinstance(value, Path) else value


def test_the_rooms_of_a_layer_are_its_sub_packages() -> None:
    for layer, rooms in ROOMS.items():
        found = {p.name for p in (PACKAGE / layer).iterdir() if p.is_dir() and p.name != "__pycache__"}
        assert found == set(rooms) and all((PACKAGE / layer / room / "__init__.py").is_file() for room in rooms)


@pytest.mark.parametrize(("layer", "room", "path"), room_modules(), ids=room_id)
def test_a_room_imports_of_its_layer_only_what_it_names(layer: str, room: str, path: Path) -> None:
    """Sweeps import nothing of the report or of a training run; the report reads sweeps only through
    their state module (the one owner of ``sweep.json``)."""
    own = f"aiayn.{layer}"
    allowed = ROOMS[layer][room]
    wrong = sorted(
        module
        for module in imports_of(path)
        if layer_of(module) == layer and not any(module == a or module.startswith(f"{a}.") for a in allowed)
    )
    assert not wrong, f"{own}.{room} may import of {own} only {sorted(allowed)}; {path.name} imports {wrong}"


@pytest.mark.parametrize(("layer", "room", "path"), room_modules(), ids=room_id)
def test_no_room_imports_lightning(layer: str, room: str, path: Path) -> None:
    """aiayn-sweep and aiayn-report train nothing: their rooms import no Lightning, not even inside a
    function, and of the training layer only its Lightning-free metrics module."""
    found = set().union(*(imports_of(path, package) for package in LIGHTNING))
    training = {module for module in imports_of(path) if layer_of(module) == "training"}
    assert not found and training <= {"aiayn.training.metrics"}, (found, training)


def test_the_model_imports_without_hydra_omegaconf_or_lightning() -> None:
    blocked = ("hydra", "omegaconf", "pytorch_lightning", "lightning", "lightning_fabric")
    script = "\n".join(
        [
            "import sys",
            *(f"sys.modules[{name!r}] = None" for name in blocked),  # importing them now raises
            "import aiayn.model as m",
            "model = m.Transformer(m.TransformerConfig(vocab_size=50, n_layers=1, d_model=16, d_ff=32, n_heads=2,"
            " d_k=8, d_v=8))",
            "import torch",
            "print(m.translate_ids(model.eval(), torch.tensor([[5, 6, 3]]), 2, 3, m.DecodingOptions(beam_size=2)))",
            "try:",
            "    m.TransformerConfig(vocab_size=50, d_model=511)",
            "except ValueError as error:",
            "    print(type(error).__name__, error)",
        ]
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    hypotheses, error = done.stdout.strip().splitlines()
    assert hypotheses.startswith("[[") and error == "FieldError d_model=511 must be even for positional=sinusoidal"


def experiments() -> list[str]:
    folder = Path(config_dir()) / "experiment"
    return sorted(path.relative_to(folder).with_suffix("").as_posix() for path in folder.rglob("*.yaml"))


def test_every_experiment_has_a_run_name_of_its_own() -> None:
    names: dict[str, list[str]] = {}
    for experiment in experiments():
        names.setdefault(composed_run([f"experiment={experiment}"]).name, []).append(experiment)
    shared = {name: found for name, found in names.items() if len(found) > 1}
    assert not shared, f"experiments that share a run folder and a dashboard name: {shared}"
    assert len(names) == len(experiments()) >= 45
    assert compose_run_config(["experiment=table3/A1"]).name == "table3_A1"  # its path, / as _
    assert compose_run_config(["model=tiny"]).name == "tiny_multi30k_en_de"  # no experiment: model and data
    assert compose_run_config(["experiment=mini/A1", "name=mine"]).name == "mine"  # the command line wins


def test_the_smoke_settings_are_a_run_of_seconds_on_any_experiment() -> None:
    smoke = compose_run_config(["debug=smoke"])
    assert smoke.model.d_model == 64 and smoke.trainer.max_steps == 12 and not smoke.logger
    row = compose_run_config(["experiment=mini/A1", "debug=smoke"])
    assert row.name == "mini_A1" and row.model.n_heads == 1 and row.trainer.max_steps == 12


TESTS = Path(__file__).resolve().parent
# The folders of the tests: one per layer (the leaves' tests together), the console scripts', the
# benchmarks' smoke tests, and the scenarios: stories of real processes (signals, kills, locks, DDP).
TEST_FOLDERS = {*(layer for layer in LAYERS if layer not in LEAVES), "leaves", "benchmarks", "scenarios"}


def modules_of_tests() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def imported_names(path: Path) -> set[str]:
    """The top-level names of every module a file imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
    return found


def test_the_tests_mirror_the_layers_and_no_test_module_imports_another() -> None:
    paths = modules_of_tests()
    folders = {path.parent.relative_to(TESTS).as_posix() for path in paths} - {"."}
    assert folders <= TEST_FOLDERS, folders - TEST_FOLDERS
    assert [path.name for path in TESTS.glob("test_*.py")] == ["test_layout.py"]  # the one about all layers
    assert len({path.stem for path in paths}) == len(paths)  # one module name each: pytest imports them by name
    for path in paths:
        imported = {name for name in imported_names(path) if name.startswith("test_") or name == "conftest"}
        assert not imported, f"{path.relative_to(TESTS)} imports {imported}: shared plumbing goes in tests/helpers"
