"""Tracing: each role of a job built and run on the meta device inside the fake world (trace.py),
a whole iteration under megatron-core's schedule with replayed steps (iteration.py), Megatron-LM's
batch and loss (steps.py), megatron-core's own checks (checks.py), and one rank run for real
(measure.py)."""
