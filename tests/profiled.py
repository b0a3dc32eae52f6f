"""What the probes of tests/tracing/test_compiled*.py (fresh processes) read from the PyTorch
profiler."""


def peak_and_live(prof) -> tuple[int, int]:
    """The highest and the last running sum of the CPU allocations and frees `prof` (a
    torch.profiler.profile run with profile_memory=True) recorded, in time order."""
    sizes = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        f = node.extra_fields
        if type(f).__name__ == "_ExtraFields_Allocation" and f.device.type == "cpu":
            sizes.append((node.start_time_ns, f.alloc_size))
    live = peak = 0
    for _, n in sorted(sizes):
        live += n
        peak = max(peak, live)
    return peak, live
