"""Building a rank's model chunks, model presets, and meta-capable stand-ins for CUDA kernels.

Installed as `metatrace.models`. Transformer Engine and flash-attn are never imported at module
level here: they cannot be imported without CUDA.
"""
