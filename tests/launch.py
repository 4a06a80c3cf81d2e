"""Launch real ranks from the tests: horovodrun (Gloo, CPU) or torchrun (gloo), on one node or as two.

Two nodes on one machine: ``horovodrun -H localhost:2,127.0.0.1:2`` (Horovod
counts two hosts, so local rank and rank differ, and starts both without
ssh), or several torchrun agents meeting at one c10d rendezvous on 127.0.0.1
(:func:`start_agent`); the first agent started hosts the rendezvous store.

Every launcher, server or job the tests start goes through :func:`spawn`,
which counts it (the session's summary prints the count) and tags it and
everything under it with ``PKSAMPLER_TEST_LAUNCH`` in the environment. The tag
is what ends them: launchers run in sessions of their own and torchrun starts
each worker in another, so neither the terminal's Ctrl-C nor a process group
reaches them all. A launch ends with the test that started it (whatever made
the test stop: a failure, Ctrl-C, a pytest timeout), and a small guard process
ends the session's launches when pytest itself ends, SIGTERM and SIGKILL
included.

A launch is expensive (seconds of start-up per rank): make one serve many
assertions. :func:`shared_run` turns a run into a module- or session-scoped
fixture that every test reading its outputs shares.
"""

from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
HOROVODRUN = Path(sys.executable).parent / "horovodrun"
LAUNCHERS = ("horovodrun", "torchrun")
#: torch's older launcher: torchrun's agent, but it passes ``--local-rank=N`` to the script (not in LAUNCHERS: one
#: test is enough)
LEGACY = "torch.distributed.launch"
#: the environment variable that marks a launch and everything under it; a nested session extends its parent's
TAG = "PKSAMPLER_TEST_LAUNCH"
SESSION = f"{os.environ.get(TAG, 'pytest')}/{os.getpid()}.{time.monotonic_ns()}"
#: what every launch's environment holds unless the test sets it: Horovod's coordination cycle at 10 ms, not its
#: 1 ms default, which on two shared cores spends more CPU time than the ranks' work (a tiny horovodrun -np 2 run:
#: 36 s of CPU at 1 ms, 18 s at 10 ms; the Makefile's demo runs at 10 ms for the same reason). The cycle decides
#: which ready tensors share one allreduce, not what two ranks sum; from three ranks on, a fused buffer may move an
#: element's place in the ring and its rounding, within the tolerances of the -np 3 comparisons, and the
#: bit-for-bit runs turn fusion off (train.deterministic). A test that runs a command as the docs show passes
#: ``env={"HOROVOD_CYCLE_TIME": None}`` to leave it unset.
LAUNCH_DEFAULTS = {"HOROVOD_CYCLE_TIME": "10"}
#: horovodrun's controller named, as the set-up built it (Gloo, no MPI: ``horovodrun --check-build``). Without it
#: horovodrun asks whether MPI was built before it asks for Gloo, each question a forked process that imports
#: horovod.torch and with it torch: a second import of torch per launch (1.3 CPU-s of a trivial ``horovodrun -np 1``'s
#: 3.2). A test that runs a command as the docs show builds its own command line (test_default_command.py).
HOROVODRUN_CONTROLLER = ("--gloo",)
#: the launches this session started, by kind (horovodrun, torchrun, accelerate, lightning, s3 server, ...)
LAUNCHES: collections.Counter[str] = collections.Counter()
_live: dict[int, tuple[subprocess.Popen, str]] = {}
_lasting: set[int] = set()  # pids of launches that outlive the test that started them
_guard: subprocess.Popen | None = None

#: the guard: a process of its own that waits for the end of pytest (its stdin closes, however pytest ended) and
#: then ends every process still carrying one of the session's tags, with this module's own :func:`kill_tagged`
_GUARD = """
import sys
sys.path.insert(0, sys.argv[2])
from launch import kill_tagged
sys.stdin.buffer.read()
kill_tagged(sys.argv[1], rounds=20)
"""


def _start_guard() -> None:
    global _guard
    if _guard is None or _guard.poll() is not None:
        # stdin is a pipe only this process holds open (Popen closes it in every child): EOF means pytest is gone
        _guard = subprocess.Popen([sys.executable, "-c", _GUARD, SESSION, str(Path(__file__).parent)],
                                  stdin=subprocess.PIPE,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                  env={k: v for k, v in os.environ.items() if k != TAG})


def tagged(tag: str) -> list[psutil.Process]:
    """The processes that carry ``tag`` or a tag nested under it (a launch's whole tree, re-parented or not)."""
    found = []
    for process in psutil.process_iter():
        try:
            value = process.environ().get(TAG, "")
        except psutil.Error:  # gone, a zombie, or another user's
            continue
        if value == tag or value.startswith(tag + "/"):
            found.append(process)
    return found


def kill_tagged(tag: str, *, rounds: int = 10) -> None:
    """SIGKILL every process that carries ``tag`` (or a tag nested under it), again until none is left: a launcher
    may start a worker while its siblings die."""
    for _ in range(rounds):
        members = tagged(tag)
        if not members:
            return
        for member in members:
            try:
                member.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
        psutil.wait_procs(members, timeout=2)


def spawn(command: list[str], *, kind: str, outlives_test: bool = False, **popen: Any) -> subprocess.Popen:
    """Start ``command`` in a session of its own, counted under ``kind`` and tagged for :func:`end_launch`.

    ``outlives_test``: a server that a session-scoped fixture owns, restarted inside a test; its owner ends it
    (and the guard, when pytest ends), not the end of that test. ``popen`` goes to :class:`subprocess.Popen`
    (``env`` is the whole environment; the tag is added to it).
    """
    _start_guard()
    LAUNCHES[kind] += 1
    tag = f"{SESSION}/{sum(LAUNCHES.values())}"
    given = {**LAUNCH_DEFAULTS, **(popen.pop("env", None) or os.environ), TAG: tag}
    env = {key: value for key, value in given.items() if value is not None}  # None: left unset, as a user has it
    process = subprocess.Popen(command, env=env, start_new_session=True, **popen)
    _live[process.pid] = (process, tag)
    if outlives_test:
        _lasting.add(process.pid)
    return process


def end_launch(process: subprocess.Popen) -> None:
    """SIGKILL a spawned launch and every process under it, wherever it was re-parented (a no-op once it is gone)."""
    _, tag = _live.pop(process.pid, (process, None))
    _lasting.discard(process.pid)
    if tag:
        kill_tagged(tag)
    if process.poll() is None:
        process.kill()
    process.wait()


def tag_of(process: subprocess.Popen) -> str:
    """The tag :func:`spawn` gave ``process``, which every process started under it carries too."""
    return _live[process.pid][1]


def test_launches() -> list[subprocess.Popen]:
    """The spawned launches not yet ended by :func:`end_launch` that end with a test, oldest first."""
    return [process for pid, (process, _) in _live.items() if pid not in _lasting]


@contextmanager
def launched(command: list[str], *, kind: str, **popen: Any) -> Iterator[subprocess.Popen]:
    """:func:`spawn` for the length of a ``with`` block; leaving it in any way ends the launch's whole tree."""
    process = spawn(command, kind=kind, **popen)
    try:
        yield process
    finally:
        end_launch(process)


T = TypeVar("T")


def shared_run(scope: str = "module") -> Callable[[Callable[[Path], T]], Any]:
    """Turn ``make(folder)``, which launches a job and returns what the tests read, into a fixture run once per
    ``scope`` in a folder of its own; every test that names the fixture shares the one launch and its outputs.

    A launch costs seconds of start-up per rank; one run's workspace, metrics.jsonl and output can serve every
    assertion that reads them (pytest's session-scoped fixture pattern; Horovod's CI runs a whole test file under
    one ``horovodrun``). Keep a launch of its own only for a scenario that needs one (a node lost, a host joining)::

        @shared_run()
        def trained(folder: Path) -> subprocess.CompletedProcess[str]:
            return launch("horovodrun", SCRIPT, "--set", f"workspace={folder}")

        def test_it_trains(trained):
            assert trained.returncode == 0, trained.stdout[-4000:]

    The fixture takes the function's name. Tests assert on the result (its return code included), so a failed run
    fails each of them with the run's output rather than with a set-up error.
    """
    def fixture(make: Callable[[Path], T]) -> Any:
        @pytest.fixture(scope=scope, name=make.__name__)
        def once(tmp_path_factory: pytest.TempPathFactory) -> T:
            return make(tmp_path_factory.mktemp(make.__name__))
        once.__doc__ = make.__doc__
        return once
    return fixture


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch_command(launcher: str, script: str | Path, *args: str, np: int = 2, hosts: str | None = None) -> list[str]:
    """The command line that starts ``python script args`` on ``np`` local ranks (horovodrun: on ``hosts``)."""
    if launcher == "horovodrun":
        return [str(HOROVODRUN), *HOROVODRUN_CONTROLLER, "-np", str(np), "-H", hosts or f"localhost:{np}",
                "--start-timeout", "120", sys.executable, str(script), *args]
    if launcher in ("torchrun", LEGACY):
        module = "torch.distributed.run" if launcher == "torchrun" else LEGACY
        return [sys.executable, "-m", module, "--nproc_per_node", str(np),
                "--master_port", str(free_port()), str(script), *args]
    raise ValueError(f"launcher must be one of {LAUNCHERS + (LEGACY,)}, got {launcher!r}")


def environment(env: dict[str, str | None] | None = None) -> dict[str, str | None]:
    """The environment a launch runs in: this one, one OpenMP thread per rank, unbuffered output, a Gloo timeout
    for 16 ranks on two busy cores, then ``env`` (a value of None leaves that variable unset)."""
    # Gloo's rendezvous waits 30 s by default; 16 ranks importing torch on 2 busy cores can take longer.
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HOROVOD_GLOO_TIMEOUT_SECONDS": "180",
            **(env or {})}


def launch(launcher: str, script: str | Path, *args: str, np: int = 2, timeout: float = 300.0,
           env: dict[str, str] | None = None, hosts: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run the script on ``np`` ranks; stdout and stderr merged. A timeout kills the whole launcher."""
    command = launch_command(launcher, script, *args, np=np, hosts=hosts)
    return run_launcher(command, kind=launcher, timeout=timeout, env=environment(env))


def run_launcher(command: list[str], *, kind: str, timeout: float, env: dict[str, str] | None = None,
                 cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Run a launcher to its end, stdout and stderr merged; past ``timeout``, or on any exit of the test while it
    runs, its whole tree is killed (a timeout fails the test with the output)."""
    with launched(command, kind=kind, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                  text=True) as process:
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            end_launch(process)
            output, _ = process.communicate()
            raise AssertionError(f"{command} timed out after {timeout}s:\n{output[-4000:]}") from None
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
    horovod = any("horovodrun" in Path(part).name for part in command[:2])  # horovodrun, or a script wrapping it
    kind = "torchrun" if "torch.distributed.run" in command else "horovodrun" if horovod else Path(command[0]).name
    with open(log, "w", encoding="utf-8") as stream:
        return spawn(command, kind=kind, cwd=ROOT, env=environment(env), stdout=stream, stderr=subprocess.STDOUT,
                     text=True)


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
    if process.pid in _live:
        end_launch(process)
        return
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
    # a launch of its own: an interrupted test ends the walk-through's ranks too
    return run_launcher(["bash", "-e", "-c", script], kind="walkthrough", timeout=timeout, env=env, cwd=folder)
