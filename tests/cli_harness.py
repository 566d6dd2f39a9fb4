"""Command lines run one after another in ONE fresh Python process, each as its own ``__main__``.

A refused command line costs a few milliseconds; a fresh interpreter costs seconds importing torch.
Each command runs as ``python -m module args`` or ``python script args`` would: ``sys.argv`` set,
the exit code taken from ``SystemExit`` (a message to stderr and 1 for a string, 1 and the traceback
for an exception), its stdout and stderr captured apart. Only refusals belong here: a command that
starts its work shares the process with the ones after it.
"""
import contextlib
import io
import json
import os
import runpy
import subprocess
import sys
import traceback
from dataclasses import dataclass


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str


def run_each(commands, cwd, timeout=180, env=None):
    """Done for each command line (``["-m", module, *args]`` or ``[script, *args]``), run in `cwd`."""
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], input=json.dumps(commands), cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env=env)
    done = [Done(**json.loads(line)) for line in proc.stdout.splitlines()]
    assert proc.returncode == 0 and len(done) == len(commands), (
        f"the runner stopped after {len(done)} of {len(commands)} commands:\n{proc.stderr[-4000:]}")
    return done


def _run_one(command):
    out, err = io.StringIO(), io.StringIO()
    argv, path = list(sys.argv), list(sys.path)
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
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
                code = exit_.code or 0
            else:
                print(exit_.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 (reported as the interpreter would, then the next command)
            traceback.print_exc()
            code = 1
    sys.argv, sys.path[:] = argv, path
    return Done(code, out.getvalue(), err.getvalue())


if __name__ == "__main__":
    sys.path.pop(0)  # this file's folder: the commands see the path their own interpreter would
    for command in json.load(sys.stdin):
        print(json.dumps(_run_one(command).__dict__), flush=True)
