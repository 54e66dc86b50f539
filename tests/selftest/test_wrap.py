"""``wrap()`` (the selftest's and the example's way to shard a model) takes Megatron-FSDP as a
user names it: the package, its ``fully_shard`` module, or the ``fully_shard`` function that the
package exports under the same name, or ``fully_shard_model``; anything else is a clear error."""

from __future__ import annotations

from conftest import run_python

CHECK = """
import sys
import megatron_fsdp
from megatron_fsdp import fully_shard, fully_shard_model
module = sys.modules["megatron_fsdp.fully_shard"]
from mfsdp_hotfix.selftest.wrapping import fully_shard_model_of
assert fully_shard is not module  # the function hides the module of the same name
for given in (megatron_fsdp, module, fully_shard, fully_shard_model):
    assert fully_shard_model_of(given) is fully_shard_model, given
for wrong in (megatron_fsdp.MegatronFSDP, "megatron_fsdp", None):
    try:
        fully_shard_model_of(wrong)
    except TypeError as exc:
        print(exc)
    else:
        raise AssertionError(wrong)
"""


def test_wrap_takes_the_package_the_module_or_the_function(fsdp_release) -> None:
    proc = run_python(CHECK, fsdp_release("0.5.1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 3 and all(line.startswith(
        "wrap() takes Megatron-FSDP as its first argument: the package (megatron_fsdp, or "
        "megatron.core.distributed.fsdp.src.megatron_fsdp), its fully_shard module or function, "
        "or fully_shard_model; got ") for line in lines), lines
    assert lines[1].endswith("got 'megatron_fsdp'")
