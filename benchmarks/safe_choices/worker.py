"""The worker processes: one per variant (the hotfix patches at import, so it is per process).
The driver's handle (``Worker``) sends one request a line on stdin; the worker's side (``serve``)
answers one marked line each on stdout, whatever the libraries print going to its log."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
import traceback

from . import REPO

MARK = "@@safe_choices@@ "  # prefixes the worker's answers; anything else on its stdout is noise


class Worker:
    """The driver's handle on one worker process: it answers with one line per request."""

    def __init__(self, argv, env, log_path, ready_timeout_s, turn_timeout_s):
        self.log_path = log_path
        self.ready_timeout_s, self.turn_timeout_s = ready_timeout_s, turn_timeout_s
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.answers = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self.answers.put(json.loads(line[len(MARK):]))
        self.answers.put(None)  # end of file: the process is gone

    def _answer(self, timeout_s):
        try:
            answer = self.answers.get(timeout=timeout_s)
        except queue.Empty:
            return dict(ok=False, error=f"no answer within {timeout_s:.0f} s")
        if answer is None:
            self.answers.put(None)
            try:
                rc = self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                rc = "?"
            return dict(ok=False, error=f"worker exited (rc {rc}): {self.log_tail(600)}")
        return answer

    def log_tail(self, n):
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def ready(self):
        return self._answer(self.ready_timeout_s)

    def turn(self, rep):
        try:
            self.proc.stdin.write(json.dumps(dict(op="turn", rep=rep)) + "\n")
            self.proc.stdin.flush()
        except OSError as e:
            return dict(ok=False, error=f"worker gone: {e}")
        return self._answer(self.turn_timeout_s)

    def close(self):
        try:
            self.proc.stdin.write(json.dumps(dict(op="exit")) + "\n")
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def worker_env(spec, rel_paths):
    env = dict(os.environ)
    # keep what /tmp/te-env.sh put on PYTHONPATH (TransformerEngine) after the release
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (REPO, rel_paths[spec["release"]], os.environ.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    # FakeStore implements no set/get: the hotfix's cross-rank check cannot run in a fake world
    env["MFSDP_HOTFIX_CROSS_RANK_CHECK"] = "off"
    if spec["hotfix"]:
        env.pop("MFSDP_HOTFIX", None)
    else:
        env["MFSDP_HOTFIX"] = "0"  # as shipped even if something imports mfsdp_hotfix
    env.pop("MFSDP_HOTFIX_AUDIT", None)
    return env


def serve(start):
    """The worker's side: ``start(info)`` sets up (filling ``info``) and returns
    ``turn(rep, out)``; answer the start-up, then one answer per turn until told to exit."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what libraries print goes to the log, not into the answers

    def say(msg):
        answers.write(MARK + json.dumps(msg, default=str) + "\n")
        answers.flush()

    info = dict(ok=False, phases_s={})
    t0 = time.time()
    turn = None
    try:
        turn = start(info)
        info["ok"] = not info.get("invalid")
    except BaseException as e:  # the answer says what broke; the driver goes on
        info.update(failure(e))
    info["start_s"] = round(time.time() - t0, 2)
    say(info)
    if info["ok"]:
        for line in sys.stdin:
            request = json.loads(line)
            if request["op"] != "turn":
                break
            out = dict(rep=request["rep"], ok=False)
            try:
                turn(request["rep"], out)
                out["ok"] = True
            except BaseException as e:
                out.update(failure(e))
            say(out)
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's teardown (about 10 s with TE loaded); all is said


def failure(e):
    lines = str(e).strip().splitlines()
    return dict(error=f"{type(e).__name__}: {' | '.join(lines[:3])[:600]}",
                traceback=traceback.format_exc()[-3000:])
