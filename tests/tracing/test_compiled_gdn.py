"""Gated DeltaNet's @jit_fuser methods as inductor runs them (models/compiled.py's gdn_*).

On CPU tensors, per method: the compiled original (megatron-core's, torch.compile) against the
stand-in, on a stand-in `self`: the peak above the start and the bytes left after forward and
after forward + backward (the PyTorch profiler's allocation events), the bytes saved for
backward (saved_tensors_hooks); and the stand-in's values and gradients against the eager
original's. The output norm and fla's l2norm are graph breaks (torch.compiler.disable), as
Transformer Engine's norm and fla's Triton kernels are. Each case runs in a fresh process, as in
test_compiled.py; compiling takes about 10 s a case.
"""

import json
import subprocess
import sys
import textwrap

import pytest

_PROBE = textwrap.dedent("""
    import importlib, json, sys
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile
    from tests.helpers import saved_storages
    from tests.profiled import peak_and_live
    from metatrace.models import compiled as standins
    from metatrace.models import gdn_kernels

    def allocations(fn, make, backward):
        torch.manual_seed(0)
        args = make()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            outs, saved = saved_storages(lambda: fn(*args))
            outs = outs if isinstance(outs, tuple) else (outs,)
            if backward:
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        peak, live = peak_and_live(prof)
        inputs = {a.untyped_storage()._cdata for a in args if isinstance(a, torch.Tensor)}
        return [peak, live, sum(saved.values()), sum(n for p, n in saved.items() if p in inputs)]

    def values(fn, make):
        torch.manual_seed(0)
        args = make()
        outs = fn(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.manual_seed(1)
        torch.autograd.backward(outs, [torch.randn_like(o) for o in outs])
        grads = [a.grad for a in args if isinstance(a, torch.Tensor) and a.grad is not None]
        return [t.float() for t in (*outs, *grads)]

    try:
        module = importlib.import_module("megatron.core.ssm.gated_delta_net.common")
        cls = module._GDNBase
    except ImportError:  # 0.16.1
        module = importlib.import_module("megatron.core.ssm.gated_delta_net")
        cls = module.GatedDeltaNet
    module.l2norm = torch.compiler.disable(gdn_kernels.l2norm)

    class Norm(torch.nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.norm = torch.nn.RMSNorm(dim, dtype=torch.bfloat16)

        @torch.compiler.disable
        def forward(self, x):
            return self.norm(x)

    b, s, hk, hv, dk, dv = 2, 1024, 4, 8, 32, 64
    me = torch.nn.Module()
    me.out_norm, me.act_fn = Norm(dv), F.silu
    me.qk_dim_local_tp, me.v_dim_local_tp, me.cp_size = hk * dk, hv * dv, 1
    me.key_head_dim, me.value_head_dim, me.use_qk_l2norm = dk, dv, True
    me.num_key_heads, me.num_value_heads = hk, hv
    B = torch.bfloat16

    def leaf(*shape, dtype=B):
        return torch.randn(*shape, dtype=dtype, requires_grad=True)

    def gated_norm():  # core_attn_out, gate [b, s, hv, dv]
        return leaf(b, s, hv, dv), leaf(b, s, hv, dv)

    def g_and_beta():  # A_log, dt_bias [hv] (fp32 parameters), alpha, beta [b, 4s, hv]
        return leaf(hv, dtype=torch.float32), leaf(hv, dtype=torch.float32), leaf(b, 4 * s, hv), leaf(b, 4 * s, hv)

    def prepare():  # qkv from the convolution; gate, beta, alpha strided views of in_proj's output
        z = leaf(s, b, 2 * hk * dk + 2 * hv * dv + 2 * hv).transpose(0, 1)
        _, gate, beta, alpha = torch.split(z, [2 * hk * dk + hv * dv, hv * dv, hv, hv], dim=-1)
        return leaf(b, s, 2 * hk * dk + hv * dv), gate.reshape(b, s, -1, dv), b, s, beta, alpha

    method, standin, make = sys.argv[1], sys.argv[2], eval(sys.argv[3])
    compiled_fn = getattr(cls, method)
    assert hasattr(compiled_fn, "_torchdynamo_orig_callable"), "jit_fuser is torch.compile"
    eager_fn = compiled_fn._torchdynamo_orig_callable
    compiled = lambda *a: compiled_fn(me, *a)
    eager = lambda *a: eager_fn(me, *a)
    other = (lambda *a: getattr(standins, standin)(me, *a)) if standin != "eager" else eager
    compiled(*make())
    diffs = [(x - y).abs().max().item() / max(1.0, y.abs().max().item())
             for x, y in zip(values(other, make), values(eager, make))]
    print(json.dumps({
        "compiled": allocations(compiled, make, False) + allocations(compiled, make, True)[:2],
        "standin": allocations(other, make, False) + allocations(other, make, True)[:2],
        "error": max(diffs),
    }))
""")

CASES = {  # method: (metatrace's stand-in, "eager" where none is needed; the inputs)
    "_apply_gated_norm": ("gdn_apply_gated_norm", "gated_norm"),
    "_compute_g_and_beta": ("gdn_compute_g_and_beta", "g_and_beta"),
    # graph broken at l2norm, its compiled halves allocate and save what eager does
    "_prepare_input_for_gated_delta_rule": ("eager", "prepare"),
}


def _probe(method):
    import megatron.core.ssm.gated_delta_net as gdn

    if method != "_apply_gated_norm" and not hasattr(gdn, "common"):
        pytest.skip("megatron-core 0.16.1 computes it in forward, not in a @jit_fuser method")
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, method, *CASES[method]],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(CASES))
def test_gdn_standin_allocates_as_compiled(method):
    got = _probe(method)
    compiled, standin = got["compiled"], got["standin"]
    # peak, end of forward, saved, saved of the inputs, peak and end of forward + backward
    for c, s in zip(compiled, standin):
        assert abs(s - c) <= max(64 << 10, compiled[0] // 16), got
    assert standin[2:4] == compiled[2:4], got  # the saved bytes exactly, and which are inputs
    assert got["error"] < 1e-2, got  # bf16 outputs and gradients, against eager's


def test_gated_norm_saves_less_than_eager():
    """The measurement the stand-in rests on: compiled, the gate multiply saves y and the gate
    (bf16 [rows, D] each) where eager saves y, gate.float() and its silu (fp32): 2 * 4 - 2 =
    6 bytes an element fewer; the norm (eager in both) saves the same."""
    got = _probe("_apply_gated_norm")
    elements = 2 * 1024 * 8 * 64
    eager = _probe_eager_saved()
    assert eager - got["compiled"][2] == 6 * elements, (eager, got)


def _probe_eager_saved():
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, "_apply_gated_norm", "eager", "gated_norm"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["standin"][2]
