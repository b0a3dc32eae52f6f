"""The JSON report: a documented, versioned view of an analysed job (schema in
report.schema.json).

`job_report(analysis)` returns plain data (dicts, lists, numbers, strings); `write_json` writes
it. Every figure comes from metatrace.analysis.analyze; this module only arranges it.
"""

from __future__ import annotations

import dataclasses
import json

from metatrace import __version__
from metatrace.analysis import aggregate as agg
from metatrace.analysis.margins import error_band
from metatrace.analysis.timing import STEP_PHASES, breakdown

SCHEMA_VERSION = 3


def _collective(c) -> dict:
    out = {
        "op": c.op,
        "group": c.group,
        "ranks": list(c.ranks),
        "shape": list(c.shape),
        "dtype": c.dtype,
        "bytes": c.bytes,
        "count": c.count,
        "phase": c.phase,
        "module": c.module,
        "aten": c.aten,
    }
    if c.peer is not None:
        out["peer"] = c.peer
    return out


def _modules(tree) -> list[dict]:
    out = []
    for row in agg.walk(tree):
        out.append(
            {
                "fqn": row.fqn,
                "type": row.type,
                "layer": row.layer,
                "params": row.params,
                "param_bytes": row.param_bytes,
                "param_shapes": {name: list(s) for name, s in row.param_shapes},
                "params_total": row.params_total,
                "param_bytes_total": row.param_bytes_total,
                "activation_bytes": row.activation_bytes,
                "activation_bytes_total": row.activation_bytes_total,
                "peak_bytes": row.peaks,
            }
        )
    return out


def _memory(m) -> dict:
    return {
        "params_bytes": m.params,
        "grads_bytes": m.grads,
        "optimizer_bytes": m.optimizer,
        "workspace_bytes": m.workspaces,
        "activations_bytes": m.activations,
        "temporary_bytes": m.temporary,
        "peak_bytes": m.peak,
        "peak_at": {
            "phase": m.peak_at.phase,
            "microbatch": m.peak_at.microbatch,
            "chunk": m.peak_at.chunk,
            "module": m.peak_at.module,
        },
        "inflight_microbatches": m.inflight,
    }


def _totals(t) -> dict:
    return {
        "count": t.count,
        "bytes_sent": t.bytes_sent,
        "bytes_received": t.bytes_received,
        "message_bytes": t.message_bytes,
        "intra_node_bytes": t.intra,
        "inter_node_bytes": t.inter,
        "seconds": t.seconds,
        "exposed_seconds": t.exposed_seconds,
    }


def _comm_item(it) -> dict:
    return {
        "dimension": it.dimension,
        "op": it.op,
        "group": it.group,
        "ranks": list(it.ranks),
        "shape": list(it.shape),
        "dtype": it.dtype,
        "message_bytes": it.message,
        "bytes_sent": it.sent,
        "bytes_received": it.received,
        "count": it.count,
        "per_microbatch": it.per_microbatch,
        "phase": it.phase,
        "module": it.module,
        "layers": it.layers,
        "crosses_nodes": it.crosses_nodes,
        "overlapped_with": it.overlapped,
    }


def _device(d) -> dict:
    """A role's analysis.device.DeviceMemory."""
    return {
        "total_bytes": d.taken,
        "allocated_peak_bytes": d.allocated,
        "allocator_reserve_bytes": d.used.reserved,
        "allocator_segments": d.used.segments,
        "allocator_retries": d.retries,
        "allocator_out_of_memory": not d.fit[0],
        "holes": [{"bytes": n, "left_by": who} for n, who in d.holes],
        "reserve_peak_at": d.reserve_peak_at,
        "outside_allocator_bytes": d.outside,
        "context_bytes": d.context,
        "userbuffer_bytes": d.userbuffers,
        "nccl": [
            {
                "group": c.group,
                "size": c.size,
                "setup_bytes": c.setup,
                "ring_bytes": c.ring,
                "nvls_bytes": c.nvls,
                "p2p_bytes": c.p2p,
            }
            for c in d.nccl
        ],
        "expandable_reserve_bytes": d.expandable.reserved if d.expandable is not None else None,
    }


def verdict_report(job, v) -> dict:
    """The JSON report's memory_verdict of analysis.memory.Verdict `v`."""
    d = v.binding
    out = {
        "not_modelled": [dataclasses.asdict(n) for n in job.not_modelled],
        "fits": v.fits,
        "gpu_memory_bytes": v.capacity,
        "reserved_overhead_bytes": v.overhead,
        "userbuffer_bytes": v.userbuffers,
        "highest_peak_bytes": v.worst,
        "highest_peak_ranks": list(v.worst_ranks),
        "headroom_bytes": v.headroom,
        "out_of_memory_ranks": list(v.oom_ranks),
        "allocator_conf": job.cluster.allocator_conf or "default",
        "device_bytes": d.taken,
        "device_ranks": list(v.binding_ranks),
        "allocated_peak_bytes": d.allocated,
        "allocator_reserve_bytes": d.used.reserved,
        "allocator_retries": d.retries,
        "outside_allocator_bytes": d.outside,
        "outside_terms": [{"term": t, "bytes": n} for t, n in d.terms()],
        "expandable_segments": None,
        "error_band": _error_band(job, v.headroom, d.allocated),
    }
    if v.expandable_ranks_oom is not None:
        out["expandable_segments"] = {
            "fits": not v.expandable_ranks_oom,
            "headroom_bytes": v.expandable_headroom,
            "out_of_memory_ranks": list(v.expandable_ranks_oom),
        }
    return out


def _error_band(job, headroom: int, allocated: int) -> dict:
    """The prediction's error band for the job's kind (metatrace.analysis.margins) and whether
    the headroom (or the shortfall) lies within it."""
    band = error_band(job)
    return {
        "kind": band.kind,
        "fraction": band.fraction,
        "bytes": band.bytes_of(allocated),
        "within": band.within(headroom, allocated),
        "source": band.source,
    }


def role_report(ra, world=None) -> dict:
    """One role of the report; `ra`: a metatrace.analysis.analyze.RoleAnalysis."""
    rt, trace, s = ra.traced, ra.trace, ra.summary
    out = {
        "index": rt.role.index,
        "pp_stage": rt.role.pp_stage,
        "ranks": list(rt.role.ranks),
        "traced_rank": trace.rank,
        "vpp_chunks": len(rt.chunks),
        "layers": list(s.layers),
        "params": {"count": s.params, "bytes": s.param_bytes},
        "activations_per_microbatch_bytes": s.activation_bytes,
        "collectives_per_microbatch": [_collective(c) for c in trace.collectives],
        "modules": _modules(ra.tree),
        "op_counts": dict(sorted(trace.op_counts.items())),
        "unclassified_ops": dict(sorted(trace.unclassified.items())),
        "trace_seconds": round(rt.seconds, 3),
    }
    if world is not None:
        out["gpus"] = [world.gpu(r) for r in rt.role.ranks]
    if ra.memory is not None:
        out["memory"] = _memory(ra.memory)
    if ra.device is not None:
        out["device"] = _device(ra.device)
    if ra.comm is not None:
        out["comm"] = {d: _totals(t) for d, t in ra.comm.dims.items()}
        out["comm_collectives"] = [_comm_item(it) for it in ra.comm.items]
    if ra.offload is not None:
        out["offload"] = {
            "d2h_bytes_per_microbatch": ra.offload.d2h_per_microbatch,
            "d2h_bytes_per_iteration": ra.offload.d2h_per_iteration,
            "pinned_host_bytes": ra.offload.pinned_host,
        }
    if rt.host_optimizer is not None:
        out["host_optimizer"] = dataclasses.asdict(rt.host_optimizer)
    return out


def job_report(analysis) -> dict:
    """The report of a metatrace.analysis.analyze.Analysis."""
    job, world = analysis.job, analysis.world
    par = job.parallel
    model = dataclasses.asdict(job.model)
    model.update(
        padded_vocab_size=job.padded_vocab_size,
        total_params=analysis.total_params,
        active_params=analysis.active_params,
    )
    report = {
        "schema_version": SCHEMA_VERSION,
        "metatrace_version": __version__,
        "megatron_core": analysis.traced.megatron_core,
        "source": job.source,
        "model": model,
        "parallel": dataclasses.asdict(par),
        "training": dataclasses.asdict(job.training),
        "implementation": dataclasses.asdict(job.implementation),
        "cluster": dataclasses.asdict(job.cluster),
        "world": {
            "num_gpus": world.size,
            "gpus_per_node": world.gpus_per_node,
            "tp": par.tp,
            "pp": par.pp,
            "vpp": par.vpp,
            "cp": par.cp,
            "ep": par.ep,
            "etp": par.etp,
            "dp": par.dp,
            "expert_dp": world.expert_dp,
            "rank_order": par.rank_order,
            "num_microbatches": job.num_microbatches,
        },
        "notes": list(job.notes),
    }
    if job.model.num_experts:
        from metatrace.config.routing import Routing

        report["moe_routing"] = Routing.of_job(job).describe()
    jc = analysis.comm
    if jc is not None:
        report["cluster"]["comm"] = {d: _totals(t) for d, t in jc.cluster.items()}
        report["cluster"]["comm"]["total"] = _totals(jc.total)
    report["groups"] = {kind: world.groups(kind) for kind in world.kinds()}
    report["roles"] = [role_report(ra, world) for ra in analysis.roles]
    if analysis.verdict is not None:
        report["memory_verdict"] = verdict_report(job, analysis.verdict)
        _add_timing(report, analysis)
    if analysis.full is not None:
        full = role_report(analysis.full)
        for key in ("ranks", "traced_rank", "index", "pp_stage"):
            full.pop(key)
        report["full_model"] = full
    return report


def _add_timing(report: dict, analysis) -> None:
    """The time model (metatrace.analysis.timing): a "timing" object per role and for the job."""
    timing = analysis.timing
    if timing is None:  # no peak FLOP/s known for the GPU
        return
    stages = {st.stage: st for st in timing.stages}
    for role, rt in zip(report["roles"], analysis.traced.roles):
        st = stages[rt.role.pp_stage]
        role["timing"] = {
            "iteration_seconds": st.iteration_seconds,
            "bubble_fraction": st.bubble_fraction,
            "busy_seconds": st.busy_seconds,
            "optimizer_seconds": st.optimizer_seconds,
            "flops_per_microbatch": sum(w.flops for w in rt.trace.windows if w.chunk is not None),
            "offload_copy_seconds": max(
                (sp.offload_seconds for sp in st.spans if sp.phase in STEP_PHASES), default=0.0
            ),
        }
    report["timing"] = {
        "iteration_seconds": timing.iteration_seconds,
        "bubble_fraction": timing.bubble_fraction,
        "pipeline_seconds": timing.pipeline_seconds,
        "peak_tflops": timing.peak_tflops,
        "compute_efficiency": timing.efficiency,
        "breakdown": breakdown(timing).to_json(),
        "host": timing.host.to_json() if timing.host is not None else None,
    }


def search_report(search) -> dict:
    return {
        "best": search.best,
        "candidates": list(search.candidates),
        "probes": [
            {
                "micro_batch_size": p.micro_batch_size,
                "num_microbatches": p.num_microbatches,
                "highest_peak_bytes": p.peak,
                "headroom_bytes": p.headroom,
                "fits": p.fits,
                "highest_peak_ranks": list(p.ranks),
            }
            for p in search.probes
        ],
    }


def check_report(report, source: str) -> None:
    """ConfigError unless `report` is a JSON report of this schema version
    (report.schema.json)."""
    from importlib import resources

    import jsonschema

    from metatrace.config.read import excerpt
    from metatrace.errors import ConfigError

    if not isinstance(report, dict) or "schema_version" not in report or "roles" not in report:
        raise ConfigError(f"{source} is not a JSON report of `metatrace run --json`")
    version = report["schema_version"]
    if version != SCHEMA_VERSION:
        raise ConfigError(
            f"{source}: a report of schema version {excerpt(version)}; this metatrace reads "
            f"version {SCHEMA_VERSION} (write it again with `metatrace run --json`)"
        )
    text = resources.files("metatrace.export").joinpath("report.schema.json").read_text()
    validator = jsonschema.Draft202012Validator(json.loads(text))
    error = jsonschema.exceptions.best_match(validator.iter_errors(report))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "the top level"
        raise ConfigError(
            f"{source}: not a JSON report of `metatrace run --json` (at {where}: "
            f"{error.message[:100]})"
        )


def write_json(report: dict, path: str) -> None:
    try:
        with open(path, "w") as f:
            # Compact and in one piece: json.dumps uses the C encoder (megabytes on large
            # clusters), json.dump writing piecewise does not.
            f.write(json.dumps(report, allow_nan=False) + "\n")  # NaN is not JSON
    except OSError as e:
        from metatrace.errors import ConfigError

        raise ConfigError(f"cannot write {path}: {e.strerror or e}") from None
