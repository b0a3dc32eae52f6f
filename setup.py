"""Install the root-level cli.py as the module metatrace.cli.

pyproject.toml declares `metatrace.cli` with package directory `cli`, which is enough for an
editable install (setuptools' finder resolves `metatrace.cli` to ./cli.py). For a built wheel,
build_py below copies ./cli.py into the `metatrace` package instead of looking for a `cli/`
directory that does not exist.
"""

from setuptools import setup
from setuptools.command.build_py import build_py

_CLI = "metatrace.cli"


class BuildPy(build_py):
    def check_package(self, package, package_dir):
        if package == _CLI:
            return None
        return super().check_package(package, package_dir)

    def find_package_modules(self, package, package_dir):
        if package == _CLI:
            return []
        modules = super().find_package_modules(package, package_dir)
        if package == "metatrace":
            modules.append(("metatrace", "cli", "cli.py"))
        return modules


setup(cmdclass={"build_py": BuildPy})
