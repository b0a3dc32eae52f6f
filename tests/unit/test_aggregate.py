"""Aggregation is pure: synthetic records in, tables out (invariants on a real trace are in
tests/tracing/test_aggregate.py)."""

from metatrace.analysis import aggregate as agg
from metatrace.records import STEP, Collective, MemEvent, ModuleInfo, ParamInfo, Saved, Trace


def p(name, *shape, sharded=False, copy=False):
    n = 1
    for d in shape:
        n *= d
    return ParamInfo(name, shape, "bfloat16", n, 2 * n, tp_sharded=sharded, embedding_copy=copy)


def saved(seq, storage, nbytes, module, phase="forward", static=False):
    return Saved(seq, storage, nbytes, (nbytes // 2,), "bfloat16", module, phase, static)


MODULES = (
    ModuleInfo("", "GPTModel", ()),
    ModuleInfo("decoder", "TransformerBlock", ()),
    ModuleInfo("decoder.layers", "ModuleList", ()),
    ModuleInfo("decoder.layers.0", "TransformerLayer", (), 1),
    ModuleInfo("decoder.layers.0.mlp", "MLP", (p("weight", 8, 4, sharded=True),), 1),
    ModuleInfo("decoder.layers.1", "TransformerLayer", (), 2),
    ModuleInfo("decoder.layers.1.mlp", "MLP", (p("weight", 8, 4, sharded=True),), 2),
    ModuleInfo("decoder.layers.2", "TransformerLayer", (), 3),
    ModuleInfo("decoder.layers.2.mlp", "MLP", (p("weight", 8, 2, sharded=True),), 3),
    ModuleInfo(
        "output_layer", "ColumnParallelLinear", (p("weight", 16, 4, sharded=True, copy=True),)
    ),
    ModuleInfo("final_norm", "LocalNorm", (p("weight", 4),)),
)


def trace(saves=(), memory=(), collectives=()):
    return Trace(
        rank=0,
        modules=MODULES,
        collectives=tuple(collectives),
        saved=tuple(saves),
        memory=tuple(memory),
        static_bytes=1000,
    )


def test_each_storage_counts_once_for_its_first_saver_in_forward():
    t = trace(
        [
            saved(1, 10, 512, "decoder.layers.0.mlp"),
            saved(2, 10, 512, "decoder.layers.1.mlp"),  # the same storage saved again
            saved(3, 11, 1024, "decoder.layers.1.mlp"),
            saved(4, 12, 4096, "decoder.layers.1.mlp", static=True),  # a weight
            saved(5, 13, 2048, "decoder.layers.1.mlp", phase="recompute"),  # transient
            saved(6, 14, 512, STEP),
        ]
    )
    assert agg.activation_owners(t) == {
        10: ("decoder.layers.0.mlp", 512),
        11: ("decoder.layers.1.mlp", 1024),
        14: (STEP, 512),
    }
    assert agg.activation_bytes(t) == 2048
    (root,) = agg.module_tree(t)
    assert root.activation_bytes_total == 1536  # the step is not part of the model
    layers = {r.fqn: r for r in agg.walk([root])}
    assert layers["decoder.layers.1"].activation_bytes_total == 1024
    assert root.params_total == 32 + 32 + 16 + 64 + 4


def test_peaks_by_module_include_descendants():
    t = trace(
        memory=[
            MemEvent(1, 512, 1512, "decoder.layers.0.mlp", "forward"),
            MemEvent(2, 1024, 2536, "decoder.layers.1.mlp", "forward"),
            MemEvent(3, -512, 2024, "decoder.layers.1.mlp", "backward"),
            MemEvent(4, 4096, 6120, STEP, "backward"),
        ]
    )
    assert agg.peak(t) == agg.Peak(6120, "backward", STEP, 4)
    peaks = agg.module_peaks(t)
    assert peaks["decoder"] == {"forward": 2536, "backward": 2024}
    assert peaks["decoder.layers.0"] == {"forward": 1512}
    assert peaks[STEP] == {"backward": 6120}  # the step is not inside the model
    assert peaks[""] == {"forward": 2536, "backward": 2024}


def test_identical_numbered_siblings_fold():
    (root,) = agg.module_tree(trace())
    layers = next(r for r in agg.walk([root]) if r.fqn == "decoder.layers")
    folds = agg.fold_children(layers)
    assert [(f.first, f.last, f.count, f.layers) for f in folds] == [
        ("0", "1", 2, (1, 2)),
        ("2", "2", 1, (3, 3)),
    ]


def test_collectives_make_layers_differ():
    ar = Collective(
        1,
        "all_reduce",
        "c10d.allreduce_.default",
        "tp",
        (0, 1),
        (4,),
        "bfloat16",
        8,
        1,
        "forward",
        "decoder.layers.1.mlp",
    )
    (root,) = agg.module_tree(trace(collectives=[ar]))
    layers = next(r for r in agg.walk([root]) if r.fqn == "decoder.layers")
    assert [f.count for f in agg.fold_children(layers)] == [1, 1, 1]


def test_whole_model_counts_shards_and_skips_the_embedding_copy():
    assert agg.model_params([trace()], tp=2) == 2 * (32 + 32 + 16) + 4
