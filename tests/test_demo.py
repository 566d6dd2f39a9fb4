"""The demo runs end to end: two spawned ranks, every mode, a table and a plot."""
import os
import subprocess
import sys


def test_demo_runs_every_mode_and_saves_the_plot(tmp_path):
    plot = tmp_path / "demo.png"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    done = subprocess.run([sys.executable, "-m", "gradsync.demo", "--steps", "4", "--batch", "4", "--plot", str(plot)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    for mode in ["fp32 DDP", "torch fp16 hook", "gradsync fp16 hook", "gradsync bf16 hook", "gradsync fp8+EF hook",
                 "gradsync.DataParallel fp16"]:
        assert f"\n{mode} " in done.stdout, done.stdout
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert plot.stat().st_size > 0
