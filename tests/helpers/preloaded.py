"""Run a Python script as ``python SCRIPT ARGS...`` (or ``python -m MODULE ARGS...``) would,
started from a server that has imported torch already.

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
    try:
        if argv[0] == "-m":  # python -m MODULE ARGS...: the working directory goes first
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0:0] = [os.getcwd()]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(argv[0])
            sys.argv = [script, *argv[1:]]
            sys.path[0:0] = [os.path.dirname(script)]  # the interpreter puts the script's folder first
            runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # what the interpreter runs on its way out


class Script:
    """A script started by :func:`start_script`: a ``subprocess.Popen`` for the calls the tests
    make (``pid``, ``poll``, ``wait``, ``kill``), its output read once it has ended."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str) -> None:
        self.args = [sys.executable, *argv]
        self._folder = tempfile.TemporaryDirectory(prefix="mini_ddp_script_")
        self._out = os.path.join(self._folder.name, "stdout")
        self._err = os.path.join(self._folder.name, "stderr")
        self._proc = forkserver_context().Process(
            target=_script_main, args=(argv, env, cwd, self._out, self._err),
            name=f"script {Path(argv[0]).name}")
        self._proc.start()
        self.pid: int = self._proc.pid

    def poll(self) -> int | None:
        """The exit code, or None while the script runs."""
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code once the script has ended; :class:`subprocess.TimeoutExpired` (the
        output so far in it) when it runs past ``timeout``."""
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            out, err = self.output()
            raise subprocess.TimeoutExpired(self.args, timeout, output=out, stderr=err)
        return self._proc.exitcode

    def kill(self) -> None:
        """SIGKILL to the script and every process it started (its own process group)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._proc.join()

    def output(self) -> tuple[str, str]:
        """What the script wrote so far to its stdout and its stderr."""
        return tuple(Path(p).read_text(errors="replace") if os.path.exists(p) else ""
                     for p in (self._out, self._err))


def start_script(argv: list[str | Path], *, env: dict[str, str], cwd: str | Path
                 ) -> Script:
    """Start ``python argv...`` with ``env`` in ``cwd``, the interpreter's start shared."""
    return Script([str(a) for a in argv], dict(env), str(cwd))


def run_script(argv: list[str | Path], *, env: dict[str, str], cwd: str | Path,
               timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *argv], env=env, cwd=cwd, capture_output=True,
    text=True, timeout=timeout)``, the interpreter's start shared: the same result, and on a
    timeout the same :class:`subprocess.TimeoutExpired` (with the output so far) after the
    script and every process it started are killed."""
    script = start_script(argv, env=env, cwd=cwd)
    try:
        code = script.wait(timeout)
    finally:
        if script.poll() is None:
            script.kill()
    return subprocess.CompletedProcess(script.args, code, *script.output())
