"""The built wheel installs everything under the metatrace name and runs from there."""

import os
import subprocess
import sys
import zipfile

from tests.helpers import ROOT


def installed(tmp_path, env, *argv):
    """Python run with `argv` outside the checkout, where only the installed wheel is found."""
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300
    )


def test_wheel_holds_only_the_metatrace_package(tmp_path):
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            ROOT,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("metatrace-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"metatrace", next(t for t in top if t.endswith(".dist-info"))}
    for module in (
        "metatrace/cli.py",
        "metatrace/models/build.py",
        "metatrace/hooks/recorder.py",
        "metatrace/config/job.py",
        "metatrace/export/report.schema.json",
        "metatrace/py.typed",
        "metatrace/config/megatron/flags.tsv",
    ):
        assert module in names

    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    env = {**os.environ, "PYTHONPATH": str(target)}
    probe = (
        "import metatrace.cli, metatrace.config.presets, metatrace.hooks.recorder as r; "
        "print(r.__file__)"
    )
    run = installed(tmp_path, env, "-c", probe)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == str(target / "metatrace" / "hooks" / "recorder.py")
    # The report's JSON Schema is package data, read where the package is installed.
    schema = (
        "import json, importlib.resources as r, metatrace.export.report as m; "
        "s = json.loads(r.files('metatrace.export').joinpath('report.schema.json').read_text()); "
        "print(s['properties']['schema_version']['const'] == m.SCHEMA_VERSION, "
        "r.files('metatrace.export'))"
    )
    run = installed(tmp_path, env, "-c", schema)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["True", str(target / "metatrace" / "export")]
    # The flag table reads Megatron-LM's parser attributes from package data too.
    flags = "import metatrace.config.megatron.flags as f; print(len(f.FLAGS))"
    run = installed(tmp_path, env, "-c", flags)
    # 933 flags of Megatron-LM's parsers (core_v0.16.1, core_v0.19.2, HEAD) + 10 of older releases.
    assert run.returncode == 0 and run.stdout.split() == ["943"], run.stderr[-2000:]
    version = installed(tmp_path, env, "-m", "metatrace", "--version")
    assert version.returncode == 0 and version.stdout.startswith("metatrace 0.")


def test_the_0_19_constraints_are_the_tested_ones_but_megatron_core():
    """constraints-0.19.txt (README.md, "megatron-core 0.19") pins what constraints.txt pins,
    megatron-core 0.19.2 in place of 0.16.1, and the triton 0.19's modules import."""
    import re

    def pins(name):
        with open(os.path.join(ROOT, name)) as f:
            lines = [line.strip() for line in f if line.strip() and not line.startswith("#")]
        return dict(re.match(r"([A-Za-z0-9_.-]+)==(\S+)$", line).groups() for line in lines)

    base, newer = pins("constraints.txt"), pins("constraints-0.19.txt")
    assert base.pop("megatron-core") == "0.16.1"
    assert newer.pop("megatron-core").startswith("0.19.")
    assert "triton" in newer and newer.pop("triton")
    assert newer == base
