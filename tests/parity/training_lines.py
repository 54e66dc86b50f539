"""Lines in the format of Megatron-LM's ``training_log``, for the cases no real excerpt holds
(a NaN, a restart, a cut line). The format is Megatron's own, field by field, as each release's
``megatron/training/training.py`` builds ``log_string`` (0.14/0.15: a timestamp to the second
and ``decoupled learning rate``; 0.16 on: to the microsecond; 0.18 on: MoE metrics ``{:.2f}``
after the losses). The real excerpts are in ``fixtures/``."""

from __future__ import annotations

STAMP_SECONDS = " [2026-12-06 05:37:39]"
STAMP_MICROS = " [2026-12-06 05:37:39.783399]"


def megatron_line(iteration: int, losses: dict[str, float], grad_norm: float | None,
                  stamp: str = STAMP_MICROS, train_iters: int = 3, skipped: int = 0,
                  nan: int = 0, moe_metrics: dict[str, float] | None = None,
                  decoupled_lr: float | None = None) -> str:
    line = stamp
    line += f" iteration {iteration:8d}/{train_iters:8d} |"
    line += f" consumed samples: {8 * iteration:12d} |"
    line += f" elapsed time per iteration (ms): {900.4:.1f} |"
    line += f" learning rate: {1e-4:.6E} |"
    if decoupled_lr is not None:
        line += f" decoupled learning rate: {decoupled_lr:.6E} |"
    line += f" global batch size: {8:5d} |"
    for key, value in losses.items():
        if value >= 0.0:  # Megatron prints only a non-negative average (so never a NaN one)
            line += f" {key}: {value:.6E} |"
    line += "".join(f" {k}: {v:.2f} |" for k, v in (moe_metrics or {}).items())
    line += f" loss scale: {1.0:.1f} |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    line += f" num zeros: {0} |"
    line += f" number of skipped iterations: {skipped:3d} |"
    line += f" number of nan iterations: {nan:3d} |"
    return line
