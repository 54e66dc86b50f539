"""The command-line flags of real Megatron-LM releases, read from their own
``megatron/training/arguments.py`` (and, from megatron-core 0.16 on, the config dataclasses it
turns into flags through ``ArgumentGroupFactory``), with the help text of each.

Sources: the megatron-core wheels 0.17 and later carry ``megatron/training`` (unpacked by
:mod:`releases`); 0.14 to 0.16 and NVIDIA main are read from a Megatron-LM git clone
(``MFSDP_TEST_MEGATRON_LM``, a git dir), at the release tags ``core_v<version>``."""

from __future__ import annotations

import ast
import functools
import re
import subprocess
from collections.abc import Callable, Iterator
from typing import NamedTuple

import releases

WHEEL_RELEASES = ["0.17.1", "0.18.2", "0.19.2"]  # megatron/training is in these wheels
GIT_RELEASES = ["0.14.0", "0.15.3", "0.16.1"]  # ... not in these: their git tag
OLDER = "0.13.1"  # the last release of --use-custom-fsdp, Megatron-FSDP's older name
ARGUMENTS = "megatron/training/arguments.py"

Reader = Callable[[str], str | None]  # path inside the release -> its text
MANY = -1  # a flag that takes every word up to the next flag (nargs '+' or '*')


class Flag(NamedTuple):
    """One flag of a release: the source that declares it (help text included) and how many
    words follow it (0 for a switch, 1, or ``MANY``)."""

    text: str
    values: int


def _values_of_call(source: str) -> int:
    if re.search(r"action=['\"]store_(true|false)|action=['\"]store_const|BooleanOptional",
                 source):
        return 0
    return MANY if re.search(r"nargs=['\"][+*]", source) else 1


def wheel_reader(version: str) -> Reader:
    root = releases.unpacked("megatron-core", version)

    def read(path: str) -> str | None:
        file = root / path
        return file.read_text() if file.is_file() else None
    return read


def git_reader(ref: str) -> Reader | None:
    """Files of ``ref`` in the Megatron-LM clone; None without a clone or that ref."""
    git = releases.MEGATRON_LM_GIT
    if git is None or subprocess.run(["git", "--git-dir", str(git), "rev-parse", "--verify",
                                      "--quiet", f"{ref}^{{commit}}"],
                                     capture_output=True).returncode:
        return None

    def read(path: str) -> str | None:
        proc = subprocess.run(["git", "--git-dir", str(git), "show", f"{ref}:{path}"],
                              capture_output=True, text=True)
        return proc.stdout if proc.returncode == 0 else None
    return read


Locate = Callable[[str], list[str]]  # class name -> the files that define it


def _find_class(read: Reader, locate: Locate, name: str) -> ast.ClassDef | None:
    for path in locate(name):
        for node in ast.walk(ast.parse(read(path) or "")):
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node
    return None


def _dataclass_flags(read: Reader, locate: Locate, name: str,
                     exclude: set[str]) -> Iterator[tuple[str, Flag]]:
    """The flags ``ArgumentGroupFactory(name)`` makes: one per field (bases included), its
    ``argparse_meta`` ``arg_names`` where given, ``--no-<field>`` for a bool that defaults True."""
    node = _find_class(read, locate, name)
    if node is None:
        raise AssertionError(f"class {name} not found in the release")
    for base in node.bases:
        if isinstance(base, ast.Name):
            yield from _dataclass_flags(read, locate, base.id, exclude)
    body = node.body
    for index, item in enumerate(body):
        if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
            continue
        field = item.target.id
        if field in exclude or field.startswith("_"):
            continue
        doc = ""
        if index + 1 < len(body) and isinstance(body[index + 1], ast.Expr):
            doc = ast.unparse(body[index + 1])
        value = ast.unparse(item.value) if item.value else ""
        annotation = ast.unparse(item.annotation)
        values = 0 if annotation == "bool" else MANY if re.match(
            r"(Optional\[)?(list|List)\b", annotation) else 1
        if "'nargs'" in value:
            values = MANY
        flag = Flag(f"{annotation} {doc} {value}", values)
        names = re.findall(r"'arg_names':\s*\[([^\]]*)\]", value)
        if names:
            for name in re.findall(r"'(--[\w-]+)'", names[0]):
                yield name, flag
            continue
        default_true = annotation == "bool" and (value == "True" or "default=True" in value)
        yield ("--no-" if default_true else "--") + field.replace("_", "-"), flag


def release_flags(read: Reader, locate: Locate) -> dict[str, Flag]:
    """Every flag the release's parser has."""
    text = read(ARGUMENTS)
    assert text, f"no {ARGUMENTS}"
    flags: dict[str, Flag] = {}
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "add_argument":
            for arg in node.args:
                if isinstance(arg, ast.Constant) and str(arg.value).startswith("--"):
                    source = ast.unparse(node)
                    flags[str(arg.value)] = Flag(source, _values_of_call(source))
        elif isinstance(func, ast.Name) and func.id == "ArgumentGroupFactory" and node.args:
            cls = ast.unparse(node.args[0])
            exclude = set(re.findall(r"'(\w+)'", ast.unparse(node.keywords[0].value))
                          ) if node.keywords else set()
            for flag, doc in _dataclass_flags(read, locate, cls, exclude):
                flags[flag] = doc
    return flags


def wheel_locate(version: str) -> Locate:
    root = releases.unpacked("megatron-core", version)
    texts = {str(p.relative_to(root)): p.read_text(errors="replace")
             for p in (root / "megatron").rglob("*.py")}
    return lambda name: [path for path, text in texts.items()
                         if re.search(rf"^class {name}\b", text, re.M)]


def git_locate(ref: str) -> Locate:
    def locate(name: str) -> list[str]:
        proc = subprocess.run(["git", "--git-dir", str(releases.MEGATRON_LM_GIT), "grep", "-l",
                               "-E", f"^class {name}\\b", ref, "--", "megatron"],
                              capture_output=True, text=True)
        return [line.split(":", 1)[1] for line in proc.stdout.split()]
    return locate


@functools.cache
def all_release_flags() -> dict[str, dict[str, Flag]]:
    """Release label -> its flags: the wheels always, the git refs where a clone is given."""
    out = {v: release_flags(wheel_reader(v), wheel_locate(v)) for v in WHEEL_RELEASES}
    for label, ref in [(v, f"core_v{v}") for v in [OLDER, *GIT_RELEASES]] + [("main", "HEAD")]:
        read = git_reader(ref)
        if read is not None:
            out[label] = release_flags(read, git_locate(ref))
    return out


if __name__ == "__main__":
    import sys
    for label, flags in all_release_flags().items():
        words = sys.argv[1:] or ["fsdp"]
        print(label, len(flags), sorted(f for f, h in flags.items()
                                         if any(w in (f + h.text).lower() for w in words)))
