"""``mfsdp-hotfix run`` puts this folder first on PYTHONPATH: arm the hotfix, then run the
``sitecustomize`` this one shadows (module or package), so the user's keeps working."""

import importlib.machinery
import importlib.util
import os
import sys


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


try:
    import mfsdp_hotfix.bootstrap

    mfsdp_hotfix.bootstrap.start("sitecustomize")
except Exception as exc:
    sys.stderr.write(f"mfsdp_hotfix: bootstrap skipped: {exc!r}\n")
_chain()
