"""Instruments: the recorder, CUDA-to-meta remapping, the fake world and megatron-core patches.

Installed as `metatrace.hooks`. Every instrument is a context manager that restores what it
changed on exit.
"""
