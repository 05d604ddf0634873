"""SM-initiated peer traffic: hand-written PTX, JIT-compiled by the driver (as cudadrv's
write_pattern), that streams 16-byte stores or loads to a peer GPU's memory, and a single
thread that chases a chain of pointers through it.

Why kernels and not cuMemcpyPeer: a copy engine can take a path that SM loads and stores do
not. On some boxes (no PCIe switch, GPUs under different root ports) the driver stages
kernel-initiated peer traffic through system memory while copies run at full speed; custom
allreduce kernels then run ~15x slower (rtx6kpro, "NVIDIA P2P Driver Override (ForceP2P)").
Loads use ld.global.cv (fetch again, never from a cache), so every load crosses the fabric.
"""

from __future__ import annotations

import ctypes
import struct

from commbench.topology.cudadrv import Driver

PEER_PTX = """
.version PTX_VERSION
.target PTX_TARGET
.address_size 64

.visible .entry peer_store(
    .param .u64 dst_ptr,
    .param .u64 count,
    .param .u32 seed
)
{
    .reg .pred p;
    .reg .b32 r<8>;
    .reg .b64 rd<8>;
    ld.param.u64 rd1, [dst_ptr];
    ld.param.u64 rd2, [count];
    ld.param.u32 r1, [seed];
    mov.u32 r2, %ctaid.x;
    mov.u32 r3, %ntid.x;
    mov.u32 r4, %tid.x;
    mov.u32 r5, %nctaid.x;
    mul.wide.u32 rd3, r2, r3;
    cvt.u64.u32 rd4, r4;
    add.u64 rd3, rd3, rd4;
    mul.wide.u32 rd5, r5, r3;
STORE_LOOP:
    setp.ge.u64 p, rd3, rd2;
    @p bra STORE_DONE;
    shl.b64 rd6, rd3, 4;
    add.u64 rd7, rd1, rd6;
    cvt.u32.u64 r6, rd3;
    xor.b32 r7, r6, r1;
    st.global.v4.u32 [rd7], {r7, r7, r7, r7};
    add.u64 rd3, rd3, rd5;
    bra STORE_LOOP;
STORE_DONE:
    ret;
}

.visible .entry peer_load(
    .param .u64 src_ptr,
    .param .u64 count,
    .param .u64 out_ptr,
    .param .u32 seed
)
{
    .reg .pred p<3>;
    .reg .b32 r<12>;
    .reg .b64 rd<9>;
    ld.param.u64 rd1, [src_ptr];
    ld.param.u64 rd2, [count];
    ld.param.u64 rd8, [out_ptr];
    ld.param.u32 r1, [seed];
    mov.u32 r2, %ctaid.x;
    mov.u32 r3, %ntid.x;
    mov.u32 r4, %tid.x;
    mov.u32 r5, %nctaid.x;
    mul.wide.u32 rd3, r2, r3;
    cvt.u64.u32 rd4, r4;
    add.u64 rd3, rd3, rd4;
    mul.wide.u32 rd5, r5, r3;
    mov.u32 r11, 0;
LOAD_LOOP:
    setp.ge.u64 p1, rd3, rd2;
    @p1 bra LOAD_DONE;
    shl.b64 rd6, rd3, 4;
    add.u64 rd7, rd1, rd6;
    ld.global.cv.v4.u32 {r6, r7, r8, r9}, [rd7];
    xor.b32 r11, r11, r6;
    xor.b32 r11, r11, r7;
    xor.b32 r11, r11, r8;
    xor.b32 r11, r11, r9;
    add.u64 rd3, rd3, rd5;
    bra LOAD_LOOP;
LOAD_DONE:
    setp.ne.u32 p2, r11, r1;
    @p2 bra LOAD_END;
    st.global.u32 [rd8], r11;
LOAD_END:
    ret;
}

.visible .entry peer_chase(
    .param .u64 start_ptr,
    .param .u32 hops,
    .param .u64 out_ptr
)
{
    .reg .pred p;
    .reg .b32 r<4>;
    .reg .b64 rd<4>;
    ld.param.u64 rd1, [start_ptr];
    ld.param.u32 r1, [hops];
    ld.param.u64 rd2, [out_ptr];
    mov.u32 r2, 0;
CHASE_LOOP:
    setp.ge.u32 p, r2, r1;
    @p bra CHASE_DONE;
    ld.global.cv.u64 rd1, [rd1];
    add.u32 r2, r2, 1;
    bra CHASE_LOOP;
CHASE_DONE:
    st.global.u64 [rd2], rd1;
    ret;
}
"""
KERNEL_NAMES = ("peer_store", "peer_load", "peer_chase")
THREADS = 256
VECTOR_BYTES = 16
# The kernel stores only when the XOR of all it read equals this seed. The store pattern (four
# equal words per vector) XORs to 0, so nothing is written, yet the loads cannot be optimised away.
LOAD_SEED = 0x9E3779B9


def chain(base: int, nodes: int, stride_bytes: int) -> bytes:
    """Host image of a pointer ring: the word at base + k*stride holds base + (k+1)*stride."""
    image = bytearray(nodes * stride_bytes)
    for k in range(nodes):
        struct.pack_into("<Q", image, k * stride_bytes, base + ((k + 1) % nodes) * stride_bytes)
    return bytes(image)


class PeerKernels:
    """The three kernels, loaded into the current context, and their launches."""

    def __init__(self, drv: Driver):
        self.drv = drv
        module = drv.load_ptx(PEER_PTX)
        self.functions = {name: drv.function(module, name) for name in KERNEL_NAMES}

    def store(self, dst: int, nbytes: int, blocks: int, seed: int) -> None:
        self.drv.launch(self.functions["peer_store"], blocks, THREADS,
                        [ctypes.c_uint64(dst), ctypes.c_uint64(nbytes // VECTOR_BYTES), ctypes.c_uint32(seed)],
                        "peer_store")

    def load(self, src: int, nbytes: int, out: int, blocks: int) -> None:
        self.drv.launch(self.functions["peer_load"], blocks, THREADS,
                        [ctypes.c_uint64(src), ctypes.c_uint64(nbytes // VECTOR_BYTES), ctypes.c_uint64(out),
                         ctypes.c_uint32(LOAD_SEED)], "peer_load")

    def chase(self, start: int, hops: int, out: int) -> None:
        self.drv.launch(self.functions["peer_chase"], 1, 1,
                        [ctypes.c_uint64(start), ctypes.c_uint32(hops), ctypes.c_uint64(out)], "peer_chase")
