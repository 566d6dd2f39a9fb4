"""Command lines run one after another in ONE fresh Python process, each as its own ``__main__``.

A refused command line costs a few milliseconds; a fresh interpreter costs seconds importing torch.
Each command runs as ``python -m module args`` or ``python script args`` would: ``sys.argv`` and
``sys.path`` set, the exit code taken from ``SystemExit`` (a message to stderr and 1 for a string, 1
and the traceback for an exception), then its non-daemon threads joined and the exit handlers run,
all with file descriptors 1 and 2 captured apart (text that C code writes included). The working
folder, the environment, ``sys.argv``, ``sys.path`` and the warning filters are restored after each
command; imported modules stay. Only refusals belong here: a command that starts its work shares
the process with the ones after it.
"""
import atexit
import json
import os
import runpy
import subprocess
import sys
import tempfile
import threading
import traceback
import warnings
from dataclasses import dataclass


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str


def run_each(commands, cwd, timeout=180, env=None):
    """Done for each command line (``["-m", module, *args]`` or ``[script, *args]``), run in `cwd`."""
    with tempfile.TemporaryFile("w+") as report:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(report.fileno())],
                              input=json.dumps(commands), cwd=cwd, capture_output=True, text=True, timeout=timeout,
                              env=env, pass_fds=[report.fileno()])
        report.seek(0)
        done = [Done(**json.loads(line)) for line in report]
    assert proc.returncode == 0 and len(done) == len(commands), (
        f"the runner stopped after {len(done)} of {len(commands)} commands:\n{proc.stderr[-4000:]}")
    return done


def _run(command):
    """The command's exit code, as its own interpreter would end with it."""
    try:
        if command[0] == "-m":
            sys.argv = [command[1], *command[2:]]  # runpy puts the module's file name first
            sys.path.insert(0, os.getcwd())  # as `python -m` does
            runpy.run_module(command[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(command)
            sys.path.insert(0, os.path.dirname(os.path.abspath(command[0])))  # as `python script` does
            runpy.run_path(command[0], run_name="__main__")
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            return exit_.code or 0
        print(exit_.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 (reported as the interpreter would, then the next command)
        traceback.print_exc()
        return 1
    return 0


def _run_one(command):
    saved = (os.getcwd(), dict(os.environ), list(sys.argv), list(sys.path), sys.stdout, sys.stderr)
    threads = set(threading.enumerate())
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, warnings.catch_warnings():
        fds = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            code = _run(command)
            for thread in set(threading.enumerate()) - threads:
                if not thread.daemon:
                    thread.join()
            atexit._run_exitfuncs()  # its own exceptions are printed, the exit code stays, as at a real exit
        finally:
            for stream in (sys.stdout, sys.stderr, saved[4], saved[5]):
                stream.flush()
            os.dup2(fds[0], 1)
            os.dup2(fds[1], 2)
            os.close(fds[0])
            os.close(fds[1])
            sys.stdout, sys.stderr = saved[4], saved[5]
            os.chdir(saved[0])
            os.environ.clear()
            os.environ.update(saved[1])
            sys.argv, sys.path[:] = saved[2], saved[3]
        out.seek(0)
        err.seek(0)
        return Done(code, out.read().decode(errors="replace"), err.read().decode(errors="replace"))


if __name__ == "__main__":
    sys.path.pop(0)  # this file's folder: the commands see the path their own interpreter would
    with open(int(sys.argv[1]), "w") as report:  # not fd 1: the commands' own output goes there
        for command in json.load(sys.stdin):
            print(json.dumps(_run_one(command).__dict__), file=report, flush=True)
