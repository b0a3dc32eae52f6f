"""The bad-input contract, fuzzed over the whole command line.

    python bench/fuzz_inputs.py [--cases N] [--seed S]

Runs metatrace's command line (cli.main, in this process) on generated inputs, by category:
mutated job-file keys, corrupted job-file bytes, mutated Hugging Face config.json files,
mutated Megatron-LM argument lists (any flag of the parser), command-line misuse, mutated diff
sides (JSON reports), and micro-batch counts up to the bound. Inputs that load are traced (the
debug model, so seconds each). The contract checked for every case: exit status 0, 1 or 2;
no exception out of main (a traceback); exit 2 with one message of at most 2,000 characters
on stderr; every number in a written JSON report finite; each case within 300 s (a hang).

Prints per category the cases tried, the exits, the violations (with the first few inputs),
and the slowest input error (seconds in this process, megatron-core already imported); then
the replay time and peaks for 1,000, 10,000 and 100,000 micro-batches."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import signal
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DEBUG = os.path.join(ROOT, "examples", "debug.yaml")
HF = os.path.join(ROOT, "tests", "data", "hf", "Qwen3-8B", "config.json")
FLAGS = os.path.join(ROOT, "metatrace", "config", "megatron", "flags.tsv")
SMALL_ARGS = (
    "--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 256 "
    "--max-position-embeddings 256 --micro-batch-size 2 --global-batch-size 16 "
    "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel "
    "--bf16 --use-distributed-optimizer --vocab-size 32000 --tokenizer-type NullTokenizer"
).split()

VALUES = [
    None, True, False, 0, 1, -1, 2, 3, 7, 64, 4096, 2**31 - 1, 2**31, 10**30, -(10**30),
    0.5, 1e-300, 1e300, -80.0, float("nan"), float("inf"), float("-inf"), "", "abc", "h100",
    "[1]*1000000000000", "([0]*3+[1]*5)", ":4096:8", "garbage", [1, 2], [], {"a": 1}, "1e30",
]  # fmt: skip
TEXT_VALUES = ["0", "-1", "1e30", "nan", "inf", "", "abc", "99999999999999999999", "3", "2", "1"]


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang()


def run_cli(argv: list[str], json_path: str | None):
    """(exit status, stderr, seconds, violation or None)."""
    from cli import main

    err, out = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    signal.alarm(300)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                code = main(argv)
            except SystemExit as e:  # argparse
                code = e.code if isinstance(e.code, int) else 2
    except Hang:
        return None, err.getvalue(), time.perf_counter() - start, "hang (over 300 s)"
    except BaseException as e:  # what the contract forbids
        return None, err.getvalue(), time.perf_counter() - start, f"{type(e).__name__}: {e}"[:300]
    finally:
        signal.alarm(0)
    seconds = time.perf_counter() - start
    text = err.getvalue()
    if code not in (0, 1, 2):
        return code, text, seconds, f"exit {code}"
    if "Traceback" in text:
        return code, text, seconds, "traceback on stderr"
    if code == 2:
        message = [line for line in text.splitlines() if line.startswith(("metatrace", "usage"))]
        if not message or len(text) > 2000:
            return code, text, seconds, f"exit 2 without one short message: {text[:200]!r}"
    if code in (0, 1) and json_path and os.path.exists(json_path):
        try:
            with open(json_path) as f:
                report = json.load(f, parse_constant=lambda c: float(c))
        except ValueError as e:
            return code, text, seconds, f"JSON report unreadable: {e}"
        try:
            json.dumps(report, allow_nan=False)
        except ValueError:
            return code, text, seconds, "a number in the JSON report is not finite"
    return code, text, seconds, None


# ----------------------------------------------------------------------------- generators


def _yaml(data) -> str:
    import yaml

    return yaml.safe_dump(data, allow_unicode=True)


def job_keys(rng: random.Random, tmp: str) -> list[str]:
    import dataclasses
    import typing

    import yaml

    from metatrace.config.job import Job

    with open(DEBUG) as f:
        data = yaml.safe_load(f)
    sections = ("model", "parallel", "training", "cluster", "implementation")
    hints = typing.get_type_hints(Job)
    keys = [(s, f.name) for s in sections for f in dataclasses.fields(hints[s])]
    for _ in range(rng.randint(1, 3)):
        section, key = rng.choice(keys)
        kind = str(hints[section].__dataclass_fields__[key].type)
        data.setdefault(section, {})[key] = (
            _plausible(rng, kind) if rng.random() < 0.5 else rng.choice(VALUES)
        )
    path = os.path.join(tmp, "job.yaml")
    with open(path, "w") as f:
        f.write(_yaml(data))
    return ["run", "--config", path]


def _plausible(rng: random.Random, kind: str):
    """A value of the field's type that a user might write."""
    if "bool" in kind:
        return rng.choice([True, False])
    if "int" in kind:
        return rng.choice([1, 2, 4, 8, 16, 0])
    if "float" in kind:
        return rng.choice([0.0, 0.1, 0.5, 1.0, 2.0, 80.0])
    return rng.choice(["", "bf16", "fp8", "h100", "a100", "alltoall", "full", "selective"])


_BYTES = [
    b"{", b"}", b"[", b"]", b": ", b"- ", b"&a ", b"*a", b"<<: *a\n", b"\t", b"\x00", b"\xff",
    b"\xef\xbb\xbf", b"'", b'"', b"#", b"\n  x: 1\n", b"!!python/object:os.system ", b"%YAML 9\n",
    b"---\n", b"...\n", b"? ", b"|\n", b">\n", b"1e999", b".nan", b"~",
]  # fmt: skip


def job_bytes(rng: random.Random, tmp: str) -> list[str]:
    with open(DEBUG, "rb") as f:
        text = bytearray(f.read())
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        at = rng.randrange(len(text) + 1)
        if op == 0 and text:
            del text[at : at + rng.randint(1, 8)]
        elif op == 1:
            text[at:at] = rng.choice(_BYTES)
        elif op == 2:
            lines = bytes(text).split(b"\n")
            i = rng.randrange(len(lines))
            lines.insert(i, lines[i])
            text = bytearray(b"\n".join(lines))
        elif op == 3:
            text = text[: rng.randrange(len(text) + 1)]
        elif op == 4:
            text[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        else:
            encoding = rng.choice(["utf-16", "latin-1", "utf-8-sig", "utf-32"])
            text = bytearray(bytes(text).decode("utf-8", "replace").encode(encoding, "replace"))
    path = os.path.join(tmp, "job.yaml")
    with open(path, "wb") as f:
        f.write(bytes(text))
    return ["run", "--config", path]


def hf_config(rng: random.Random, tmp: str) -> list[str]:
    with open(HF) as f:
        config = json.load(f)
    keys = list(config)
    for _ in range(rng.randint(1, 3)):
        key = rng.choice(keys + ["model_type", "unknown_key"])
        value = config.get(key)
        if rng.random() < 0.15:
            config.pop(key, None)
        elif rng.random() < 0.5 and type(value) in (int, float):
            config[key] = type(value)(value * rng.choice([0, 0.5, 2, 3]))
        else:
            config[key] = rng.choice(VALUES)
    text = json.dumps(config)  # NaN and Infinity as Python writes them
    if rng.random() < 0.2:
        at = rng.randrange(len(text))
        text = text[:at] + rng.choice(["", "{", "]", ",", '"', "\x00"]) + text[at + 1 :]
    hf = os.path.join(tmp, "config.json")
    with open(hf, "w") as f:
        f.write(text)
    job = {
        "model": {"hf_config": hf, "num_layers": 2},
        "parallel": {"tp": 2},
        "training": {"seq_length": 256, "micro_batch_size": 1, "global_batch_size": 4},
        "cluster": {"num_gpus": 4, "gpus_per_node": 4},
    }
    path = os.path.join(tmp, "job.yaml")
    with open(path, "w") as f:
        f.write(_yaml(job))
    return ["run", "--config", path]


def _flags() -> list[tuple[str, str]]:
    out = []
    with open(FLAGS) as f:
        for line in f:
            if line.startswith(("#", "flag\t")):
                continue
            cells = line.rstrip("\n").split("\t")
            out.append((cells[0], cells[2]))
    return out


_FLAG_LIST: list[tuple[str, str]] = []


def megatron_args(rng: random.Random, tmp: str) -> list[str]:
    flags = _FLAG_LIST or _FLAG_LIST.extend(_flags()) or _FLAG_LIST
    args = list(SMALL_ARGS)
    values = [i for i, a in enumerate(args) if not a.startswith("--")]
    for _ in range(rng.randint(0, 1)):
        args[rng.choice(values)] = rng.choice(TEXT_VALUES)
    switches = [f for f, kind in flags if kind in ("store_true", "store_false")]
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.5:
            args.append(rng.choice(switches))  # a switch Megatron-LM has
            continue
        flag, kind = rng.choice(flags)
        args.append(flag)
        if kind not in ("store_true", "store_false", "store_const") or rng.random() < 0.1:
            args.append(rng.choice(TEXT_VALUES + ["bf16", "e4m3", "hybrid", "flex", "uniform"]))
    if rng.random() < 0.1 and len(args) > 2:
        del args[rng.randrange(len(args))]
    return ["run", "--megatron-args", " ".join(args), "--world-size", rng.choice(["8", "4", "0"])]


_COMMANDS = ["run", "comm", "groups", "tree", "measure", "diff", "plan", ""]
_OPTIONS = [
    "--config", "--json", "--html", "--chrome-trace", "--memory-snapshot", "--rank", "--depth",
    "--width", "--jobs", "--gpu-memory-gib", "--gpu", "--gpus-per-node", "--world-size", "--env",
    "--megatron-args", "--megatron-args-file", "--quiet", "--summary", "--detail", "--expand",
    "--max-mbs", "--fail-on-oom", "--no-full-model", "--steps", "--top", "-x", "--",
]  # fmt: skip
_ARGS = [
    DEBUG, "/dev/zero", "/nonexistent/x.yaml", "/proc/self/nothing/x.json", "/", "-1", "0", "nan",
    "1e30", "99999999999", "abc", "", "NAME", "A=B", "CUBLAS_WORKSPACE_CONFIG=garbage", "h100",
    "x" * 5000, "/tmp",
]  # fmt: skip


def command_line(rng: random.Random, tmp: str) -> list[str]:
    argv = [rng.choice(_COMMANDS)] if rng.random() < 0.95 else []
    if rng.random() < 0.7:
        argv += ["--config", DEBUG]
    for _ in range(rng.randint(0, 4)):
        argv.append(rng.choice(_OPTIONS))
        if rng.random() < 0.8:
            argv.append(rng.choice(_ARGS))
    return [a for a in argv if a != ""] if rng.random() < 0.5 else argv


_REPORT: dict = {}


def diff_side(rng: random.Random, tmp: str) -> list[str]:
    report = json.loads(json.dumps(_REPORT))
    for _ in range(rng.randint(1, 3)):
        # A random place in the report: a container and one of its keys (or indices).
        parent, key = None, None
        node = report
        for _ in range(rng.randint(1, 5)):
            keys = list(node) if isinstance(node, dict) else list(range(len(node)))
            if not keys:
                break
            parent, key = node, rng.choice(keys)
            node = parent[key]
            if not isinstance(node, (dict, list)) or rng.random() < 0.3:
                break
        if parent is None:
            report = rng.choice(VALUES)
            break
        if isinstance(parent, dict) and rng.random() < 0.3:
            del parent[key]
        else:
            parent[key] = rng.choice(VALUES)
    path = os.path.join(tmp, "side.json")
    with open(path, "w") as f:
        f.write(json.dumps(report))
    other = os.path.join(tmp, "report.json")
    return ["diff", path, other] if rng.random() < 0.5 else ["diff", other, path]


def microbatches(rng: random.Random, tmp: str) -> list[str]:
    import yaml

    with open(DEBUG) as f:
        data = yaml.safe_load(f)
    m = int(10 ** rng.uniform(0, 6.2))  # up to past the bound of 1,000,000
    data["training"]["global_batch_size"] = 2 * m
    path = os.path.join(tmp, "job.yaml")
    with open(path, "w") as f:
        f.write(_yaml(data))
    return ["run", "--config", path]


CATEGORIES = {
    "job file: mutated keys": job_keys,
    "job file: corrupted bytes": job_bytes,
    "Hugging Face config.json": hf_config,
    "Megatron-LM arguments": megatron_args,
    "command line": command_line,
    "diff sides": diff_side,
    "micro-batch counts": microbatches,
}
TRACED = {"micro-batch counts": 0.2}
"""Categories whose cases mostly trace: run this share of --cases."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=200, help="cases per category")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    signal.signal(signal.SIGALRM, _alarm)
    import metatrace.tracing.trace  # noqa: F401  megatron-core imported before the timings

    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # what a case writes to a relative path lands here
        report = os.path.join(tmp, "report.json")
        code, text, _, bad = run_cli(
            ["run", "--config", DEBUG, "--quiet", "--no-full-model", "--json", report], report
        )
        assert code == 0 and bad is None, (code, text, bad)
        with open(report) as f:
            _REPORT.update(json.load(f))
        total = 0
        print(
            f"{'category':<28}{'cases':>6}{'exit 0':>8}{'exit 1':>8}{'exit 2':>8}"
            f"{'violations':>12}{'slowest exit 2':>16}"
        )
        for name, make in CATEGORIES.items():
            rng = random.Random(f"{args.seed}-{name}")
            n = max(1, round(args.cases * TRACED.get(name, 1.0)))
            exits = {0: 0, 1: 0, 2: 0}
            bad_cases, slowest = [], 0.0
            for _ in range(n):
                argv = make(rng, tmp)
                if argv and argv[0] in ("run", "comm", "tree", "groups", "plan"):
                    argv += ["--quiet", "--jobs", "1"] if argv[0] == "run" else []
                    if argv[0] == "run":
                        argv += ["--no-full-model", "--json", os.path.join(tmp, "out.json")]
                out = os.path.join(tmp, "out.json")
                if os.path.exists(out):
                    os.remove(out)
                code, _, seconds, violation = run_cli(argv, out)
                if violation:
                    bad_cases.append((violation, argv))
                else:
                    exits[code] += 1
                    if code == 2:
                        slowest = max(slowest, seconds)
            total += n
            print(
                f"{name:<28}{n:>6}{exits[0]:>8}{exits[1]:>8}{exits[2]:>8}"
                f"{len(bad_cases):>12}{slowest:>14.2f} s",
                flush=True,
            )
            for violation, argv in bad_cases[:3]:
                print(f"    {violation}\n      {' '.join(map(str, argv))[:300]}")
        print(f"{'all':<28}{total:>6}")
    replay_times()


def replay_times() -> None:
    from bench.replay_speed import run

    print("\nreplay (examples/debug.yaml; MoE: 4 experts, ep 2, pp 2, dp 4): trace, analysis")
    for moe in (False, True):
        for m in (1_000, 10_000, 100_000):
            trace_s, analyse_s, peaks = run(m, None, moe)
            print(
                f"  {'MoE' if moe else 'dense'} {m:>7,}: trace {trace_s:5.2f} s, "
                f"analysis {analyse_s:5.2f} s, peaks {peaks}"
            )


if __name__ == "__main__":
    main()
