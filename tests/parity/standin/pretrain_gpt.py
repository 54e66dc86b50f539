"""A stand-in for Megatron-LM's ``pretrain_gpt.py`` (whose training loop needs a GPU): it takes
the same flags, writes where Megatron-LM writes (the checkpoint folder, TensorBoard, the
dataset index cache next to the data when no ``--data-cache-path`` is given) and prints
``training_log`` lines in Megatron-LM's format. It trains nothing: its losses and grad norms
are a function of the seed, the iteration and the layer count, and Megatron-FSDP without the
hotfix (``--use-megatron-fsdp`` with ``MFSDP_HOTFIX=0``) reports a grad norm 1.6 % off, the
size of the shipped defect. ``PARITY_STANDIN`` makes it crash, hang, print nothing, or leave
sleeping processes in sessions of their own (as torchrun's ranks are) for the cleanup tests."""

import datetime
import os
import subprocess
import sys
import time


def value(flag, default=None):
    """The flag's last value, as argparse keeps."""
    args, found = sys.argv[1:], default
    for index, word in enumerate(args):
        if word == flag and index + 1 < len(args):
            found = args[index + 1]
        elif word.startswith(flag + "="):
            found = word.split("=", 1)[1]
    return found


def write(folder, name, text):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "w") as f:
        f.write(text)


def main():
    mode = os.environ.get("PARITY_STANDIN", "")
    if "--the-flag-it-rejects" in sys.argv:
        sys.exit("pretrain_gpt.py: error: unrecognized arguments: --the-flag-it-rejects")
    if mode == "record":  # where the test can see what each run was given
        with open(os.environ["PARITY_STANDIN_RECORD"], "a") as f:
            f.write(" ".join(sys.argv[1:]) + f" MFSDP_HOTFIX={os.environ.get('MFSDP_HOTFIX')}"
                    f" WANDB_MODE={os.environ.get('WANDB_MODE')}\n")
    if mode in ("spawn", "hang"):
        pids = [os.getpid()]
        for _ in range(2):  # a rank in a session of its own, as torchrun starts them
            pids.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                         start_new_session=True).pid)
        with open(os.environ["PARITY_STANDIN_PIDS"], "a") as f:
            f.write("".join(f"{pid}\n" for pid in pids))
    seed, layers = int(value("--seed", "1234")), int(value("--num-layers", "2"))
    last = int(value("--train-iters", "10"))
    start = 0
    load = value("--load")
    if load and os.path.exists(os.path.join(load, "latest_checkpointed_iteration.txt")):
        with open(os.path.join(load, "latest_checkpointed_iteration.txt")) as f:
            start = int(f.read())
    for data in (value("--data-path") or "").split():
        if not data.replace(".", "").isdigit():  # the index cache, next to the data without a path
            cache = value("--data-cache-path") or os.path.join(os.path.dirname(data), "cache")
            write(cache, "GPTDataset_indices.npy", "index")
    shipped = "--use-megatron-fsdp" in sys.argv and os.environ.get("MFSDP_HOTFIX") == "0"
    # Megatron-LM prints training_log from the last rank only (print_rank_last).
    printing = os.environ.get("RANK", "0") == str(int(os.environ.get("WORLD_SIZE", "1")) - 1)
    print("> building GPT model ...", flush=True)
    for iteration in range(start + 1, last + 1):
        if mode == "silent" or not printing:
            continue
        loss = 10.0 - 0.1 * iteration + 0.001 * (seed % 7) + 0.01 * layers
        norm = (2.0 + 0.1 * iteration) * (1.016 if shipped else 1.0)
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")
        print(f" [{stamp}] iteration {iteration:8d}/{last:8d} | consumed samples: "
              f"{8 * iteration:12d} | elapsed time per iteration (ms): 12.5 | learning rate: "
              f"1.000000E-04 | global batch size:     8 | lm loss: {loss:.6E} | loss scale: 1.0 "
              f"| grad norm: {norm:.3f} | number of skipped iterations:   0 | number of nan "
              "iterations:   0 |", flush=True)
        if mode == "crash" and iteration == start + 1:
            print("Traceback (most recent call last):\n  File \"pretrain_gpt.py\", line 1\n"
                  "torch.OutOfMemoryError: CUDA out of memory.", flush=True)
            sys.exit(1)
        if mode == "hang":
            time.sleep(600)
        if value("--save"):
            write(value("--save"), "latest_checkpointed_iteration.txt", str(iteration))
        if value("--tensorboard-dir"):
            write(value("--tensorboard-dir"), "events.out.tfevents", str(iteration))


if __name__ == "__main__":
    main()
