"""Child process, one per participant (a GPU, or a torchrun rank): cross-process memory sharing.

Each participant exports two buffers on its GPU: a legacy CUDA IPC one (cuMemAlloc +
cuIpcGetMemHandle) and a VMM one (cuMemCreate, exported as a POSIX file descriptor and passed
over a Unix socket with SCM_RIGHTS, the way torch symmetric memory and FlashInfer do). Every
participant then imports every peer's buffers, grants itself access (cuMemSetAccess), writes
a pattern with SM stores into its own slot and, after all have written, each owner verifies
every slot. Participants meet through files in a shared directory; every wait has a deadline,
so a peer that dies or hangs is reported by name instead of blocking the others.

With the user's permission and no policy variable forbidding it, participant 0 also creates a
multicast object that every participant joins and binds its VMM buffer to (setup only).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from commbench.topology.childproc import child_main, emit
from commbench.topology.cudadrv import CudaError, Driver, count_wrong

WORDS_PER_SLOT = 16384      # 64 KiB per writer slot


def seed_for(writer: int, owner: int) -> int:
    return ((writer * 131 + owner * 17 + 3) * 0x85EBCA6B) & 0xFFFFFFFF


class Meeting:
    """File-based rendezvous between the participants of one host."""

    def __init__(self, directory: str, me: int, count: int, deadline: float):
        self.dir = Path(directory)
        self.me, self.count, self.deadline = me, count, deadline

    def put(self, name: str, data: bytes = b"") -> None:
        tmp = self.dir / f".{name}.{self.me}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self.dir / f"{name}.{self.me}")

    def get(self, name: str, who: int) -> bytes | None:
        """Wait for participant who's file; None when it reported an error or at the deadline."""
        path, error = self.dir / f"{name}.{who}", self.dir / f"{name}_error.{who}"
        while time.time() < self.deadline:
            if path.exists():
                return path.read_bytes()
            if error.exists():
                return None
            time.sleep(0.01)
        return None

    def barrier(self, name: str) -> list[int]:
        """Announce name, wait for everyone; returns the participants that never arrived."""
        self.put(name)
        return [j for j in range(self.count) if self.get(name, j) is None]

    def sock_path(self, name: str, who: int) -> str:
        return str(self.dir / f"{name}{who}.sock")


def serve_fd(path: str, fd: int, stop: threading.Event) -> None:
    """Hand a duplicate of fd to everyone who connects, until stop is set."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(64)
    srv.settimeout(0.1)
    while not stop.is_set():
        try:
            conn, _ = srv.accept()
        except socket.timeout:
            continue
        with conn:
            socket.send_fds(conn, [b"f"], [fd])
    srv.close()


def receive_fd(path: str, deadline: float) -> int:
    while True:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(max(0.1, deadline - time.time()))
                s.connect(path)
                _, fds, _, _ = socket.recv_fds(s, 1, 1)
                return fds[0]
        except (FileNotFoundError, ConnectionRefusedError):
            if time.time() >= deadline:
                raise
            time.sleep(0.01)


def missing_peer(meet: Meeting, name: str, who: int) -> str:
    err = meet.dir / f"{name}_error.{who}"
    if err.exists():
        return f"participant {who} could not export: {err.read_text()}"
    return f"participant {who} did not export within the time limit"


def run(spec: dict[str, Any]) -> None:
    me, count, device = int(spec["me"]), int(spec["count"]), int(spec["device"])
    meet = Meeting(spec["dir"], me, count, float(spec["deadline"]))
    words = count * WORDS_PER_SLOT
    nbytes = words * 4
    drv = Driver()
    ctx = drv.primary_context(device)
    drv.set_current(ctx)

    # --- export -----------------------------------------------------------------------------
    ipc_ptr = None
    try:
        ipc_ptr = drv.alloc(nbytes)
        drv.memset32(ipc_ptr, 0, words)
        meet.put("ipc", drv.ipc_handle(ipc_ptr))
        emit("export", mechanism="ipc", participant=me, status="ok")
    except CudaError as exc:
        meet.put("ipc_error", str(exc).encode())
        emit("export", mechanism="ipc", participant=me, status="fail", detail=str(exc))

    vmm_handle = vmm_va = None
    vmm_size = 0
    stop = threading.Event()
    try:
        prop = drv.vmm_prop(device)
        gran = drv.vmm_granularity(prop)
        vmm_size = ((nbytes + gran - 1) // gran) * gran
        vmm_handle = drv.vmm_create(prop, vmm_size)
        vmm_va = drv.vmm_map(vmm_handle, vmm_size, gran, device)
        drv.memset32(vmm_va, 0, words)
        fd = drv.vmm_export_fd(vmm_handle)
        threading.Thread(target=serve_fd, args=(meet.sock_path("vmm", me), fd, stop), daemon=True).start()
        meet.put("vmm", str(gran).encode())
        emit("export", mechanism="vmm", participant=me, status="ok", size_bytes=vmm_size)
    except CudaError as exc:
        meet.put("vmm_error", str(exc).encode())
        emit("export", mechanism="vmm", participant=me, status="fail", detail=str(exc))
    drv.synchronize()

    # --- every participant writes its slot in every peer's buffers ----------------------------
    for owner in range(count):
        if owner == me:
            continue
        seed = seed_for(me, owner)
        emit("start", step=f"IPC write {me} -> {owner}")
        handle = meet.get("ipc", owner)
        if handle is None:
            emit("write", mechanism="ipc", writer=me, owner=owner, status="fail",
                 detail=missing_peer(meet, "ipc", owner))
        else:
            try:
                peer = drv.ipc_open(handle)
                drv.write_pattern(device, peer + me * WORDS_PER_SLOT * 4, WORDS_PER_SLOT, seed)
                drv.synchronize()
                drv.ipc_close(peer)
                emit("write", mechanism="ipc", writer=me, owner=owner, status="ok")
            except CudaError as exc:
                emit("write", mechanism="ipc", writer=me, owner=owner, status="fail", detail=str(exc))
        emit("start", step=f"VMM import and write {me} -> {owner}")
        gran_text = meet.get("vmm", owner)
        if gran_text is None:
            emit("write", mechanism="vmm", writer=me, owner=owner, status="fail",
                 detail=missing_peer(meet, "vmm", owner))
            continue
        fd = -1
        try:
            fd = receive_fd(meet.sock_path("vmm", owner), meet.deadline)
            imported = drv.vmm_import_fd(fd)
            gran = int(gran_text)
            size = ((nbytes + gran - 1) // gran) * gran
            va = drv.vmm_map(imported, size, gran, device)
            drv.write_pattern(device, va + me * WORDS_PER_SLOT * 4, WORDS_PER_SLOT, seed)
            drv.synchronize()
            drv.vmm_unmap(va, size)
            drv.vmm_release(imported)
            emit("write", mechanism="vmm", writer=me, owner=owner, status="ok")
        except (CudaError, OSError) as exc:
            emit("write", mechanism="vmm", writer=me, owner=owner, status="fail",
                 detail=str(exc) if isinstance(exc, CudaError) else f"receiving the file descriptor: {exc}")
        finally:
            if fd >= 0:
                os.close(fd)

    late = meet.barrier("written")
    # --- owners verify every slot --------------------------------------------------------------
    for mechanism, base in (("ipc", ipc_ptr), ("vmm", vmm_va)):
        if base is None:
            continue
        for writer in range(count):
            if writer == me:
                continue
            try:
                got = drv.read_words(base + writer * WORDS_PER_SLOT * 4, WORDS_PER_SLOT)
            except CudaError as exc:
                emit("verify", mechanism=mechanism, writer=writer, owner=me, status="fail", detail=str(exc))
                continue
            wrong = count_wrong(got, seed_for(writer, me))
            if wrong == 0:
                emit("verify", mechanism=mechanism, writer=writer, owner=me, status="ok")
            elif writer in late:   # it never said it had written: its own record says why
                emit("verify", mechanism=mechanism, writer=writer, owner=me, status="not_run",
                     detail=f"participant {writer} did not finish writing in time")
            else:
                emit("verify", mechanism=mechanism, writer=writer, owner=me, status="wrong",
                     detail=f"{wrong} of {WORDS_PER_SLOT} words wrong")

    if spec.get("multicast") and vmm_handle is not None:
        multicast_setup(drv, meet, device, vmm_handle, vmm_size)
    stop.set()
    meet.barrier("done")


def multicast_setup(drv: Driver, meet: Meeting, device: int, vmm_handle: int, vmm_size: int) -> None:
    """Create (participant 0), join, bind and unbind a multicast object: setup only."""
    emit("start", step="multicast setup")
    stop = threading.Event()
    try:
        if meet.me == 0:
            mc, mc_size = drv.multicast_create(meet.count, vmm_size)
            fd = drv.vmm_export_fd(mc)
            threading.Thread(target=serve_fd, args=(meet.sock_path("mc", 0), fd, stop), daemon=True).start()
            meet.put("mc", str(mc_size).encode())
        else:
            size_text = meet.get("mc", 0)
            if size_text is None:
                raise TimeoutError("participant 0 did not create the multicast object in time")
            mc_size = int(size_text)
            fd = receive_fd(meet.sock_path("mc", 0), meet.deadline)
            mc = drv.vmm_import_fd(fd)
            os.close(fd)
        drv.multicast_add_device(mc, device)
        if meet.barrier("mc_added"):
            raise TimeoutError("not every participant joined the multicast object in time")
        drv.multicast_bind(mc, vmm_handle, min(vmm_size, mc_size))
        meet.barrier("mc_bound")
        drv.multicast_unbind(mc, device, min(vmm_size, mc_size))
        drv.vmm_release(mc)
        emit("multicast", participant=meet.me, status="ok")
    except (CudaError, OSError, TimeoutError) as exc:
        emit("multicast", participant=meet.me, status="fail", detail=str(exc))
    finally:
        meet.barrier("mc_done")
        stop.set()


def _tell_peers(spec: dict[str, Any], exc: Exception) -> dict[str, Any]:
    """Tell the peers at once instead of letting them wait for the deadline."""
    meet = Meeting(spec["dir"], int(spec["me"]), int(spec["count"]), float(spec["deadline"]))
    for name in ("ipc_error", "vmm_error"):
        meet.put(name, str(exc).encode())
    meet.put("written")
    meet.put("done")
    return {"step": "group check"}


def main(argv: list[str]) -> int:
    return child_main(argv, run, _tell_peers)


if __name__ == "__main__":
    main(sys.argv)
    # Leave at once: every record is flushed, and interpreter teardown could race the driver's
    # own cleanup while an fd-server thread still runs.
    os._exit(0)
