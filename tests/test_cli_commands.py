"""``cli.COMMANDS``: commands are loaded lazily, as pip's ``commands_dict``: ``mfsdp-hotfix run``
imports only what running a command needs, while the list of commands and each command's help
still come from every command's own module."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

from mfsdp_hotfix import cli

# The package modules ``mfsdp-hotfix run -- COMMAND`` has imported when it starts COMMAND: the
# package, its trigger and variables, the bootstrap (for the sitecustomize folder), the parser,
# and the run command with the commands' exit statuses and output. Measured with
# ``python -X importtime -m mfsdp_hotfix run -- true``: 43 before commands were loaded lazily.
RUN_IMPORTS = 10
# Counts the package modules imported when ``run`` starts its command, instead of starting it.
_COUNT = ("import os, sys\n"
          "os.execvp = lambda *a: (print(sorted(m for m in sys.modules "
          "if m.split('.')[0] == 'mfsdp_hotfix')), sys.exit(0))\n"
          "from mfsdp_hotfix.cli import main\n"
          "main(['run', '--', 'true'])\n")


def imported_by(source: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True,
                          cwd=REPO, check=True)
    return eval(proc.stdout)  # noqa: S307 - our own print of a list of names


def test_run_imports_only_what_starting_a_command_needs() -> None:
    modules = imported_by(_COUNT)
    assert len(modules) == RUN_IMPORTS, modules
    assert "mfsdp_hotfix.commands.run" in modules
    assert not {"mfsdp_hotfix.installer", "mfsdp_hotfix.reporting",
                "mfsdp_hotfix.commands.status"} & set(modules)


def test_every_command_is_listed_with_its_own_help() -> None:
    for name in cli.COMMANDS:
        command = cli.load(name)
        assert command.NAME == name
    proc = subprocess.run([sys.executable, "-m", "mfsdp_hotfix", "--help"], capture_output=True,
                          text=True, cwd=REPO, check=True)
    for name in cli.COMMANDS:
        assert cli.load(name).HELP in proc.stdout, name


def test_a_commands_help_loads_that_command() -> None:
    for name in cli.COMMANDS:
        assert cli._needed([name, "--json"]) == [name]
        assert cli._needed(["help", name]) == [name]
    assert cli._needed([]) == list(cli.COMMANDS)
    assert cli._needed(["--help", "run"]) == list(cli.COMMANDS)
    assert cli._needed(["help"]) == list(cli.COMMANDS)
    assert cli._needed(["no-such-command"]) == list(cli.COMMANDS)
