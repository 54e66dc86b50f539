"""Never touch the user's data: every flag of the real releases through which Megatron-LM
writes is dropped or pointed into the run's own folder (``outputs.OUTPUT_FLAGS``); the flags
that only look like outputs are named here with the reason they are not; a rewritten command
names no path of the user's to write to."""

from __future__ import annotations

import re

from parity.megatron_arguments import OLDER, all_release_flags

from mfsdp_hotfix.parity import flags
from mfsdp_hotfix.parity.outputs import ADDED, DROP, OUTPUT_FLAGS, SHARED, redirect, written_paths

# Words in a flag's name that may mean it writes somewhere.
OUTPUT_WORDS = re.compile(r"save|-dir\b|dir$|path|file|wandb|tensorboard|profil|snapshot|logger|"
                          r"trace|dump|record|upload|cache-", re.I)
# The flags with such a word that write nothing of their own, and why.
NOT_OUTPUTS = {
    "read by the run (data, tokenizer, model and precision configuration)": {
        "--data-path", "--train-data-path", "--valid-data-path", "--test-data-path",
        "--data-args-path", "--per-split-data-args-path", "--per-dataset-sequences-path",
        "--block-data-path", "--embedding-path", "--evidence-data-path", "--titles-data-path",
        "--retro-project-dir", "--vocab-file", "--merge-file", "--kitchen-config-file",
        "--te-precision-config-file", "--heterogeneous-layers-config-path",
        "--nccl-communicator-config-path", "--dump-param-to-param-group-map",
        "--logits-load-dir"},
    "a setting of an output that is dropped or redirected": {
        "--ckpt-fully-parallel-save", "--no-ckpt-fully-parallel-save",
        "--ckpt-fully-parallel-save-process-group", "--dist-ckpt-save-pre-mcore-014",
        "--no-save-optim", "--no-save-rng", "--no-save-tokenizer-assets",
        "--logits-save-dtype", "--logits-save-top-k", "--logits-save-top-p",
        "--logits-save-top-p-min-k", "--moe-routing-trace-capture-hidden-states",
        "--moe-routing-trace-capture-logits", "--moe-routing-trace-dump-weights",
        "--moe-routing-trace-max-training-iters", "--flight-recorder-include-stack-trace",
        "--flight-recorder-trace-buffer-size", "--no-flight-recorder-dump-on-timeout",
        "--no-flight-recorder-extra-dump-on-exec", "--no-flight-recorder-include-only-active",
        "--log-memory-to-tensorboard", "--log-timers-to-tensorboard",
        "--log-validation-ppl-to-tensorboard", "--log-world-size-to-tensorboard",
        "--no-log-loss-scale-to-tensorboard", "--tensorboard-log-interval",
        "--tensorboard-queue-size", "--no-one-logger"},
    "not an output (memory, caching in memory, inference or RL settings)": {
        "--cache-mla-latents", "--dataloader-fast-cache-load", "--disable-mamba-mem-eff-path",
        "--distribute-saved-activations", "--no-mmap-bin-files", "--rl-kv-cache-management-mode",
        "--rl-offload-kv-cache-during-training", "--rl-remove-kv-cache-during-training",
        "--inference-wandb-logging"},
}


def test_every_output_flag_of_every_release_is_dropped_or_redirected() -> None:
    known = set(OUTPUT_FLAGS).union(*NOT_OUTPUTS.values())
    for label, found in all_release_flags().items():
        if label == OLDER:
            continue
        unknown = {flag for flag in found if OUTPUT_WORDS.search(flag)} - known
        assert not unknown, f"{label}: put these in outputs.OUTPUT_FLAGS or NOT_OUTPUTS"


def test_each_output_flag_is_dropped_or_pointed_into_the_run_folder() -> None:
    for flag, rule in OUTPUT_FLAGS.items():
        given = [flag] if rule.values == 0 else [flag, "/user/x"] if rule.values == 1 else [
            flag, "/user/x", "/user/y"]
        args, notes = redirect(["--seed", "1", *given, "--bf16"], "/out/candidate", "/out")
        assert args[:2] == ["--seed", "1"] and "--bf16" in args, flag
        assert not any(word.startswith("/user") for word in args), flag
        assert any(flag in note and rule.reason in note for note in notes), flag
        if rule.into == DROP:
            assert not flags.has(args, flag), flag
        else:
            folder = "/out" if flag in SHARED else "/out/candidate"
            assert flags.value_of(args, flag) == f"{folder}/{rule.into}", flag


def test_the_data_cache_is_set_on_every_run_and_uploads_are_off() -> None:
    """Without --data-cache-path, Megatron writes its index cache next to the user's data."""
    args, notes = redirect(["--data-path", "/data/corpus"], "/out/reference", "/out")
    assert flags.value_of(args, "--data-cache-path") == "/out/data-cache"
    assert all(flags.has(args, flag) for flag in ADDED)
    assert written_paths(args) == ["/out/data-cache"]
    args, _ = redirect(["--data-cache-path=/data/cache", "--tensorboard-dir", "/tb"], "/o/r", "/o")
    assert sorted(written_paths(args)) == ["/o/data-cache", "/o/r/tensorboard"]
