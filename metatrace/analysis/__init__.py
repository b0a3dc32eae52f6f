"""Analysis: records in, tables out. Pure functions over metatrace.records and the job (no torch,
no megatron-core): per-module and per-role aggregates, memory over an iteration and the verdict,
communication per dimension, the time model, the diff of two reports, and `analyze`, which
computes everything an output needs once."""
