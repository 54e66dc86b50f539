"""What the hotfix knows, declared in one place: the copies it targets, the code shapes it
recognises, the eras those shapes form, and the fixes each era receives.

Every fingerprint below was computed from the released wheels (see
``shared/reference/bug-anatomy.md`` §8 and ``tests/test_detection.py``, which recomputes them).
Shapes are named after the first release that carries them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Release = tuple[int, ...]


@dataclass(frozen=True)
class Copy:
    """One importable copy of Megatron-FSDP; each has its own classes and is patched on its own."""

    label: str
    package: str
    distribution: str

    @property
    def buffer_module(self) -> str:
        """Defines ``ParamAndGradBuffer`` and ``GradReducePipeline``."""
        return f"{self.package}.param_and_grad_buffer"

    @property
    def model_module(self) -> str:
        """Defines ``MegatronFSDP``."""
        return f"{self.package}.megatron_fsdp"


COPIES = (
    Copy("megatron-fsdp", "megatron_fsdp", "megatron-fsdp"),
    Copy("megatron-core (vendored)", "megatron.core.distributed.fsdp.src.megatron_fsdp",
         "megatron-core"),
)

# Copies whose design the fixes do not fit: importing them gets a refusal, never a patch.
REFUSED_MODULES = {
    "megatron.core.distributed.custom_fsdp.param_and_grad_buffer": (
        "megatron-core 0.13 custom_fsdp",
        "its main_grad getter is a class-level property on torch.nn.Parameter, a different design "
        "that this hotfix does not patch; upgrade to megatron-core >= 0.14 (with mfsdp-hotfix) or "
        "run with fsdp_double_buffer=False",
    ),
}

GETTER = "ParamAndGradBuffer._init_each_parameter_group_buffers.<locals>.main_grad_getter"
DRAIN = "GradReducePipeline._enforce_double_buffer_limit"
WAIT = "GradReducePipeline.wait_for_previous_grad_reduce"
# In the model module (megatron_fsdp.py). Only a fix's own gate: an unknown shape here does not
# refuse the copy, it leaves the fixes that need a known one unverified.
HOOKS = "MegatronFSDP._register_fsdp_hooks"
MODEL_TARGETS = frozenset({HOOKS})

SHAPES: dict[str, dict[str, str]] = {
    GETTER: {
        "991107f2e75eaa6e2f5567049a45235be088a70697e281c937dd01ce2e69f495": "0.14",
        "0480c5a8ac2347fe62a2103b10b13f88a227086cd017499eba3c1b10ae2f07ff": "0.17",
        "9536069f4985f747be30ef6fd5b73ba366d0325847d531a9af6629d46f4eb02a": "0.19",
    },
    DRAIN: {
        "cc2d1fa2642c351d39147350dafca5a1a00903f1269e5a7fd9308f62e9c1ee85": "0.14",
        "a1783b8dc8f20c5e639262da00c959dcff7666e0132ad89868340b10cd3c3578": "0.18",
        "9b70f49286019d5cb6b84bb6e52df6025f9d3c118579eabc67a4aa062ffcb2bd": "0.19",
    },
    WAIT: {
        "18a7000ad753206566df235d409814de9319429954a1f2761717b20d53920b2e": "0.14",
        "274b821a5fb1391b53f2cc32f68e06300fb7fafb7429e5a54b1f3134b232653f": "0.17",
    },
    HOOKS: {  # 0.14: a unit's post-forward releases its parameters at once, never lazily
        "165cb11b0521d204ab991b78257547ca679b491978d7c2240c64068e0ffe4ce0": "0.14",
        "819fea0a1dbddaa5c909b026dd6660a873509886698a31a6d71e785aef76e450": "0.16",
        "32fe8ef255b44a394c015edfbcaaf81868496e158c1dc3d32e7dbae0c93ef99c": "0.17",
        "049be221636061637620cac833fc943cf6c8eedd59bd4b659d60f278751407fb": "0.18",
        "fa95ce6cc803e35c9d0b319da2ef2115c31985aa725592638fbe1a6343079c9d": "0.19",
    },
}


@dataclass(frozen=True)
class Era:
    """A (getter shape, drain shape) pair, what it does wrong, and the releases that ship it."""

    name: str
    getter_shape: str
    drain_shape: str
    defect: str
    releases: dict[str, tuple[Release, Release]]  # distribution -> [first, end)


ERAS = (
    Era("A", "0.14", "0.14", "crash: 'No buffer found for bucket_id' (unguarded getter)",
        {"megatron-fsdp": ((0, 1, 0), (0, 4, 0)), "megatron-core": ((0, 14, 0), (0, 17, 0))}),
    Era("A", "0.17", "0.14", "crash: 'No buffer found for bucket_id' (unguarded getter)",
        {"megatron-fsdp": ((0, 4, 0), (0, 5, 0)), "megatron-core": ((0, 17, 0), (0, 18, 0))}),
    Era("B", "0.17", "0.18",
        "silent gradient corruption: a freed slot is rewritten while its reduce-scatter may "
        "still read it",
        {"megatron-fsdp": ((0, 5, 0), (0, 6, 0)), "megatron-core": ((0, 18, 0), (0, 19, 0))}),
    Era("C", "0.19", "0.19",
        "race when a reduce-scatter is slower than one unit's backward (the drain orders only "
        "rs_stream)",
        {"megatron-fsdp": ((0, 6, 0), (0, 7, 0)), "megatron-core": ((0, 19, 0), (0, 20, 0))}),
)


@dataclass(frozen=True)
class Fix:
    """One repair, the eras that need it, and where it stands upstream.

    ``shapes``: for a fix written against more code than the era's, the shapes of that code it
    is right for (target -> shapes); another known shape does not need the fix, an unknown one
    leaves it unverified.
    """

    id: str
    summary: str
    eras: frozenset[str]
    upstream: str
    shapes: dict[str, frozenset[str]] = field(default_factory=dict)


GETTER_GUARD = Fix(
    "getter-guard",
    "main_grad_getter drains the reduce-scatter queue before it allocates a gradient bucket",
    frozenset("AB"),
    "NVIDIA/Megatron-LM#5222, first released in megatron-core 0.19.0 / megatron-fsdp 0.6.0",
)
ORDERED_DRAIN = Fix(
    "ordered-drain",
    "at most pool-size units live, counting the incoming one; the stream that writes into a "
    "recycled slot waits on the reduce-scatter that last read it",
    frozenset("ABC"),
    "not fixed upstream as of megatron-core 0.19.2 / megatron-fsdp 0.6.1",
)
MISSED_POST_BACKWARD = Fix(
    "missed-post-backward",
    "a ZeRO-3 unit whose post-backward hook never ran (no input needs a gradient, e.g. the "
    "first unit) is released before the next forward instead of keeping one of the 2 slots of "
    "the double-buffered parameter pool ('[fsdp_params] No buffer found for bucket_id')",
    frozenset("A"),
    "not fixed as such; megatron-fsdp 0.3.0 / megatron-core 0.16.0 release such a unit's "
    "parameters lazily, which avoids the crash",
    {HOOKS: frozenset({"0.14"})},
)
FIXES = (GETTER_GUARD, ORDERED_DRAIN, MISSED_POST_BACKWARD)
FIX_IDS = frozenset(fix.id for fix in FIXES)
