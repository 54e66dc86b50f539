"""The torch.cuda stand-in's happens-before bookkeeping, checked without installing it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from mfsdp_hotfix.selftest import cuda_standin as cs


def test_same_stream_is_ordered() -> None:
    s = cs.Stream()
    ev = s.record_event()
    assert s.has_waited_for(ev)


def test_other_stream_is_not_ordered_until_it_waits() -> None:
    rs, compute = cs.Stream(), cs.Stream()
    ev = rs.record_event()
    assert not compute.has_waited_for(ev)
    compute.wait_event(ev)
    assert compute.has_waited_for(ev)
    assert ev in compute.waited


def test_wait_covers_earlier_events_only() -> None:
    rs, compute = cs.Stream(), cs.Stream()
    first = rs.record_event()
    compute.wait_event(first)
    later = rs.record_event()
    assert compute.has_waited_for(first)
    assert not compute.has_waited_for(later)


def test_event_wait_uses_the_current_stream() -> None:
    rs, compute = cs.Stream(), cs.Stream()
    ev = rs.record_event()
    with cs.stream(rs):
        ev.wait()  # rs waits on itself: orders nothing for compute
    assert not compute.has_waited_for(ev)
    with cs.stream(compute):
        ev.wait()
    assert compute.has_waited_for(ev)


def test_wait_stream_and_transitivity() -> None:
    a, b, c = cs.Stream(), cs.Stream(), cs.Stream()
    ev = a.record_event()
    b.wait_stream(a)  # everything enqueued on a so far
    assert b.has_waited_for(ev)
    assert not c.has_waited_for(ev)
    c.wait_event(b.record_event())  # c after b after a
    assert c.has_waited_for(ev)


def test_record_on_current_stream_and_thread_local_stream() -> None:
    s = cs.Stream()
    seen: list[cs.Stream] = []
    with cs.stream(s):
        ev = cs.Event()
        ev.record()
        worker = threading.Thread(target=lambda: seen.append(cs.current_stream()))
        worker.start()
        worker.join()
        assert cs.current_stream() is s
    assert ev.stream is s
    assert seen == [cs.default_stream()]
    assert cs.current_stream() is cs.default_stream()


def test_unrecorded_event_wait_is_noop_and_stream_none_context() -> None:
    s = cs.Stream()
    s.wait_event(cs.Event())
    assert s.waited == []
    with cs.stream(None):
        assert cs.current_stream() is cs.default_stream()


def test_host_synchronize_orders_later_work() -> None:
    rs, compute = cs.Stream(), cs.Stream()
    ev = rs.record_event()
    ev.synchronize()
    assert compute.has_waited_for(ev)
    later = rs.record_event()
    assert not compute.has_waited_for(later)
    cs.synchronize()
    assert compute.has_waited_for(later)


def test_device_index_shim() -> None:
    idx = cs.CpuDeviceIndex()
    assert idx == "cpu" and f"cuda:{idx}" == "cuda:0" and int(idx) == 0


def test_install_and_undo_in_a_subprocess() -> None:
    code = (
        "import torch\n"
        "from mfsdp_hotfix.selftest import cuda_standin as cs\n"
        "orig = torch.cuda.Stream\n"
        "undo = cs.install()\n"
        "assert torch.cuda.Stream is cs.Stream\n"
        "assert torch.cuda.current_stream() is cs.default_stream()\n"
        "t = torch.ones(2); assert t.cuda() is t\n"
        "assert torch.empty(1, device=torch.cuda.current_device()).device.type == 'cpu'\n"
        "undo(); assert torch.cuda.Stream is orig\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_install_refuses_once_the_audit_watches_the_real_torch_cuda(tmp_path: Path) -> None:
    """Looking ``megatron`` up fires the import trigger, which arms the audit on whatever
    torch.cuda is then: the stand-in must come first (``selftest --audit`` once counted 0
    reuses when ``--flavour auto`` looked the copy up before installing it)."""
    code = (
        "import importlib.util, sys, torch\n"
        "import mfsdp_hotfix\n"
        "from mfsdp_hotfix.selftest import cuda_standin as cs\n"
        "if sys.argv[1] == 'standin-first':\n"
        "    cs.install()\n"
        "importlib.util.find_spec('megatron')\n"
        "from mfsdp_hotfix import audit\n"
        "assert audit.snapshot() is not None\n"
        "if sys.argv[1] == 'standin-first':\n"
        "    assert torch.cuda.Event is cs.Event\n"
        "    e = cs.Event(); e.record(); cs.Stream().wait_event(e)\n"
        "    print(audit.snapshot()['observed_operations'])\n"
        "else:\n"
        "    try:\n"
        "        cs.install()\n"
        "    except cs.AuditArmedFirst as exc:\n"
        "        print('refused:', exc)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MFSDP_HOTFIX")}
    env["MFSDP_HOTFIX_AUDIT"] = str(tmp_path / "audit")
    outs = {}
    for order in ("standin-first", "audit-first"):
        out = subprocess.run([sys.executable, "-c", code, order], capture_output=True, text=True,
                             timeout=120, cwd=Path(__file__).resolve().parents[2], env=env)
        assert out.returncode == 0, out.stderr
        outs[order] = out.stdout.strip()
    assert int(outs["standin-first"]) >= 2  # the audit observed the stand-in's record and wait
    assert outs["audit-first"].startswith("refused: the torch.cuda stand-in must be installed "
                                          "before the on-the-job audit is armed")
