"""On-the-job audit: does every reuse of a gradient-pool slot wait for the reduce-scatter that
last read it, in this job, on these GPUs, with this release or fork? And where a gradient
buffer's data-parallel group has one rank (no slot is reused there), is the releases' size-one
group defect repaired in it (``copies.OneRankGrads``)?

Switched on by ``MFSDP_HOTFIX_AUDIT=<path>`` (or ``mfsdp-hotfix audit --out <path> -- ...``);
without it this package is never imported and nothing is wrapped. ``install()`` arms it, also
under ``MFSDP_HOTFIX=0``: with the hotfix off the audit diagnoses, with it on it verifies. It is
read-only: every wrapper calls the original once and returns its result (or exception)
unchanged, and an error in the audit's own bookkeeping disables it with one warning while the job
goes on. Pieces: ``observer`` (ordering through ``torch.cuda`` / ``torch.distributed``),
``copies`` (each Megatron-FSDP copy's pools), ``rank_files`` (one JSON file per rank),
``verdicts`` (what a copy's counts mean), ``job_line`` (the job's summary line at exit),
``summary`` (the ``mfsdp-hotfix audit`` command's reading of the rank files).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .. import incidents, registry, v2
from ..settings import Settings
from . import job_line, rank_files
from .copies import CopyAudit, watch_buffer_module, watch_model_module, watch_v2_module
from .observer import Observer

log = logging.getLogger("mfsdp_hotfix")

AUDIT, REPORT, SUMMARY = "audit", "audit-report", "audit-summary"
_UNWRITABLE = ("no rank file is written from this process; the audit goes on counting (the job "
               "summary line still reports it). Point MFSDP_HOTFIX_AUDIT at a writable path.")

_lock = threading.RLock()
_audit: _Audit | None = None


def arm(settings: Settings, applied: Callable[[], dict[str, Any]]) -> None:
    """Start auditing this process (idempotent); ``settings.audit_path`` must be set.
    ``applied()`` describes the hotfix's patching (``installer.applied_fingerprint``: passed in,
    because the installer is the layer above)."""
    global _audit
    with _lock:
        if _audit is not None or settings.audit_path is None:
            return
        _audit = _Audit(settings, applied)
        try:
            _audit.start()
        except Exception as exc:
            _audit.fail("arming the audit", exc)


def snapshot(final: bool = False) -> dict[str, Any] | None:
    """This rank's report as plain data (None: the audit is not armed)."""
    with _lock:
        return _audit.snapshot(final) if _audit is not None else None


def finish() -> None:
    """Write the final rank file and log the job's summary (at exit; idempotent)."""
    with _lock:
        audit = _audit
    if audit is not None:
        audit.finish()


def disarm() -> bool:
    """Remove every audit wrapper that is still ours (for tests); True if all were."""
    global _audit
    with _lock:
        audit, _audit = _audit, None
    return audit.stop() if audit is not None else True


class _Audit:
    def __init__(self, settings: Settings, applied: Callable[[], dict[str, Any]]) -> None:
        assert settings.audit_path is not None
        self.settings = settings
        self.applied = applied
        self.path = os.path.abspath(settings.audit_path)
        self.pid = os.getpid()
        self.host = socket.gethostname()
        self.observer = Observer(self.fail)
        self.copies: dict[str, CopyAudit] = {}
        self.file = rank_files.RankFile(self.path)
        self.steps = 0
        self.disabled: str | None = None
        self.finished = False
        self.group: tuple[Any, int, int] | None = None  # (store, rank, world) once known
        self._models: set[str] = set()
        self._undo_models: list[Any] = []

    # ---- life cycle
    def start(self) -> None:
        import torch
        import wrapt

        dist = torch.distributed if torch.distributed.is_available() else None
        self.observer.instrument(torch.cuda, dist)
        for copy in registry.COPIES:
            wrapt.register_post_import_hook(functools.partial(self._buffer_imported, copy),
                                            copy.buffer_module)
            wrapt.register_post_import_hook(functools.partial(self._model_imported, copy),
                                            copy.model_module)
            wrapt.register_post_import_hook(functools.partial(self._v2_imported, copy),
                                            f"{v2.package(copy)}.{v2.MODULE}")
        for name in registry.REFUSED_MODULES:
            wrapt.register_post_import_hook(self._refused_imported, name)
        atexit.register(finish)
        self._probe()

    def _probe(self) -> None:
        """Say now, before the job trains, when no rank file can be written: found at the
        first write, the warning would come after the whole job."""
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
        except OSError:
            pass  # the probe below names the folder that cannot hold the files
        problem = rank_files.probe(self.path)
        if problem is not None:
            incidents.report(REPORT, f"writing {self.path}.rank<N>.json", OSError(problem),
                             advice=_UNWRITABLE)

    def stop(self) -> bool:
        self.observer.active = False
        done = self.observer.uninstrument()
        for copy in self.copies.values():
            done = all([undo() for undo in copy.undo]) and done
        return all([undo() for undo in self._undo_models]) and done

    def fail(self, where: str, exc: Exception) -> None:
        """A bookkeeping error: stop auditing (the wrappers keep calling the originals)."""
        with _lock:
            if self.disabled is not None:
                return
            self.disabled = f"disabled: {where}: {type(exc).__name__}: {exc}"
            self.observer.active = False
            for copy in self.copies.values():
                if copy.rule is not None:
                    copy.rule.active = False
        incidents.report(AUDIT, where, exc, advice="the audit stopped; the training job goes on "
                         "unaudited and the rank files say 'disabled'. Please report this with "
                         "`mfsdp-hotfix status --json`.")
        self.write()

    # ---- import hooks (never raise into the user's import)
    def _live(self) -> bool:
        return _audit is self and self.disabled is None

    def _buffer_imported(self, copy: registry.Copy, module: ModuleType) -> None:
        if not self._live():
            return
        try:
            with _lock:
                if copy.package not in self.copies:
                    self.copies[copy.package] = watch_buffer_module(copy, module, self.observer,
                                                                    self.fail)
        except Exception as exc:
            self.fail(f"auditing {copy.label}", exc)

    def _model_imported(self, copy: registry.Copy, module: ModuleType) -> None:
        if not self._live():
            return
        try:
            with _lock:
                if module.__name__ not in self._models:
                    self._models.add(module.__name__)
                    undo = watch_model_module(module, self.after_step,
                                              functools.partial(self._record, copy), self.fail)
                    if undo is not None:
                        self._undo_models.append(undo)
        except Exception as exc:
            self.fail(f"auditing {module.__name__}", exc)

    def _record(self, copy: registry.Copy) -> CopyAudit | None:
        """The copy's record while the audit is live (its models tell it what they are)."""
        return self.copies.get(copy.package) if self._live() else None

    def _v2_imported(self, copy: registry.Copy, module: ModuleType) -> None:
        if not self._live():
            return
        try:
            with _lock:
                self._undo_models.append(watch_v2_module(copy, module, self._v2_built,
                                                         self.fail))
        except Exception as exc:
            self.fail(f"auditing {module.__name__}", exc)

    def _v2_built(self, record: CopyAudit) -> None:
        """A v2 model: listed unwatched, and the rank file written now (v2 has no
        ``finish_grad_sync`` after which the file would be)."""
        with _lock:
            if record.package not in self.copies:
                self.copies[record.package] = record
                self.write()

    def _refused_imported(self, module: ModuleType) -> None:
        label, _ = registry.REFUSED_MODULES[module.__name__]
        with _lock:
            self.copies.setdefault(module.__name__, CopyAudit(
                module.__name__.rsplit(".", 1)[0], None, None,
                note=f"not audited: {label} has a different gradient-buffer design; run it with "
                     "fsdp_double_buffer=False"))

    # ---- reporting
    def after_step(self) -> None:
        """After ``finish_grad_sync``: learn the process group once, rewrite the file."""
        self.steps += 1
        if self.group is None:
            self.group = _process_group()
        self.write()

    def rank(self) -> int:
        if self.group is None:  # e.g. a crash before the first finish_grad_sync
            self.group = _process_group()
        if self.group is not None:
            return self.group[1]
        try:
            return int(os.environ.get("RANK", "0"))
        except ValueError:
            return 0

    def snapshot(self, final: bool = False) -> dict[str, Any]:
        # per copy package, the fixes the hotfix applied in this process (none when it is off)
        fixes = {package: [f for f in applied.split(",") if f]
                 for package, _, _, applied in self.applied()["copies"]}
        rank = self.rank()
        return {"rank": rank, "world_size": self.group[2] if self.group else None,
                "host": self.host, "pid": self.pid, "final": final,
                "finish_grad_sync_calls": self.steps, "audit": self.disabled or "on",
                "observed_operations": self.observer.operations,
                "copies": [c.as_dict(fixes.get(c.package, [])) for c in self.copies.values()]}

    def write(self, final: bool = False) -> None:
        if os.getpid() != self.pid or incidents.disabled(REPORT):
            return  # a forked child, or a path that cannot be written
        with _lock:
            data = self.snapshot(final)
            target = rank_files.rank_file(self.path, data["rank"])
            try:
                self.file.write(data)
            except Exception as exc:
                incidents.report(REPORT, f"writing {target}", exc, advice=_UNWRITABLE)

    def finish(self) -> None:
        if os.getpid() != self.pid or self.finished:
            return
        self.finished = True
        data = self.snapshot(final=True)
        if not self.steps and not any(c["reuses"] or c["crashed"] or c["era"] == v2.ERA
                                      for c in data["copies"]):
            return  # a process that never trained (a helper that imported Megatron)
        self.write(final=True)
        self._summarise(data)

    def _summarise(self, data: dict[str, Any]) -> None:
        mine = {**job_line.totals(data), "unwritten": int(incidents.disabled(REPORT))}
        world = self.group[2] if self.group is not None else 1
        found: dict[int, dict[str, int]] | None = {data["rank"]: mine}
        if world > 1:
            if self.settings.cross_rank_check == "off" or self.group is None \
                    or self.group[0] is None:
                return
            store, rank, _ = self.group
            try:
                found = job_line.exchange(store, rank, world, mine,
                                          self.settings.cross_rank_timeout)
            except Exception as exc:
                incidents.report(SUMMARY, "exchanging the audit's totals through the store", exc,
                                 advice="the job summary line is not logged; every rank's "
                                 f"result is in {self.path}.rank*.json")
                return
        if found is not None:
            verdict, line = job_line.job_line(found, world, self.path,
                                              self.settings.cross_rank_timeout)
            _tell(logging.INFO if verdict == "ordered" else logging.WARNING, line)


def _tell(level: int, line: str) -> None:
    """The job's verdict line reaches a person whatever the verdict: through the
    ``mfsdp_hotfix`` logger where logging is set up to emit it at ``level``, else on stderr
    (an ``ordered`` line is INFO, which unconfigured logging drops)."""
    if log.isEnabledFor(level) and log.hasHandlers():
        log.log(level, "%s", line)
    else:
        print(line, file=sys.stderr, flush=True)


def _process_group() -> tuple[Any, int, int] | None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:
        store = None
    return store, dist.get_rank(), dist.get_world_size()
