"""Launch real ranks with horovodrun (Gloo, CPU) from the tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOROVODRUN = Path(sys.executable).parent / "horovodrun"


def horovodrun(script: str | Path, *args: str, np: int = 2, timeout: float = 300.0,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python script args`` on ``np`` local ranks; return the finished process.

    A timeout kills the whole launcher, so a hang fails the test instead of
    blocking the suite.
    """
    command = [
        str(HOROVODRUN), "-np", str(np), "-H", f"localhost:{np}", "--start-timeout", "120",
        sys.executable, str(script), *args,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    process = subprocess.Popen(command, cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        output, _ = process.communicate()
        raise AssertionError(f"horovodrun {script} timed out after {timeout}s:\n{output[-4000:]}") from None
    return subprocess.CompletedProcess(command, process.returncode, output, "")
