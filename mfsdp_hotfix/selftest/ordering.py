"""The selftest's ordering checker: the slot-reuse rule read from the CPU stand-in's own clocks.

Why a checker of its own: the rule (``mfsdp_hotfix.slot_reuse``) is the product's, but here it
asks the ``torch.cuda`` stand-in (``cuda_standin``) directly whether the writer stream has waited
for the reduce-scatter event, instead of observing ``torch.cuda`` calls as the audit does. With
the audit on (``selftest --audit``) the two counts must agree: a check that the audit sees every
ordering operation the library makes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from mfsdp_hotfix import slot_reuse
from mfsdp_hotfix.selftest import cuda_standin
from mfsdp_hotfix.slot_reuse import SlotReuse, Unordered

Violation = Unordered


class StandinClocks:
    """:class:`slot_reuse.Clocks` answered by the stand-in's events and current stream."""

    def mark_of(self, event: object) -> cuda_standin.Event | None:
        return event if isinstance(event, cuda_standin.Event) and event.recorded else None

    def writer_after(self, mark: cuda_standin.Event) -> tuple[bool, str]:
        writer = cuda_standin.current_stream()
        return writer.has_waited_for(mark), writer.name

    def describe(self, mark: cuda_standin.Event) -> str:
        return repr(mark)


@dataclass
class OrderingChecker:
    """Observes one release's gradient pools and collects violations of the reuse rule."""

    rule: SlotReuse[cuda_standin.Event] = field(
        default_factory=lambda: SlotReuse(StandinClocks()))

    @property
    def checks(self) -> int:
        return self.rule.reuses

    @property
    def violations(self) -> list[Violation]:
        return self.rule.unordered

    def summary(self) -> dict[str, Any]:
        found = self.rule.summary()
        return {"checks": found["reuses"], "violations": found["unordered"],
                "first_violations": found["first_unordered"]}

    def install(self, pgb_module: ModuleType) -> None:
        """Wrap the pool and pipeline classes of one release's ``param_and_grad_buffer``."""
        slot_reuse.observe(pgb_module, self.rule, "selftest-ordering", _raise)


def _raise(where: str, exc: Exception) -> None:
    raise exc
