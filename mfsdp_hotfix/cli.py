"""``mfsdp-hotfix``: status, selftest, run, audit, parity, bootstrap-path and help.

``status`` and ``bootstrap-path`` work without torch; ``selftest`` needs torch and a
Megatron-FSDP copy; ``run`` starts a command with the sitecustomize bootstrap on PYTHONPATH;
``audit`` does the same with the on-the-job audit on and summarises its rank files. This module
is the parser and the dispatch; each command is a module of :mod:`.commands`.
"""

from __future__ import annotations

import argparse
import signal
import sys
import textwrap
from importlib import import_module

from .__about__ import __version__
from .commands import Command
from .commands.exits import BROKEN_PIPE, HUNG_UP, INTERRUPTED, TERMINATED, USAGE_ERROR
from .commands.output import quiet_stdout
from .errors import Stopped

DESCRIPTION = ("Runtime repair of Megatron-FSDP's gradient double-buffer race. 'status' and "
               "'bootstrap-path' work without torch; 'selftest' needs torch and a Megatron-FSDP "
               "copy; 'run' starts a command with the hotfix loaded in every Python process; "
               "'audit' does the same with the on-the-job audit on and summarises it; "
               "'parity' runs a job against Megatron's own DDP and compares every iteration.")
# Each command's name -> its module in ``commands/``, in the order ``--help`` lists them; ``help``
# follows, as the parser's own. As pip's ``commands_dict``: a command's module (and what it
# imports: ``status`` reads every layer of the package) is imported only where that command runs
# or its help is shown, so ``mfsdp-hotfix run`` imports none of the others.
COMMANDS = {"status": "status", "selftest": "selftest", "run": "run", "audit": "audit",
            "parity": "parity", "bootstrap-path": "bootstrap_path"}
HELP = "help"


def load(name: str) -> Command:
    """The module of command ``name`` (a key of :data:`COMMANDS`)."""
    command: Command = import_module(f"{__package__}.commands.{COMMANDS[name]}")
    return command


def _needed(argv: list[str]) -> list[str]:
    """The commands whose module this command line needs: the one it names (and, for ``help
    COMMAND``, that one); every one where it names none, or asks for the list of commands."""
    words = [word for word in argv if word != "--"]
    first = next((i for i, word in enumerate(words) if not word.startswith("-")), None)
    if first is None or words[first] not in (*COMMANDS, HELP) or any(
            word in ("-h", "--help") for word in words[:first]):
        return list(COMMANDS)
    if words[first] != HELP:
        return [words[first]]
    topic = words[first + 1:first + 2]
    return topic if topic and topic[0] in COMMANDS else list(COMMANDS)


class _WholeWordsFormatter(argparse.HelpFormatter):
    """Help text wrapped between words only: argparse's own breaks after hyphens, splitting
    names (``mfsdp-`` / ``hotfix``, ``Megatron-`` / ``FSDP``, ``--no-`` / ``sync``)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width,
                             break_on_hyphens=False, break_long_words=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(self._whitespace_matcher.sub(" ", text).strip(), width,
                             initial_indent=indent, subsequent_indent=indent,
                             break_on_hyphens=False, break_long_words=False)


class _CommandListFormatter(_WholeWordsFormatter):
    """One line per command: argparse measures the command names without the indent they are
    printed with, so the longest (bootstrap-path) would wrap its help onto a line of its own."""

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        for subaction in self._iter_indented_subactions(action):
            self._action_max_length = max(self._action_max_length, self._current_indent + len(
                self._format_action_invocation(subaction)))


def _command_list(commands: argparse._SubParsersAction) -> str:  # type: ignore[type-arg]
    """``usage``, then each command and what it does, one line each (bare ``mfsdp-hotfix``)."""
    helps = {action.dest: action.help or "" for action in commands._choices_actions}
    width = max(map(len, helps))
    return ("usage: mfsdp-hotfix COMMAND [OPTIONS]\n"
            "commands:\n" + "".join(f"  {name:<{width}}  {what}\n" for name, what in helps.items()))


def main(argv: list[str] | None = None) -> int:
    """``mfsdp-hotfix``; a closed stdout (``| head``) ends it quietly with status 141 (``status``
    keeps its own), Ctrl-C with 130, SIGTERM with 143, SIGHUP with 129, as the shell reports a
    command such a signal killed (every process a command started is ended by then:
    ``processes.supervised``)."""
    try:
        try:
            code = _main(argv)
        finally:  # also after argparse's exit (--help, usage errors)
            sys.stdout.flush()
    except BrokenPipeError:
        quiet_stdout()
        return BROKEN_PIPE
    except (KeyboardInterrupt, Stopped) as stop:
        name = "SIGINT" if isinstance(stop, KeyboardInterrupt) else signal.Signals(
            stop.signum).name
        sys.stderr.write(f"mfsdp-hotfix: stopped by {name}\n")
        return {"SIGINT": INTERRUPTED, "SIGTERM": TERMINATED, "SIGHUP": HUNG_UP}[name]
    return code


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="mfsdp-hotfix", description=DESCRIPTION,
                                     formatter_class=_CommandListFormatter)
    parser.add_argument("--version", action="version", version=f"mfsdp-hotfix {__version__}",
                        help="print the version and exit")
    commands = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    argv = sys.argv[1:] if argv is None else argv
    needed = _needed(argv)
    loaded = {}
    for name in COMMANDS:
        if name not in needed:  # never shown: the list of commands loads them all
            commands.add_parser(name)
            continue
        command = loaded[name] = load(name)
        command.add_arguments(commands.add_parser(command.NAME, help=command.HELP,
                                                  usage=command.USAGE,
                                                  description=command.DESCRIPTION,
                                                  formatter_class=_WholeWordsFormatter))
    guide = commands.add_parser(HELP, help="print the commands, or one command's help",
                                usage="mfsdp-hotfix help [COMMAND]",
                                description="Print the list of commands, or with COMMAND that "
                                            "command's options (as 'mfsdp-hotfix COMMAND "
                                            "--help' does).",
                                formatter_class=_WholeWordsFormatter)
    names = [name for name in commands.choices if name != HELP]
    guide.add_argument("topic", nargs="?", metavar="COMMAND", choices=names,
                       help=f"one of: {', '.join(names)}")
    args, extra = parser.parse_known_args(argv)
    if extra:  # argparse would blame the top-level parser, and show its usage
        (commands.choices[args.command] if args.command else parser).error(
            f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:  # a usage error, with the list of commands, one line each
        sys.stderr.write(_command_list(commands))
        parser.exit(USAGE_ERROR, "mfsdp-hotfix: error: name a COMMAND (above; 'mfsdp-hotfix "
                                 "help COMMAND' shows its options)\n")
    if args.command == HELP:
        print((commands.choices[args.topic] if args.topic else parser).format_help(), end="")
        return 0
    return loaded[args.command].run(args, commands.choices[args.command])
