"""Run a Python script as ``python SCRIPT ARGS...`` would, started from a server that has imported
torch already.

A script the tests start as a user would (tests/mistakes/train.py, its ranks forked from it)
spends most of its CPU importing torch, and each rank again importing ``torch._dynamo`` (its
first forward). :func:`run_script` starts it instead as a child of the forkserver of
:func:`mini_ddp.training.spawn.forkserver_context`, where those imports are done: the script runs
as ``__main__`` with its own ``sys.argv``, ``sys.path[0]``, environment and working directory,
its output in files, its exit code its own. What the script does after that — forking ranks,
``mp.spawn``, a process group — is unchanged; only the interpreter's start is shared.

Environment variables that torch reads only while it is imported do not take effect here; the
one the tests set, ``OMP_NUM_THREADS``, is applied with ``torch.set_num_threads``.
"""

from __future__ import annotations

import atexit
import os
import runpy
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from mini_ddp.training.spawn import forkserver_context


def _script_main(argv: list[str], env: dict[str, str], cwd: str, out_path: str,
                 err_path: str) -> None:
    """The child: become ``python argv...`` in ``cwd`` with ``env``, its output in the files."""
    os.setpgrp()  # its own process group: a timeout stops the ranks it forked too
    for fd, path in ((1, out_path), (2, err_path)):
        file_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(file_fd, fd)
        os.close(file_fd)
    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    os.chdir(cwd)
    script = os.path.abspath(argv[0])
    sys.argv = [script, *argv[1:]]
    sys.path[0:0] = [os.path.dirname(script)]  # as the interpreter puts the script's folder first
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # what the interpreter runs on its way out


def run_script(argv: list[str | Path], *, env: dict[str, str], cwd: str | Path,
               timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *argv], env=env, cwd=cwd, capture_output=True,
    text=True, timeout=timeout)``, the interpreter's start shared: the same result, and on a
    timeout the same :class:`subprocess.TimeoutExpired` (with the output so far) after the
    script and every process it started are killed."""
    argv = [str(a) for a in argv]
    with tempfile.TemporaryDirectory(prefix="mini_ddp_script_") as folder:
        out_path, err_path = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        proc = forkserver_context().Process(
            target=_script_main, args=(argv, dict(env), str(cwd), out_path, err_path),
            name=f"script {Path(argv[0]).name}")
        proc.start()
        proc.join(timeout)
        timed_out = proc.exitcode is None
        if timed_out:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.join()
        out, err = (Path(p).read_text(errors="replace") if os.path.exists(p) else ""
                    for p in (out_path, err_path))
    cmd = [sys.executable, *argv]
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err)
    return subprocess.CompletedProcess(cmd, proc.exitcode, out, err)
