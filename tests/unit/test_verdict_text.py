"""The verdict's sentence (metatrace.render.format.verdict_text), shared by the terminal and the
HTML report."""

import pytest

from metatrace.render.format import verdict_text

GIB = 2**30


def sentence(headroom, margin=0, expandable=None, retries=0):
    """A memory_verdict of a rank that takes 180 GiB of a 184 GiB GPU less `headroom`."""
    device = 184 * GIB - margin - headroom
    return verdict_text(
        "gb200 (184 GiB)",
        {
            "fits": headroom >= 0,
            "device_bytes": device,
            "device_ranks": [0, 1],
            "out_of_memory_ranks": [] if headroom >= 0 else [0, 1],
            "headroom_bytes": headroom,
            "reserved_overhead_bytes": margin,
            "allocated_peak_bytes": device - 6 * GIB,
            "allocator_reserve_bytes": device - 4 * GIB,
            "allocator_retries": retries,
            "outside_allocator_bytes": 4 * GIB,
            "outside_terms": [
                {"term": "CUDA context and libraries", "bytes": 3 * GIB},
                {"term": "NCCL (tp)", "bytes": GIB},
            ],
            "expandable_segments": expandable,
        },
    )


def test_a_fit_gives_the_device_memory_its_parts_and_the_headroom():
    text = sentence(2 * GIB)
    assert text.startswith(
        "Fits on gb200 (184 GiB): ranks 0-1 take 182.00 GiB: allocator reserve 178.00 GiB "
        "(peak 176.00 GiB allocated) + 4.00 GiB outside it (CUDA context and libraries "
        "3.00 GiB); headroom 2.00 GiB."
    )
    assert text.endswith("headroom 2.00 GiB.")
    assert "margin" not in text


def test_the_margin_kept_free_is_named():
    assert "+ the 1.00 GiB margin kept free; headroom 2.00 GiB." in sentence(2 * GIB, GIB)


def test_out_of_memory_says_by_how_much_and_what_expandable_segments_change():
    text = sentence(-21 * 2**20, expandable={"fits": True, "headroom_bytes": GIB})
    assert text.startswith("Out of memory on gb200 (184 GiB) by 21.0 MiB on ranks 0-1: ")
    assert text.endswith(
        "With PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True it fits (headroom 1.00 GiB)."
    )
    same = sentence(-5 * GIB, expandable={"fits": False, "headroom_bytes": -GIB})
    assert "expandable" not in same  # the verdict is the same: nothing to say


def test_a_fit_only_by_freeing_the_cache_is_said():
    assert "frees its cache" in sentence(GIB, retries=3)
    assert "frees its cache" not in sentence(GIB)


@pytest.mark.parametrize(
    "module, chunk, chunks, step, where",
    [
        ("chunk1.decoder.layers.2.mlp", 1, 4, "fwd µb 29 c1", "layers.2.mlp"),
        ("chunk3", 3, 4, "fwd µb 29 c3", "model"),
        ("decoder.layers.15.mlp", None, 1, "fwd µb 29", "layers.15.mlp"),
        (None, None, 1, "fwd µb 29", "model"),
    ],
)
def test_where_a_stage_peaks_names_the_chunk_once(module, chunk, chunks, step, where):
    from types import SimpleNamespace

    from metatrace.render.summary import peak_module, peak_step

    at = SimpleNamespace(phase="forward", microbatch=29, chunk=chunk, module=module)
    assert (peak_step(at, chunks), peak_module(at, chunks)) == (step, where)
    optimizer = SimpleNamespace(phase="optimizer", microbatch=None, chunk=None, module=None)
    assert (peak_step(optimizer, 1), peak_module(optimizer, 1)) == ("optimizer step", None)


def test_interleaved_stages_show_their_first_and_last_layers():
    from metatrace.render.summary import stage_layers

    assert stage_layers(range(1, 17)) == "1-16"
    assert stage_layers([1, 32, 33]) == "1, 32-33"
    assert stage_layers([1, 2, 3, 4, 17, 18, 19, 20, 33, 34, 35, 36]) == "1-4 … 33-36"
    assert stage_layers([16, 32, 48, 64, 80, 96, 112]) == "16 … 112"


@pytest.mark.parametrize(
    "example, named",
    [
        ("llama2-7b-tp2-pp2.yaml", ["sequence parallel", "distributed optimizer"]),
        (
            "llama3-70b-gb200-fsdp-offload-fp8.yaml",
            [
                "Megatron-FSDP optim_grads_params",
                "FP8 tensorwise scaling (hybrid), FP8 parameters",
                "first 40 layers' activations offloaded",
            ],
        ),
        ("llama3-8b-gb200-cuda-graphs.yaml", ["CUDA graph of the whole iteration"]),
        ("llama3-70b-h100-tp-overlap.yaml", ["TP overlap (userbuffers)"]),
        ("llama3-70b-gb200-nvfp4.yaml", ["FP4 nvfp4, first 1 and last 1 layers in bf16"]),
        ("mixtral-8x7b-64gpu.yaml", ["alltoall dispatcher"]),
        ("debug.yaml", []),
    ],
)
def test_the_summary_names_what_is_in_effect(example, named, monkeypatch):
    """What shapes memory or time beyond the layout, as the summary's third line says it."""
    import os

    from metatrace.config import load_job
    from metatrace.render.summary import in_effect
    from tests.helpers import EXAMPLES

    monkeypatch.chdir(os.path.dirname(EXAMPLES))  # the userbuffers file's path is the root's
    features = in_effect(load_job(os.path.join(EXAMPLES, example)))
    assert all(n in features for n in named), features
    assert (features == []) == (named == [])
