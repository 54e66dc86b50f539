"""The reference's rewrite, flag by flag, against the flags of the real releases: every flag of
megatron-core 0.14 to 0.19 and NVIDIA main that exists for Megatron-FSDP (or PyTorch FSDP2) is in
the one table, with the number of words the release's parser gives it; the reference drops or
maps each, the candidate keeps each (but the one dropped from every run, said so); and every
flag parity adds exists in every release."""

from __future__ import annotations

import re

import pytest
from parity.megatron_arguments import MANY as RELEASE_MANY
from parity.megatron_arguments import OLDER, all_release_flags

from mfsdp_hotfix.parity import flags, outputs, plan
from mfsdp_hotfix.parity.flags import MANY
from mfsdp_hotfix.parity.rewrite import EVERY_RUN, FSDP_ONLY, KEPT, REFERENCE_ADDS
from mfsdp_hotfix.parity.rewrite import rewrite as rw

# A flag is Megatron-FSDP's (or FSDP2's) when its name or its help says so.
FSDP_WORDS = re.compile(r"fsdp|hsdp|sharding-strategy", re.I)
RELEASES = all_release_flags()
SUPPORTED = {label: found for label, found in RELEASES.items() if label != OLDER}


def test_the_releases_were_read() -> None:
    """The wheels always; 0.14-0.16 and main where a Megatron-LM clone is given."""
    assert {"0.17.1", "0.18.2", "0.19.2"} <= set(RELEASES)
    for label, found in SUPPORTED.items():
        assert "--use-megatron-fsdp" in found and "--num-layers" in found, label
    if len(SUPPORTED) < 7:
        pytest.skip("0.14-0.16 and main need MFSDP_TEST_MEGATRON_LM (a Megatron-LM git dir)")


@pytest.mark.parametrize("label", sorted(SUPPORTED))
def test_every_fsdp_flag_of_the_release_is_in_the_table(label: str) -> None:
    found = {flag for flag, source in SUPPORTED[label].items()
             if FSDP_WORDS.search(flag) or FSDP_WORDS.search(source.text)}
    assert "--data-parallel-sharding-strategy" in found
    missing = found - set(FSDP_ONLY) - set(KEPT)
    assert not missing, f"{label}: put these in rewrite.FSDP_ONLY (or KEPT), with a reason"


def test_every_table_flag_is_a_real_flag_with_the_words_it_takes() -> None:
    """A typo in the table would leave the real flag in the reference; a wrong word count would
    drop a neighbour or leave a value behind."""
    for flag, rule in [*FSDP_ONLY.items(), *((f, o) for f, o in outputs.OUTPUT_FLAGS.items())]:
        seen = {label: found[flag] for label, found in RELEASES.items() if flag in found}
        assert seen or len(RELEASES) < 8, f"{flag} is in no release"
        for label, source in seen.items():
            expected = MANY if source.values == RELEASE_MANY else source.values
            assert rule.values == expected, (flag, label, source.text[:200])


@pytest.mark.parametrize("label", sorted(SUPPORTED))
def test_every_flag_parity_adds_exists_in_the_release(label: str) -> None:
    added = [*REFERENCE_ADDS, *outputs.ADDED, "--deterministic-mode", "--log-interval",
             "--train-iters", "--train-samples", "--eval-iters", "--num-layers",
             *(f for f, o in outputs.OUTPUT_FLAGS.items() if o.into != outputs.DROP)]
    shared = [f for f in added if f in outputs.OUTPUT_FLAGS and f not in outputs.SHARED]
    missing = [f for f in added if f not in SUPPORTED[label] and f not in shared]
    assert not missing, label


def example(flag: str, values: int) -> list[str]:
    return [flag] if values == 0 else [flag, "v"] if values == 1 else [flag, "0", "1"]


BASE = ["--num-layers", "4", "--seed", "7", "--data-path", "/data/x", "--bf16"]


@pytest.mark.parametrize("flag", sorted(f for f, r in FSDP_ONLY.items() if not r.replace))
@pytest.mark.parametrize("joined", [False, True])
def test_the_reference_drops_each_fsdp_flag_the_candidate_keeps_it(flag: str,
                                                                   joined: bool) -> None:
    rule = FSDP_ONLY[flag]
    given = example(flag, rule.values)
    if joined and rule.values == 1:
        given = [f"{flag}=v"]
    args = BASE[:2] + given + BASE[2:]
    reference, notes = rw(args, reference=True)
    candidate, candidate_notes = rw(args, reference=False)
    assert reference == BASE + list(REFERENCE_ADDS)
    assert any(flag in note and rule.reason in note for note in notes)
    if rule.runs == EVERY_RUN:
        assert candidate == BASE and candidate_notes
    else:
        assert candidate == args and not candidate_notes


def test_the_checkpoint_format_is_mapped_only_from_fsdp_dtensor() -> None:
    for given, expected in (("fsdp_dtensor", "torch_dist"), ("torch_dist", "torch_dist"),
                            ("torch", "torch")):
        for args in (["--ckpt-format", given], [f"--ckpt-format={given}"]):
            reference, _ = rw(args, reference=True)
            assert flags.value_of(reference, "--ckpt-format") == expected, args
            assert rw(args, reference=False)[0] == args


def test_a_real_megatron_fsdp_command_becomes_megatron_ddp() -> None:
    args = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
            "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor", "--fsdp-double-buffer",
            "--overlap-grad-reduce", "--tensor-model-parallel-size", "2", "--seed", "3"]
    reference, notes = rw(args, reference=True)
    assert reference == ["--use-distributed-optimizer", "--ckpt-format", "torch_dist",
                         "--overlap-grad-reduce", "--tensor-model-parallel-size", "2", "--seed",
                         "3", "--no-gradient-accumulation-fusion"]
    assert len(notes) == 5
    assert not any(flags.name_of(w) in FSDP_ONLY and w != "--ckpt-format" for w in reference)


def test_values_of_a_many_word_flag_go_with_it() -> None:
    args = ["--profile-ranks", "0", "1", "--seed", "3"]
    assert flags.remove(args, "--profile-ranks", MANY) == (["--seed", "3"],
                                                          ["--profile-ranks", "0", "1"])


def test_deterministic_mode_is_added_unless_the_job_forbids_it() -> None:
    args, env, notes = plan._determinism(["--seed", "1"], {"NCCL_ALGO": "Tree"}, True)
    assert args[-1] == "--deterministic-mode" and "NCCL_ALGO" not in env
    assert env == {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    assert "added --deterministic-mode" in notes[0]
    args, env, notes = plan._determinism(["--cross-entropy-loss-fusion"], {}, True)
    assert "--deterministic-mode" not in args and not env
    assert "--cross-entropy-loss-fusion" in notes[0]
    assert plan._determinism(["--seed"], {}, False)[:2] == (["--seed"], {})
