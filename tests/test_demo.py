"""The demo runs end to end: two spawned ranks, every mode, a table and a plot; bad arguments are refused first."""
import importlib.util
import os
import subprocess
import sys

from cli_harness import run_each


def test_demo_runs_every_mode_and_saves_the_plot(tmp_path):
    plot = tmp_path / "demo.png"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    done = subprocess.run([sys.executable, "-m", "gradsync.demo", "--steps", "4", "--batch", "4", "--plot", str(plot)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {}
    for mode in ["fp32 DDP", "torch fp16 hook", "gradsync fp16 hook", "gradsync bf16 hook", "gradsync fp8+EF hook",
                 "gradsync.DataParallel fp16"]:
        line = next((l for l in done.stdout.splitlines() if l.startswith(mode + " ")), None)
        assert line, done.stdout
        step_ms, megabytes, loss, diff = line[len(mode):].split()
        rows[mode] = float(megabytes.removesuffix("MB")), float(loss), float(diff)
    fp32_bytes, fp32_loss, _ = rows["fp32 DDP"]
    assert rows["fp32 DDP"][2] == 0.0  # the reference itself
    for mode, (megabytes, loss, diff) in rows.items():
        # Adam moves a parameter by about lr (3e-3) per step: 4 steps apart from fp32 DDP's at most
        # twice that, whatever the wire; a lost gradient or a NaN would show here
        assert abs(loss - fp32_loss) < 0.01 and (mode == "fp32 DDP" or 0 < diff < 0.03), (mode, done.stdout)
    assert abs(rows["gradsync fp16 hook"][0] - fp32_bytes / 2) <= 0.01
    assert rows["gradsync fp8+EF hook"][0] < fp32_bytes / 3
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert plot.stat().st_size > 0


def test_demo_refuses_bad_arguments_before_it_trains(tmp_path):
    cases = [(["--lr", "nan"], "--lr must be a positive number, got nan"),
             (["--lr=-1e-3"], "--lr must be a positive number, got -0.001"),
             (["--plot", "missing/demo.png"], "--plot missing/demo.png: the folder"),
             (["--modes", "fp32 DDP,bogus"], "unknown mode(s) ['bogus']; choose from"),
             (["--modes", " , "], "no mode given; choose from")]
    if importlib.util.find_spec("matplotlib"):  # without it nothing is plotted
        # matplotlib would refuse these, or write elsewhere, only after the training
        cases += [(["--plot", "losses.txt"], "--plot losses.txt: give an image file name ending in"),
                  (["--plot", "losses"], "--plot losses: give an image file name"),
                  (["--plot", "sub/"], "--plot sub/: give an image file name"),
                  (["--plot", "."], "--plot .: give an image file name"),
                  (["--plot", "/proc/demo.png"], "--plot /proc/demo.png: cannot write in the folder /proc")]
    runs = run_each([["-m", "gradsync.demo", *args] for args, _ in cases], cwd=tmp_path)
    for (args, says), done in zip(cases, runs):
        assert done.returncode == 2 and says in done.stderr, (args, done.stderr)


def test_demo_help_says_what_it_compares(tmp_path):
    done = subprocess.run([sys.executable, "-m", "gradsync.demo", "--help"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)  # the installed package, not the source tree
    assert done.returncode == 0 and "and gradsync.DataParallel, side by side" in done.stdout, done.stdout
    assert "torchrun --nproc-per-node 4 -m gradsync.demo" in done.stdout, done.stdout


def test_without_matplotlib_no_plot_is_drawn_so_its_folder_is_not_checked(monkeypatch):
    from gradsync.demo import plot_path_problem
    assert plot_path_problem("/proc/demo.png") == "cannot write in the folder /proc (No such file or directory)" \
        if importlib.util.find_spec("matplotlib") else plot_path_problem("/proc/demo.png") is None
    monkeypatch.setitem(sys.modules, "matplotlib.backend_bases", None)  # its import fails
    assert plot_path_problem("/proc/demo.png") is None and plot_path_problem("demo.txt") is None
