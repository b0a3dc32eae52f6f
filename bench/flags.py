"""How metatrace classifies Megatron-LM's command line.

    python bench/flags.py [--list CLASS]

Counts every option string of Megatron-LM's pretrain_gpt.py parser (core_v0.16.1, core_v0.19.2
and a 2026 HEAD; metatrace/config/megatron/flags.tsv), and the flags of older releases metatrace
knows, per class of metatrace/config/megatron/flags.py: modelled, no effect on allocated memory
or traffic, not modelled yet (by the way it could move the peak), and refused by Megatron-LM
itself; per parser (the flags each has) and per release (where each first or last appears); the
not-modelled features with their flag counts; the environment variables metatrace reads; and the
megatron-core config fields new in 0.19.2 per class (metatrace/config/megatron/fields.py).
`--list CLASS` prints that class's flags with their reason.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter, defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

CLASSES = ("modelled", "no_effect", "not_modelled", "refused")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", choices=CLASSES, help="print the flags of one class")
    args = parser.parse_args(argv)
    from metatrace.config.megatron import fields as mfields
    from metatrace.config.megatron import flags as mf

    flags = mf.FLAGS.values()
    if args.list:
        for f in sorted(flags, key=lambda f: (f.reason, f.name)):
            if f.cls == args.list:
                extra = f" [{f.direction}]" if f.direction else ""
                print(f"{f.name:55} {f.reason}{extra}")
        return 0
    by_class = Counter(f.cls for f in flags)
    by_version: defaultdict[str, Counter] = defaultdict(Counter)
    by_parser: defaultdict[str, Counter] = defaultdict(Counter)
    for f in flags:
        by_version[f.versions][f.cls] += 1
        for p in f.parsers:
            by_parser[p][f.cls] += 1
    print(
        "flags each parser has (core_v0.19.2's without its modelopt group, which its wheel lacks)"
    )
    _table(("all known", *mf.PARSERS), (by_class, *(by_parser[p] for p in mf.PARSERS)))
    print(
        "\nper release: in core_v0.16.1 and later ones, core_v0.16.1's alone, new in core_v0.19.2"
        "\n(3 of them not in HEAD), new after it (HEAD), older releases only"
    )
    versions = ("all", "core_v0.16.1", "core_v0.19.2", "HEAD", "older")
    labels = ("0.16.1 on", "0.16.1 only", "new 0.19.2", "HEAD only", "older")
    _table(labels, [by_version[v] for v in versions])

    directions = Counter(f.direction for f in flags if f.cls == "not_modelled")
    print(
        "\nnot modelled, by how they could move the peak: "
        + ", ".join(f"{d} {n}" for d, n in directions.most_common())
    )
    features = Counter((f.reason, f.direction) for f in flags if f.cls == "not_modelled")
    print(f"{len(features)} features not modelled:")
    for (feature, direction), n in sorted(features.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {n:3} {feature} [{direction}]")
    reasons = Counter(f.reason for f in flags if f.cls == "no_effect")
    print(f"\nno effect, {len(reasons)} reasons:")
    for reason, n in reasons.most_common():
        print(f"  {n:3} {reason}")
    print(
        "\nvalues of modelled flags not modelled: "
        + ", ".join(
            f"{flag} {'/'.join(map(str, vals))}"
            for flag, (vals, _, _) in mf.UNMODELLED_VALUES.items()
        )
    )
    fields = Counter((f.config, f.cls) for f in mfields.FIELDS_0_19_2)
    configs = sorted({c for c, _ in fields})
    print(f"\nmegatron-core config fields new in 0.19.2 ({len(mfields.FIELDS_0_19_2)}):")
    print(f"{'class':14} " + " ".join(f"{c:>30}" for c in configs))
    for cls in (*CLASSES[:3], None):
        row = [
            sum(n for (c2, _), n in fields.items() if c2 == c) if cls is None else fields[(c, cls)]
            for c in configs
        ]
        print(f"{cls or 'total':14} " + " ".join(f"{n:30}" for n in row))
    print(
        f"\nenvironment: {len(mf.ENV_MODELLED)} read or checked, {len(mf.ENV_NOT_MODELLED)} "
        f"known not modelled ({', '.join(mf.ENV_NOT_MODELLED)}), {len(mf.ENV_NO_EFFECT)} names "
        f"and {len(mf.ENV_NO_EFFECT_PREFIXES)} prefixes with no effect; any other is accepted "
        "and named in a note"
    )
    return 0


def _table(labels, counters) -> None:
    print(f"{'class':14} " + " ".join(f"{label:>12}" for label in labels))
    for cls in (*CLASSES, None):
        row = [sum(c.values()) if cls is None else c[cls] for c in counters]
        print(f"{cls or 'total':14} " + " ".join(f"{n:12}" for n in row))


if __name__ == "__main__":
    sys.exit(main())
