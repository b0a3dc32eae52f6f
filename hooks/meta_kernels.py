"""The Meta kernel of `aten::masked_select`, which torch 2.13 lacks: its output size depends on
the mask's values, which meta tensors do not have. megatron-core's MoE token dispatchers select
routing probabilities with it; the patches that run them (hooks/patches.py) say how many
elements are selected (`selecting`), from the routing map metatrace built.

And Meta kernels for the in-place random fills that initialise weights (`normal_`, `uniform_`):
torch's own run its Python reference implementation, which builds the random tensor and copies
it (about 2 ms a weight; a third of building Llama-2 70B's 80 layers). On meta they only return
the tensor, as the reference does in effect.
"""

from __future__ import annotations

import contextlib

import torch

_SELECTED: list[int] = []  # True entries of the masks that masked_select sees, innermost last


@contextlib.contextmanager
def selecting(count: int):
    """masked_select calls inside select `count` elements (the mask's True entries)."""
    _SELECTED.append(int(count))
    try:
        yield
    finally:
        _SELECTED.pop()


def _masked_select_meta(x, mask):
    if not _SELECTED:
        raise NotImplementedError(
            "aten::masked_select on meta tensors: the number of selected elements depends on the "
            "data (metatrace supplies it only for MoE routing maps)"
        )
    return x.new_empty((_SELECTED[-1],))


def masked_select_meta_library() -> torch.library.Library:
    """A library registering the Meta kernel of aten::masked_select (torch has none); the
    kernel is gone once the caller destroys it."""
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("masked_select", _masked_select_meta, "Meta")
    return lib


def _fill_meta(self, *args, **kwargs):
    return self


def init_fills_meta_library() -> torch.library.Library:
    """A library registering Meta kernels of aten::normal_ and aten::uniform_ that return the
    tensor (see the module docstring); torch's are back once the caller destroys it."""
    lib = torch.library.Library("aten", "IMPL")
    for op in ("normal_", "uniform_"):
        try:
            lib.impl(op, _fill_meta, "Meta")
        except RuntimeError:
            # torch 2.11 registers its reference from Python and refuses a second Python
            # kernel for the key (2.13 does not): keep torch's, slower but the same tensor.
            pass
    return lib
