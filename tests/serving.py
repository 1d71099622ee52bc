# >>> ch16 file: a real server for the tests
"""A `minioverlap serve` process on 127.0.0.1 on a free port, for chapter 16's tests: started, waited
for (GET /health), stopped with SIGTERM (the way a supervisor stops it), and checked to exit cleanly.
What it prints (an access-log line per request among it) is read as it comes by a thread, so that a
full pipe never stalls the server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child that imports the package, with `extra`: the repository's root
    first on PYTHONPATH and the parent's entries kept after it, so that the child imports what we do."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, **extra, "PYTHONPATH": path}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def skip_without_a_gpu_a_rank(device: str, args: tuple[str, ...]) -> None:
    """On a GPU a server of --tp N runs rank r on cuda:r: skip where this machine has fewer than N GPUs,
    as conftest skips an LLM of tp_size ranks (on a CPU every rank runs on the CPU)."""
    if device == "cpu" or "--tp" not in args:
        return
    import pytest
    import torch

    ranks, gpus = int(args[args.index("--tp") + 1]), torch.cuda.device_count()
    if ranks > gpus:
        pytest.skip(f"--tp {ranks} runs a rank on each of {ranks} GPUs; this machine has {gpus}")


class Server:
    def __init__(self, *args: str, startup_s: float = 120.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = child_env(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        device = os.environ.get("MINIOVERLAP_TEST_DEVICE", "cpu")     # on a GPU in fp32, as the suite's engines
        on_device = ["--device", device] + (["--dtype", "float32"] if device != "cpu" else [])
        skip_without_a_gpu_a_rank(device, args)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "minioverlap", "serve", "--port", str(self.port), *on_device, *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self.read, daemon=True)
        self.reader.start()
        self.wait_healthy(startup_s)

    def read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)

    def output(self) -> str:
        """What the server has printed so far (stdout and stderr)."""
        return "".join(self.lines)

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.reader.join(10)
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.process.kill()
        self.reader.join(10)
        raise RuntimeError(f"the server did not answer /health within {timeout_s} s:\n{self.output()}")

    def integrity(self) -> dict:
        return httpx.get(f"{self.url}/integrity", timeout=30.0).json()

    def wait_idle(self, timeout_s: float = 60.0) -> dict:
        """The integrity report once nothing is queued, running or in flight."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            report = self.integrity()
            if report["idle"]:
                return report
            time.sleep(0.1)
        raise AssertionError(f"the engine is still busy after {timeout_s} s: {report}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> tuple[int, str]:
        """Send `sig`; the exit code and everything the server printed."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            self.reader.join(10)
            raise AssertionError(f"the server did not stop within {timeout_s} s of signal {sig}:\n{self.output()}")
        self.reader.join(10)
        return self.process.returncode, self.output()
