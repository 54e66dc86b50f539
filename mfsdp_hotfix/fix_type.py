"""What a fix's declaration holds (:class:`Fix`) and what its failure at runtime does
(:class:`OnFailure`): the type the catalogues (``fix_catalogue.py``, ``fix_catalogue_outside.py``)
declare every fix with, apart from them so that both can use it."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .defects import ReleaseDefect
from .limits import Limit
from .registry import Shape


class OnFailure(Enum):
    """What a fix's failure at runtime does (``guard.py`` carries it out)."""

    SWITCH_OFF = "switch off"  # reported once; the code runs as shipped from then on
    STOP = "stop"  # reported, and the step raises UnsupportedConfiguration: going on as
    #                shipped would train on wrong gradients silently


@dataclass(frozen=True)
class Fix:
    """One repair, declared whole.

    ``module``: its module in ``mfsdp_hotfix.fixes``, whose ``apply(module) -> Undo`` patches
    the copy's module ``target`` (:meth:`~mfsdp_hotfix.registry.Copy.module`: ``registry.BUFFER``,
    ``registry.MODEL``, another module of the copy's package as ``.name``, or a megatron-core
    module outside Megatron-FSDP by its full name), once that module is imported.
    ``not_needed``: why a copy does not need it, as ``status`` says it.
    ``depends_on``: functions that must have a known shape for the fix to be applied (or for
    its need to be decided); an unknown shape there refuses the copy, and this fix with it
    (``refused``), while a fix that depends on none of them still applies.
    ``only_unguarded``: needed only where the getter's shape is unguarded.
    ``only_unordered``: not needed where the getter drains and the drain orders the caller's
    stream with at most pool-size units live (era "none": the change proposed upstream).
    ``gate``: a model-module function (:data:`~mfsdp_hotfix.registry.GATES`), or megatron-core's
    fused linear (:data:`~mfsdp_hotfix.registry.CORE_LINEAR_BACKWARD`), whose shape decides the
    need (its :attr:`~mfsdp_hotfix.registry.Shape.needs`); an unknown shape there leaves the fix
    unverified, not the copy refused; a gate whose code is not in the copy's tree at all
    (megatron-core's linear beside megatron-fsdp): not needed. A gate the registry does not
    declare (:data:`~mfsdp_hotfix.registry.GATE_MODULES`) is declared here: ``gate_module``
    where it is read (as ``target``) and ``gate_shapes`` its known shapes;
    ``gate_absent_unless_named``: a gate missing from a module that never names this word is
    not in the copy's tree (the releases before it: nothing there can do what the fix undoes),
    a gate missing from a module that names it is an unknown shape.
    ``reductions``: buffer-module functions of which at least one must reduce
    (:attr:`~mfsdp_hotfix.registry.Shape.reduces`) for the fix to be needed; an unknown shape
    there: unverified.
    ``defect``: the release defect it repairs (None: a defect of the double buffer).
    ``limits``: the configurations it covers (``coverage.py`` refuses them where it cannot apply).
    ``on_failure``: what its failure at runtime does; ``stop_because`` (STOP): what going on
    would do, for the message.
    """

    id: str
    summary: str
    module: str
    target: str
    not_needed: str
    upstream: str
    depends_on: tuple[str, ...] = ()
    only_unguarded: bool = False
    gate: str | None = None
    reductions: tuple[str, ...] = ()
    only_unordered: bool = False  # not needed where the getter and drain form era "none"
    gate_module: str | None = None
    gate_shapes: tuple[Shape, ...] = ()
    gate_absent_unless_named: str = ""
    defect: ReleaseDefect | None = None
    limits: tuple[Limit, ...] = ()
    on_failure: OnFailure = OnFailure.SWITCH_OFF
    stop_because: str = ""

    def __post_init__(self) -> None:
        assert self.defect is None or self.defect.fix == self.id, (self.id, self.defect)
        assert (self.on_failure is OnFailure.STOP) == bool(self.stop_because), self.id

    @property
    def stopped(self) -> str:
        """What a STOP fix's failure tells the user: why the step stops, and the way around."""
        workarounds = " or ".join(self.defect.workarounds) if self.defect else ""
        return (f"the step is stopped, because going on would {self.stop_because}; "
                f"workaround: {workarounds}. Please report this with "
                "`mfsdp-hotfix status --json`")
