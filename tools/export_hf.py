"""Export a training checkpoint to a Hugging Face folder (transformers / vLLM load it).

    python tools/export_hf.py workdirs/quickstart exported/quickstart [--step N]

Writes config.json, model.safetensors and the tokenizer files.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", help="training workdir (with config.json and checkpoints/)")
    parser.add_argument("output", help="folder to write the HF checkpoint into")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    args = parser.parse_args(argv)

    from jaxrl4llm.models import weights
    from jaxrl4llm.train.checkpoint import load_trained_policy

    try:
        _, model_config, params, tokenizer = load_trained_policy(args.workdir, args.step)
    except FileNotFoundError as e:
        parser.error(str(e))
    weights.export_hf(params, model_config, args.output, tokenizer=tokenizer)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
