"""metatrace: what each GPU of a Megatron-Core training job holds and sends, traced on meta."""

__version__ = "0.1.0"
