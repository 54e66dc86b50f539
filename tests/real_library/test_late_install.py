"""A model built before the hotfix installs (a late import): the install finds it, guards its
getters and says so; an era-A release that crashes as shipped then trains correctly."""

from __future__ import annotations

import pytest
from realcases import GRAD_TOLERANCE, case, describe

pytestmark = pytest.mark.slow


def test_late_install_repairs_the_built_model() -> None:
    result = case("megatron-fsdp", "0.4.0", hotfix="late")
    assert not result.crashed, describe(result)
    assert result.max_abs_grad_error is not None
    assert result.max_abs_grad_error <= GRAD_TOLERANCE, describe(result)
    assert result.ordering_violations == 0, describe(result)
    (copy,) = result.hotfix_status["copies"]
    assert copy["models_repaired"] == 1
    assert copy["fixes"]["getter-guard"]["state"] == "applied"
    assert "was loaded after 1 megatron-fsdp model(s) had been built; guarded" in result.log_tail
