"""A thin ctypes binding to the CUDA driver (libcuda.so.1), for the probe's child processes.

Why ctypes and not cuda-python: libcuda ships with every NVIDIA driver, so the functional
checks run wherever a GPU does, start in a fraction of a second (no torch import in the
children) and never depend on an optional package. Only the handful of calls the probe needs
are bound; every failure raises CudaError naming the call and the driver's error name.
"""

from __future__ import annotations

import ctypes
from typing import Any

# CUdevice_attribute values (cuda.h; stable across driver versions).
ATTR_MULTIPROCESSOR_COUNT = 16
ATTR_PCI_BUS_ID = 33
ATTR_PCI_DEVICE_ID = 34
ATTR_UNIFIED_ADDRESSING = 41
ATTR_PCI_DOMAIN_ID = 50
ATTR_CC_MAJOR = 75
ATTR_CC_MINOR = 76
ATTR_VMM_SUPPORTED = 102
ATTR_HANDLE_POSIX_FD_SUPPORTED = 103
ATTR_GPU_DIRECT_RDMA_SUPPORTED = 116
ATTR_HANDLE_FABRIC_SUPPORTED = 128
ATTR_MULTICAST_SUPPORTED = 132
ATTR_MPS_ENABLED = 133

# Driver attributes recorded per GPU: snapshot key -> attribute number.
CAPABILITY_ATTRIBUTES = {
    "unified_addressing": ATTR_UNIFIED_ADDRESSING,
    "vmm": ATTR_VMM_SUPPORTED,
    "posix_fd_handle": ATTR_HANDLE_POSIX_FD_SUPPORTED,
    "fabric_handle": ATTR_HANDLE_FABRIC_SUPPORTED,
    "multicast": ATTR_MULTICAST_SUPPORTED,
    "gpudirect_rdma": ATTR_GPU_DIRECT_RDMA_SUPPORTED,
}

MEM_ALLOCATION_TYPE_PINNED = 1
MEM_HANDLE_TYPE_POSIX_FD = 1
MEM_LOCATION_TYPE_DEVICE = 1
MEM_ACCESS_READWRITE = 3
IPC_LAZY_ENABLE_PEER_ACCESS = 1
PEER_ACCESS_ALREADY_ENABLED = 704

# A kernel that stores (index XOR seed) into dst[index] as 32-bit words. Hand-written PTX,
# JIT-compiled by the driver (no nvcc/nvrtc needed); SM stores into peer memory are what
# collective kernels do, unlike a copy-engine memcpy.
WRITE_PATTERN_PTX = """
.version PTX_VERSION
.target PTX_TARGET
.address_size 64

.visible .entry write_pattern(
    .param .u64 dst_ptr,
    .param .u32 count,
    .param .u32 seed
)
{
    .reg .pred p;
    .reg .b32 r<8>;
    .reg .b64 rd<4>;
    ld.param.u64 rd1, [dst_ptr];
    ld.param.u32 r1, [count];
    ld.param.u32 r2, [seed];
    mov.u32 r3, %ctaid.x;
    mov.u32 r4, %ntid.x;
    mov.u32 r5, %tid.x;
    mad.lo.u32 r6, r3, r4, r5;
    setp.ge.u32 p, r6, r1;
    @p bra DONE;
    xor.b32 r7, r6, r2;
    mul.wide.u32 rd2, r6, 4;
    add.s64 rd3, rd1, rd2;
    st.global.u32 [rd3], r7;
DONE:
    ret;
}
"""
# (PTX ISA version, target) tried in order: the oldest that the driver accepts for this GPU.
# A driver that no longer JIT-compiles very old targets still takes the chip's own one.
PTX_TARGETS = (("6.0", "sm_60"), ("7.8", "sm_90"), ("8.6", "sm_100"), ("8.7", "sm_120"))
PATTERN_THREADS = 256


class CudaError(RuntimeError):
    """A driver call failed: carries the call name and the driver's error name."""

    def __init__(self, call: str, code: int, name: str):
        super().__init__(f"{call} failed: {name} ({code})")
        self.call = call
        self.code = code
        self.error_name = name


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class MemAllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", MemLocation), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", AllocFlags)]


class MemAccessDesc(ctypes.Structure):
    _fields_ = [("location", MemLocation), ("flags", ctypes.c_int)]


class MulticastObjectProp(ctypes.Structure):
    _fields_ = [("numDevices", ctypes.c_uint), ("size", ctypes.c_size_t),
                ("handleTypes", ctypes.c_ulonglong), ("flags", ctypes.c_ulonglong)]


class IpcMemHandle(ctypes.Structure):
    # unsigned bytes: a c_char array would read back as bytes cut at the first NUL
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


def load_driver() -> ctypes.CDLL:
    """libcuda.so.1, or OSError when no NVIDIA driver is installed."""
    return ctypes.CDLL("libcuda.so.1")


def multicast_supported(device: int) -> bool:
    """CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED of one device: a read, creates nothing."""
    try:
        return Driver().attribute(device, ATTR_MULTICAST_SUPPORTED) == 1
    except (OSError, CudaError):
        return False


def mps_enabled(device: int) -> bool | None:
    """CU_DEVICE_ATTRIBUTE_MPS_ENABLED: are this process's contexts on the device shared
    through an MPS daemon? None when the driver cannot say (no driver, or one too old)."""
    try:
        return Driver().attribute(device, ATTR_MPS_ENABLED) == 1
    except (OSError, CudaError):
        return None


class Driver:
    """The calls the probe uses, each checked. One instance per process."""

    def __init__(self, lib: ctypes.CDLL | None = None):
        self.lib = lib or load_driver()
        self.lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), IpcMemHandle, ctypes.c_uint]
        self.lib.cuMemImportFromShareableHandle.argtypes = [
            ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_int]
        self.lib.cuMemCreate.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t,
                                         ctypes.POINTER(MemAllocationProp), ctypes.c_ulonglong]
        self.lib.cuMemMap.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_uint64,
                                      ctypes.c_ulonglong]
        self.lib.cuMemAddressReserve.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t,
                                                 ctypes.c_size_t, ctypes.c_uint64, ctypes.c_ulonglong]
        self.lib.cuMemSetAccess.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER(MemAccessDesc),
                                            ctypes.c_size_t]
        self.lib.cuMemcpyPeerAsync.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p,
                                               ctypes.c_size_t, ctypes.c_void_p]
        self.lib.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
        self.lib.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_char_p, ctypes.c_size_t]
        self.lib.cuMemsetD32_v2.argtypes = [ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t]
        self.lib.cuMemFree_v2.argtypes = [ctypes.c_uint64]
        self.lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
        self.lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(IpcMemHandle), ctypes.c_uint64]
        self.lib.cuMemUnmap.argtypes = [ctypes.c_uint64, ctypes.c_size_t]
        self.lib.cuMemAddressFree.argtypes = [ctypes.c_uint64, ctypes.c_size_t]
        self.lib.cuMemRelease.argtypes = [ctypes.c_uint64]
        self.lib.cuMemExportToShareableHandle.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int,
                                                          ctypes.c_ulonglong]
        self.lib.cuMulticastAddDevice.argtypes = [ctypes.c_uint64, ctypes.c_int]
        self.lib.cuMulticastBindMem.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_size_t,
                                                ctypes.c_size_t, ctypes.c_ulonglong]
        self.lib.cuMulticastUnbind.argtypes = [ctypes.c_uint64, ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t]
        self.lib.cuEventElapsedTime.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p]
        self.lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
            ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        self.check("cuInit", self.lib.cuInit(0))
        self._kernels: dict[int, ctypes.c_void_p] = {}

    def error_name(self, code: int) -> str:
        name = ctypes.c_char_p()
        if self.lib.cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
            return name.value.decode()
        return f"CUDA error {code}"

    def check(self, call: str, code: int) -> None:
        if code != 0:
            raise CudaError(call, code, self.error_name(code))

    # -- devices -------------------------------------------------------------------------
    def device_count(self) -> int:
        n = ctypes.c_int()
        self.check("cuDeviceGetCount", self.lib.cuDeviceGetCount(ctypes.byref(n)))
        return n.value

    def driver_version(self) -> str:
        v = ctypes.c_int()
        self.check("cuDriverGetVersion", self.lib.cuDriverGetVersion(ctypes.byref(v)))
        return f"{v.value // 1000}.{(v.value % 1000) // 10}"

    def attribute(self, device: int, attr: int) -> int:
        v = ctypes.c_int()
        self.check(f"cuDeviceGetAttribute({attr})", self.lib.cuDeviceGetAttribute(ctypes.byref(v), attr, device))
        return v.value

    def name(self, device: int) -> str:
        buf = ctypes.create_string_buffer(256)
        self.check("cuDeviceGetName", self.lib.cuDeviceGetName(buf, 256, device))
        return buf.value.decode()

    def pci_bus_id(self, device: int) -> str:
        buf = ctypes.create_string_buffer(64)
        self.check("cuDeviceGetPCIBusId", self.lib.cuDeviceGetPCIBusId(buf, 64, device))
        return buf.value.decode()

    def uuid(self, device: int) -> str:
        raw = (ctypes.c_ubyte * 16)()
        self.check("cuDeviceGetUuid", self.lib.cuDeviceGetUuid(raw, device))
        h = bytes(raw).hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"

    def total_memory_bytes(self, device: int) -> int:
        v = ctypes.c_size_t()
        self.check("cuDeviceTotalMem", self.lib.cuDeviceTotalMem_v2(ctypes.byref(v), device))
        return v.value

    def can_access_peer(self, device: int, peer: int) -> bool:
        v = ctypes.c_int()
        self.check("cuDeviceCanAccessPeer", self.lib.cuDeviceCanAccessPeer(ctypes.byref(v), device, peer))
        return bool(v.value)

    # -- contexts ------------------------------------------------------------------------
    def primary_context(self, device: int) -> ctypes.c_void_p:
        ctx = ctypes.c_void_p()
        self.check("cuDevicePrimaryCtxRetain", self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device))
        return ctx

    def set_current(self, ctx: ctypes.c_void_p) -> None:
        self.check("cuCtxSetCurrent", self.lib.cuCtxSetCurrent(ctx))

    def synchronize(self) -> None:
        self.check("cuCtxSynchronize", self.lib.cuCtxSynchronize())

    def enable_peer_access(self, peer_ctx: ctypes.c_void_p) -> None:
        """From the current context; 'already enabled' counts as success."""
        code = self.lib.cuCtxEnablePeerAccess(peer_ctx, 0)
        if code not in (0, PEER_ACCESS_ALREADY_ENABLED):
            self.check("cuCtxEnablePeerAccess", code)

    # -- memory --------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> int:
        p = ctypes.c_uint64()
        self.check("cuMemAlloc", self.lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(nbytes)))
        return p.value

    def free(self, ptr: int) -> None:
        self.check("cuMemFree", self.lib.cuMemFree_v2(ptr))

    def memset32(self, ptr: int, value: int, count: int) -> None:
        self.check("cuMemsetD32", self.lib.cuMemsetD32_v2(ptr, value, count))

    def read_words(self, ptr: int, count: int) -> list[int]:
        host = (ctypes.c_uint32 * count)()
        self.check("cuMemcpyDtoH", self.lib.cuMemcpyDtoH_v2(host, ptr, count * 4))
        return list(host)

    def write_bytes(self, ptr: int, data: bytes) -> None:
        """Host bytes to device memory (any GPU's: unified addressing routes it), after earlier work."""
        self.check("cuMemcpyHtoD", self.lib.cuMemcpyHtoD_v2(ptr, data, len(data)))

    def ipc_handle(self, ptr: int) -> bytes:
        h = IpcMemHandle()
        self.check("cuIpcGetMemHandle", self.lib.cuIpcGetMemHandle(ctypes.byref(h), ptr))
        return bytes(h)

    def ipc_open(self, handle: bytes) -> int:
        h = IpcMemHandle.from_buffer_copy(handle)
        p = ctypes.c_uint64()
        self.check("cuIpcOpenMemHandle", self.lib.cuIpcOpenMemHandle_v2(ctypes.byref(p), h,
                                                                          IPC_LAZY_ENABLE_PEER_ACCESS))
        return p.value

    def ipc_close(self, ptr: int) -> None:
        self.check("cuIpcCloseMemHandle", self.lib.cuIpcCloseMemHandle(ptr))

    # -- virtual memory management (cuMemCreate and friends) ------------------------------
    def vmm_prop(self, device: int, handle_type: int = MEM_HANDLE_TYPE_POSIX_FD) -> MemAllocationProp:
        prop = MemAllocationProp()
        prop.type = MEM_ALLOCATION_TYPE_PINNED
        prop.requestedHandleTypes = handle_type
        prop.location = MemLocation(MEM_LOCATION_TYPE_DEVICE, device)
        return prop

    def vmm_granularity(self, prop: MemAllocationProp, recommended: bool = False) -> int:
        g = ctypes.c_size_t()
        flag = 1 if recommended else 0     # CU_MEM_ALLOC_GRANULARITY_RECOMMENDED / _MINIMUM
        self.check("cuMemGetAllocationGranularity",
                   self.lib.cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(prop), flag))
        return g.value

    def vmm_create(self, prop: MemAllocationProp, nbytes: int) -> int:
        h = ctypes.c_uint64()
        self.check("cuMemCreate", self.lib.cuMemCreate(ctypes.byref(h), nbytes, ctypes.byref(prop), 0))
        return h.value

    def vmm_export_fd(self, handle: int) -> int:
        fd = ctypes.c_int(-1)
        self.check("cuMemExportToShareableHandle",
                   self.lib.cuMemExportToShareableHandle(ctypes.byref(fd), handle, MEM_HANDLE_TYPE_POSIX_FD, 0))
        return fd.value

    def vmm_import_fd(self, fd: int) -> int:
        h = ctypes.c_uint64()
        self.check("cuMemImportFromShareableHandle",
                   self.lib.cuMemImportFromShareableHandle(ctypes.byref(h), ctypes.c_void_p(fd),
                                                           MEM_HANDLE_TYPE_POSIX_FD))
        return h.value

    def vmm_map(self, handle: int, nbytes: int, granularity: int, access_device: int) -> int:
        """Reserve an address range, map the allocation and grant read/write to one device."""
        va = ctypes.c_uint64()
        self.check("cuMemAddressReserve", self.lib.cuMemAddressReserve(ctypes.byref(va), nbytes, granularity, 0, 0))
        self.check("cuMemMap", self.lib.cuMemMap(va.value, nbytes, 0, handle, 0))
        desc = MemAccessDesc(MemLocation(MEM_LOCATION_TYPE_DEVICE, access_device), MEM_ACCESS_READWRITE)
        self.check("cuMemSetAccess", self.lib.cuMemSetAccess(va.value, nbytes, ctypes.byref(desc), 1))
        return va.value

    def vmm_unmap(self, va: int, nbytes: int) -> None:
        self.check("cuMemUnmap", self.lib.cuMemUnmap(va, nbytes))
        self.check("cuMemAddressFree", self.lib.cuMemAddressFree(va, nbytes))

    def vmm_release(self, handle: int) -> None:
        self.check("cuMemRelease", self.lib.cuMemRelease(handle))

    # -- multicast (only ever called when the user allowed it and no policy forbids it) ---
    def multicast_create(self, num_devices: int, nbytes: int) -> tuple[int, int]:
        prop = MulticastObjectProp(num_devices, 0, MEM_HANDLE_TYPE_POSIX_FD, 0)
        g = ctypes.c_size_t()
        self.check("cuMulticastGetGranularity",
                   self.lib.cuMulticastGetGranularity(ctypes.byref(g), ctypes.byref(prop), 0))
        prop.size = ((nbytes + g.value - 1) // g.value) * g.value
        h = ctypes.c_uint64()
        self.check("cuMulticastCreate", self.lib.cuMulticastCreate(ctypes.byref(h), ctypes.byref(prop)))
        return h.value, prop.size

    def multicast_add_device(self, mc_handle: int, device: int) -> None:
        self.check("cuMulticastAddDevice", self.lib.cuMulticastAddDevice(mc_handle, device))

    def multicast_bind(self, mc_handle: int, mem_handle: int, nbytes: int) -> None:
        self.check("cuMulticastBindMem", self.lib.cuMulticastBindMem(mc_handle, 0, mem_handle, 0, nbytes, 0))

    def multicast_unbind(self, mc_handle: int, device: int, nbytes: int) -> None:
        self.check("cuMulticastUnbind", self.lib.cuMulticastUnbind(mc_handle, device, 0, nbytes))

    # -- kernels, copies, events -----------------------------------------------------------
    def load_ptx(self, template: str) -> ctypes.c_void_p:
        """JIT-load PTX (PTX_VERSION/PTX_TARGET placeholders) into the current context."""
        module = ctypes.c_void_p()
        code = -1
        for version, target in PTX_TARGETS:
            ptx = template.replace("PTX_VERSION", version).replace("PTX_TARGET", target)
            code = self.lib.cuModuleLoadData(ctypes.byref(module), ptx.encode() + b"\0")
            if code == 0:
                break
        self.check("cuModuleLoadData", code)
        return module

    def function(self, module: ctypes.c_void_p, name: str) -> ctypes.c_void_p:
        func = ctypes.c_void_p()
        self.check("cuModuleGetFunction", self.lib.cuModuleGetFunction(ctypes.byref(func), module, name.encode()))
        return func

    def launch(self, func: ctypes.c_void_p, blocks: int, threads: int, args: list[Any], name: str = "") -> None:
        """One launch on the current context's default stream; args are ctypes scalars."""
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        self.check(f"cuLaunchKernel({name})" if name else "cuLaunchKernel",
                   self.lib.cuLaunchKernel(func, blocks, 1, 1, threads, 1, 1, 0, None, params, None))

    def write_pattern(self, ctx_key: int, dst: int, count: int, seed: int) -> None:
        """Launch the pattern kernel in the current context (ctx_key caches the module)."""
        func = self._kernels.get(ctx_key)
        if func is None:
            func = self.function(self.load_ptx(WRITE_PATTERN_PTX), "write_pattern")
            self._kernels[ctx_key] = func
        blocks = (count + PATTERN_THREADS - 1) // PATTERN_THREADS
        self.launch(func, blocks, PATTERN_THREADS, [ctypes.c_uint64(dst), ctypes.c_uint32(count),
                                                    ctypes.c_uint32(seed)])

    def copy_peer_async(self, dst: int, dst_ctx: Any, src: int, src_ctx: Any, nbytes: int) -> None:
        self.check("cuMemcpyPeerAsync", self.lib.cuMemcpyPeerAsync(dst, dst_ctx, src, src_ctx, nbytes, None))

    def event(self) -> ctypes.c_void_p:
        ev = ctypes.c_void_p()
        self.check("cuEventCreate", self.lib.cuEventCreate(ctypes.byref(ev), 0))
        return ev

    def record(self, ev: ctypes.c_void_p) -> None:
        self.check("cuEventRecord", self.lib.cuEventRecord(ev, None))

    def elapsed_ms(self, start: ctypes.c_void_p, end: ctypes.c_void_p) -> float:
        self.check("cuEventSynchronize", self.lib.cuEventSynchronize(end))
        ms = ctypes.c_float()
        self.check("cuEventElapsedTime", self.lib.cuEventElapsedTime(ctypes.byref(ms), start, end))
        return ms.value


def count_wrong(words: list[int], seed: int) -> int:
    return sum(1 for i, w in enumerate(words) if w != (i ^ seed))
