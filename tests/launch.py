"""Launch real ranks from the tests: horovodrun (Gloo, CPU) or torchrun (gloo)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOROVODRUN = Path(sys.executable).parent / "horovodrun"
LAUNCHERS = ("horovodrun", "torchrun")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch_command(launcher: str, script: str | Path, *args: str, np: int = 2) -> list[str]:
    """The command line that starts ``python script args`` on ``np`` local ranks."""
    if launcher == "horovodrun":
        return [str(HOROVODRUN), "-np", str(np), "-H", f"localhost:{np}", "--start-timeout", "120",
                sys.executable, str(script), *args]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(np),
                "--master_port", str(_free_port()), str(script), *args]
    raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")


def launch(launcher: str, script: str | Path, *args: str, np: int = 2, timeout: float = 300.0,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the script on ``np`` ranks; stdout and stderr merged. A timeout kills the whole launcher."""
    command = launch_command(launcher, script, *args, np=np)
    # Gloo's rendezvous waits 30 s by default; 16 ranks importing torch on 2 busy cores can take longer.
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HOROVOD_GLOO_TIMEOUT_SECONDS": "180",
                **(env or {})}
    process = subprocess.Popen(command, cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        output, _ = process.communicate()
        raise AssertionError(f"{launcher} {script} timed out after {timeout}s:\n{output[-4000:]}") from None
    return subprocess.CompletedProcess(command, process.returncode, output, "")


def rank_tracebacks(output: str) -> int:
    """Python tracebacks printed by the ranks, not counting the launcher's own report of a failed job.

    horovodrun ends a failed job with a RuntimeError traceback from the
    launcher and torchrun with a ChildFailedError one; both are the
    launcher's, printed once, whatever the ranks did.
    """
    total = output.count("Traceback (most recent call last)")
    launcher = output.count("horovod/runner/launch.py") > 0
    launcher += output.count("ChildFailedError") > 0
    return total - int(launcher)


def horovodrun(script: str | Path, *args: str, np: int = 2, timeout: float = 300.0,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return launch("horovodrun", script, *args, np=np, timeout=timeout, env=env)
