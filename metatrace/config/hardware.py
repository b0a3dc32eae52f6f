"""What metatrace knows of each GPU model: compute capability, memory, links, peak FLOP/s,
memory bandwidth; and the cuBLAS workspaces PyTorch allocates on it."""

from __future__ import annotations

import re

# Compute capability of each GPU model (what Transformer Engine's choices depend on).
GPU_ARCH = {
    "a100-40gb": "sm80",
    "a100": "sm80",
    "h100": "sm90",
    "h800": "sm90",
    "h200": "sm90",
    "b200": "sm100",
    "gb200": "sm100",
    # Blackwell Ultra is compute capability 10.3; Transformer Engine takes its sm100 paths for
    # every capability from 10.0 below 12.0 (is_non_tn_fp8_gemm_supported, the MXFP8 checks).
    "b300": "sm100",
    "gb300": "sm100",
    "l40s": "sm89",
    "mi300x": "gfx942",
}

# Device memory as `torch.cuda.get_device_properties(0).total_memory` reports it, in GiB,
# rounded to 0.1 GiB (the advertised "80 GB" of an H100 is 79.1 GiB usable by PyTorch).
GPU_MEMORY_GIB = {
    "a100-40gb": 39.4,
    "a100": 79.3,
    "h100": 79.1,
    "h800": 79.1,
    "h200": 139.8,
    "b200": 178.4,
    "gb200": 184.0,
    # Blackwell Ultra: 288 GB of HBM3e per GPU (HGX B300: 2.3 TB for 8; GB300 NVL72: 20.7 TB
    # for 72), taken as 288e9 bytes: PyTorch's reported total on these parts is not measured.
    "b300": 268.2,
    "gb300": 268.2,
    "l40s": 44.4,
    "mi300x": 191.5,
}


# Link bandwidth per GPU and direction, in Gb/s: (inside a node: NVLink or PCIe, across nodes:
# one NIC per GPU). Class defaults of common systems (e.g. DGX H100: NVLink 4 at 450 GB/s, one
# 400 Gb/s NDR InfiniBand port per GPU); set cluster.intra_node_gbps / inter_node_gbps for yours.
GPU_LINKS_GBPS = {
    "a100-40gb": (2400, 200),  # NVLink 3, 300 GB/s; HDR InfiniBand
    "a100": (2400, 200),
    "h100": (3600, 400),  # NVLink 4, 450 GB/s; NDR InfiniBand
    "h800": (1600, 400),  # NVLink 4 at 200 GB/s
    "h200": (3600, 400),
    "b200": (7200, 400),  # NVLink 5, 900 GB/s
    "gb200": (7200, 400),
    "b300": (7200, 800),  # NVLink 5; one ConnectX-8 800 Gb/s port per GPU
    "gb300": (7200, 800),
    "l40s": (256, 200),  # PCIe 4.0 x16, 32 GB/s
    "mi300x": (3584, 400),  # Infinity Fabric, 7 links of 64 GB/s
}


# The link between a GPU and host memory, per direction, in Gb/s: what activation offloading
# copies over. PCIe 4.0 x16 (32 GB/s), PCIe 5.0 x16 (64 GB/s), or on GB200 NVLink-C2C to the
# Grace CPU (450 GB/s each way); set cluster.host_link_gbps for yours.
GPU_HOST_GBPS = {
    "a100-40gb": 256,
    "a100": 256,
    "h100": 512,
    "h800": 512,
    "h200": 512,
    "b200": 512,
    "gb200": 3600,
    "b300": 512,
    "gb300": 3600,  # NVLink-C2C to the Grace CPU, as on GB200
    "l40s": 256,
    "mi300x": 512,
}


# Peak dense (no sparsity) bf16 tensor-core throughput per GPU, TFLOP/s, from the vendors' data
# sheets (SXM / OAM parts). The time model (metatrace.analysis.timing) runs every counted FLOP at this
# peak times cluster.compute_efficiency; FP8 GEMMs run at twice it on GPU_FP8_ARCHS.
GPU_PEAK_TFLOPS = {
    "a100-40gb": 312,
    "a100": 312,
    "h100": 989,
    "h800": 989,
    "h200": 989,
    "b200": 2250,
    "gb200": 2500,
    "b300": 2250,
    "gb300": 2500,
    "l40s": 362,
    "mi300x": 1307,
}
"""Sources: the data sheets' sparse figures halved where they print only those. HGX B200 and
HGX B300: 36 PFLOPS FP16/BF16 for 8 GPUs (sparse); GB200 NVL72 and GB300 NVL72: 360 PFLOPS for
72 GPUs (sparse)."""

# Architectures whose tensor cores run FP8 at twice the bf16 rate (Ada, Hopper, Blackwell).
GPU_FP8_ARCHS = ("sm89", "sm90", "sm100")

# Peak dense FP4 (NVFP4, MXFP4) tensor-core throughput, TFLOP/s, on the GPUs that have it. Data
# sheets: HGX B200 144 | 72 PFLOPS FP4 for 8 GPUs (sparse | dense); GB200 NVL72 1,440 | 720 for
# 72; HGX B300 144 | 108 for 8; GB300 NVL72 1,440 | 1,080 for 72 (Blackwell Ultra raised dense
# FP4 by half over Blackwell; its FP8 and BF16 rates are Blackwell's).
GPU_FP4_TFLOPS = {
    "b200": 9000,
    "gb200": 10000,
    "b300": 13500,
    "gb300": 15000,
}

# GPUs joined by NVLink in one domain where it spans more than a node: the NVL72 racks of
# GB200 and GB300 (72 GPUs, 18 trays of 4, one NVLink switch fabric). cluster.nvlink_domain
# sets it; elsewhere the domain is the node (cluster.gpus_per_node).
GPU_NVLINK_DOMAIN = {"gb200": 72, "gb300": 72}

# Device memory bandwidth, TB/s (data sheets): the optimizer step's element-wise update is
# bound by it (metatrace.analysis.timing).
GPU_HBM_TBPS = {
    "a100-40gb": 1.555,
    "a100": 2.039,
    "h100": 3.35,
    "h800": 3.35,
    "h200": 4.8,
    "b200": 8.0,
    "gb200": 8.0,
    "b300": 8.0,
    "gb300": 8.0,
    "l40s": 0.864,
    "mi300x": 5.3,
}


# PyTorch reads CUBLAS_WORKSPACE_CONFIG as every match of this, left to right, and uses its
# default where nothing matches (a warning, no error): parseChosenWorkspaceSize in
# aten/src/ATen/cuda/CublasHandlePool.cpp.
CUBLAS_PAIR = re.compile(r":([0-9]+):([0-9]+)")


def cublas_default(gpu: str) -> str:
    """PyTorch's default CUBLAS_WORKSPACE_CONFIG for `gpu`."""
    return ":4096:8" if GPU_ARCH.get(gpu) in ("sm90", "sm100") else ":4096:2:16:8"


def cublas_workspace_bytes(job) -> int:
    """Bytes of one PyTorch cuBLAS workspace: CUBLAS_WORKSPACE_CONFIG's ":SIZE_KIB:COUNT"
    pairs as PyTorch parses them, or its default for the GPU (":4096:8" on sm90 and sm100,
    ":4096:2:16:8" otherwise) when it is unset or has no pair."""
    spec = job.cluster.cublas_workspace_config
    pairs = CUBLAS_PAIR.findall(spec) if spec is not None else []
    if not pairs:
        pairs = CUBLAS_PAIR.findall(cublas_default(job.cluster.gpu))
    return sum(int(size) * 1024 * int(count) for size, count in pairs)


def te_workspace_bytes(arch: str) -> int:
    """Transformer Engine's cuBLAS workspace for one stream (TE 2.8 get_cublas_workspace_size):
    32 MiB + 1 KiB on sm90 and later, 4 MiB before."""
    hopper_or_later = arch.startswith("sm") and int(arch[2:]) >= 90
    return 32 * 2**20 + 1024 if hopper_or_later else 4 * 2**20


NCCL_CHANNELS = 32
"""Collective channels per NCCL communicator: twice the rings NCCL's topology search finds, at
most 64 (nccl src/graph/connect.cc:326-360). [assumption] 32, the channel count of an 8-GPU
NVSwitch node in ../shared/notes/device-memory.md; it depends on the topology
(cluster.nccl_channels sets it, NCCL_MIN_NCHANNELS / NCCL_MAX_NCHANNELS bound it)."""
