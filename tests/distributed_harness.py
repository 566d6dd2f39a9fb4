"""Multi-process worlds for tests: N spawned ranks in a gloo group that run test functions on command.

A World starts its processes once; World.run(fn, *args) runs fn(rank, size, *args) on every rank
(fn must be a module-level function of an importable module) and returns the per-rank results.
Every wait has a timeout; close() always reaps the processes. Rendezvous goes through a file in a
fresh temporary folder, so no port is ever chosen or reused.
"""
import datetime
import importlib
import multiprocessing
import os
import shutil
import subprocess
import tempfile
import time
import traceback


def _worker(rank, size, init_file, conn, group_timeout_s, backend):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=group_timeout_s))
    try:
        while True:
            message = conn.recv()
            if message is None:
                break
            module, name, args = message
            try:
                fn = getattr(importlib.import_module(module), name)
                conn.send(("ok", fn(rank, size, *args)))
            except BaseException:  # noqa: B902 - report everything to the parent
                conn.send(("error", traceback.format_exc()))
    finally:
        import gradsync
        gradsync.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()


class World:
    def __init__(self, size, *, group_timeout_s=60, backend="gloo"):
        context = multiprocessing.get_context("spawn")
        self.size = size
        self.folder = tempfile.mkdtemp(prefix="gradsync-world-")
        init_file = os.path.join(self.folder, "rendezvous")
        self.conns, self.procs = [], []
        for rank in range(size):
            parent, child = context.Pipe()
            proc = context.Process(target=_worker, args=(rank, size, init_file, child, group_timeout_s, backend), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(self, fn, *args, timeout=180):
        for conn in self.conns:
            conn.send((fn.__module__, fn.__name__, args))
        deadline = time.monotonic() + timeout
        results, errors = [], []
        for rank, conn in enumerate(self.conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                self.close()
                raise TimeoutError(f"rank {rank} did not finish {fn.__name__} within {timeout} s")
            try:
                status, value = conn.recv()
            except EOFError:
                self.close()
                raise RuntimeError(f"rank {rank} died running {fn.__name__}") from None
            results.append(value)
            if status == "error":
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:
            raise AssertionError(f"{fn.__name__} failed:\n" + "\n".join(errors))
        return results

    def close(self):
        """Stops every rank; returns True if all of them exited by themselves."""
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 20
        clean = True
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                clean = False
                proc.kill()
                proc.join(5)
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self.folder, ignore_errors=True)
        return clean


def run_processes(commands, cwd, timeout=100):
    """Runs the commands at once (one per rank of a world they make themselves) and returns each
    one's (returncode, stdout, stderr); any still running after ``timeout`` seconds is killed."""
    procs = [subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for command in commands]
    try:
        outs = [proc.communicate(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [(proc.returncode, out, err) for proc, (out, err) in zip(procs, outs)]
