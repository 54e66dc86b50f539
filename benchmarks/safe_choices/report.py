"""The report: the markdown table of a result for docs/PERFORMANCE.md, with the paragraph that
says what was measured on what, and the compact table a GPU call prints at its end."""

from __future__ import annotations

from .plan import gemm_flop, unit_params


def describe(doc):
    """One paragraph: what was measured, on what."""
    size = doc["size"]
    first = next((r["result"] for r in doc["records"] if (r.get("result") or {}).get("ok")), {})
    n_params = first.get("n_params") or size["units"] * unit_params(size["hidden"], size["ffn"])
    return (f"{size['units']} units of TE LayerNormLinear(h, 3h) + Linear(h, h) + "
            f"LayerNormMLP(h, ffn), h {size['hidden']}, ffn {size['ffn']}: "
            f"{count(n_params)} parameters, bf16; {size['tokens']} tokens x "
            f"{size['microbatches']} microbatches per step; {size['warmup']} warm-up + "
            f"{size['steps']} timed steps (CUDA events) per run; one process per variant, "
            f"runs taken in turn (A B C D A B C D ...), one at a time on the GPU. "
            f"{first.get('gpu', '?')}, torch {first.get('torch', '?')}, TransformerEngine "
            f"{first.get('te', '?')}; fake 2-rank group with NCCL work semantics; "
            f"{doc.get('date_utc', '?')} UTC.")


def count(n):
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def fmt_ratio(r):
    if r is None:
        return ""
    if r["n"] == 1:
        return f"{r['median']:.3f}"
    return f"{r['median']:.3f} [{r['min']:.3f}–{r['max']:.3f}]"


def render_markdown(doc):
    """The README table: one row per release, ZeRO level and variant."""
    lines = [describe(doc), "",
             "| release | ZeRO | variant | runs | median step ms (each run) | p10–p90 ms (each run)"
             " | peak allocated MB | step time / hotfix, median [min–max] over runs"
             " | peak memory / hotfix |",
             "|---|---|---|---|---|---|---|---|---|"]
    for g in doc["summary"]:
        for row in g["rows"]:
            ok = [run for run in row["runs"] if run["ok"]]
            failed = [run for run in row["runs"] if not run["ok"]]
            meds = ", ".join(f"{run['step_ms_median']:.1f}" for run in ok)
            p1090 = ", ".join(f"{run['step_ms_p10']:.1f}–{run['step_ms_p90']:.1f}" for run in ok)
            peaks = ", ".join(sorted({f"{run['peak_mem_mb']:.0f}" for run in ok}))
            if failed:
                meds += ("; " if meds else "") + f"{len(failed)} failed: {failed[0]['error'][:80]}"
            lines.append(f"| {g['release']} | {g['zero']} | {row['title']} | {len(ok)} | {meds} "
                         f"| {p1090} | {peaks} | {fmt_ratio(row['time_ratio'])} "
                         f"| {fmt_ratio(row['mem_ratio'])} |")
    for s in doc.get("skipped", []):
        lines.append(f"\nNot run: {s['group']} ({s['reason']}).")
    return "\n".join(lines)


def compact_table(doc):
    flop = gemm_flop(doc["size"])
    lines = [f"{'group':<15} {'variant':<9} {'ok':>2} {'median ms':>9} {'p10':>7} {'p90':>7} "
             f"{'TFLOP/s':>7} {'t/hotfix [min-max]':>22} {'peak MB':>8} {'m/hotfix':>8}"]
    nan = float("nan")
    for g in doc["summary"]:
        for row in g["rows"]:
            p = row["pooled"]
            peaks = [run["peak_mem_mb"] for run in row["runs"] if run["ok"]]
            median = p.get("step_ms_median", nan)
            lines.append(
                f"{g['group']:<15} {row['variant']:<9} {row['n_ok']:>2} {median:>9.2f} "
                f"{p.get('step_ms_p10', nan):>7.2f} {p.get('step_ms_p90', nan):>7.2f} "
                f"{flop / median / 1e9:>7.1f} {fmt_ratio(row['time_ratio']):>22} "
                f"{(max(peaks) if peaks else nan):>8.0f} "
                f"{(row['mem_ratio'] or {}).get('median', nan):>8.3f}")
    for s in doc.get("skipped", []):
        lines.append(f"skipped {s['group']}: {s['reason']}")
    return "\n".join(lines)
