"""Each built model's ``ddp_config`` as the coverage gate last judged it.

The gate (:mod:`coverage`) judges a model when it is built, but a config is a plain mutable
object: ``fully_shard_model`` takes no ``gradient_reduce_div_fusion``, so a ``fully_shard`` user
sets it on ``model.ddp_config`` afterwards, and the release reads it only when it reduces. A
config changed after the gate judged it is judged again before its gradients are synchronised
(``installer``); this module only says whether it changed.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

log = logging.getLogger("mfsdp_hotfix")
_JUDGED: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def remember(model: Any) -> None:
    """``model``'s config is the one the gate has just judged. A config without attributes of
    its own (``__slots__``) or a model without weak references is not remembered, so it is not
    judged again: this runs while the model is built, which it must never break."""
    try:
        _JUDGED[model] = dict(vars(model.ddp_config))
    except TypeError as exc:
        log.debug("mfsdp_hotfix: a change to this model's config will not be judged again (%s)",
                  exc)


def changed(model: Any) -> bool:
    """Whether ``model``'s config differs from the one the gate judged (False for a model the
    gate never judged: one built before the hotfix was loaded)."""
    try:
        judged = _JUDGED.get(model)
    except TypeError:  # a model without weak references: never remembered
        return False
    if judged is None:
        return False
    try:
        now = vars(model.ddp_config)
    except TypeError:  # replaced by a config without attributes of its own
        return True
    if now.keys() != judged.keys():
        return True
    for name, value in now.items():
        try:
            if value is not judged[name] and bool(value != judged[name]):
                return True
        except Exception:  # a value without a plain equality: compare by identity only
            return True
    return False
