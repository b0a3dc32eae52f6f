"""Faster meta execution: reuse the output metadata of functional operators.

PyTorch computes the outputs of many operators on meta tensors with Python reference
implementations (torch._refs / torch._prims), which costs tens of microseconds per call and
dominates a trace. The transformer layers of a model repeat the same operators on tensors of the
same shapes, so `MetaMemo` remembers, for an operator and the metadata of its arguments (shapes,
strides, dtypes, and every non-tensor argument), the shapes, strides and dtypes of its outputs,
and on a repeat creates fresh meta tensors with that metadata instead of running the kernel.

Only operators whose outputs are new tensors qualify: the schema mutates nothing and no output
aliases an input (views, in-place and out= variants, and collectives always run). On meta the
outputs of such an operator depend on nothing but that metadata, so the result is the same.
"""

from __future__ import annotations

import torch

_SCALARS = (
    int,
    float,
    bool,
    str,
    type(None),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)
_MISS = object()


# Operators whose output shapes depend on values, which on meta come from elsewhere (the MoE
# routing assumption sizes masked_select): never memoised.
_DATA_DEPENDENT = {"masked_select", "nonzero", "unique", "_unique2", "repeat_interleave"}


# Factories whose meta kernels are C++ and cheaper than the memo's key (measured: 6-7 us a call
# against 16 us through the memo).
_DIRECT = {"empty.memory_format", "empty_strided.default"}


def _functional(func) -> bool:
    schema = func._schema
    if func.namespace != "aten" or schema.is_mutable or func._opname in _DATA_DEPENDENT:
        return False
    if f"{func._opname}.{func._overloadname}" in _DIRECT:
        return False
    for ret in schema.returns:
        if ret.alias_info is not None or str(ret.type) not in ("Tensor", "Tensor?"):
            return False
    return bool(schema.returns)


_SCALAR_TYPES = frozenset(_SCALARS)


def _key(obj):
    """A hashable description of an argument, or _MISS when it cannot be described."""
    kind = type(obj)
    if kind in _SCALAR_TYPES:
        # The type matters: mul(bool_tensor, True) is bool, mul(bool_tensor, 1) is int64.
        return (kind, obj)
    if kind is tuple or kind is list:
        return _items(obj)
    if isinstance(obj, torch.Tensor):
        if not obj.is_meta or obj.is_nested or obj.layout != torch.strided:
            return _MISS
        return (obj.shape, obj.stride(), obj.dtype)  # (torch.Size hashes and compares as a tuple)
    if isinstance(obj, _SCALARS):
        return (kind, obj)
    if isinstance(obj, (list, tuple)):
        return _items(obj)
    return _MISS


def _items(obj):
    items = []
    for item in obj:
        key = _key(item)
        if key is _MISS:
            return _MISS
        items.append(key)
    return tuple(items)


class MetaMemo:
    """Output metadata of functional aten operators on meta tensors, by argument metadata."""

    def __init__(self):
        self._functional: dict = {}
        self._outputs: dict = {}
        self.hits = 0
        self.misses = 0

    def __call__(self, func, args, kwargs):
        functional = self._functional.get(func)
        if functional is None:
            functional = self._functional[func] = _functional(func)
        if not functional:
            return func(*args, **kwargs)
        key = _key(args)
        kw = _key(tuple(sorted(kwargs.items()))) if kwargs else ()
        if key is _MISS or kw is _MISS:
            return func(*args, **kwargs)
        key = (func, key, kw)
        spec = self._outputs.get(key)
        if spec is None:
            self.misses += 1
            out = func(*args, **kwargs)
            if _aliases(out, args):
                # Schemas do not mark every alias (e.g. aten._unsafe_view): never memoise it.
                self._functional[func] = False
                return out
            self._outputs[key] = _spec(out)
            return out
        if spec is _MISS:
            return func(*args, **kwargs)
        self.hits += 1
        return _make(spec)


def _storages(obj, found):
    if isinstance(obj, torch.Tensor):
        found.add(obj.untyped_storage()._cdata)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _storages(item, found)
    return found


def _aliases(out, args) -> bool:
    return bool(_storages(out, set()) & _storages(args, set()))


def _spec(out):
    if isinstance(out, torch.Tensor):
        if out.device.type != "meta":
            return _MISS
        return (tuple(out.shape), out.stride(), out.dtype)
    if isinstance(out, tuple) and all(isinstance(t, torch.Tensor) for t in out):
        specs = tuple(_spec(t) for t in out)
        return _MISS if any(s is _MISS for s in specs) else ("tuple", specs)
    return _MISS


def _make(spec):
    if spec[0] == "tuple":
        return tuple(_make(s) for s in spec[1])
    shape, stride, dtype = spec
    return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
