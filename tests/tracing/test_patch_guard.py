"""metatrace's patches and copies checked against the installed megatron-core: every patch target
exists (or the patch declares that it creates it), a missing one fails loudly and leaves nothing
behind, the release is checked on entry, copied sources still hash as recorded, and the backend
spec providers override megatron-core's methods with megatron-core's signatures."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os

import pytest

from metatrace.errors import ConfigError
from metatrace.hooks import guards, training
from metatrace.hooks.guards import MEGATRON_CORE, PatchError, Versions, parse_release
from metatrace.hooks.patches import (
    COMPILED_PATCHES,
    FUSED_OPTIMIZER_PATCHES,
    PATCHES,
    TORCH_OPTIMIZER_PATCHES,
    Patch,
    _resolve,
    megatron_patches,
    patched,
)

ALL_PATCHES = (
    PATCHES
    + COMPILED_PATCHES
    + FUSED_OPTIMIZER_PATCHES
    + TORCH_OPTIMIZER_PATCHES
    + (training._backward_step(lambda orig: orig),)
    + training._combined_patches(None, None)
)
HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
RANDOM = "megatron.core.tensor_parallel.random"


def small_job(**sections):
    """A resolved job on the debug preset with `sections` merged in (tests/helpers.py's)."""
    from metatrace.config import job_from_dict

    data = {"model": {"preset": "debug"}, "training": {"seq_length": 64, "micro_batch_size": 2}}
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return job_from_dict(data)


# --- targets ---------------------------------------------------------------------------------

# The targets megatron-core binds only when an optional package imports, so that the patch may
# have to create them: Transformer Engine's functions (moe_utils, layers) and Apex's extension.
CREATED = {
    "megatron.core.tensor_parallel.layers.fused_weight_gradient_mlp_cuda",
    "megatron.core.tensor_parallel.layers.get_dummy_wgrad",
    "megatron.core.transformer.moe.moe_utils.te_general_gemm",
    "megatron.core.transformer.moe.experts.Fp8Padding",
    "megatron.core.tensor_parallel.random.FP8GlobalStateManager",
    "megatron.core.tensor_parallel.random.fp8_autocast",
    "megatron.core.tensor_parallel.random.activation_recompute_forward",
    "megatron.core.transformer.moe.experts.Fp8Unpadding",
    "megatron.core.transformer.moe.moe_layer.te_checkpoint",
    "megatron.core.transformer.moe.moe_layer.TELinear",
    "megatron.core.ssm.mamba_mixer.mamba_split_conv1d_scan_combined",
    "megatron.core.ssm.mamba_mixer.mamba_chunk_scan_combined",
    "megatron.core.ssm.gated_delta_net.l2norm",
    *(
        f"megatron.core.transformer.moe.moe_utils.{name}"
        for name in (
            "fused_permute",
            "fused_permute_with_probs",
            "fused_unpermute",
            "fused_sort_chunks_by_index",
            "fused_sort_chunks_by_index_with_probs",
            "fused_topk_with_score_function",
            "fused_compute_score_for_moe_aux_loss",
            "fused_moe_aux_loss",
        )
    ),
}


BOTH = Versions((0, 16), (0, 19))  # every supported release


@pytest.mark.parametrize("patch", ALL_PATCHES, ids=lambda p: p.name)
def test_every_patch_target_exists_in_the_installed_megatron_core(patch):
    assert any(v.since in patch.versions for v in MEGATRON_CORE), "applies to a supported release"
    if guards.release() not in patch.versions:
        pytest.skip(f"for megatron-core {patch.versions} only")
    owner, attr = _resolve(patch)  # PatchError when a module or attribute on the way is missing
    assert patch.creates or hasattr(owner, attr)


def test_only_what_optional_packages_bind_is_created():
    assert {p.name for p in ALL_PATCHES if p.creates} == CREATED
    if not HAVE_TE:  # megatron-core binds them from TE: without it there is nothing to replace
        apex = "megatron.core.tensor_parallel.layers.fused_weight_gradient_mlp_cuda"
        for name in CREATED - {apex}:  # Apex's is bound once imported inside megatron_patches
            module, _, attr = name.rpartition(".")
            # 0.19 binds the names it imports from TE to None without it
            assert getattr(importlib.import_module(module), attr, None) is None, name


@pytest.mark.skipif(HAVE_TE, reason="Transformer Engine binds the attributes itself")
def test_created_attributes_exist_only_inside_the_patches():
    from megatron.core.transformer.moe import moe_utils

    with megatron_patches():
        assert moe_utils.fused_permute.__module__ == "metatrace.models.te_moe"
        assert moe_utils.HAVE_TE is True
    assert vars(moe_utils).get("fused_permute") is None  # absent in 0.16.1, None in 0.19
    assert moe_utils.HAVE_TE is False


def test_a_renamed_target_fails_naming_the_patch_and_leaves_nothing_behind():
    random = importlib.import_module(RANDOM)
    orig_get, orig_set = random._get_cuda_rng_state, random._set_cuda_rng_state
    applied = [
        Patch(RANDOM, "_get_cuda_rng_state", lambda orig: "get", BOTH, "first"),
        Patch(RANDOM, "_set_cuda_rng_state", lambda orig: "set", BOTH, "second"),
    ]
    renamed = Patch(
        RANDOM,
        "_set_cuda_rng_stat",
        lambda orig: "new",
        BOTH,
        "restores the CUDA RNG state",
    )
    with pytest.raises(PatchError) as raised:
        with patched((*applied, renamed)):
            pytest.fail("entered with a missing target")
    message = str(raised.value)
    assert message.startswith(
        f"patch {RANDOM}._set_cuda_rng_stat (megatron-core 0.16.x to 0.19.x): "
    )
    assert f"{RANDOM} has no _set_cuda_rng_stat in megatron-core {guards.release_text()}" in message
    assert message.endswith("Why it is patched: restores the CUDA RNG state")
    assert "_set_cuda_rng_stat" not in vars(random)
    assert (random._get_cuda_rng_state, random._set_cuda_rng_state) == (orig_get, orig_set)


@pytest.mark.parametrize(
    "module, target, missing",
    [
        (RANDOM, "CudaRNGStatesTrackr.fork", f"{RANDOM} has no CudaRNGStatesTrackr"),
        (RANDOM, "CudaRNGStatesTracker.forked", f"{RANDOM} has no CudaRNGStatesTracker.forked"),
        (
            "megatron.core.tensor_parallel.randomness",
            "fork",
            "module megatron.core.tensor_parallel.randomness does not import",
        ),
    ],
)
def test_a_missing_class_or_module_on_the_way_fails(module, target, missing):
    patch = Patch(module, target, lambda orig: None, BOTH, "why")
    with pytest.raises(PatchError, match=missing):
        with patched((patch,)):
            pass
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    assert "forked" not in vars(CudaRNGStatesTracker)


def test_a_declared_creation_is_undone_on_exit():
    random = importlib.import_module(RANDOM)
    patch = Patch(
        RANDOM,
        "metatrace_created",
        lambda orig: ("made", orig),
        BOTH,
        "test",
        creates=True,
    )
    with patched((patch,)):
        assert random.metatrace_created == ("made", None)
    assert not hasattr(random, "metatrace_created")


def test_a_patch_outside_its_releases_is_not_applied():
    random = importlib.import_module(RANDOM)
    orig = random._get_cuda_rng_state
    old = Patch(
        RANDOM,
        "_get_cuda_rng_state",
        lambda orig: "old",
        Versions((0, 12), (0, 13)),
        "a bug of 0.12 and 0.13",
    )
    with patched((old,), release=(0, 16, 1)):
        assert random._get_cuda_rng_state is orig
    with patched((old,), release=(0, 13, 4)):
        assert random._get_cuda_rng_state == "old"
    assert random._get_cuda_rng_state is orig


# --- releases --------------------------------------------------------------------------------


def test_releases_parse_and_compare():
    assert parse_release("0.16.1") == (0, 16, 1)
    assert parse_release("0.17.0rc2") == (0, 17, 0)
    assert parse_release("0.16.0.dev0+g1a2b3c") == (0, 16, 0)
    assert parse_release("0.16") == (0, 16, 0)
    with pytest.raises(ValueError):
        parse_release("dev")
    series = Versions((0, 12), (0, 16))
    assert [r in series for r in ((0, 11, 9), (0, 12, 0), (0, 16, 7), (0, 17, 0))] == [
        False,
        True,
        True,
        False,
    ]
    one = Versions((0, 16, 1))
    assert [r in one for r in ((0, 16, 0), (0, 16, 1), (0, 16, 2))] == [False, True, False]
    assert [str(v) for v in (series, one, Versions((0, 16)))] == [
        "0.12.x to 0.16.x",
        "0.16.1",
        "0.16.x",
    ]
    assert guards.supported_text() == "0.16.1 and 0.19.x"
    assert [guards.supported(r) for r in ((0, 16, 1), (0, 17, 0), (0, 18, 2), (0, 19, 2))] == [
        True,
        False,
        False,
        True,
    ]


@pytest.mark.parametrize("version", ["0.17.0", "0.16.0", "0.15.3"])
def test_an_unsupported_megatron_core_is_refused_before_anything_is_patched(monkeypatch, version):
    from megatron.core import package_info

    random = importlib.import_module(RANDOM)
    orig = random._get_cuda_rng_state
    monkeypatch.setattr(package_info, "__version__", version)
    monkeypatch.setenv("NVTE_FLASH_ATTN", "1")  # megatron_patches clears it when it starts
    with pytest.raises(ConfigError) as raised:
        with megatron_patches():
            pytest.fail("entered with an unsupported megatron-core")
    assert str(raised.value) == (
        f"megatron-core {version} is installed; metatrace supports megatron-core 0.16.1 and "
        "0.19.x, the releases its patches of megatron-core were checked against"
    )
    assert random._get_cuda_rng_state is orig
    assert os.environ["NVTE_FLASH_ATTN"] == "1"


def test_the_refusal_reaches_the_user_as_it_is(monkeypatch):
    """transformer_config wraps megatron-core's own refusals, not the release check."""
    from megatron.core import package_info

    from metatrace.models.build import transformer_config

    monkeypatch.setattr(package_info, "__version__", "0.17.0")
    with pytest.raises(ConfigError, match=r"^megatron-core 0\.17\.0 is installed;"):
        transformer_config(small_job())


# --- the patches moved from metatrace.tracing --------------------------------------------------


def test_backward_step_patches_restore_megatron_cores():
    from megatron.core.pipeline_parallel import schedules

    orig = schedules.backward_step

    def replay(*args):
        return "replayed"

    with training.replayed_backward(replay):
        assert schedules.backward_step is replay
    assert schedules.backward_step is orig

    class Rec:
        windows = []

        def window(self, phase):
            import contextlib

            self.windows.append(phase)
            return contextlib.nullcontext()

    rec = Rec()
    schedules.backward_step = lambda *args: ("real", args)
    try:
        with training.marked_backward(rec):
            assert schedules.backward_step(1, 2) == ("real", (1, 2))
        assert rec.windows == ["backward"]
    finally:
        schedules.backward_step = orig


def test_local_broadcasts_restores_torch_distributed():
    import torch.distributed as dist

    orig = dist.broadcast
    with training.local_broadcasts():
        assert dist.broadcast is not orig
    assert dist.broadcast is orig


# --- copies of megatron-core source ----------------------------------------------------------


def test_copied_megatron_core_sources_are_unchanged():
    marks = guards.copies()
    assert {m.original.rpartition(".")[2] for m in marks} >= {
        "parse_str_to_list",
        "RankGenerator",
        "generate_masked_orthogonal_rank_groups",
        "bias_gelu",
        "bias_gelu_back",
        "swiglu",
        "swiglu_back",
        "bias_swiglu",
        "bias_swiglu_back",
        "calculate_gradients",
        "bias_dropout_add_fused_train",
        "_apply_gated_norm",
        "get_gpt_layer_with_transformer_engine_spec",
        "get_gpt_layer_local_spec",
        "grouped_mlp_modules",
        "dispatch_postprocess",
        "preprocess",
        "sinkhorn",
        "fork",
        "get_gated_delta_net_module_spec",
        "mamba_layer_specs",
        "Symbols",
    }
    assert {m.where.split(":")[0] for m in marks} >= {
        "metatrace/config/checks.py",
        "metatrace/world.py",
        "models/compiled.py",
        "models/specs.py",
        "models/moe.py",
        "hooks/patches.py",
        "models/hybrid.py",
    }
    assert guards.stale(marks) == []


def test_every_source_hash_written_is_a_mark_the_guard_reads():
    """A "(source sha256: ...)" the mark's pattern does not match (a placeholder hash, a
    missing "Restates") would be checked by nothing."""
    import re

    written = re.compile(rf"\(source{guards._GAP}sha256:")
    for path in guards._files():
        text = path.read_text()
        if path.name == "guards.py":  # its docstring shows the form
            continue
        assert len(written.findall(text)) == len(guards.MARK.findall(text)), path


def test_a_changed_original_names_the_copy():
    mark = guards.Copy(
        "metatrace/world.py:86", "megatron.core.parallel_state.RankGenerator", "000000000000"
    )
    gone = guards.Copy("models/x.py:1", "megatron.core.parallel_state.RankGenerater", "0" * 12)
    now = guards.source_hash(guards.resolve(mark.original))
    assert len(now) == 12 and now != mark.sha
    assert guards.stale([mark, gone]) == [
        f"metatrace/world.py:86: megatron.core.parallel_state.RankGenerator changed (source "
        f"sha256 000000000000 in the mark, {now} installed): review the copy, then record the "
        "new hash",
        "models/x.py:1: megatron.core.parallel_state.RankGenerater cannot be read (module "
        "'megatron.core.parallel_state' has no attribute 'RankGenerater')",
    ]


def test_marks_are_found_wrapped_across_comment_lines():
    text = (
        "    # the parser, restated. Restates\n"
        "    # megatron.core.transformer.pipeline_parallel_layer_layout.X.parse\n"
        "    # (source sha256: 0123456789ab).\n"
        '    """Copied from megatron.core.a.b (source sha256: abcdefabcdef)."""\n'
        "    Restates megatron.core.<module>.<name> (source sha256: <first 12 hex digits>).\n"
        "    # Restates megatron.core.c.d (source sha256: 0123456789ab,\n"
        "    # abcdefabcdef; since 0.19).\n"
    )
    assert [m.groups() for m in guards.MARK.finditer(text)] == [
        ("megatron.core.transformer.pipeline_parallel_layer_layout.X.parse", "0123456789ab", None),
        ("megatron.core.a.b", "abcdefabcdef", None),
        ("megatron.core.c.d", "0123456789ab,\n    # abcdefabcdef", "0.19"),
    ]
    newer = guards.Copy("x.py:1", "megatron.core.c.d", "0" * 12, since=(99, 0))
    assert guards.stale([newer]) == []  # the installed release has no such original to compare


def test_the_hash_ignores_indentation_of_the_block_only():
    def nested(x):
        return x + 1

    top = "def nested(x):\n    return x + 1"
    import hashlib

    assert guards.source_hash(nested) == hashlib.sha256(top.encode()).hexdigest()[:12]


# --- backend spec providers ------------------------------------------------------------------


def _parameters(method) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(method).parameters.values()]


def signature_mismatches(cls, base) -> list[str]:
    """Methods of `cls` overriding one of `base` with other parameters (names, defaults). The
    override may add parameters after megatron-core's, with defaults: another supported
    release's (0.19's layer_norm(..., has_residual=False) over 0.16.1's)."""
    out = []
    for name, method in vars(cls).items():
        theirs = getattr(base, name, None)
        if not callable(method) or name.startswith("__") or theirs is None:
            continue
        mine, megatron = _parameters(method), _parameters(theirs)
        empty = inspect.Parameter.empty
        extra = mine[len(megatron) :]
        if (
            len(mine) < len(megatron)
            # a default where megatron-core's has none is one callers never use
            or any(m[0] != t[0] or t[1] not in (m[1], empty) for m, t in zip(mine, megatron))
            or any(d is empty for _, d in extra)
        ):
            mine = ", ".join(n for n, _ in _parameters(method))
            megatron = ", ".join(n for n, _ in _parameters(theirs))
            out.append(
                f"{cls.__name__}.{name}({mine}) overrides {base.__name__}.{name}({megatron})"
            )
    return out


def _providers():
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
    from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider

    from metatrace.models.specs import MetaLocalSpecProvider, MetaTESpecProvider

    return [
        (MetaLocalSpecProvider, LocalSpecProvider),
        (MetaLocalSpecProvider, BackendSpecProvider),
        (MetaTESpecProvider, TESpecProvider),
        (MetaTESpecProvider, BackendSpecProvider),
    ]


def test_spec_providers_override_with_megatron_cores_signatures():
    problems = [p for cls, base in _providers() for p in signature_mismatches(cls, base)]
    assert problems == []
    from metatrace.models.specs import MetaTESpecProvider

    assert {"layer_norm", "grouped_mlp_modules", "core_attention"} <= set(vars(MetaTESpecProvider))


def test_a_changed_provider_signature_is_named():
    from megatron.core.models.backends import BackendSpecProvider

    class Newer(BackendSpecProvider):  # a newer megatron-core's layer_norm
        def layer_norm(
            self,
            rms_norm: bool = False,
            for_qk: bool = False,
            has_residual: bool = False,
            zero_centered: bool = False,
        ) -> type:
            return type

    from metatrace.models.specs import MetaLocalSpecProvider

    assert signature_mismatches(MetaLocalSpecProvider, Newer) == [
        "MetaLocalSpecProvider.layer_norm(self, rms_norm, for_qk, has_residual) overrides "
        "Newer.layer_norm(self, rms_norm, for_qk, has_residual, zero_centered)"
    ]


def test_megatron_core_imports_without_the_compiler():
    """import_megatron_core defers megatron-core's torch.compile: a fresh interpreter imports
    megatron-core and enters the patches without importing inductor, and jit_fuser is the
    deferred compile (with it, inductor comes in: the check can fail)."""
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "from metatrace.hooks.guards import import_megatron_core\n"
        "from metatrace.hooks.patches import megatron_patches\n"
        "import_megatron_core()\n"
        "with megatron_patches():\n"
        "    pass\n"
        "from megatron.core import jit\n"
        "print(jit.jit_fuser.__name__, 'torch._inductor' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["_deferred_compile", "False"]


def test_a_deferred_function_runs_eagerly_in_a_trace_and_compiles_once_outside(monkeypatch):
    import torch

    from metatrace.hooks import guards

    compiled = []

    def fake_compile(fn, **options):
        compiled.append(options)
        return lambda *args: ("compiled", fn(*args))

    monkeypatch.setattr(torch, "compile", fake_compile)
    double = guards._deferred_compile(mode="max-autotune")(lambda x: 2 * x)
    with megatron_patches():
        assert double(torch.tensor(3)).item() == 6
    assert compiled == []
    assert double(1) == ("compiled", 2)
    assert double(2) == ("compiled", 4)
    assert compiled == [{"mode": "max-autotune"}]


def test_lazy_shards_are_megatron_cores_views():
    import torch
    from megatron.core.distributed import param_and_grad_buffer as pgb

    from metatrace.hooks.patches import _lazy_shards

    buffer = torch.empty(48, dtype=torch.bfloat16, device="meta")
    eager = pgb.shard_buffer(buffer, 6)
    lazy = _lazy_shards(pgb.shard_buffer)(buffer, 6)
    assert len(lazy) == len(eager) == 6
    assert lazy[4] is lazy[4] is lazy[-2]  # made once, as the list's element is one tensor
    for a, b in zip(lazy, eager, strict=True):
        assert (a.shape, a.stride(), a.storage_offset()) == (
            b.shape,
            b.stride(),
            b.storage_offset(),
        )
        assert a.untyped_storage()._cdata == buffer.untyped_storage()._cdata
    with pytest.raises(IndexError):
        lazy[6]
    with pytest.raises(AssertionError):
        _lazy_shards(pgb.shard_buffer)(buffer, 5)
