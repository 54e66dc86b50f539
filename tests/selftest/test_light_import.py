"""``import mfsdp_hotfix.selftest`` must not import torch, nor touch ``torch.cuda``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_selftest_package_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "import mfsdp_hotfix\n"
        "before = 'torch' in sys.modules\n"
        "import mfsdp_hotfix.selftest as st\n"
        "st.CaseSpec; st.run_selftest; st.format_table\n"
        "import mfsdp_hotfix.selftest.runner, mfsdp_hotfix.selftest.spec\n"
        "print(before, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    before, after = out.stdout.split()
    assert after == before  # nothing of ours pulled torch in
