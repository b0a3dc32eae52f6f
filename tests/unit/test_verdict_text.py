"""The verdict's sentence (metatrace.render.format.verdict_text), shared by the terminal and the
HTML report."""

import pytest

from metatrace.render.format import verdict_text

GIB = 2**30


def sentence(headroom, userbuffers=0):
    return verdict_text(
        "gb200 (184 GiB)",
        fits=headroom >= 0,
        worst=180 * GIB,
        worst_ranks=(0, 1),
        oom_ranks=() if headroom >= 0 else (0, 1),
        headroom=headroom,
        reserved_gib=4.0,
        userbuffers=userbuffers,
    )


def test_a_fit_gives_the_headroom_and_what_was_added_to_the_peak():
    text = sentence(2 * GIB, userbuffers=768 * 2**20)
    assert text.startswith("Fits on gb200 (184 GiB): highest peak 180.00 GiB on ranks 0-1")
    assert "+ 4 GiB reserved overhead + 768.0 MiB of userbuffers" in text
    assert text.endswith("headroom 2.00 GiB.")


def test_missing_less_than_the_reserve_says_how_small_the_overhead_must_be():
    text = sentence(-21 * 2**20)
    assert "Out of memory on gb200 (184 GiB) by 21.0 MiB on ranks 0-1" in text
    assert "It fits if the CUDA context, NCCL and fragmentation take less than 3.98 GiB" in text


def test_missing_more_than_the_reserve_does_not():
    assert "It fits if" not in sentence(-5 * GIB)


@pytest.mark.parametrize(
    "module, chunk, chunks, text",
    [
        ("chunk1.decoder.layers.2.mlp", 1, 4, "fwd µb 29 chunk 1, layers.2.mlp"),
        ("chunk3", 3, 4, "fwd µb 29 chunk 3, model"),
        ("decoder.layers.15.mlp", None, 1, "fwd µb 29, layers.15.mlp"),
        (None, None, 1, "fwd µb 29, model"),
    ],
)
def test_where_a_stage_peaks_names_the_chunk_once(module, chunk, chunks, text):
    from types import SimpleNamespace

    from metatrace.render.summary import where

    at = SimpleNamespace(phase="forward", microbatch=29, chunk=chunk, module=module)
    assert where(at, chunks) == text
