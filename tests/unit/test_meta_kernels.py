"""The Meta kernels metatrace registers (hooks/meta_kernels.py)."""

import torch

from metatrace.hooks.meta_kernels import init_fills_meta_library


def test_init_fills_keep_a_python_meta_kernel_registered_before(monkeypatch):
    """torch 2.11 registers aten::normal_'s Meta kernel from Python and refuses a second one
    (torch.library raises; every trace failed there): metatrace keeps torch's kernel, which
    returns the same tensor, and registers the others."""
    impl = torch.library.Library.impl
    registered = []

    def refusing(self, op, fn, key, *args, **kwargs):
        if op == "normal_":
            raise RuntimeError(
                "This is not allowed since there's already a kernel registered from python "
                "overriding normal_'s behavior for Meta dispatch key and aten namespace."
            )
        registered.append(op)
        return impl(self, op, fn, key, *args, **kwargs)

    monkeypatch.setattr(torch.library.Library, "impl", refusing)
    lib = init_fills_meta_library()
    try:
        assert registered == ["uniform_"]
        w = torch.empty(4, 4, device="meta")
        assert w.normal_() is w
        assert w.uniform_() is w
    finally:
        lib._destroy()
