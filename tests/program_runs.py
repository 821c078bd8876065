"""`python -m PROGRAM ARGS`, for tests that run programs many times over only to see them refuse
their input or print their help: most of such a run is the interpreter importing JAX and Flax.

`run_forked` runs the module as `python -m` does, in a process forked from a server process
that has imported the third-party libraries every program imports (NumPy, JAX, Flax, absl) and
nothing else: no JAX backend started, no module of this project imported, one Python thread.
The forked process imports the program and the project's modules itself, as a fresh interpreter
would, runs the module as `__main__` (`runpy`, as `-m` does: sys.argv[0] its file, the working
directory first on sys.path), and ends as the interpreter ends a program: the exit status of its
SystemExit (1 after an uncaught exception, its traceback on stderr), non-daemon threads joined,
atexit functions run, output flushed. Its stdout and stderr go to files of its own.

One server per environment (JAX reads some of its settings from the environment on import),
started at the first run that needs it and stopped when the test process exits; runs take turns.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# The server: imports the libraries, then for each request line {"module", "args", "cwd", "env",
# "out", "err"} forks a child that runs the module, answers {"pid"}, waits for it and answers
# {"returncode"} (as subprocess gives it: minus the signal's number for a killed child).
_SERVER = r"""
import atexit, json, os, runpy, sys, threading, traceback

import absl.app, absl.flags, absl.logging, flax.nnx, jax, jax.numpy, numpy  # what programs import


def exit_code(e):
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def run(request):
    code = 1
    try:
        for fd, path in ((1, request["out"]), (2, request["err"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]  # as `python -m` puts the working directory first
        sys.argv = [request["module"], *request["args"]]  # run_module sets argv[0] to the file
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = exit_code(e)
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        threading._shutdown()  # as the interpreter ends: non-daemon threads, atexit, flush
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        run(request)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)
"""


class _Server:
    def __init__(self, env: dict[str, str]):
        self.log = tempfile.TemporaryFile("w+")  # the server's own stderr
        self.process = subprocess.Popen(
            [sys.executable, "-c", _SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            text=True,
        )
        self.lock = threading.Lock()

    def run(self, module: str, args: list[str], cwd: Path, env: dict[str, str], timeout: float):
        command = [sys.executable, "-m", module, *args]
        with self.lock, tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "out", Path(tmp) / "err"
            request = dict(
                module=module, args=args, cwd=str(cwd), env=env, out=str(out), err=str(err)
            )
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            pid = self._answer()["pid"]
            killed = threading.Event()

            def kill():
                killed.set()
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

            timer = threading.Timer(timeout, kill)
            timer.start()
            try:
                returncode = self._answer()["returncode"]
            finally:
                timer.cancel()
            if killed.is_set():
                raise subprocess.TimeoutExpired(command, timeout, out.read_text(), err.read_text())
            return subprocess.CompletedProcess(
                command, returncode, out.read_text(), err.read_text()
            )

    def _answer(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            self.log.seek(0)
            raise RuntimeError(f"the program server ended (exit status {code}):\n{self.log.read()}")
        return json.loads(line)

    def stop(self):
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()


_servers: dict[tuple, _Server] = {}
_servers_lock = threading.Lock()


@atexit.register
def _stop_servers():
    for server in _servers.values():
        server.stop()


def run_forked(
    module: str,
    *args: str,
    cwd: Path,
    env: dict[str, str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
    cwd=cwd, env=env, timeout=timeout)`, the process forked from a server (see above)."""
    env = dict(os.environ if env is None else env)
    # pytest's variables change from test to test and JAX reads none of them
    key = tuple(sorted((k, v) for k, v in env.items() if not k.startswith("PYTEST_")))
    with _servers_lock:
        if key not in _servers or _servers[key].process.poll() is not None:
            _servers[key] = _Server(env)
        server = _servers[key]
    return server.run(module, list(args), cwd, env, timeout)
