"""jaxrl4llm-rl: the RL math of jaxrl4llm (the package jaxrl4llm.rl) on its own, with jax and
numpy as its only requirements, built from this repository's tree (docs/library.md).

    pip install ./packaging/rl          # from a checkout (or git+URL#subdirectory=packaging/rl)

It ships jaxrl4llm/__init__.py, the two pure-Python modules of jaxrl4llm.config that the math
imports (errors.py, options.py) and jaxrl4llm/rl/; nothing else of the trainer. The trainer's
distribution (the repository's setup.py) holds the same modules: install one or the other.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

REPO = os.path.relpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
PACKAGES = ["jaxrl4llm", "jaxrl4llm.config", "jaxrl4llm.rl"]
# The modules taken from each package (None: all of them); the rest of jaxrl4llm.config
# (cli.py: absl, paths.py: fsspec) belongs to the trainer.
MODULES = {"jaxrl4llm": ("__init__",), "jaxrl4llm.config": ("__init__", "errors", "options")}
INSTALL_REQUIRES = ["jax>=0.10.2", "numpy>=2.4"]


class BuildLibraryModules(build_py):
    """build_py keeping only MODULES of the packages they list."""

    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        keep = MODULES.get(package)
        return modules if keep is None else [m for m in modules if m[1] in keep]


if __name__ == "__main__":
    setup(
        name="jaxrl4llm-rl",
        version="0.1.0",
        description="The RL math of jaxrl4llm (advantages, policy losses, KL, filters) as "
        "pure, jittable JAX",
        python_requires=">=3.11",
        packages=PACKAGES,
        package_dir={"": REPO},
        install_requires=INSTALL_REQUIRES,
        cmdclass={"build_py": BuildLibraryModules},
    )
