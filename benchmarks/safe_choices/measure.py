"""One variant, measured in its worker: the inputs, one step, the first warm-up at set-up (nothing
timed), then in each turn a warm-up and the timed steps, one CUDA event pair each."""

from __future__ import annotations

from .build import build, phase_timer
from .plan import gemm_flop
from .summary import step_stats


def setup(spec, info):
    """Import, build and warm up one variant; return the function that measures one turn."""
    info["spec"] = spec
    phase = phase_timer(info)
    torch, hotfix, model = build(spec, info, phase)
    if info.get("invalid"):
        return None  # no number for a variant that is not what it says

    step = stepper(torch, model, spec)
    for n in range(spec["warmup"]):  # first use: kernel loading, TE's torch.compile
        step(n)
    torch.cuda.synchronize()
    phase("first_warmup")
    info["peak_mem_mb_first_warmup"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    if hotfix is not None:
        info["hotfix_summary"] = hotfix.summary()

    def turn(rep, out):  # every turn measures the same; ``rep`` is the driver's count
        timed_turn(torch, step, spec, out)

    return turn


def stepper(torch, model, spec):
    """``step(n)``: zero the gradient buffer, forward and backward of every microbatch,
    ``finish_grad_sync()``; returns the last microbatch's loss."""
    inputs = []  # made before timing; two sets, alternated, so no step reuses the last's input
    dev = torch.device("cuda", 0)
    gen = torch.Generator(device=dev)
    for i in range(2 * spec["microbatches"]):
        gen.manual_seed(10_000 + i)
        inputs.append(torch.randn(spec["tokens"], spec["hidden"], device=dev,
                                  dtype=torch.bfloat16, generator=gen))

    def step(n):
        model.zero_grad_buffer()
        for mb in range(spec["microbatches"]):
            x = inputs[(n % 2) * spec["microbatches"] + mb].detach().requires_grad_()
            loss = model(x).float().square().mean()
            loss.backward()
        model.finish_grad_sync()
        return loss.detach()

    return step


def timed_turn(torch, step, spec, out):
    """Warm-up, then the timed steps, one CUDA event pair each; peak memory over them."""
    for n in range(spec["warmup"]):
        step(n)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    events, losses = [], []
    for n in range(spec["steps"]):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        losses.append(step(n))
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    out["peak_mem_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    out["peak_reserved_mb"] = round(torch.cuda.max_memory_reserved() / 2**20, 1)
    out["step_ms"] = [round(s.elapsed_time(e), 3) for s, e in events]
    out.update(step_stats(out["step_ms"]))
    out["gemm_tflops"] = round(gemm_flop(spec) / out["step_ms_median"] / 1e9, 1)
    out["loss_finite"] = bool(torch.isfinite(torch.stack(losses)).all())
