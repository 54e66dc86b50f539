"""``expert-accumulate`` and the release defect it repairs, ``moe-op-fuser-wgrad-overwrite``:
how the need is recognised (the shape of ``TEGroupedMLP._ensure_main_grad``, read from every
megatron-core release), and what the fix does to the real 0.19.2 code.

The real code runs on CPU without TransformerEngine: megatron-core 0.19.2's
``transformer/moe/experts.py`` imports without it, and its ``TEGroupedMLP``'s fused pre-forward
hook (``_make_fused_impl_pre_forward_hook``) and ``_ensure_main_grad`` run as shipped. What needs
TransformerEngine is stood in for, and is what this file cannot show: the expert linears are
plain modules (TE's ``GroupedLinear`` cannot be built here), and Megatron-FSDP's pre-forward
all-gather is a hook that marks the parameters as its ``all_gather_and_wait_parameters_ready``
does (``__fsdp_param__``, then ``overwrite_main_grad`` as Megatron-FSDP decided). So this shows
the flag TransformerEngine's fused wgrad reads, not the gradients: the gradient parity against
Megatron's DDP with the op fuser is a GPU run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import releases
import vendored_copy
from conftest import run_python

from mfsdp_hotfix import (
    UnsupportedConfiguration,
    coverage,
    detection,
    fix_catalogue,
    fix_catalogue_outside,
    incidents,
    installer,
    registry,
    release_defects,
)
from mfsdp_hotfix.fixes import expert_accumulate
from mfsdp_hotfix.structure import expert_main_grad, overwrite_setter

STANDALONE, VENDORED = registry.COPIES
FIX = fix_catalogue_outside.EXPERT_ACCUMULATE
GATE = fix_catalogue_outside.ENSURE_MAIN_GRAD
NEEDS = ("0.19.0", "0.19.1", "0.19.2")
# Their experts.py never names overwrite_main_grad (0.18 has the op fuser, without that line).
BEFORE = ("0.14.0", "0.15.3", "0.16.1", "0.17.1", "0.18.0", "0.18.2")
MAIN = "d98e8a64dd"


def _state(found: detection.Detection) -> str:
    return vendored_copy.fix_state(FIX, found)


@pytest.mark.parametrize("version", NEEDS)
def test_releases_that_set_overwrite_main_grad_need_the_fix(version: str) -> None:
    found = vendored_copy.detect(releases.unpacked("megatron-core", version))
    shape = found.shapes[GATE]
    assert shape is not None and shape.name == "0.19"
    assert found.matched_by[GATE] == detection.FINGERPRINT
    assert found.needs(FIX) and _state(found) == installer.WOULD_APPLY
    assert fix_catalogue_outside.MOE_OP_FUSER_WGRAD_OVERWRITE in release_defects.defects_of(
        {FIX.id: "would apply"})


@pytest.mark.parametrize("version", BEFORE)
def test_releases_whose_experts_never_name_the_flag_do_not_need_it(version: str) -> None:
    found = vendored_copy.detect(releases.unpacked("megatron-core", version))
    assert GATE not in found.shapes and _state(found) == "not needed"


def test_a_copy_outside_megatron_core_does_not_need_it(fsdp_release) -> None:
    found = detection.find_installed(STANDALONE, [str(fsdp_release("0.6.1"))])
    assert found is not None
    assert _state(detection.detect_file(STANDALONE, found, installed=False)) == "not needed"


def test_an_experts_module_that_names_the_flag_elsewhere_is_unverified(tmp_path: Path) -> None:
    """A tree whose experts.py names overwrite_main_grad but has no ``_ensure_main_grad``: a
    fork that moved it, not a release before it. Unverified, so the configuration is refused."""
    root = tmp_path / "tree"
    release = releases.unpacked("megatron-core", "0.18.2")
    for part in ("megatron/core/distributed/fsdp/src/megatron_fsdp",):
        (root / part).mkdir(parents=True)
        for path in (release / part).glob("*.py"):
            (root / part / path.name).write_text(path.read_text())
    experts = root / "megatron/core/transformer/moe/experts.py"
    experts.parent.mkdir(parents=True)
    experts.write_text("class TEGroupedMLP:\n    def elsewhere(self, p):\n"
                       "        p.overwrite_main_grad = True\n")
    found = vendored_copy.detect(root)
    assert found.shapes[GATE] is None and _state(found) == "unverified"


def test_nvidia_main_has_the_releases_text() -> None:
    git = releases.MEGATRON_LM_GIT
    if git is None:
        pytest.skip("needs a Megatron-LM clone: set MFSDP_TEST_MEGATRON_LM")
    import subprocess

    from mfsdp_hotfix import fingerprints

    source = subprocess.run(["git", "--git-dir", str(git), "show",
                             f"{MAIN}:megatron/core/transformer/moe/experts.py"],
                            capture_output=True, text=True, check=True).stdout
    shape, how = detection.match(GATE, fingerprints.ParsedFile(source).source(GATE))
    assert shape is not None and shape.name == "0.19" and how == detection.FINGERPRINT


SETS_TRUE = '''
@staticmethod
def _ensure_main_grad(module):
    for weight in module.parameters(recurse=False):
        if getattr(weight, "main_grad", None) is None:
            weight.main_grad = weight.get_main_grad()
        setattr_free = True
        weight.overwrite_main_grad = True
'''
LEAVES = '''
@staticmethod
def _ensure_main_grad(module):
    for weight in module.parameters(recurse=False):
        weight.main_grad = weight.get_main_grad()
'''
DECIDES = '''
@staticmethod
def _ensure_main_grad(module):
    for weight in module.parameters(recurse=False):
        weight.overwrite_main_grad = not hasattr(weight, "__fsdp_param__")
'''


def test_forks_in_their_own_words() -> None:
    assert overwrite_setter.always_overwrites_main_grad(SETS_TRUE)
    assert expert_main_grad.leaves_overwrite_main_grad(LEAVES)
    assert not expert_main_grad.leaves_overwrite_main_grad(SETS_TRUE)
    assert [detection.match(GATE, source)[0] for source in (SETS_TRUE, LEAVES)] == [
        FIX.gate_shapes[1], FIX.gate_shapes[2]]
    assert FIX.id in FIX.gate_shapes[1].needs and FIX.id not in FIX.gate_shapes[2].needs
    assert detection.match(GATE, DECIDES) == (None, None)  # neither: unverified, not guessed


# The real 0.19.2 fused pre-forward hook on two stand-in expert linears: fc1 holds two
# Megatron-FSDP parameters, fc2 one and one parameter of no Megatron-FSDP (its flag set by
# someone else). The stand-in of Megatron-FSDP's all-gather marks each of its parameters as
# ``all_gather_and_wait_parameters_ready`` does, with the value under test.
REAL_HOOK = '''
import json, sys, torch
import mfsdp_hotfix
import megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp
from megatron.core.transformer.moe import experts
from mfsdp_hotfix import patching

def build(fsdp_value):
    torch.manual_seed(0)
    fc1, fc2 = torch.nn.Linear(4, 8, bias=False), torch.nn.Linear(8, 4)
    for linear in (fc1, fc2):
        linear.fuse_wgrad_accumulation = True
        for param in linear.parameters(recurse=False):
            buffer = torch.randn(param.shape)
            param.get_main_grad = (lambda b: (lambda: b))(buffer)
    fsdp = [fc1.weight, fc2.weight]
    fc2.bias.overwrite_main_grad = False  # not Megatron-FSDP's
    def all_gather(module, _):
        for param in module.parameters(recurse=False):
            if any(param is p for p in fsdp):
                param.__fsdp_param__ = True
                param.overwrite_main_grad = fsdp_value
    fc1.register_forward_pre_hook(all_gather)
    fc2.register_forward_pre_hook(all_gather)
    mlp = experts.TEGroupedMLP.__new__(experts.TEGroupedMLP)
    torch.nn.Module.__init__(mlp)
    mlp.linear_fc1, mlp.linear_fc2 = fc1, fc2
    return mlp, [fc1.weight, fc2.weight, fc2.bias]

def run(fsdp_value):
    mlp, params = build(fsdp_value)
    mlp._make_fused_impl_pre_forward_hook()(None)
    return [{"overwrite": p.overwrite_main_grad,
             "main_grad": p.main_grad.flatten().tolist(),
             "fsdp": hasattr(p, "__fsdp_param__")} for p in params]

wrapped = patching.fix_of(experts.TEGroupedMLP.__dict__["_ensure_main_grad"].__func__)
state = mfsdp_hotfix.status()
vendored = [c for c in state["copies"] if c["package"].startswith("megatron.core.")][0]
out = {"wrapped": wrapped, "state": vendored["fixes"]["expert-accumulate"]["state"],
       "fixed": {str(v): run(v) for v in (False, True)}}
mfsdp_hotfix.uninstall()
out["shipped"] = {str(v): run(v) for v in (False, True)}
print(json.dumps(out))
'''


def test_the_real_hook_keeps_megatron_fsdps_decision_and_changes_nothing_else() -> None:
    proc = run_python(REAL_HOOK, releases.unpacked("megatron-core", "0.19.2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["wrapped"] == FIX.id and got["state"] == "applied"
    shipped, fixed = got["shipped"], got["fixed"]
    # As shipped, the defect: Megatron-FSDP said add (False), the hook says overwrite.
    assert [p["overwrite"] for p in shipped["False"]] == [True, True, True]
    # With the fix, Megatron-FSDP's parameters keep False; the other one is set as shipped.
    assert [p["overwrite"] for p in fixed["False"]] == [False, False, True]
    # Everything else, bit for bit: main_grad exposed as shipped; where Megatron-FSDP said
    # overwrite (ZeRO-2/3 over several ranks) nothing differs at all.
    for value in ("False", "True"):
        for before, after in zip(shipped[value], fixed[value], strict=True):
            assert (before["main_grad"], before["fsdp"]) == (after["main_grad"], after["fsdp"])
    assert fixed["True"] == shipped["True"]


def test_a_failure_stops_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    owner = type("TEGroupedMLP", (), {"_ensure_main_grad": staticmethod(lambda module: None)})
    module = ModuleType("experts")
    module.TEGroupedMLP = owner  # type: ignore[attr-defined]
    undo = expert_accumulate.apply(module)
    monkeypatch.setattr(incidents, "_failed", {})
    try:
        unmarked = SimpleNamespace(parameters=lambda recurse: [SimpleNamespace()])
        owner._ensure_main_grad(unmarked)  # nothing of Megatron-FSDP's to keep: runs as shipped
        with pytest.raises(UnsupportedConfiguration, match="expert-accumulate failed"):
            owner._ensure_main_grad(SimpleNamespace())  # no parameters(): the fix raises
        assert FIX.id in incidents.failures()
    finally:
        assert undo()


def _model(strategy: str, fused: bool, experts_class: type) -> Any:
    mlp = experts_class()
    mlp._with_fused_impl = fused
    return SimpleNamespace(
        ddp_config=SimpleNamespace(data_parallel_sharding_strategy=strategy,
                                   overlap_grad_reduce=True, fsdp_double_buffer=False,
                                   average_in_collective=False),
        dist_index=SimpleNamespace(use_hybrid_fsdp=False),
        module=SimpleNamespace(modules=lambda: [mlp]),
        param_and_grad_buffer=SimpleNamespace(parameter_groups=[]))


def test_the_limit_is_zero1_or_one_rank_groups_with_op_fused_experts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in experts module (a class named as megatron-core's) in ``sys.modules``: the
    limit reads which classes the model holds, nothing of TransformerEngine."""
    experts = ModuleType(fix_catalogue_outside.EXPERTS_MODULE)
    experts.TEGroupedMLP = type("TEGroupedMLP", (), {})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, fix_catalogue_outside.EXPERTS_MODULE, experts)
    (limit,) = [limit for limit in coverage.LIMITS if limit.fix == FIX.id]
    assert limit.matches(_model("optim", True, experts.TEGroupedMLP))
    assert not limit.matches(_model("optim", False, experts.TEGroupedMLP))
    assert not limit.matches(_model("optim_grads_params", True, experts.TEGroupedMLP))
    found = vendored_copy.detect(releases.unpacked("megatron-core", "0.19.2"))
    for state, refused in (("unverified", True), ("failed", True), ("applied", False),
                           ("disabled", False)):
        fixes = {fix.id: ("not needed", "") for fix in fix_catalogue.FIXES}
        fixes[FIX.id] = (state, "")
        model = _model("optim", True, experts.TEGroupedMLP)
        if refused:
            with pytest.raises(UnsupportedConfiguration, match="op fuser"):
                coverage.check(found, fixes, model)
        else:
            coverage.check(found, fixes, model)
