"""pyproject.toml declares what src/aiayn imports: every third-party library in the dependencies or in an
extra, one that :func:`aiayn.extras.require` names in the extra it names, and the modules of the package
import with the dependencies alone (a default Multi30k run needs no extra; a feature imports its extra's
libraries only when it is used).

Imports are read from the source (``ast``: at a module's top and inside functions, and the modules that
``require`` / ``require_installed`` and Hydra's plugins table name as strings) and mapped to the installed
distributions that provide them, so the ``[dev]`` extra must be installed; where
``$AIAYN_TESTS_ALLOW_MISSING_EXTRAS=1``, a library that is not installed is skipped instead.
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

import aiayn
from aiayn.extras import HYDRA_PLUGINS
from helpers.extras import ALLOW_SKIP, toml_reader

tomllib = toml_reader()

PACKAGE = Path(aiayn.__file__).resolve().parent
PYPROJECT = PACKAGE.parents[1] / "pyproject.toml"
LOCK = PACKAGE.parents[1] / ".ci" / "requirements.lock"
REQUIRES = ("require", "require_installed")  # aiayn.extras's: (module, extra, what)
CORE = ""  # the dependencies, among the extras' names


@cache
def project() -> dict:
    return tomllib.loads(PYPROJECT.read_text())["project"]


@cache
def declared() -> dict[str, set[str]]:
    """The distributions each extra brings (its own references to ``aiayn[...]`` followed), and the
    dependencies under :data:`CORE`."""
    raw = {CORE: project()["dependencies"], **project()["optional-dependencies"]}
    own = canonicalize_name(project()["name"])

    def brings(extra: str, seen: frozenset[str] = frozenset()) -> set[str]:
        found = set()
        for line in raw[extra]:
            requirement = Requirement(line)
            if canonicalize_name(requirement.name) != own:
                found.add(canonicalize_name(requirement.name))
            else:
                assert requirement.extras <= raw.keys(), f"{extra}: {line} names an extra that is not declared"
                for other in requirement.extras - seen:
                    found |= brings(other, seen | {extra})
        return found

    return {extra: brings(extra) for extra in raw}


@cache
def providers() -> dict[str, list[str]]:
    return metadata.packages_distributions()


def distributions_of(module: str) -> set[str]:
    """The installed distributions that provide ``module`` (for a namespace package's module, those that
    hold its files: hydra_plugins.hydra_submitit_launcher is one plugin's); none is a failure, or a skip
    where ``$AIAYN_TESTS_ALLOW_MISSING_EXTRAS=1``."""
    top = module.partition(".")[0]
    found = {canonicalize_name(name) for name in providers().get(top, [])}
    if len(found) > 1 and "." in module:
        prefix = module.replace(".", "/")
        found = {
            name
            for name in found
            if any(str(file).startswith((f"{prefix}/", f"{prefix}.py")) for file in metadata.files(name) or [])
        }
    if not found:
        if os.environ.get(ALLOW_SKIP) == "1":
            pytest.skip(f"{module} is not installed (the [dev] extra installs it)")
        pytest.fail(f"src/aiayn imports {module}, which no installed distribution provides: install '.[dev]'")
    return found


@cache
def imports() -> dict[str, set[str]]:
    """The top-level modules outside the standard library and aiayn that src/aiayn imports, with the files
    that do."""
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE.parent))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            else:
                names = [name for name, _ in required(node)]
            for top in (name.partition(".")[0] for name in names):
                if top not in (*sys.stdlib_module_names, "aiayn"):
                    found.setdefault(top, set()).add(where)
    return found


def required(node: ast.AST) -> list[tuple[str, str]]:
    """``(module, extra)`` of a call ``require("module", "extra", ...)`` (or ``require_installed``)."""
    if not isinstance(node, ast.Call) or len(node.args) < 2:
        return []
    name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
    module, extra = node.args[:2]
    if name in REQUIRES and isinstance(module, ast.Constant) and isinstance(extra, ast.Constant):
        return [(module.value, extra.value)]
    return []


def required_in_extras() -> list[tuple[str, str]]:
    """Every ``(module, extra)`` that src/aiayn requires at run time, Hydra's plugins included."""
    calls = {pair for path in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
             for pair in required(node)}  # fmt: skip
    return sorted(calls | {(plugin, extra) for plugin, extra, _ in HYDRA_PLUGINS.values()})


@pytest.mark.parametrize("module", sorted(imports()))
def test_every_imported_library_is_declared(module: str) -> None:
    found = distributions_of(module)
    files = ", ".join(sorted(imports()[module]))
    assert found & set().union(*declared().values()), (
        f"{module} ({', '.join(sorted(found))}), imported by {files}: declare it in pyproject.toml (in the "
        "dependencies, or in the extra of the feature that imports it)"
    )


@pytest.mark.parametrize(("module", "extra"), required_in_extras(), ids="{0[0]}".format)
def test_a_required_library_is_in_the_extra_it_names(module: str, extra: str) -> None:
    """The extra that the one-line error tells the user to install brings the library (or the
    dependencies do, and the call is needless)."""
    assert extra in declared(), f"require({module!r}, {extra!r}): pyproject.toml has no extra {extra}"
    assert distributions_of(module) & (declared()[extra] | declared()[CORE]), (
        f"pip install 'aiayn[{extra}]' does not install {module}: add it to that extra"
    )


def test_the_extras_all_and_dev_bring_every_extra() -> None:
    features = set(declared()) - {CORE, "all", "dev"}
    assert set().union(*(declared()[e] for e in features - {"bench"})) <= declared()["all"]
    assert set().union(*(declared()[e] for e in features)) <= declared()["dev"]


def locked() -> dict[str, Version]:
    """``.ci/requirements.lock``: each distribution's pinned version."""
    pins = [line.split("==") for line in LOCK.read_text().splitlines() if line and not line.startswith("#")]
    return {canonicalize_name(name): Version(version) for name, version in pins}


def test_the_ci_lock_pins_what_the_dev_install_brings_within_the_declared_ranges() -> None:
    """CI installs the locked versions (.ci/run): a dependency added to pyproject.toml without a pin, or a
    range that excludes its pin, fails here before it changes what CI tests."""
    lines = [*project()["dependencies"], *(line for extra in project()["optional-dependencies"].values()
                                            for line in extra)]  # fmt: skip
    requirements = [Requirement(line) for line in lines if canonicalize_name(Requirement(line).name) != "aiayn"]
    pins = locked()
    brought = closure(requirements) - {"torch"}  # torch: pinned by .ci/run itself, the CPU build on disk
    assert not brought - set(pins), f"not in {LOCK.name}: {sorted(brought - set(pins))}"
    for requirement in requirements:
        name = canonicalize_name(requirement.name)
        if name in pins and (requirement.marker is None or requirement.marker.evaluate()):
            assert requirement.specifier.contains(pins[name], prereleases=True), (
                f"{name}=={pins[name]} vs {requirement}"
            )


def closure(requirements: list[Requirement]) -> set[str]:
    """The installed distributions that ``requirements`` bring, their dependencies' too (with the extras
    each requirement asks for); those not installed are left out."""
    found: set[str] = set()
    todo = list(requirements)
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        key = name + "[" + ",".join(sorted(requirement.extras)) + "]"
        if key in found:
            continue
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        found |= {name, key}
        for line in requires:
            nested = Requirement(line)
            wanted = {"", *requirement.extras}
            if nested.marker is None or any(nested.marker.evaluate({"extra": extra}) for extra in wanted):
                todo.append(nested)
    return {name for name in found if "[" not in name}


# Run with the names to hide as its argument: hides them as a lean install lacks them (import and
# find_spec find nothing, importlib.metadata lists no distribution of theirs), imports every module of
# aiayn and prints, as JSON, those that failed with their error.
IMPORT_ALL = """
import importlib, importlib.machinery, json, re, sys, traceback

hidden, dists, modules = json.loads(sys.argv[1])
path_finder = importlib.machinery.PathFinder


class WithoutExtras(path_finder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.partition(".")[0] in hidden else super().find_spec(name, path, target)

    @classmethod
    def find_distributions(cls, *args, **kwargs):
        for dist in super().find_distributions(*args, **kwargs):
            if re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower() not in dists:
                yield dist


sys.meta_path[sys.meta_path.index(path_finder)] = WithoutExtras
failed = {}
for module in modules:
    try:
        importlib.import_module(module)
    except Exception as error:
        failed[module] = "".join(traceback.format_exception_only(error)).strip()
print(json.dumps(failed))
"""


@pytest.mark.slow
def test_every_module_imports_with_the_dependencies_alone() -> None:
    """A lean install (``pip install aiayn``) imports every module of the package: the commands of a
    Multi30k run and the data, training and evaluation code they load, and the modules of the extras'
    features too, whose libraries are imported only when the feature is used (through
    :func:`aiayn.extras.require`). Hidden: the distributions that only the extras bring, with their own
    dependencies that the dependencies do not bring (scipy, pandas, pyarrow...)."""
    extras = {name for extra, names in declared().items() if extra != CORE for name in names}
    core = closure([Requirement(line) for line in project()["dependencies"]])
    extra_only = closure([Requirement(name) for name in extras]) - core
    installed = {canonicalize_name(name) for names in providers().values() for name in names}
    heavy = {"datasets", "sweeps", "matplotlib", "transformers", "scipy", "scikit-learn", "pandas", "pyarrow"}
    assert heavy & installed <= extra_only, f"the dependencies bring {sorted(heavy & installed - extra_only)}"
    hidden = sorted(top for top, names in providers().items() if all(canonicalize_name(n) in extra_only for n in names))
    modules = sorted(
        ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        for path in PACKAGE.rglob("*.py")
    )
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, json.dumps([hidden, sorted(extra_only), modules])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    failed = json.loads(done.stdout.strip().splitlines()[-1])
    assert not failed, "without the extras these modules do not import:\n" + "\n".join(
        f"{module}: {error}" for module, error in failed.items()
    )
