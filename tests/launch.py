"""Launch real ranks from the tests: horovodrun (Gloo, CPU) or torchrun (gloo), on one node or as two.

Two nodes on one machine: ``horovodrun -H localhost:2,127.0.0.1:2`` (Horovod
counts two hosts, so local rank and rank differ, and starts both without
ssh), or several torchrun agents meeting at one c10d rendezvous on 127.0.0.1
(:func:`start_agent`); the first agent started hosts the rendezvous store.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
HOROVODRUN = Path(sys.executable).parent / "horovodrun"
LAUNCHERS = ("horovodrun", "torchrun")
#: torch's older launcher: torchrun's agent, but it passes ``--local-rank=N`` to the script (not in LAUNCHERS: one
#: test is enough)
LEGACY = "torch.distributed.launch"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch_command(launcher: str, script: str | Path, *args: str, np: int = 2, hosts: str | None = None) -> list[str]:
    """The command line that starts ``python script args`` on ``np`` local ranks (horovodrun: on ``hosts``)."""
    if launcher == "horovodrun":
        return [str(HOROVODRUN), "-np", str(np), "-H", hosts or f"localhost:{np}", "--start-timeout", "120",
                sys.executable, str(script), *args]
    if launcher in ("torchrun", LEGACY):
        module = "torch.distributed.run" if launcher == "torchrun" else LEGACY
        return [sys.executable, "-m", module, "--nproc_per_node", str(np),
                "--master_port", str(free_port()), str(script), *args]
    raise ValueError(f"launcher must be one of {LAUNCHERS + (LEGACY,)}, got {launcher!r}")


def _environment(env: dict[str, str] | None) -> dict[str, str]:
    # Gloo's rendezvous waits 30 s by default; 16 ranks importing torch on 2 busy cores can take longer.
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HOROVOD_GLOO_TIMEOUT_SECONDS": "180",
            **(env or {})}


def launch(launcher: str, script: str | Path, *args: str, np: int = 2, timeout: float = 300.0,
           env: dict[str, str] | None = None, hosts: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run the script on ``np`` ranks; stdout and stderr merged. A timeout kills the whole launcher."""
    command = launch_command(launcher, script, *args, np=np, hosts=hosts)
    full_env = _environment(env)
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


def agent_command(script: str | Path, *args: str, nnodes: str, nproc: int, endpoint: str,
                  max_restarts: int = 0) -> list[str]:
    """One torchrun agent (a node) of ``nproc`` ranks that meets the others at the c10d store ``endpoint``."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=pksampler-test",
            f"--max-restarts={max_restarts}", str(script), *args]


def start_agent(command: list[str], log: Path, *, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a launcher in its own session, stdout and stderr to ``log`` (read it while it runs)."""
    with open(log, "w", encoding="utf-8") as stream:
        return subprocess.Popen(command, cwd=ROOT, env=_environment(env), stdout=stream, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)


def wait_for_port(port: int, process: subprocess.Popen, *, timeout: float = 120.0) -> None:
    """Block until something listens on 127.0.0.1:``port`` (the first agent's rendezvous store)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"nothing listens on port {port} (launcher status {process.poll()})")


def kill_agent(process: subprocess.Popen) -> None:
    """SIGKILL a launcher and every process under it: a node lost at once.

    torchrun starts each worker in a session of its own, so killing the
    agent's process group would leave its workers running.
    """
    try:
        tree = [*psutil.Process(process.pid).children(recursive=True), psutil.Process(process.pid)]
    except psutil.NoSuchProcess:
        return
    for member in tree:
        try:
            member.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    process.wait()


def finish_agent(process: subprocess.Popen, log: Path, *, timeout: float) -> subprocess.CompletedProcess[str]:
    """Wait for a launcher started by :func:`start_agent`; past ``timeout`` kill it and fail."""
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_agent(process)
        raise AssertionError(f"{process.args} timed out after {timeout}s:\n{log.read_text()[-4000:]}") from None
    return subprocess.CompletedProcess(process.args, process.returncode, log.read_text(), "")


def launch_agents(script: str | Path, *args: str, agents: int = 2, nproc: int = 2, timeout: float = 300.0,
                  env: dict[str, str] | None = None, log_dir: Path) -> list[subprocess.CompletedProcess[str]]:
    """``agents`` torchrun agents of ``nproc`` ranks each, one job at a c10d rendezvous on 127.0.0.1."""
    port = free_port()
    command = agent_command(script, *args, nnodes=str(agents), nproc=nproc, endpoint=f"127.0.0.1:{port}")
    processes = [start_agent(command, log_dir / "agent0.log", env=env)]
    wait_for_port(port, processes[0])
    try:
        processes += [start_agent(command, log_dir / f"agent{i}.log", env=env) for i in range(1, agents)]
        started = time.monotonic()
        return [finish_agent(p, log_dir / f"agent{i}.log", timeout=max(timeout - (time.monotonic() - started), 1.0))
                for i, p in enumerate(processes)]
    finally:
        for process in processes:
            if process.poll() is None:
                kill_agent(process)


def page_walkthrough(page: Path) -> str:
    """The ``bash`` blocks between a docs page's ``<!-- walk-through -->`` markers, as one script."""
    import re

    text = page.read_text(encoding="utf-8")
    section = text.split("<!-- walk-through -->", 1)[1].split("<!-- /walk-through -->", 1)[0]
    return "\n".join(re.findall(r"```bash\n(.*?)```", section, flags=re.S))


def run_walkthrough(script: str, folder: Path, *, timeout: float) -> subprocess.CompletedProcess[str]:
    """``script`` under ``bash -e`` in ``folder``, which sees the repository's ``train/`` and ``configs/`` (as a fresh
    clone would), ``python`` and ``horovodrun`` being this environment's."""
    for name in ("train", "configs"):
        (folder / name).symlink_to(ROOT / name)
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}",
           "OMP_NUM_THREADS": "1", "HOROVOD_GLOO_TIMEOUT_SECONDS": "180", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(["bash", "-e", "-c", script], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=timeout)
