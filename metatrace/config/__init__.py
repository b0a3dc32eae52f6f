"""Configuration: the job (dataclasses), what metatrace knows of each GPU, reading and resolving
a job file or Megatron-LM's arguments, and the checks that run before any model is built.

    job.py       the sections' dataclasses            hardware.py  GPU tables, cuBLAS workspaces
    load.py      YAML / mapping -> Job                resolve.py   derived values, then checks.py
    presets.py   model presets                        hf.py        Hugging Face config.json
    megatron/    Megatron-LM's command line -> a job

Nothing here imports torch or megatron-core; megatron-core's own checks run before a trace
(metatrace.tracing.checks). Bad input raises `ConfigError` (exit code 2 on the command line).
"""

from metatrace.config.hardware import (
    GPU_ARCH,
    GPU_FP8_ARCHS,
    GPU_HBM_TBPS,
    GPU_HOST_GBPS,
    GPU_LINKS_GBPS,
    GPU_MEMORY_GIB,
    GPU_PEAK_TFLOPS,
    cublas_workspace_bytes,
)
from metatrace.config.job import (
    GATED_ACTIVATIONS,
    SECTIONS,
    Cluster,
    Implementation,
    Job,
    Model,
    NotModelled,
    Parallel,
    Recompute,
    Training,
)
from metatrace.config.load import job_from_dict, job_to_dict, load_job
from metatrace.config.resolve import moe_layer_pattern, resolve

__all__ = [
    "GATED_ACTIVATIONS",
    "GPU_ARCH",
    "GPU_FP8_ARCHS",
    "GPU_HBM_TBPS",
    "GPU_HOST_GBPS",
    "GPU_LINKS_GBPS",
    "GPU_MEMORY_GIB",
    "GPU_PEAK_TFLOPS",
    "SECTIONS",
    "Cluster",
    "Implementation",
    "Job",
    "Model",
    "NotModelled",
    "Parallel",
    "Recompute",
    "Training",
    "cublas_workspace_bytes",
    "job_from_dict",
    "job_to_dict",
    "load_job",
    "moe_layer_pattern",
    "resolve",
]
