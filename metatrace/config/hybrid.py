"""Hybrid models' layer patterns (model.hybrid_layer_pattern), as megatron-core reads them.

megatron-core 0.16.1's MambaModel takes `hybrid_override_pattern`: one symbol a layer, M (Mamba-2),
* (attention), - (MLP), E (mixture of experts) (megatron/core/ssm/mamba_hybrid_layer_allocation.py,
Symbols). megatron-core 0.19's HybridModel takes `hybrid_layer_pattern`, which adds G (Gated
DeltaNet), D (DeepSeek sparse attention) and + (multi-latent attention), `|` between pipeline
stages and `/` before each multi-token-prediction depth's pattern
(megatron/core/models/hybrid/hybrid_layer_allocation.py, parse_hybrid_pattern). Pure: no torch.
Restates megatron.core.ssm.mamba_hybrid_layer_allocation.Symbols (source sha256: 90f8fb7b6e12,
39922661ee42). Restates megatron.core.models.hybrid.hybrid_layer_allocation.parse_hybrid_pattern
(source sha256: 7c3372dcc278; since 0.19).
"""

from __future__ import annotations

from dataclasses import dataclass

from metatrace.errors import ConfigError

MAMBA, ATTENTION, MLP, MOE, GDN = "M", "*", "-", "E", "G"
NAMES = {
    MAMBA: "Mamba-2",
    ATTENTION: "attention",
    MLP: "MLP",
    MOE: "mixture of experts",
    GDN: "Gated DeltaNet",
}
"""The layer symbols metatrace builds (D and + of 0.19 are refused: not modelled)."""
SINCE_0_19 = {GDN}
PIPE, MTP = "|", "/"


@dataclass(frozen=True)
class Pattern:
    """A parsed hybrid layer pattern."""

    layers: str
    """The main decoder's symbols, one a layer, without stage boundaries."""
    stages: tuple[str, ...] | None
    """The main pattern split at `|` (one entry a pipeline segment), or None without `|`."""
    mtp: str | None
    """The multi-token-prediction pattern of one depth, or None."""
    mtp_depths: int

    def count(self, symbol: str) -> int:
        return self.layers.count(symbol)


def parse(text: str, *, since_0_19: bool) -> Pattern:
    """`text` as megatron-core parses it; ConfigError names what the installed release
    (`since_0_19`: 0.19 or later) cannot build."""
    where = "model.hybrid_layer_pattern"
    main, *mtp_parts = text.split(MTP)
    if mtp_parts and not since_0_19:
        raise ConfigError(
            f"{where} {text!r}: '/' (multi-token prediction in the pattern) needs megatron-core "
            "0.19; megatron-core 0.16.1's MambaModel has no multi-token prediction"
        )
    if PIPE in main and not since_0_19:
        raise ConfigError(
            f"{where} {text!r}: '|' (pipeline stage boundaries) needs megatron-core 0.19; "
            "under 0.16.1 use parallel.pp (and first/last stage layers)"
        )
    for part in [main, *mtp_parts]:
        for symbol in part:
            if symbol == PIPE and part is main:
                continue
            if symbol not in NAMES:
                known = ", ".join(f"{s} ({n})" for s, n in NAMES.items())
                raise ConfigError(
                    f"{where} {text!r}: unknown layer symbol {symbol!r}; known: {known}"
                )
            if symbol in SINCE_0_19 and not since_0_19:
                raise ConfigError(
                    f"{where} {text!r}: {symbol} ({NAMES[symbol]}) needs megatron-core 0.19; "
                    "under 0.16.1 Gated DeltaNet layers are model.linear_attention_freq in a GPT "
                    "model"
                )
    if mtp_parts and any(p != mtp_parts[0] for p in mtp_parts):
        raise ConfigError(
            f"{where} {text!r}: every multi-token-prediction pattern must be the same"
        )
    mtp = mtp_parts[0] if mtp_parts and mtp_parts[0] else None
    layers = main.replace(PIPE, "")
    if not layers:
        raise ConfigError(f"{where} {text!r} has no layers")
    stages = tuple(main.split(PIPE)) if PIPE in main else None
    return Pattern(layers, stages, mtp, len(mtp_parts) if mtp else 0)
