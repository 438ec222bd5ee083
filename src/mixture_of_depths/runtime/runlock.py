"""One run per folder: a lock file held for the whole of a training run.

``<out>/run.lock`` holds the owner's host, PID and process start time, and the process holds an
exclusive `flock` on it while it trains. A second `mod train` on the same folder is refused with
the owner's name. A lock left by a process that was killed (kill -9, a crash, a reboot) is stale
and taken over: the kernel drops the flock with the process, and the PID no longer names a live
process started at that time (or the machine has rebooted since: its boot id changed). A
container restarted under a new hostname is the same machine (same boot id). A lock written on
another machine (a shared filesystem) cannot be checked from here; the refusal says so and how to
clear it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # Windows: the PID check alone
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = "run.lock"


class RunLockedError(RuntimeError):
    """Another live process is training in this folder (`held`: its flock is taken now), or a
    process on another machine may be (`held` False: the lock cannot be checked from here)."""

    def __init__(self, message: str, held: bool = True) -> None:
        super().__init__(message)
        self.held = held


def start_time(pid: int) -> str | None:
    """When process `pid` started (Linux: clock ticks since boot), to tell a reused PID apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the name in (...) may hold spaces


def boot_id() -> str | None:
    """This kernel's boot id (Linux): the same in every container on one machine, new after a
    reboot, so it tells "this machine, this boot" better than the hostname does."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        pass
    now = start_time(pid)
    return start is None or now is None or now == start


def _owner() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "start": start_time(os.getpid()),
        "boot": boot_id(),
        "since": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }


def _describe(info: dict[str, Any]) -> str:
    return f"process {info.get('pid')} on host {info.get('host')} (since {info.get('since')})"


class RunLock:
    """Hold ``<folder>/run.lock`` (or ``<folder>/<name>``) for a run: ``with RunLock(folder): ...``.

    Raises `RunLockedError` when a live process holds it. Released on exit (the file is removed);
    a killed owner leaves a stale file that the next run takes over.
    """

    def __init__(self, folder: str | Path, name: str = LOCK_NAME) -> None:
        self.path = Path(folder) / name
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(10):  # a retry only when another process removed the file under us
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if not self._flock(fd):
                    info = self._read(fd)
                    for _ in range(40):  # the owner may be between its flock and its write
                        if info:
                            break
                        time.sleep(0.025)
                        info = self._read(fd)
                    raise RunLockedError(self._refusal(info, held=True))
                # The owner may have released (unlinked) the file between our open and flock:
                # then we hold a lock on a file nobody else will see. Retry on the new one.
                try:
                    same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    same = False
                if not same:
                    os.close(fd)
                    continue
                info = self._read(fd)
                if info and not self._stale(info):
                    raise RunLockedError(self._refusal(info, held=False), held=False)
                os.ftruncate(fd, 0)
                os.pwrite(fd, (json.dumps(_owner()) + "\n").encode(), 0)
                os.fsync(fd)
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd
            return self
        raise RunLockedError(f"could not take {self.path}: it keeps changing hands")

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still holding the flock: see acquire
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    @staticmethod
    def _flock(fd: int) -> bool:
        if fcntl is None:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError:  # a filesystem without flock: the PID check still stands
            return True
        return True

    @staticmethod
    def _read(fd: int) -> dict[str, Any]:
        try:
            info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        except (ValueError, UnicodeDecodeError):
            return {}  # half-written by a process killed while writing it: stale
        return info if isinstance(info, dict) else {}

    @staticmethod
    def _stale(info: dict[str, Any]) -> bool:
        """Whether the lock `info` describes is left over (called once our flock succeeded, so
        no live process on this kernel holds the file's flock). The PID check stays for
        filesystems without flock and for lock files written by hand."""
        boot, here = info.get("boot"), boot_id()
        same_boot = boot is not None and boot == here
        if not same_boot and info.get("host") != socket.gethostname():
            return False  # another machine over a shared filesystem: cannot check from here
        if boot is not None and here is not None and boot != here:
            return True  # this machine, rebooted since: its processes are gone
        pid = info.get("pid")
        if not isinstance(pid, int) or pid == os.getpid():
            return True
        return not _alive(pid, info.get("start"))

    @staticmethod
    def _same_machine(info: dict[str, Any]) -> bool:
        boot = info.get("boot")
        return (boot is not None and boot == boot_id()) or info.get("host") == socket.gethostname()

    def _refusal(self, info: dict[str, Any], held: bool) -> str:
        owner = _describe(info) if info else "another process"
        msg = f"{self.path.parent} is in use: {owner} is training there (lock {self.path})."
        if not held and not self._same_machine(info):
            msg += (
                " That host cannot be checked from here: if no run is alive there, delete the "
                "lock file and try again."
            )
        else:
            msg += " Wait for it to finish or stop it, or pick another --out."
        return msg
