"""The math as a dependency another codebase can declare: the distribution jaxrl4llm-rl
(packaging/rl/setup.py) holds jaxrl4llm.rl and the two modules of jaxrl4llm.config it imports,
requires jax and numpy only, and imports from its own files; the trainer's distribution puts
no top-level `experiments` into an environment."""

import os
import runpy
import subprocess
import sys

from tests.rl.test_dependencies import BLOCKED

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIBRARY = os.path.join(REPO, "packaging", "rl")


def _build_py(setup_dir, build_lib):
    """setup.py's build_py into build_lib: the files a wheel of it holds."""
    subprocess.run(
        [sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(build_lib)],
        cwd=setup_dir,
        check=True,
        capture_output=True,
        timeout=300,
    )
    return sorted(
        os.path.relpath(os.path.join(d, f), build_lib)
        for d, _, files in os.walk(build_lib)
        for f in files
        if f.endswith(".py")
    )


def test_the_library_distribution_holds_the_math_and_requires_jax_and_numpy(tmp_path):
    files = _build_py(LIBRARY, tmp_path / "lib")
    rl_files = sorted(
        os.path.join("jaxrl4llm", "rl", f)
        for f in os.listdir(os.path.join(REPO, "jaxrl4llm", "rl"))
        if f.endswith(".py")
    )
    config = [
        os.path.join("jaxrl4llm", "config", f"{m}.py") for m in ("__init__", "errors", "options")
    ]
    assert files == sorted(["jaxrl4llm/__init__.py", *config, *rl_files])
    setup = runpy.run_path(os.path.join(LIBRARY, "setup.py"), run_name="not_main")
    assert [r.split(">=")[0] for r in setup["INSTALL_REQUIRES"]] == ["jax", "numpy"]
    script = (
        "import importlib.abc, sys\n"
        f"BLOCKED = {BLOCKED!r}\n"
        "class Refuse(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if any(name == b or name.startswith(b + '.') for b in BLOCKED):\n"
        "            raise ModuleNotFoundError(name, name=name)\n"
        "sys.meta_path.insert(0, Refuse())\n"
        "import jax.numpy as jnp\n"
        "import jaxrl4llm.rl as rl\n"
        "assert rl.__file__.startswith(sys.argv[1]), rl.__file__\n"
        "cfg = rl.get_preset('gmpo')\n"
        "adv, keep, _ = rl.compute_advantages(cfg, jnp.array([1.0, 0.0]), jnp.array([1, 0]) > 0,"
        " jnp.ones((2, 3), bool), 2)\n"
        "s, d, _ = rl.policy_loss(cfg, jnp.full((2, 3), -1.0), None, adv, jnp.ones((2, 3)), keep)\n"
        "print('LOSS', float(s / d))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "lib")],
        cwd=tmp_path,  # not the repository: only the built files are importable
        env=dict(os.environ, PYTHONPATH=str(tmp_path / "lib"), JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LOSS 0.0" in result.stdout  # on policy: -A exp(0) averages to 0


def test_the_trainer_distribution_installs_no_top_level_experiments(tmp_path):
    files = _build_py(REPO, tmp_path / "trainer")
    tops = {f.split(os.sep)[0] for f in files}
    assert tops == {"jaxrl4llm"}
