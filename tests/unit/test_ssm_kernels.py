"""The state-space and Gated DeltaNet stand-ins (models/ssm_kernels.py, models/gdn_kernels.py).

On meta: the bytes each forward saves for backward, counted as metatrace measures them (each
storage once), equal the closed forms derived from the kernels' sources. On the CPU: each
forward equals a naive sequential recurrence written here (not the chunked algorithm the
stand-ins restate), and its backward equals autograd through that recurrence.
"""

import pytest
import torch
import torch.nn.functional as F

from metatrace.models import gdn_kernels as G
from metatrace.models import ssm_kernels as K
from tests.helpers import saved_storages

BF16 = torch.bfloat16


def saved_storage_bytes(fn) -> int:
    """Bytes of the distinct storages fn()'s autograd graph saves."""
    return sum(saved_storages(fn)[1].values())


def _param(*shape, dtype=torch.float32, device="meta"):
    return torch.empty(*shape, dtype=dtype, device=device).requires_grad_()


# Shape sets: (batch, seqlen, nheads, headdim, ngroups, dstate, chunk_size, dtype)
MAMBA_SHAPES = [
    pytest.param(2, 256, 8, 64, 1, 128, 128, torch.float32, id="fp32-g1"),
    pytest.param(3, 200, 16, 32, 4, 64, 64, BF16, id="bf16-g4-ragged"),
]


@pytest.mark.parametrize("b,sl,h,p,g,n,L,dtype", MAMBA_SHAPES)
def test_split_conv1d_scan_saves_its_closed_form(b, sl, h, p, g, n, L, dtype):
    d, w = h * p, 4
    zx = _param(b, sl, 2 * d + 2 * g * n + h, dtype=dtype)
    weight, bias = _param(d + 2 * g * n, w, dtype=dtype), _param(d + 2 * g * n, dtype=dtype)
    dt_bias, A, D = _param(h), _param(h), _param(h)

    def run():
        K.mamba_split_conv1d_scan_combined(
            zx, weight, bias, dt_bias, A, D, L, headdim=p, ngroups=g, norm_before_gate=False
        )

    size = torch.finfo(dtype).bits // 8
    dims = dict(batch=b, seqlen=sl, nheads=h, headdim=p, ngroups=g, dstate=n, d_conv=w)
    assert saved_storage_bytes(run) == K.saved_bytes(
        "mamba_split_conv1d_scan_combined", **dims, dtype_bytes=size
    )
    # The activations alone: zxbcdt and out_x.
    act = K.split_conv1d_scan_saved_bytes(**dims, dtype_bytes=size, params=False)
    assert act == b * sl * ((2 * d + 2 * g * n + h) + d) * size


@pytest.mark.parametrize("b,sl,h,p,g,n,L,dtype", MAMBA_SHAPES)
def test_chunk_scan_saves_its_closed_form(b, sl, h, p, g, n, L, dtype):
    x, z = _param(b, sl, h, p, dtype=dtype), _param(b, sl, h, p, dtype=dtype)
    dt = _param(b, sl, h, dtype=dtype)
    B, C = _param(b, sl, g, n, dtype=dtype), _param(b, sl, g, n, dtype=dtype)
    A, D, dt_bias = _param(h), _param(h), _param(h)

    def run():
        K.mamba_chunk_scan_combined(x, dt, A, B, C, L, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)

    size = torch.finfo(dtype).bits // 8
    assert saved_storage_bytes(run) == K.saved_bytes(
        "mamba_chunk_scan_combined",
        batch=b,
        seqlen=sl,
        nheads=h,
        headdim=p,
        ngroups=g,
        dstate=n,
        chunk_size=L,
        dtype_bytes=size,
    )


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_causal_conv1d_and_gated_norm_save_their_closed_forms(dtype):
    size = torch.finfo(dtype).bits // 8
    x, weight, bias = _param(2, 96, 300, dtype=dtype), _param(96, 4, dtype=dtype), _param(96)
    got = saved_storage_bytes(lambda: K.causal_conv1d_fn(x, weight, bias, activation="silu"))
    assert got == (
        K.causal_conv1d_saved_bytes(batch=2, dim=96, seqlen=300, dtype_bytes=size, params=False)
        + 96 * 4 * size
        + 96 * 4
    )
    norm = K.RMSNormGated(256, group_size=64, norm_before_gate=False, device="meta", dtype=dtype)
    y, z = _param(300, 2, 256, dtype=dtype), _param(300, 2, 256, dtype=dtype)
    for gate in (None, z):
        got = saved_storage_bytes(lambda gate=gate: norm(y, gate))
        assert got == K.saved_bytes(
            "rmsnorm_fn",
            rows=600,
            hidden=256,
            group_size=64,
            dtype_bytes=size,
            gated=gate is not None,
        )


# --- the CPU values against naive recurrences ---------------------------------------------------


def naive_ssd(x, dt, A, B, C, D, z, dt_bias):
    """Mamba-2, one step at a time: h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T (per head, h_t
    [p, n]), y_t = h_t C_t + D x_t, gated by silu(z); dt = softplus(dt + dt_bias)."""
    b, sl, nh, p = x.shape
    rep = nh // B.shape[2]
    B, C = B.repeat_interleave(rep, 2), C.repeat_interleave(rep, 2)
    dt = F.softplus(dt + dt_bias)
    state = x.new_zeros(b, nh, p, B.shape[-1])
    ys = []
    for t in range(sl):
        decay = torch.exp(dt[:, t] * A)[..., None, None]
        state = decay * state + (dt[:, t, :, None, None] * x[:, t, :, :, None]) * B[:, t, :, None]
        ys.append((state * C[:, t, :, None]).sum(-1) + D[:, None] * x[:, t])
    return torch.stack(ys, 1) * F.silu(z)


def naive_conv(x, weight, bias):
    """[b, d, s]: out_t = silu(bias + sum_i weight[:, i] x_{t - (w - 1) + i})."""
    w = weight.shape[1]
    xp = F.pad(x, (w - 1, 0))
    out = sum(weight[:, i, None] * xp[..., i : i + x.shape[-1]] for i in range(w))
    return F.silu(out + bias[:, None])


def _close(a, b, tol=1e-4):
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def _mamba_inputs(b=2, sl=64, h=4, p=8, g=2, n=16):
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen)
    return dict(
        x=r(b, sl, h, p),
        dt=r(b, sl, h) - 1,
        A=-torch.rand(h, generator=gen) - 0.5,
        B=r(b, sl, g, n) / 4,
        C=r(b, sl, g, n) / 4,
        D=r(h),
        z=r(b, sl, h, p),
        dt_bias=r(h) / 2,
    )


def _grads_of(fn, inputs, names, seed=1):
    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    out = fn(**leaves)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    grads = torch.autograd.grad(out, [leaves[k] for k in names], dout)
    return out.detach(), dict(zip(names, grads))


def _same_function(fn, ref, inputs, names=None, grad_tol=1e-4):
    """fn and ref give the same output on `inputs` and the same gradients of `names` (all
    inputs by default) for one random output gradient."""
    names = list(inputs) if names is None else names
    out, grads = _grads_of(fn, inputs, names)
    expected, expected_grads = _grads_of(ref, inputs, names)
    _close(out, expected)
    for k in names:
        _close(grads[k], expected_grads[k], grad_tol)


@pytest.mark.parametrize("sl", [64, 56])
def test_chunk_scan_matches_the_recurrence(sl):
    inputs = _mamba_inputs(sl=sl)
    names = ["x", "dt", "A", "B", "C", "D", "z", "dt_bias"]
    stand_in = lambda x, dt, A, B, C, D, z, dt_bias: K.mamba_chunk_scan_combined(
        x, dt, A, B, C, 16, D=D, z=z, dt_bias=dt_bias, dt_softplus=True
    )
    _same_function(stand_in, naive_ssd, inputs, names, grad_tol=2e-4)


def test_split_conv1d_scan_matches_the_recurrence():
    b, sl, h, p, g, n, w = 2, 64, 4, 8, 2, 16, 4
    d = h * p
    gen = torch.Generator().manual_seed(2)
    inputs = dict(
        zx=torch.randn(b, sl, 2 * d + 2 * g * n + h, generator=gen),
        weight=torch.randn(d + 2 * g * n, w, generator=gen) / 2,
        bias=torch.randn(d + 2 * g * n, generator=gen) / 4,
        dt_bias=torch.randn(h, generator=gen) / 2,
        A=-torch.rand(h, generator=gen) - 0.5,
        D=torch.randn(h, generator=gen),
    )

    def stand_in(zx, weight, bias, dt_bias, A, D):
        return K.mamba_split_conv1d_scan_combined(
            zx, weight, bias, dt_bias, A, D, 16, headdim=p, ngroups=g, norm_before_gate=False
        )

    def naive(zx, weight, bias, dt_bias, A, D):
        z, xbc, dt = torch.split(zx, [d, d + 2 * g * n, h], dim=-1)
        xbc = naive_conv(xbc.transpose(1, 2), weight, bias).transpose(1, 2)
        x, B, C = torch.split(xbc, [d, g * n, g * n], dim=-1)
        y = naive_ssd(
            x.reshape(b, sl, h, p),
            dt,
            A,
            B.reshape(b, sl, g, n),
            C.reshape(b, sl, g, n),
            D,
            z.reshape(b, sl, h, p),
            dt_bias,
        )
        return y.reshape(b, sl, d)

    _same_function(stand_in, naive, inputs, grad_tol=2e-4)


def test_causal_conv1d_and_gated_norm_match_naive_forms():
    gen = torch.Generator().manual_seed(3)
    inputs = dict(
        x=torch.randn(2, 24, 64, generator=gen),
        weight=torch.randn(24, 4, generator=gen),
        bias=torch.randn(24, generator=gen),
    )
    conv = lambda x, weight, bias: K.causal_conv1d_fn(x, weight, bias, activation="silu")
    _same_function(conv, naive_conv, inputs)

    norm = K.RMSNormGated(32, eps=1e-5, group_size=8, norm_before_gate=False)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32, generator=gen))
    inputs = dict(y=torch.randn(10, 2, 32, generator=gen), z=torch.randn(10, 2, 32, generator=gen))

    def naive_norm(y, z):  # norm(y * silu(z)) over groups of 8, times the weight
        v = (y * F.silu(z)).reshape(10, 2, 4, 8)
        v = v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5)
        return v.reshape(10, 2, 32) * norm.weight

    _same_function(lambda y, z: norm(y, z), naive_norm, inputs)


# --- Gated DeltaNet -----------------------------------------------------------------------------

# (batch, seqlen, heads, key_dim, value_dim, chunk_size, dtype)
GDN_SHAPES = [
    pytest.param(2, 256, 4, 128, 128, 64, torch.float32, id="fp32"),
    pytest.param(1, 200, 6, 64, 96, 32, BF16, id="bf16-ragged-bt32"),
]


@pytest.mark.parametrize("b,sl,h,kd,vd,bt,dtype", GDN_SHAPES)
def test_gated_delta_rule_saves_its_closed_form(b, sl, h, kd, vd, bt, dtype):
    q, k = _param(b, sl, h, kd, dtype=dtype), _param(b, sl, h, kd, dtype=dtype)
    v, beta = _param(b, sl, h, vd, dtype=dtype), _param(b, sl, h, dtype=dtype)
    g = _param(b, sl, h)  # megatron-core's gates are fp32

    def run():
        G.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, chunk_size=bt)

    size = torch.finfo(dtype).bits // 8
    dims = dict(batch=b, seqlen=sl, heads=h, key_dim=kd, value_dim=vd, chunk_size=bt)
    assert saved_storage_bytes(run) == G.saved_bytes(
        "chunk_gated_delta_rule", **dims, dtype_bytes=size
    )
    # With the l2norm in the kernel, the normalised q and k replace the inputs, plus rstd.
    run = lambda: G.chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, chunk_size=bt, use_qk_l2norm_in_kernel=True
    )
    assert saved_storage_bytes(run) == G.saved_bytes(
        "chunk_gated_delta_rule", **dims, dtype_bytes=size, qk_l2norm_in_kernel=True
    )


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_l2norm_and_fla_conv_save_their_closed_forms(dtype):
    size = torch.finfo(dtype).bits // 8
    x = _param(2, 100, 6, 64, dtype=dtype)
    assert saved_storage_bytes(lambda: G.l2norm(x)) == G.saved_bytes(
        "l2norm", rows=1200, dim=64, dtype_bytes=size
    )
    x, w, bias = _param(2, 100, 96, dtype=dtype), _param(96, 4, dtype=dtype), _param(96)
    got = saved_storage_bytes(lambda: G.causal_conv1d(x, w, bias, activation="silu"))
    assert got == G.causal_conv1d_saved_bytes(
        batch=2, seqlen=100, dim=96, dtype_bytes=size, params=False
    ) + 96 * 4 * (size + 1)


def naive_gated_delta_rule(q, k, v, g, beta, scale):
    """fla's recurrence, one token at a time, S [V, K]: S_t = S_{t-1} (alpha_t (I - beta_t
    k_t k_t^T)) + beta_t v_t k_t^T, o_t = S_t (scale q_t), alpha_t = exp(g_t)."""
    b, sl, h, kd = q.shape
    S = q.new_zeros(b, h, v.shape[-1], kd)
    eye = torch.eye(kd)
    outs = []
    for t in range(sl):
        kt, vt, bt = k[:, t], v[:, t], beta[:, t, :, None, None]
        alpha = g[:, t].exp()[..., None, None]
        kk = kt[..., :, None] * kt[..., None, :]  # [b, h, K, K]
        S = S @ (alpha * (eye - bt * kk)) + bt * vt[..., :, None] * kt[..., None, :]
        outs.append((S @ (scale * q[:, t])[..., None]).squeeze(-1))
    return torch.stack(outs, 1)


@pytest.mark.parametrize("sl", [64, 50])
def test_gated_delta_rule_matches_the_recurrence(sl):
    b, h, kd, vd = 2, 3, 16, 8
    gen = torch.Generator().manual_seed(4)
    unit = lambda *s: F.normalize(torch.randn(*s, generator=gen), dim=-1)
    inputs = dict(
        q=unit(b, sl, h, kd),
        k=unit(b, sl, h, kd),
        v=torch.randn(b, sl, h, vd, generator=gen),
        g=F.logsigmoid(torch.randn(b, sl, h, generator=gen) + 2),
        beta=torch.rand(b, sl, h, generator=gen),
    )
    stand_in = lambda q, k, v, g, beta: G.chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, scale=0.5, chunk_size=16
    )[0]
    naive = lambda **kw: naive_gated_delta_rule(**kw, scale=0.5)
    _same_function(stand_in, naive, inputs, grad_tol=2e-4)


def test_l2norm_in_kernel_and_fla_conv_match_naive_forms():
    gen = torch.Generator().manual_seed(5)
    b, sl, h, kd, vd = 1, 32, 2, 8, 8
    inputs = dict(
        q=torch.randn(b, sl, h, kd, generator=gen),
        k=torch.randn(b, sl, h, kd, generator=gen),
        v=torch.randn(b, sl, h, vd, generator=gen),
        g=F.logsigmoid(torch.randn(b, sl, h, generator=gen) + 2),
        beta=torch.rand(b, sl, h, generator=gen),
    )
    stand_in = lambda q, k, v, g, beta: G.chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, chunk_size=16, use_qk_l2norm_in_kernel=True
    )[0]

    def naive(q, k, v, g, beta):
        q, k = (
            q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6),
            k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6),
        )
        return naive_gated_delta_rule(q, k, v, g, beta, kd**-0.5)

    _same_function(stand_in, naive, inputs, grad_tol=2e-4)

    x = dict(x=torch.randn(2, 40, 24, generator=gen))
    _same_function(
        lambda x: G.l2norm(x), lambda x: x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6), x
    )

    # fla's conv on [B, T, D], given a strided view as megatron-core 0.19 passes it
    inputs = dict(
        full=torch.randn(2, 40, 30, generator=gen),
        weight=torch.randn(24, 4, generator=gen),
        bias=torch.randn(24, generator=gen),
    )
    conv = lambda full, weight, bias: G.causal_conv1d(
        full[..., :24], weight, bias, activation="silu"
    )[0]
    naive = lambda full, weight, bias: naive_conv(
        full[..., :24].transpose(1, 2), weight, bias
    ).transpose(1, 2)
    _same_function(conv, naive, inputs)


def test_the_scans_report_their_matrix_products():
    """Forward FLOPs: the SSD's C B^T, chunk states, C @ states and (C B^T) @ x per chunk; the
    delta rule's eight per-chunk products and solve_tril."""
    from metatrace.hooks import flops

    b, sl, h, p, g, n, L = 2, 256, 8, 64, 2, 128, 64
    x, z = _param(b, sl, h, p), _param(b, sl, h, p)
    dt, B, C = _param(b, sl, h), _param(b, sl, g, n), _param(b, sl, g, n)
    A = _param(h)
    count = flops.FlopCount()
    flops.push(count)
    try:
        K.mamba_chunk_scan_combined(x, dt, A, B, C, L, z=z)
    finally:
        flops.pop(count)
    c = sl // L
    expected = 2 * (b * c * g * L * n * L + b * c * h * (p * L * n + L * n * p + L * L * p))
    assert count.total == expected

    bt, kd, vd = 64, 128, 96
    q, k, v = _param(b, sl, h, kd), _param(b, sl, h, kd), _param(b, sl, h, vd)
    count = flops.FlopCount()
    flops.push(count)
    try:
        G.chunk_gated_delta_rule(q, k, v, g=_param(b, sl, h), beta=_param(b, sl, h))
    finally:
        flops.pop(count)
    rows = b * sl * h  # every chunk's rows
    # k_beta k^T, A k, A v, w h, k^T v_new, q h, q k^T, P v_new
    per_row = kd * bt + bt * kd + bt * vd + kd * vd + kd * vd + kd * vd + kd * bt + bt * vd
    assert count.total == 2 * rows * per_row + 2 * rows * bt * bt // 3
