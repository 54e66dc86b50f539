"""Megatron-LM's ``training_log`` lines, read back into iterations.

Megatron-LM prints one line per logged iteration from the last rank (``print_rank_last``): every
megatron-core release from 0.14 to 0.19 and NVIDIA main print the same fields in the same order,
``iteration N/ M | ... | <loss>: 9.132912E+00 | loss scale: 1.0 | grad norm: 2.240 | ... |
number of skipped iterations:   0 | number of nan iterations:   0 |``; they differ in the
timestamp in front (seconds up to 0.15, microseconds from 0.16) and in the fields between.
A parity run's output also holds other ranks' prints, launcher prefixes (``[rank0]:``, ``0: ``),
colours and carriage returns; a line may be cut by another process's print, and a run that was
restarted prints its iterations again. The values printed are rounded (the grad norm to 3
decimals), so each value keeps the half unit of its last printed digit: the comparison must know
what the print cannot show. The capture (``parity.capture``) records the same values at full
precision; ``read_log`` puts them in place of the printed ones where it finds them.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

GRAD_NORM = "grad norm"
SKIPPED = "number of skipped iterations"
NAN = "number of nan iterations"

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
# what launchers put before each line: torchrun's ``[rank0]:`` / ``[default0]:``, srun's ``0: ``
_LAUNCHER_PREFIX = re.compile(r"^\s*(?:\[[A-Za-z]*\d+\]:|\d+:)\s?")
_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|")
_FIELD = re.compile(r"\s*([^|:]+?)\s*:\s*([^|]*?)\s*\|")
_NUMBER = re.compile(r"[-+]?(?:(\d+)(?:\.(\d*))?(?:[eE]([-+]?\d+))?|nan|inf(?:inity)?)",
                     re.IGNORECASE)
_EXPONENT = re.compile(r"\d[eE][-+]?\d")
_SECONDS_STAMP = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\]\s*$")
_MICROS_STAMP = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\]\s*$")
# Fields printed in exponent notation that are not losses (every other one is an entry of
# Megatron's ``total_loss_dict``, printed ``{:.6E}``).
_NOT_LOSSES = frozenset({"learning rate", "decoupled learning rate"})
# How far below a cut iteration line its tail may come (other ranks' prints in between).
_CONTINUATION_WINDOW = 8

FAMILY_SECONDS = "megatron-core 0.14-0.15"
FAMILY_MICROS = "megatron-core 0.16-0.19 / main"
FAMILY_PLAIN = "line format (no timestamp)"
CAPTURE_PREFIX = "training_log-rank"


@dataclass(frozen=True)
class Iteration:
    """What one iteration reported. ``resolution`` gives, per metric (each loss by name and
    ``GRAD_NORM``), the half unit of the last digit printed: the true value lies within it
    (0.0 for a captured, full-precision value)."""

    number: int
    losses: dict[str, float]
    grad_norm: float | None
    grad_norm_digits: int | None
    skipped: int | None
    nan: int | None
    source: str
    resolution: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RunLog:
    """A run's iterations in order, one per number (after a restart, the run that went on)."""

    iterations: list[Iteration]
    family: str | None
    hotfix: str | None
    restarts: int = 0
    capture_note: str | None = None


def iteration_of(line: str) -> int | None:
    """The iteration a printed line reports, for live progress; None for any other line."""
    found = _ITERATION.search(_ANSI.sub("", line))
    return int(found.group(1)) if found else None


def parse_number(text: str) -> tuple[float, float, int | None] | None:
    """(value, half unit of the last printed digit, decimals printed) of one printed number;
    None when the text is not exactly one number (a field cut by another print)."""
    found = _NUMBER.fullmatch(text.strip())
    if found is None:
        return None
    value = float(found.group(0))
    if not math.isfinite(value):
        return value, 0.0, None
    decimals = len(found.group(2) or "")
    exponent = int(found.group(3) or 0)
    return value, 0.5 * 10.0 ** (exponent - decimals), decimals


def _physical_lines(text: str) -> list[str]:
    return [_ANSI.sub("", line) for line in re.split(r"\r\n|\r|\n", text)]


def _joined_iteration_lines(lines: list[str]) -> Iterable[tuple[str, str]]:
    """(text before the iteration, the iteration's fields) of every iteration line; a line cut
    by another print is joined with its tail (the next line near it that ends the fields)."""
    for index, line in enumerate(lines):
        found = _ITERATION.search(line)
        if found is None:
            continue
        body = line[found.start():]
        if NAN not in body:
            for tail in lines[index + 1:index + 1 + _CONTINUATION_WINDOW]:
                if _ITERATION.search(tail):
                    break
                if NAN in tail:
                    body += _LAUNCHER_PREFIX.sub("", tail, count=1)
                    break
        yield line[:found.start()], body


def _family(before: str) -> str:
    if _MICROS_STAMP.search(before):
        return FAMILY_MICROS
    if _SECONDS_STAMP.search(before):
        return FAMILY_SECONDS
    return FAMILY_PLAIN


def _is_loss(name: str, printed: str) -> bool:
    if name.lower().endswith("loss"):
        return True
    return bool(_EXPONENT.search(printed)) and name not in _NOT_LOSSES


def parse_line(body: str) -> Iteration | None:
    """One iteration's fields (``iteration N/ M | name: value | ...``); a field whose value is
    not exactly one number is left out (it was cut by another print)."""
    found = _ITERATION.match(body)
    if found is None:
        return None
    losses: dict[str, float] = {}
    resolution: dict[str, float] = {}
    grad_norm: float | None = None
    digits: int | None = None
    counts: dict[str, int] = {}
    for name, printed in _FIELD.findall(body, found.end()):
        number = parse_number(printed)
        if number is None:
            continue
        value, half_unit, decimals = number
        if name == GRAD_NORM:
            grad_norm, digits, resolution[GRAD_NORM] = value, decimals, half_unit
        elif name in (SKIPPED, NAN) and value.is_integer():
            counts[name] = int(value)
        elif _is_loss(name, printed):
            losses[name], resolution[name] = value, half_unit
    return Iteration(int(found.group(1)), losses, grad_norm, digits, counts.get(SKIPPED),
                     counts.get(NAN), "log", resolution)


def read_lines(text: str) -> RunLog:
    """The iterations printed in ``text`` (a run's whole output), without a capture. Where the
    iteration number goes back (a restart, from scratch or from a checkpoint), the iterations
    printed before from that number on are dropped: the run that went on is the one compared."""
    by_number: dict[int, Iteration] = {}
    families: list[str] = []
    restarts = 0
    last = None
    for before, body in _joined_iteration_lines(_physical_lines(text)):
        iteration = parse_line(body)
        if iteration is None:
            continue
        if last is not None and iteration.number <= last:
            restarts += 1  # what the abandoned run printed from here on is not this run's
            by_number = {n: it for n, it in by_number.items() if n < iteration.number}
        last = iteration.number
        by_number[iteration.number] = iteration
        families.append(_family(before))
    iterations = [by_number[n] for n in sorted(by_number)]
    return RunLog(iterations, max(set(families), key=families.count) if families else None,
                  None, restarts)


def read_log(text: str, capture_dir: str | None = None) -> RunLog:
    """The run's iterations: the printed lines, with the capture's full-precision values in
    place of the printed ones where ``capture_dir`` holds them."""
    printed = read_lines(text)
    if capture_dir is None:
        return printed
    captured, hotfix, note = read_capture(Path(capture_dir))
    merged, disagreeing = merge(printed.iterations, captured)
    if disagreeing:
        note = (f"the capture's grad norm is not the printed one at iterations "
                f"{', '.join(map(str, disagreeing))}: the printed values are used there")
    return replace(printed, iterations=merged, hotfix=hotfix, capture_note=note)


def merge(printed: list[Iteration],
          captured: Mapping[int, Iteration]) -> tuple[list[Iteration], list[int]]:
    """Each iteration with the captured grad norm in place of the printed one, and the
    iterations where the capture is not what the line printed (there the print is kept: a
    capture that disagrees with Megatron's own line is not trusted). Losses stay as printed:
    seven significant digits are finer than any floor, and what Megatron prints is not always
    the iteration's own loss (from 0.16 on it does not reset its sums after the first iteration,
    so the second line averages the first two), so both runs are read the same way."""
    by_number = {it.number: it for it in printed}
    disagreeing = []
    for number, got in captured.items():
        seen = by_number.get(number)
        if seen is None:
            by_number[number] = got
        elif got.grad_norm is not None and not _printed_as(seen, got.grad_norm):
            disagreeing.append(number)
        elif got.grad_norm is not None:
            resolution = {**seen.resolution, GRAD_NORM: 0.0}
            by_number[number] = replace(
                seen, grad_norm=got.grad_norm, grad_norm_digits=None, resolution=resolution,
                source="capture" if _all_captured(resolution) else "log+capture")
    return [by_number[n] for n in sorted(by_number)], sorted(disagreeing)


def _printed_as(seen: Iteration, grad_norm: float) -> bool:
    """Whether ``grad_norm`` rounds to the grad norm the line printed (or the line printed none)."""
    if seen.grad_norm is None:
        return True
    if not (math.isfinite(grad_norm) and math.isfinite(seen.grad_norm)):
        return repr(grad_norm) == repr(seen.grad_norm)
    half_unit = seen.resolution.get(GRAD_NORM, 0.0)
    return abs(grad_norm - seen.grad_norm) <= half_unit * (1 + 1e-6) + 1e-12


def _all_captured(resolution: Mapping[str, float]) -> bool:
    return all(half_unit == 0.0 for half_unit in resolution.values())


def read_capture(folder: Path) -> tuple[dict[int, Iteration], str | None, str | None]:
    """(iterations by number, what the capture saw of mfsdp_hotfix, a note when the capture is
    missing or unreadable) from the capture's files: the highest rank's file, the rank that
    prints; a later record of one iteration (a restart) wins."""
    files = sorted(folder.glob(f"{CAPTURE_PREFIX}*.jsonl"), key=_rank_of)
    if not files:
        return {}, None, f"no capture in {folder}"
    found: dict[int, Iteration] = {}
    hotfix = None
    for line in files[-1].read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line the run did not finish writing
        if not isinstance(record, dict):
            continue
        if record.get("kind") == "process":
            hotfix = record.get("hotfix")
        elif record.get("kind") == "iteration":
            iteration = _captured_iteration(record)
            found[iteration.number] = iteration
    return found, hotfix, None if found else f"the capture in {files[-1]} holds no iteration"


def _rank_of(path: Path) -> int:
    digits = path.stem[len(CAPTURE_PREFIX):]
    return int(digits) if digits.isdigit() else -1


def _captured_iteration(record: Mapping[str, object]) -> Iteration:
    """A captured iteration: its grad norm only (see ``merge`` for why not its losses)."""
    raw_norm = record.get("grad_norm")
    grad_norm = None if raw_norm is None else float(str(raw_norm))
    resolution = {} if grad_norm is None else {GRAD_NORM: 0.0}
    return Iteration(int(str(record["iteration"])), {}, grad_norm, None, None, None, "capture",
                     resolution)
