"""The planner's per-kernel closed form (metatrace.planning.estimates.kernel_seconds): what its
search orders layouts by, and why context parallelism costs at 4,096 tokens."""

import dataclasses

import pytest

from metatrace.config import job_from_dict
from metatrace.config.kernels import gemm_seconds, kernel_model
from metatrace.planning import estimates as E


def _job(pp=4, vpp=4, cp=1, **cluster):
    """Llama-2 70B on 256 H100s at tp 2 with SP, sequence 4,096, global batch 512 (the
    README's plan), the distributed optimizer."""
    parallel = {"tp": 2, "pp": pp, "cp": cp, "sequence_parallel": True}
    if vpp:
        parallel["vpp"] = vpp
    return job_from_dict(
        {
            "model": {"preset": "llama2-70b"},
            "parallel": parallel,
            "training": {
                "seq_length": 4096,
                "global_batch_size": 512,
                "distributed_optimizer": True,
            },
            "cluster": {"num_gpus": 256, "gpu": "h100", **cluster},
        }
    )


def test_context_parallel_costs_compute_at_4096_tokens():
    """The same tokens per GPU in smaller kernels: cp 4 (dp 8, 64 micro-batches of 1,024
    tokens) computes longer than cp 1 (dp 32, 16 of 4,096), by the GEMMs' and attention's
    lower rates on shorter sequences; at one FLOP rate the two cost the same."""
    one, four = _job(), _job(cp=4)
    assert (one.num_microbatches, four.num_microbatches) == (16, 64)
    assert E.estimate(four).compute > 1.03 * E.estimate(one).compute
    flat = [E.estimate(_job(cp=cp, compute_efficiency=0.5)).compute for cp in (1, 4)]
    assert flat[0] == pytest.approx(flat[1], rel=1e-6)


def test_layer_gemms_are_priced_by_shape():
    """A layer's forward GEMMs at tp 2, SP: QKV [4096, 8192] x [8192, (64 + 16) x 128 / 2],
    the projection, the FFN's two; backward as the data and weight gradients. Doubling the
    layers per stage (pp 2 against pp 4) adds exactly one stage's worth of them."""
    h100 = kernel_model("h100")
    t, h, qkv, proj, ffn = 4096, 8192, 80 * 128 // 2, 64 * 128 // 2, 28672 // 2

    def linear(k, n):
        return (
            gemm_seconds(h100, t, n, k) + gemm_seconds(h100, t, k, n) + gemm_seconds(h100, n, k, t)
        )

    gemms = linear(h, qkv) + linear(proj, h) + linear(h, 2 * ffn) + linear(ffn, h)
    pp4, pp2 = _job(vpp=None), _job(pp=2, vpp=None)
    per_mb = [E.kernel_seconds(j) / j.num_microbatches for j in (pp4, pp2)]
    # Per micro-batch, pp 2's stage holds 40 layers and pp 4's 20: the difference is 20 layers.
    layer = (per_mb[1] - per_mb[0]) / 20
    assert gemms < layer < 1.6 * gemms  # plus attention and memory-bound work


def test_unknown_gpu_falls_back_to_one_rate():
    job = _job()
    job = dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, gpu="tpu-v5"))
    assert E.kernel_seconds(job) is None
