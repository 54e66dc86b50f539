"""``reduce-once`` and the release defect it repairs, ``unsharded-grads-reduced-twice``: how the
need is recognised (what the hooks' reduction condition yields), what the fix does to the
pipeline, and, on the real library, ZeRO-1 / no_shard with ``overlap_grad_reduce=False``."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import releases
import torch

from mfsdp_hotfix import (
    cli,
    detection,
    fingerprints,
    fix_catalogue,
    registry,
    release_defects,
    tree,
)
from mfsdp_hotfix.fixes import reduce_once
from mfsdp_hotfix.selftest.runner import run_case
from mfsdp_hotfix.selftest.spec import CaseSpec
from mfsdp_hotfix.structure import hooks, overwrite_setter, synchronous_reductions

RELEASE_CONDITION = "if grad_reduce_every_bprop or is_last_microbatch or self.model_auto_sync:"


def pipeline(strategy: str, overlap: bool, outer: int = 1) -> Any:
    config = SimpleNamespace(data_parallel_sharding_strategy=strategy,
                             overlap_grad_reduce=overlap)
    index = SimpleNamespace(use_hybrid_fsdp=outer > 1,
                            get_outer_fsdp_group=lambda: SimpleNamespace(size=lambda: outer))
    return SimpleNamespace(buffer=SimpleNamespace(ddp_config=config, dist_index=index))


@pytest.mark.parametrize("strategy", ["optim", "no_shard"])
def test_under_hsdp_the_hooks_keep_the_reduction_that_carries_dp_outer(strategy: str) -> None:
    assert reduce_once.reduced_in_finish_grad_sync(pipeline(strategy, False, outer=1), BOTH)
    assert not reduce_once.reduced_in_finish_grad_sync(pipeline(strategy, False, outer=2), BOTH)


BOTH = frozenset({"optim", "no_shard"})


@pytest.mark.parametrize(("strategy", "overlap", "strategies", "skipped"), [
    ("optim", False, BOTH, True), ("no_shard", False, BOTH, True), ("optim", True, BOTH, False),
    ("no_shard", True, BOTH, False), ("optim_grads", True, BOTH, False),
    ("optim_grads_params", True, BOTH, False), ("optim_grads", False, BOTH, False),
    ("no_shard", False, frozenset({"optim"}), False), ("optim", False, frozenset(), False)])
def test_the_hooks_leave_the_pipeline_alone_only_where_finish_grad_sync_reduces(
        strategy: str, overlap: bool, strategies: frozenset[str], skipped: bool) -> None:
    assert reduce_once.reduced_in_finish_grad_sync(pipeline(strategy, overlap),
                                                   strategies) is skipped


class ParamAndGradBuffer:
    """As megatron-fsdp 0.3.0-0.4.0: the reduce-scatter reduces, the all-reduce skips every
    buffer (its inverted guard)."""

    def reduce_scatter_gradients(self, async_op=True):  # type: ignore[no-untyped-def]
        for g in self.parameter_groups:  # type: ignore[attr-defined]
            gbuf = g.main_grad_buffer
            if gbuf is None:
                continue
            torch.distributed.reduce_scatter_tensor(gbuf.get_shard_from_local_buffer(), gbuf.data)

    def all_reduce_gradients(self, async_op=False):  # type: ignore[no-untyped-def]
        for g in self.parameter_groups:  # type: ignore[attr-defined]
            gbuf = g.main_grad_buffer
            if gbuf is not None:
                continue
            torch.distributed.all_reduce(gbuf.data)


def test_apply_defers_only_the_strategies_whose_synchronous_reduction_reduces() -> None:
    calls: list[str] = []

    class GradReducePipeline:
        def __init__(self, strategy: str, overlap: bool) -> None:
            self.buffer = pipeline(strategy, overlap).buffer

        def reduce_gradients(self, params: list[int]) -> str:
            calls.append("reduce")
            return "reduced"

        def reset(self) -> None:
            calls.append("reset")

    module = ModuleType("fake_buffer_module")
    module.GradReducePipeline = GradReducePipeline  # type: ignore[attr-defined]
    module.ParamAndGradBuffer = ParamAndGradBuffer  # type: ignore[attr-defined]
    assert reduce_once.reducing_strategies(ParamAndGradBuffer) == {"optim"}
    originals = dict(GradReducePipeline.__dict__)
    undo = reduce_once.apply(module)
    zero1 = GradReducePipeline("optim", False)
    assert zero1.reduce_gradients([1]) is None and zero1.reset() is None and calls == []
    no_shard = GradReducePipeline("no_shard", False)  # its all-reduce reduces nothing: kept
    assert no_shard.reduce_gradients([1]) == "reduced"
    overlapped = GradReducePipeline("optim", True)
    assert overlapped.reduce_gradients([1]) == "reduced"
    overlapped.reset()
    assert calls == ["reduce", "reduce", "reset"]
    assert undo() is True
    assert all(GradReducePipeline.__dict__[name] is originals[name]
               for name in ("reduce_gradients", "reset"))


def hooks_source(release: Path) -> str:
    model = next(release.rglob("megatron_fsdp.py"))
    return fingerprints.parse_file(model).source(registry.HOOKS)


@pytest.mark.parametrize(("dist", "version", "needed"), [
    ("megatron-fsdp", "0.1.0", False), ("megatron-fsdp", "0.2.3", False),
    ("megatron-fsdp", "0.3.1", True), ("megatron-fsdp", "0.4.0", True),
    ("megatron-fsdp", "0.5.1", True), ("megatron-fsdp", "0.6.1", True),
    ("megatron-core", "0.14.0", False), ("megatron-core", "0.17.1", True),
    ("megatron-core", "0.19.2", True)])
def test_every_release_reduces_in_the_hooks_whatever_the_overlap_and_again_where_it_can(
        dist: str, version: str, needed: bool) -> None:
    """The hooks' condition is the releases' everywhere; the fix is needed where the
    synchronous reduction of finish_grad_sync reduces too (before megatron-fsdp 0.3.0 /
    megatron-core 0.16 neither does, and the hooks' reduction is the only one)."""
    release = releases.unpacked(dist, version)
    assert hooks.hook_reduction(hooks_source(release)) == hooks.REDUCES_ALWAYS
    copy = registry.COPIES[0] if dist == "megatron-fsdp" else registry.COPIES[1]
    found = detection.find_installed(copy, [str(release)])
    assert found is not None
    assert detection.detect_file(copy, found).needs(fix_catalogue.REDUCE_ONCE) is needed


def test_nvidia_main_reduces_once() -> None:
    tree = releases.git_tree("main")
    if tree is None:
        pytest.skip("NVIDIA main needs a Megatron-LM clone: set MFSDP_TEST_MEGATRON_LM")
    assert hooks.hook_reduction(hooks_source(tree)) == hooks.REDUCES_ONCE
    found = detection.find_installed(registry.COPIES[0], [str(tree)])
    assert found is not None
    assert not detection.detect_file(registry.COPIES[0], found).needs(fix_catalogue.REDUCE_ONCE)


@pytest.mark.parametrize(("condition", "expected"), [
    ("if grad_reduce_every_bprop or (\n                self.ddp_config.overlap_grad_reduce\n"
     "                and (is_last_microbatch or self.model_auto_sync)\n            ):",
     hooks.REDUCES_ONCE),
    ("if self.data_parallel_sharding_strategy in ('optim_grads', 'optim_grads_params') or "
     "(self.ddp_config.overlap_grad_reduce and not (not is_last_microbatch and not "
     "self.model_auto_sync)):", hooks.REDUCES_ONCE),
    ("if grad_reduce_every_bprop or not self.ddp_config.overlap_grad_reduce or "
     "is_last_microbatch or self.model_auto_sync:", None),
    ("if grad_reduce_every_bprop or self.ddp_config.overlap_grad_reduce:", None),
    ("if grad_reduce_every_bprop or self.should_reduce():", None),
], ids=["nvidia-6357", "other-words", "reduces-without-overlap", "every-microbatch",
        "a-call"])
def test_a_fork_is_judged_by_what_its_condition_yields(condition: str,
                                                        expected: str | None) -> None:
    source = hooks_source(releases.unpacked("megatron-fsdp", "0.6.1"))
    assert source.count(RELEASE_CONDITION) == 2
    assert hooks.hook_reduction(source.replace(RELEASE_CONDITION, condition)) == expected


def test_a_fork_with_the_upstream_condition_needs_no_fix(tmp_path: Path) -> None:
    root = tmp_path / "site"
    shutil.copytree(releases.unpacked("megatron-fsdp", "0.6.1"), root)
    model = root / "megatron_fsdp" / "megatron_fsdp.py"
    model.write_text(model.read_text().replace(
        RELEASE_CONDITION, "if grad_reduce_every_bprop or (self.ddp_config.overlap_grad_reduce "
                           "and (is_last_microbatch or self.model_auto_sync)):"))
    found = detection.detect_file(registry.COPIES[0],
                                  root / "megatron_fsdp" / "param_and_grad_buffer.py")
    shape = found.shapes[registry.HOOKS]
    assert shape is not None and shape.name.endswith("reduces unsharded gradients once")
    assert not found.needs(fix_catalogue.REDUCE_ONCE) and not found.needs(
        fix_catalogue.MISSED_POST_BACKWARD)


# NVIDIA/Megatron-LM#6357's condition of both hooks, in its words (comments aside).
UPSTREAM_CONDITION = ("if grad_reduce_every_bprop or (\n                self.ddp_config"
                      ".overlap_grad_reduce\n                and (is_last_microbatch or "
                      "self.model_auto_sync)\n            ):")
# The first statement after the reduction of _process_post_backward_gradients.
AFTER_THE_IF = "            # Mark parameters as processed.\n"
LAST_MICROBATCH = '            is_last_microbatch = getattr(self, "is_last_microbatch", False)\n'
# Each edit reduces outside the condition, or makes it undecidable.
OUTSIDE_THE_CONDITION = {
    "else-branch": (AFTER_THE_IF, "            else:\n                self.grad_reduce_pipeline"
                                  ".reduce_gradients(param_list)\n\n" + AFTER_THE_IF),
    "after-the-if": (AFTER_THE_IF, "            self.grad_reduce_pipeline.reduce_gradients("
                                   "param_list)\n\n" + AFTER_THE_IF),
    "getattr-default": ("(\n                self.ddp_config.overlap_grad_reduce\n",
                        '(\n                getattr(self, "reduce_in_hooks", '
                        'self.ddp_config.overlap_grad_reduce)\n'),
    "unknown-assignment": (LAST_MICROBATCH, LAST_MICROBATCH + "            grad_reduce_every_"
                           "bprop = grad_reduce_every_bprop or self._reduce_every_bprop()\n"),
}


def upstream_condition_copy(root: Path) -> Path:
    """megatron-fsdp 0.6.1 with both hooks' condition rewritten as #6357 writes it."""
    shutil.copytree(releases.unpacked("megatron-fsdp", "0.6.1"), root)
    model = root / "megatron_fsdp" / "megatron_fsdp.py"
    text = model.read_text()
    assert text.count(RELEASE_CONDITION) == 2
    model.write_text(text.replace(RELEASE_CONDITION, UPSTREAM_CONDITION))
    return model


def test_the_upstream_condition_alone_needs_no_fix(tmp_path: Path) -> None:
    upstream_condition_copy(tmp_path / "site")
    (copy,) = tree.judge(str(tmp_path / "site"))["copies"]
    assert copy["fixes"]["reduce-once"]["state"] == "not needed"


@pytest.mark.parametrize("variant", sorted(OUTSIDE_THE_CONDITION))
def test_a_reduction_outside_the_upstream_condition_is_never_not_needed(
        tmp_path: Path, variant: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A reduction the hooks may call outside #6357's condition, or under one the recogniser
    cannot decide, leaves the copy needing the fix or unverified: never "not needed"."""
    model = upstream_condition_copy(tmp_path / "site")
    old, new = OUTSIDE_THE_CONDITION[variant]
    text = model.read_text()
    assert old in text
    model.write_text(text.replace(old, new, 1))
    assert hooks.hook_reduction(hooks_source(tmp_path / "site")) is None
    (copy,) = tree.judge(str(tmp_path / "site"))["copies"]
    assert copy["fixes"]["reduce-once"]["state"] == "unverified"
    assert cli.main(["status", "--verbose", "--path", str(tmp_path / "site")]) in (0, 1)
    out = capsys.readouterr().out
    assert "reduce-once: unverified" in out and "reduce-once: not needed" not in out


def test_the_real_upstream_change_is_still_recognised() -> None:
    """NVIDIA/Megatron-LM#6357's own megatron_fsdp.py, read from the clone."""
    head = releases.git_tree("refs/pull/6357/head")
    if head is None:
        pytest.skip("NVIDIA/Megatron-LM#6357 needs a Megatron-LM clone: set "
                    "MFSDP_TEST_MEGATRON_LM")
    assert hooks.hook_reduction(hooks_source(head)) == hooks.REDUCES_ONCE
    setter = fingerprints.parse_file(head / "megatron_fsdp" / "megatron_fsdp.py").source(
        registry.OVERWRITE_SETTER)
    assert overwrite_setter.decides_overwrite_main_grad(setter)
    found = detection.detect_file(registry.COPIES[0],
                                  head / "megatron_fsdp" / "param_and_grad_buffer.py")
    assert not found.needs(fix_catalogue.REDUCE_ONCE) and not found.needs(
        fix_catalogue.ZERO1_ACCUMULATE)


def test_a_collective_outside_the_guarded_loop_is_not_skipping(tmp_path: Path) -> None:
    """0.3.1's all_reduce_gradients skips every buffer; with one more all-reduce after its
    loop it reduces, and is recognised as neither."""
    buffer = releases.unpacked("megatron-fsdp", "0.3.1") / "megatron_fsdp" / \
        "param_and_grad_buffer.py"
    source = fingerprints.parse_file(buffer).source(registry.ALL_REDUCE)
    assert synchronous_reductions.skips_every_buffer(source)
    loop_end = "        for op in all_reduce_ops:\n"
    assert loop_end in source
    edited = source.replace(loop_end, "        torch.distributed.all_reduce(self.grad_data)\n"
                            + loop_end)
    assert not synchronous_reductions.skips_every_buffer(edited)
    assert not synchronous_reductions.reduces_every_buffer(edited)


def unrecognised_hooks_copy(root: Path, version: str) -> Path:
    """A release whose hooks decide the reduction by a call the recogniser cannot evaluate."""
    shutil.copytree(releases.unpacked("megatron-fsdp", version), root)
    model = root / "megatron_fsdp" / "megatron_fsdp.py"
    text = model.read_text()
    assert text.count(RELEASE_CONDITION) == 2
    model.write_text(text.replace(RELEASE_CONDITION,
                                  "if grad_reduce_every_bprop or self.should_reduce():"))
    return root


@pytest.mark.parametrize(("version", "state", "limited"), [
    ("0.2.3", "not needed", []),
    ("0.3.1", "unverified", ["optim"]),
    ("0.6.1", "unverified", ["optim", "no_shard"])])
def test_unrecognised_hooks_limit_only_the_strategies_whose_synchronous_reduction_reduces(
        tmp_path: Path, version: str, state: str, limited: list[str]) -> None:
    """Where finish_grad_sync reduces nothing (0.1.0-0.2.3 both strategies, 0.3-0.4 no_shard)
    the hooks' reduction is the only one, whatever it looks like: not affected, not refused."""
    (copy,) = tree.judge(str(unrecognised_hooks_copy(tmp_path / "site", version)))["copies"]
    assert copy["shapes"][registry.HOOKS] is None
    assert copy["fixes"]["reduce-once"]["state"] == state
    labels = {"optim": "ZeRO-1 (optim)", "no_shard": "no_shard"}
    assert [limit["configuration"] for limit in copy["limits"]
            if limit["fix"] == "reduce-once" and not limit["configuration"].startswith(
                "HSDP")] == [f"{labels[strategy]} with overlap_grad_reduce=False"
                             for strategy in limited]


def test_the_defect_is_the_fixs() -> None:
    defect = release_defects.UNSHARDED_GRADS_REDUCED_TWICE
    assert defect in release_defects.RELEASE_DEFECTS and defect.fix == fix_catalogue.REDUCE_ONCE.id
    assert release_defects.defects_of({defect.fix: "applied"}) == [defect]
    assert release_defects.defects_of({defect.fix: "not needed"}) == []


def case(strategy: str, hotfix: str, **fields: Any) -> CaseSpec:
    return CaseSpec(flavour="standalone", path=str(releases.unpacked("megatron-fsdp", "0.6.1")),
                    hotfix=hotfix, double_buffer=False, units=3, strategy=strategy,
                    overlap_grad_reduce=False, **fields)


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "fields"), [
    ("optim", {"linear": "unfused"}), ("no_shard", {"grad_reduce": "per-token"})],
    ids=["zero1", "no_shard-sum"])
def test_shipped_reduces_twice_and_the_fix_reduces_once(strategy: str,
                                                         fields: dict[str, Any]) -> None:
    shipped = run_case(case(strategy, "off", **fields))
    assert not shipped.crashed and (shipped.max_abs_grad_error or 0) > 0, shipped.exception
    fixed = run_case(case(strategy, "on", **fields))
    assert not fixed.crashed and fixed.max_abs_grad_error == 0.0, fixed.exception


def hsdp_case(path: Path, hotfix: str, overlap: bool) -> CaseSpec:
    return CaseSpec(flavour="standalone", path=str(path), hotfix=hotfix, strategy="optim",
                    world=4, outer=2, overlap_grad_reduce=overlap, double_buffer=False,
                    linear="unfused", microbatches=1, units=4)


@pytest.mark.slow
def test_hsdp_zero1_without_overlap_is_refused_not_made_worse() -> None:
    """HSDP (DP-Outer 2 x DP-Shard 2) with ZeRO-1 and overlap_grad_reduce=False, megatron-fsdp
    0.6.1 on 4 gloo ranks: wrong as shipped (reduced twice), and reduce-once alone would leave
    out the DP-Outer all-reduce (wrong too, by more). With the hotfix the model is refused when
    it is built, naming the workaround, which is exact."""
    release = releases.unpacked("megatron-fsdp", "0.6.1")
    shipped = run_case(hsdp_case(release, "off", overlap=False))
    assert not shipped.crashed and (shipped.max_abs_grad_error or 0) > 0.1, shipped.exception
    refused = run_case(hsdp_case(release, "on", overlap=False))
    assert refused.crashed and "UnsupportedConfiguration" in (refused.exception or "")
    assert "Workaround: overlap_grad_reduce=True" in (refused.exception or "")
    workaround = run_case(hsdp_case(release, "on", overlap=True))
    assert not workaround.crashed and (workaround.max_abs_grad_error or 1) < 1e-6, (
        workaround.exception)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["no_shard", "optim"])
def test_hsdp_over_a_one_rank_dp_shard_group_summed_is_not_refused(strategy: str) -> None:
    """HSDP on 2 gloo ranks, DP-Outer 2 x DP-Shard 1, without overlap, gradients summed
    (calculate_per_token_loss), megatron-fsdp 0.6.1: with the hotfix it is built and exact (it
    was refused before). As shipped, no_shard is exact too (the second reduction, over one rank,
    changes nothing) and ZeRO-1 is wrong, so the hotfix repairs it. Averaged, the second
    reduction scales again: wrong as shipped, and refused."""
    release = str(releases.unpacked("megatron-fsdp", "0.6.1"))

    def hsdp1(hotfix: str, grad_reduce: str) -> CaseSpec:
        return CaseSpec(flavour="standalone", path=release, hotfix=hotfix, strategy=strategy,
                        world=2, outer=2, overlap_grad_reduce=False, double_buffer=False,
                        grad_reduce=grad_reduce, microbatches=2, units=3)

    shipped = run_case(hsdp1("off", "per-token"))
    assert not shipped.crashed, shipped.exception
    if strategy == "no_shard":
        assert (shipped.max_abs_grad_error or 1) < 1e-6
    else:
        assert (shipped.max_abs_grad_error or 0) > 0.1
    summed = run_case(hsdp1("on", "per-token"))
    assert not summed.crashed and (summed.max_abs_grad_error or 1) < 1e-6, summed.exception
    averaged = run_case(hsdp1("off", "scale-then-sum"))
    assert not averaged.crashed and (averaged.max_abs_grad_error or 0) > 0.1, averaged.exception
    refused = run_case(hsdp1("on", "scale-then-sum"))
    assert "UnsupportedConfiguration" in (refused.exception or ""), refused.exception
