"""`otelgpu nvml` as a subprocess, as a DaemonSet runs it: the stand-in libnvidia-ml.so.1 found by
the dynamic linker through LD_LIBRARY_PATH, SIGTERM to stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

from support import REPO

from .standin import DEVICES_ENV


class AgentProcess:
    def __init__(self, workdir: Path, library: Path, devices: Path, *args: str, node: str = "gpu-1") -> None:
        self.log = workdir / "nvml-agent.log"
        env = {**os.environ, "LD_LIBRARY_PATH": str(library.parent), DEVICES_ENV: str(devices), "NODE_NAME": node,
               "PYTHONUNBUFFERED": "1"}
        with self.log.open("a") as out:
            self.proc: Optional[subprocess.Popen] = subprocess.Popen(
                [sys.executable, "-m", "otelgpu", "nvml", *args], cwd=REPO, env=env, stdout=out,
                stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def running(self) -> bool:
        assert self.proc is not None
        assert self.proc.poll() is None, "the agent exited:\n" + self.text()[-4000:]
        return True

    def stop(self, timeout: float = 30) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout)
        self.proc = None
        return code

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
