"""`metatrace presets`: the model presets with their sizes, and one preset's every dimension
(formatting only; the parameter counts come from metatrace.planning.estimates)."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text

from metatrace.render.fit import FitTable
from metatrace.render.summary import count


def build_presets(rows) -> Group:
    """`rows`: (name, job, parameters, active parameters) per preset, the job resolved."""
    table = FitTable()
    table.add_column("Preset", "name")
    for header in ("Params", "Active", "Layers", "Hidden", "FFN", "Heads", "KV"):
        table.add_column(header)
    table.add_column("Experts", "name")
    for name, job, params, active in rows:
        m = job.model
        experts = f"{m.num_experts} top-{m.moe_router_topk}" if m.num_experts else ""
        table.add_row(
            name,
            count(params),
            count(active) if active != params else "",
            str(m.num_layers),
            str(m.hidden_size),
            str(m.ffn_hidden_size),
            str(m.num_attention_heads),
            "MLA" if m.multi_latent_attention else str(m.num_query_groups),
            experts,
        )
    return Group(
        table,
        Text(
            "Params: from the dimensions, norms and biases left out (metatrace run counts every "
            "parameter); Active: per token, top-k of the routed experts; KV: query groups (MLA: "
            "multi-latent attention). `metatrace presets NAME` lists a preset's every "
            "dimension and its source; a job file names one as model.preset.",
            style="dim",
        ),
    )


def build_preset(name: str, preset) -> Group:
    """One preset: its source, then the `model` section of a job file that names it, with what
    the preset sets as comments (a key given in the file overrides the preset's)."""
    import yaml

    def value(v) -> str:
        return (
            yaml.safe_dump(v, default_flow_style=True, width=2**16).removesuffix("\n...\n").strip()
        )

    dims = [f"{key}: {value(v)}" for key, v in preset.dims.items()]
    return Group(
        Text(f"{name}: {preset.source}", style="bold"),
        Text(f"model:\n  preset: {name}"),
        Text(
            "\n".join(
                ["  # what it sets (a key given here overrides it):"] + [f"  # {d}" for d in dims]
            ),
            style="dim",
        ),
    )
