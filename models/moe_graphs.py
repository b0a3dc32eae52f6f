"""Transformer Engine's CUDA graphs of a MoE layer's router part (cuda_graph_scope moe_router,
moe_preprocess), as the traced run sees them: where a graph's capture ends, what it returns (whose
static gradients the capture keeps), and the preprocessing recorded as a module of its own
(PREPROCESS) so that the time model counts it as captured (metatrace.tracing.graphs).

megatron-core 0.16.1 and 0.19 end such a graph in MoELayer.route (moe_router) or
MoELayer.preprocess (moe_preprocess) by raising MoECudaGraphPartialCaptureSignal while capturing
(moe_utils.maybe_skip_or_early_return_by_cudagraph); the traced run does not capture, so the
patches of those methods (hooks/patches.py) note the outputs instead, inside `capturing`.
"""

from __future__ import annotations

import contextlib

import torch

from metatrace.hooks import recorder

PREPROCESS = "preprocess"
"""The name below a MoE layer's "mlp" that MoELayer.preprocess is recorded under when a graph
captures it (moe_preprocess): not a module of its own."""


class _MoEGraphs:
    """What Transformer Engine's capture of MoE layers' router parts (moe_router, with or
    without moe_preprocess) holds beyond the eager run: one static gradient per output
    signature (make_graphed_callables with _reuse_graph_input_output_buffers: `empty_like` of
    each graph output that requires grad, one set per tuple of their shapes and dtypes, TE 2.8
    graph.py:488-506), made at the first MoE layer's forward of each signature and kept in
    `held`.

    A graph's outputs, in megatron-core's order (MoECudaGraphPartialCaptureSignal.
    get_early_return_outputs, then TransformerLayer._forward_mlp's residual): the hidden
    states and the probabilities (and the routing map, without moe_preprocess; after the
    preprocessing with it), the dispatcher's `cudagraph_attrs` that are tensors (with
    moe_preprocess), the shared experts' output (when not overlapped), the residual (the MoE
    layer's input's shape and dtype)."""

    def __init__(self, scope, held: list):
        self.preprocess = "moe_preprocess" in scope
        self.held = held
        self.signatures: set = set()

    def capture(self, layer, outputs: list, moe_input: torch.Tensor) -> None:
        if self.preprocess:
            for name in layer.token_dispatcher.cudagraph_attrs:
                attr = layer.token_dispatcher
                for part in name.split("."):
                    attr = getattr(attr, part, None)
                    if attr is None:
                        break
                if isinstance(attr, torch.Tensor):
                    outputs.append(attr)
        grads = [(tuple(o.shape), o.dtype) for o in outputs if o.requires_grad]
        shared = getattr(layer, "_metatrace_shared_output", None)
        if shared is not None:
            grads.append(shared)
        grads.append((tuple(moe_input.shape), moe_input.dtype))  # the residual's
        key = tuple(grads)
        if key not in self.signatures:
            self.signatures.add(key)
            self.held += [torch.empty(s, dtype=d, device=moe_input.device) for s, d in grads]


_MOE: list[_MoEGraphs] = []


@contextlib.contextmanager
def capturing(scope, held: list):
    """Inside, MoE layers' router graphs of `scope` note their outputs' static gradients into
    `held` (which keeps them)."""
    _MOE.append(_MoEGraphs(scope, held))
    try:
        yield
    finally:
        _MOE.pop()


def _moe_graphs() -> _MoEGraphs | None:
    return _MOE[-1] if _MOE else None


def moe_route(orig):
    """MoELayer.route, where a moe_router graph without moe_preprocess ends."""

    def route(self, hidden_states, *args, **kwargs):
        probs, routing_map = orig(self, hidden_states, *args, **kwargs)
        graphs = _moe_graphs()
        if graphs is not None and not graphs.preprocess and torch.is_grad_enabled():
            graphs.capture(self, [hidden_states, probs, routing_map], hidden_states)
        return probs, routing_map

    return route


def moe_preprocess(orig):
    """MoELayer.preprocess, where a moe_preprocess graph ends: recorded as a module of its own
    ("<layer>.mlp.preprocess") for the time model's `captured`."""

    def preprocess(self, hidden_states, probs, routing_map):
        graphs = _moe_graphs()
        rec = recorder.current() if graphs is not None and graphs.preprocess else None
        fqn = rec.fqn_of(self) if rec is not None else None
        if fqn is None:
            return orig(self, hidden_states, probs, routing_map)
        with rec.region(f"{fqn}.{PREPROCESS}", (hidden_states, probs, routing_map)) as out:
            result = orig(self, hidden_states, probs, routing_map)
            out.append(result)
        if torch.is_grad_enabled():
            graphs.capture(self, list(result), hidden_states)
        return result

    return preprocess


def moe_shared_experts(orig):
    """MoELayer.shared_experts_compute: its output, one of the router graph's outputs (its
    shape and dtype, when it requires grad: the tensor itself lives as eager mode has it)."""

    def shared_experts_compute(self, hidden_states):
        out = orig(self, hidden_states)
        if _moe_graphs() is not None:
            grad = out is not None and out.requires_grad
            self._metatrace_shared_output = (tuple(out.shape), out.dtype) if grad else None
        return out

    return shared_experts_compute
