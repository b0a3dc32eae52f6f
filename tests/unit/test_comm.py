"""Bytes a ring algorithm sends and receives per collective (the traced communication is in
tests/tracing/test_comm.py)."""

from metatrace.analysis.comm import ring_bytes


def test_ring_algorithm_bytes():
    # all-reduce: reduce-scatter then all-gather, 2(n-1)/n of the message each way.
    assert ring_bytes("all_reduce", 1000, 4) == (1500, 1500)
    assert ring_bytes("all_gather", 1000, 4) == (750, 750)
    assert ring_bytes("reduce_scatter", 800, 8) == (700, 700)
    assert ring_bytes("send", 1000, 2) == (1000, 0) and ring_bytes("recv", 1000, 2) == (0, 1000)
    assert ring_bytes("all_reduce", 1000, 1) == (0, 0)
