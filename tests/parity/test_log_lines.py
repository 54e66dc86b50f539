"""parity/log_lines: Megatron-LM's printed iterations read back, from real excerpts (fixtures/,
see its README) and from lines in each release's format where no excerpt shows the case."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from training_lines import STAMP_SECONDS, megatron_line

from mfsdp_hotfix.parity import log_lines
from mfsdp_hotfix.parity.log_lines import GRAD_NORM, iteration_of, read_log

FIXTURES = Path(__file__).parent / "fixtures"
# Real excerpts whose run also recorded the full-precision values (the record's "reported"):
# the print must be those values rounded as Megatron rounds them.
WITH_REPORTED = ["core-0.19.2-zero1-hotfix", "core-0.19.2-zero1-shipped",
                 "core-0.18.2-zero1-hotfix"]


def fixture(name: str) -> str:
    return (FIXTURES / f"{name}.log").read_text()


@pytest.mark.parametrize("name", WITH_REPORTED)
def test_a_real_excerpt_reads_as_its_runs_full_precision_values_rounded(name: str) -> None:
    reported = json.loads((FIXTURES / f"{name}.reported.json").read_text())["reported"]
    run = read_log(fixture(name))
    assert [it.number for it in run.iterations] == [1, 2, 3]
    assert run.family == log_lines.FAMILY_MICROS and run.restarts == 0
    losses = reported["loss/lm loss"]
    # from 0.16 on Megatron does not reset its sums after the first iteration: the second line
    # prints the mean of the first two iterations' losses
    printed_losses = [losses[0], (losses[0] + losses[1]) / 2, losses[2]]
    for it, loss, norm in zip(run.iterations, printed_losses, reported["grad_norm"], strict=True):
        assert it.losses == {"lm loss": float(f"{loss:.6E}")}
        assert it.grad_norm == float(f"{norm:.3f}") and it.grad_norm_digits == 3
        assert abs(it.grad_norm - norm) <= it.resolution[GRAD_NORM] == 5e-4
        assert it.resolution["lm loss"] == 5e-7
        assert (it.skipped, it.nan, it.source) == (0, 0, "log")


def family_of(name: str) -> str:
    """The format family a fixture's release prints (its name starts with the release)."""
    return log_lines.FAMILY_SECONDS if name.startswith(("core-0.14", "core-0.15")) else \
        log_lines.FAMILY_MICROS


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.log")), ids=lambda p: p.stem)
def test_every_real_excerpt(path: Path) -> None:
    """Every excerpt (those validation/parity_fixture_logs.py cuts included): consecutive
    iterations with a loss, a grad norm and the counts, in its release's family; where the run's
    capture came with it, the print is the captured grad norm rounded as Megatron rounds it."""
    printed = read_log(path.read_text())
    numbers = [it.number for it in printed.iterations]
    assert len(numbers) >= 2 and numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    assert printed.family == family_of(path.stem) and printed.restarts == 0
    for it in printed.iterations:
        assert "lm loss" in it.losses and it.grad_norm is not None
        assert (it.skipped, it.nan, it.grad_norm_digits) == (0, 0, 3)
    capture = path.with_suffix(".capture")
    if capture.is_dir():
        run = read_log(path.read_text(), str(capture))
        assert run.hotfix in ("not loaded", "off")  # run with MFSDP_HOTFIX=0
        for seen, got in zip(printed.iterations, run.iterations, strict=True):
            assert got.source == "log+capture" and seen.grad_norm == float(f"{got.grad_norm:.3f}")


def test_the_real_moe_excerpt_with_other_prints_between_its_lines() -> None:
    run = read_log(fixture("core-0.19.2-moe-bf16-shipped"))
    assert [(it.number, it.losses, it.grad_norm) for it in run.iterations] == [
        (1, {"lm loss": 9.008873}, 0.005), (2, {"lm loss": 9.008592}, 0.005),
        (3, {"lm loss": 9.006834}, 0.006)]


def test_the_oldest_family_is_recognised_by_its_timestamp() -> None:
    line = megatron_line(1, {"lm loss": 9.1}, 2.24, stamp=STAMP_SECONDS, decoupled_lr=1e-5)
    run = read_log(line)
    assert run.family == log_lines.FAMILY_SECONDS
    assert run.iterations[0].losses == {"lm loss": 9.1}  # decoupled learning rate is no loss
    assert read_log(line.replace(STAMP_SECONDS, "")).family == log_lines.FAMILY_PLAIN


def test_every_loss_key_and_not_the_moe_metrics() -> None:
    line = megatron_line(4, {"lm loss": 9.1, "load_balancing_loss": 1.02, "mtp_1 loss": 9.3,
                             "z_loss": 0.001}, 1.5, moe_metrics={"load_imbalance": 1.23})
    it = read_log(line).iterations[0]
    assert it.losses == {"lm loss": 9.1, "load_balancing_loss": 1.02, "mtp_1 loss": 9.3,
                         "z_loss": 0.001}


@pytest.mark.parametrize("prefix", ["[rank0]:", "[rank7]: ", "0: ", "12: ", "[default0]:",
                                    "\x1b[32m", "progress 40%\r"])
def test_launcher_prefixes_colours_and_carriage_returns(prefix: str) -> None:
    line = megatron_line(2, {"lm loss": 8.88}, 2.336)
    coloured = line.replace("lm loss", "\x1b[1mlm loss\x1b[0m")
    run = read_log(f"{prefix}{coloured}\x1b[0m\n")
    assert [(it.number, it.losses, it.grad_norm) for it in run.iterations] == [
        (2, {"lm loss": 8.88}, 2.336)]
    assert iteration_of(prefix + line) == 2


def test_other_ranks_lines_between_iterations_are_ignored() -> None:
    text = "\n".join([
        "[rank1]: UserWarning: iteration count is large",
        megatron_line(1, {"lm loss": 9.13}, 2.24),
        "[rank0]:[W1206 05:37:47 ProcessGroupNCCL.cpp:1575] Warning: iteration 5 of 3 | x: 1 |",
        megatron_line(2, {"lm loss": 8.88}, 2.336)])
    assert [it.number for it in read_log(text).iterations] == [1, 2]


def test_a_line_cut_by_another_print_is_joined_and_a_cut_field_left_out() -> None:
    line = megatron_line(3, {"lm loss": 8.654756}, 2.613)
    cut = line.index(" loss scale")
    joined = read_log(line[:cut] + "\n[rank1]: a warning\n" + line[cut:] + "\n")
    assert joined.iterations[0].losses == {"lm loss": 8.654756}
    assert joined.iterations[0].grad_norm == 2.613 and joined.iterations[0].nan == 0
    # the tail under a launcher's prefix
    at_norm = line.index(" grad norm")
    for prefix in ("[rank0]:", "[default0]:", "0: "):
        tail = read_log(line[:at_norm] + f"\n{prefix}{line[at_norm:]}\n").iterations[0]
        assert tail.grad_norm == 2.613 and tail.nan == 0
    # cut inside the grad norm's value: that value is not read (never a wrong number)
    middle = line.index("grad norm: ") + len("grad norm: 2.6")
    broken = read_log(line[:middle] + "[rank1]: warning\n" + line[middle:] + "\n")
    assert broken.iterations[0].grad_norm is None
    assert broken.iterations[0].losses == {"lm loss": 8.654756}


@pytest.mark.parametrize("printed, kept", [
    # from scratch, then further
    ([(1, 9.0), (2, 8.0), (1, 9.5), (2, 8.5), (3, 7.5)], [(1, 9.5), (2, 8.5), (3, 7.5)]),
    # from scratch, and stopped earlier than the first attempt: nothing of the first is kept
    ([(1, 9.0), (2, 8.0), (3, 7.0), (1, 9.5), (2, 8.5)], [(1, 9.5), (2, 8.5)]),
    # from a checkpoint saved after iteration 2
    ([(1, 9.0), (2, 8.0), (3, 7.0), (3, 7.2), (4, 6.9)], [(1, 9.0), (2, 8.0), (3, 7.2), (4, 6.9)]),
])
def test_a_restarted_run_is_the_run_that_went_on(printed: list[tuple[int, float]],
                                                  kept: list[tuple[int, float]]) -> None:
    lines = [megatron_line(n, {"lm loss": loss}, 2.0) for n, loss in printed]
    run = read_log("\n".join(lines[:2] + ["restarting"] + lines[2:]))
    assert run.restarts == 1
    assert [(it.number, it.losses["lm loss"]) for it in run.iterations] == kept


def test_not_a_number_and_infinity() -> None:
    it = read_log(megatron_line(5, {"lm loss": math.nan}, math.nan, nan=1)).iterations[0]
    assert it.losses == {} and math.isnan(it.grad_norm or 0.0) and it.nan == 1
    custom = read_log("iteration 5/ 9 | lm loss: inf | grad norm: -inf |").iterations[0]
    assert custom.losses == {"lm loss": math.inf} and custom.grad_norm == -math.inf


@pytest.mark.parametrize("printed, value, half_unit, decimals", [
    ("2.240", 2.24, 5e-4, 3), ("9.132912E+00", 9.132912, 5e-7, 6),
    ("1.000000E-04", 1e-4, 5e-11, 6), ("3", 3.0, 0.5, 0), ("2.2396607398986816", 2.2396607398986816,
                                                          5e-17, 16)])
def test_a_printed_number_keeps_its_resolution(printed: str, value: float, half_unit: float,
                                               decimals: int) -> None:
    got = log_lines.parse_number(printed)
    assert got is not None
    assert got[0] == value and math.isclose(got[1], half_unit) and got[2] == decimals
    assert log_lines.parse_number("2.2[rank1]") is None


def test_no_iteration_lines() -> None:
    assert read_log("").iterations == [] and read_log("").family is None
    assert read_log("Traceback (most recent call last):\n  ...\nRuntimeError: CUDA OOM\n"
                    ).iterations == []
    assert iteration_of("[after training is done] datetime: 2026-12-06") is None


def write_capture(folder: Path, rank: int, records: list[dict[str, object]],
                  tail: str = "") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{log_lines.CAPTURE_PREFIX}{rank}.jsonl", "w") as f:
        f.write("".join(json.dumps(record) + "\n" for record in records) + tail)


def test_the_capture_replaces_the_printed_values(tmp_path: Path) -> None:
    reported = json.loads((FIXTURES / "core-0.19.2-zero1-hotfix.reported.json").read_text())
    values = reported["reported"]
    records: list[dict[str, object]] = [{"kind": "process", "hotfix": "active"}]
    records += [{"kind": "iteration", "iteration": i + 1, "grad_norm": values["grad_norm"][i],
                 "losses": {"lm loss": values["loss/lm loss"][i]}, "skipped": 0}
                for i in range(2)]  # the run stopped writing before iteration 3
    write_capture(tmp_path, 0, [{"kind": "iteration", "iteration": 1, "grad_norm": 99.0}])
    write_capture(tmp_path, 1, records + [[1, 2]], tail='{"kind": "iteration", "iter')  # type: ignore[list-item]
    run = read_log(fixture("core-0.19.2-zero1-hotfix"), str(tmp_path))
    assert run.hotfix == "active" and run.capture_note is None
    first, _, third = run.iterations
    assert first.grad_norm == values["grad_norm"][0] and first.source == "log+capture"
    assert first.losses["lm loss"] == 9.132906  # as printed (see merge)
    assert first.resolution == {"lm loss": 5e-7, GRAD_NORM: 0.0}
    assert first.grad_norm_digits is None
    assert third.grad_norm == 2.613 and third.source == "log"


def test_an_iteration_only_the_capture_has(tmp_path: Path) -> None:
    write_capture(tmp_path, 0, [{"kind": "iteration", "iteration": 2, "grad_norm": 1.23456789,
                                 "losses": {"lm loss": 9.1}}])
    run = read_log(megatron_line(1, {"lm loss": 9.1}, 1.235), str(tmp_path))
    assert [(it.number, it.losses, it.grad_norm, it.source) for it in run.iterations] == [
        (1, {"lm loss": 9.1}, 1.235, "log"), (2, {}, 1.23456789, "capture")]


def test_a_capture_that_is_not_what_was_printed_is_not_trusted(tmp_path: Path) -> None:
    write_capture(tmp_path, 0, [
        {"kind": "iteration", "iteration": 1, "grad_norm": 2.2396607},
        {"kind": "iteration", "iteration": 2, "grad_norm": 2.3375},  # printed 2.336
        {"kind": "iteration", "iteration": 3, "grad_norm": float("nan")}])
    lines = [megatron_line(1, {"lm loss": 9.1}, 2.24), megatron_line(2, {"lm loss": 9.0}, 2.336),
             megatron_line(3, {"lm loss": 8.9}, float("nan"), nan=1)]
    run = read_log("\n".join(lines), str(tmp_path))
    assert [(it.grad_norm, it.source) for it in run.iterations][:2] == [
        (2.2396607, "log+capture"), (2.336, "log")]
    assert math.isnan(run.iterations[2].grad_norm or 0.0)
    assert run.iterations[2].source == "log+capture"
    assert run.capture_note == ("the capture's grad norm is not the printed one at iterations 2: "
                                "the printed values are used there")


def test_a_missing_capture_is_said(tmp_path: Path) -> None:
    run = read_log(megatron_line(1, {"lm loss": 9.1}, 1.235), str(tmp_path))
    assert run.capture_note == f"no capture in {tmp_path}" and run.iterations[0].source == "log"
