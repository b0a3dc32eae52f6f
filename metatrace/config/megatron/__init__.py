"""Megatron-LM's `pretrain_gpt.py` command line: every flag classified (flags.py, flags.tsv),
read from a line, a script or a mapping (script.py), and turned into a job (args.py)."""
