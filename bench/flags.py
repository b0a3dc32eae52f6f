"""How metatrace classifies Megatron-LM's command line.

    python bench/flags.py [--list CLASS]

Counts every option string of Megatron-LM's pretrain_gpt.py parser (core_v0.16.1 and a 2026
HEAD; metatrace/config/megatron/flags.tsv), and the flags of older releases metatrace knows, per
class of metatrace/megatron_flags.py: modelled, no
effect on allocated memory or traffic, not modelled yet (by the way it could move the peak), and
refused by Megatron-LM itself; per parser version; the not-modelled features with their flag
counts; and the environment variables metatrace reads. `--list CLASS` prints that class's flags
with their reason.
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
    from metatrace.config.megatron import flags as mf

    flags = mf.FLAGS.values()
    if args.list:
        for f in sorted(flags, key=lambda f: (f.reason, f.name)):
            if f.cls == args.list:
                extra = f" [{f.direction}]" if f.direction else ""
                print(f"{f.name:55} {f.reason}{extra}")
        return 0
    by_class = Counter(f.cls for f in flags)
    by_version = defaultdict(Counter)
    for f in flags:
        by_version[f.versions][f.cls] += 1
    versions = ("both", "core_v0.16.1", "HEAD", "older")
    print(f"{'class':14} {'all':>5} {'both':>6} {'0.16.1 only':>12} {'HEAD only':>10} {'older':>6}")
    for cls in (*CLASSES, None):
        row = [
            sum(c.values()) if cls is None else c[cls]
            for c in (by_class, *(by_version[v] for v in versions))
        ]
        print(f"{cls or 'total':14} {row[0]:5} {row[1]:6} {row[2]:12} {row[3]:10} {row[4]:6}")

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
    print(
        f"environment: {len(mf.ENV_MODELLED)} read or checked, {len(mf.ENV_NOT_MODELLED)} "
        f"known not modelled ({', '.join(mf.ENV_NOT_MODELLED)}), {len(mf.ENV_NO_EFFECT)} names "
        f"and {len(mf.ENV_NO_EFFECT_PREFIXES)} prefixes with no effect; any other is accepted "
        "and named in a note"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
