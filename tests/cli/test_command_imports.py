"""The commands that do not train start without Lightning (issue 27, item 2): importing each console
script's module and running its ``--help`` imports neither Lightning nor torchmetrics; the Hydra commands,
whose ``--help`` is built from their config alone (aiayn.cli.help), import neither torch nor the model.

One fresh process checks them all, one after the other; a hook on the import system names, for a module
that should not be there, the command that was starting and the chain of aiayn modules (and the function,
for an import inside one) that imported it. The commands are the installed distribution's console
scripts, whatever module holds them, except ``aiayn-train``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points

HEAVY = ("pytorch_lightning", "lightning_fabric", "lightning", "torchmetrics")
# Nor torch and the model by the --help of these commands, checked first (before another command imports them).
MODEL = ("torch", "aiayn.model")
HELP_FROM_CONFIG = {"aiayn-eval", "aiayn-export", "aiayn-summary", "aiayn-translate"}
# The commands issue 27 names; a command added later is checked too, as a console script of aiayn.
NOT_TRAINING = {
    "aiayn-average", "aiayn-eval", "aiayn-export", "aiayn-report", "aiayn-summary", "aiayn-sweep", "aiayn-translate",
}  # fmt: skip

# Run in the fresh process with the commands' entry points (name → "module:function") as its argument;
# prints one JSON object: the commands that did not exit 0 on --help, and who imported each heavy module.
CHECK = """
import contextlib, importlib, io, json, sys

HEAVY = {heavy!r}
commands = json.loads(sys.argv[1])
found, failed, starting = {{}}, {{}}, [None]


def chain():
    # The module that imports, then the aiayn modules whose code runs it (with the function, for an
    # import inside one), outermost first.
    links, frame = [], sys._getframe(2)
    while frame is not None:
        module, function = frame.f_globals.get("__name__", ""), frame.f_code.co_name
        if not module.startswith(("importlib", "__main__")) and (not links or module.startswith("aiayn")):
            link = module if function == "<module>" else f"{{module}}.{{function}}()"
            if not links or links[-1] != link:
                links.append(link)
        frame = frame.f_back
    return links[::-1]


class Spy:
    # Until the module is in sys.modules, each look-up may be its import (a probe for it may come first).
    def find_spec(self, name, path=None, target=None):
        top = next((heavy for heavy in HEAVY if name == heavy or name.startswith(heavy + ".")), None)
        if top is not None and top not in sys.modules:
            found[top] = {{"command": starting[0], "chain": chain()}}
        return None


sys.meta_path.insert(0, Spy())
for command, target in commands.items():
    starting[0] = command
    module, _, function = target.partition(":")
    sys.argv = [command, "--help"]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            getattr(importlib.import_module(module), function)()
            failed[command] = "returned instead of exiting after its help"
        except SystemExit as stop:
            if stop.code not in (0, None):
                failed[command] = f"exit status {{stop.code}}: {{err.getvalue().strip()[-500:]}}"
found = {{top: seen for top, seen in found.items() if top in sys.modules}}
print(json.dumps({{"failed": failed, "found": found}}))
"""


def test_commands_that_do_not_train_start_without_lightning() -> None:
    scripts = [
        script for script in entry_points(group="console_scripts") if script.dist and script.dist.name == "aiayn"
    ]
    commands = {script.name: script.value for script in scripts if script.name != "aiayn-train"}
    commands = dict(sorted(commands.items(), key=lambda command: command[0] not in HELP_FROM_CONFIG))
    assert set(commands) >= NOT_TRAINING, f"console scripts of aiayn missing: {sorted(NOT_TRAINING - set(commands))}"

    done = subprocess.run(
        [sys.executable, "-c", CHECK.format(heavy=HEAVY + MODEL), json.dumps(commands)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert not result["failed"], f"--help did not exit 0: {result['failed']}"
    imported = [
        f"{seen['command']} --help imports {top}: {' -> '.join([*seen['chain'], top])}"
        for top, seen in result["found"].items()
        if top in HEAVY or seen["command"] in HELP_FROM_CONFIG
    ]
    assert not imported, "\n".join(imported)
