"""Export a training checkpoint to a Hugging Face folder (transformers / vLLM load it).

    python tools/export_hf.py workdirs/quickstart exported/quickstart [--step N]

Writes config.json, model.safetensors and the tokenizer files. A LoRA run (--lora_rank > 0)
is written as a PEFT adapter folder (adapter_model.safetensors + adapter_config.json, which
peft.PeftModel.from_pretrained loads onto the base model), or with --merge as a full folder
with the adapters folded into the weights. A PPO run's critic goes to a
folder beside it (OUTPUT-critic, or --critic_output): the backbone and its value head as
transformers' *ForTokenClassification (num_labels 1), which --critic_model reads back.

Needs PyTorch, which training does not: transformers reads the tokenizer out of a GGUF model
(the embedded SmolLM2) only with torch installed (`pip install torch==2.13.0`; without it
the tool stops with exit code 2 and that command).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxrl4llm.config import cli
from jaxrl4llm.config.errors import DependencyError  # noqa: E402

TORCH_INSTALL = "pip install torch==2.13.0"


def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", help="training workdir (with config.json and checkpoints/)")
    parser.add_argument("output", help="folder to write the HF checkpoint into")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="LoRA runs: write the base with the adapters merged in (a full "
        "HF folder) instead of a PEFT adapter folder",
    )
    parser.add_argument(
        "--critic_output",
        default=None,
        help="folder for a PPO run's critic (default: OUTPUT-critic)",
    )
    args = parser.parse_args(argv)
    if importlib.util.find_spec("torch") is None:
        raise DependencyError(
            "tools/export_hf.py needs PyTorch (transformers reads and writes "
            f"the tokenizer with it), which is not installed: {TORCH_INSTALL}"
        )

    from jaxrl4llm.models import peft_format, weights
    from jaxrl4llm.train.infra.checkpoint import read_run_config
    from jaxrl4llm.train.trained import load_trained_models
    from jaxrl4llm.train.update import critic

    peft = read_run_config(args.workdir).lora.enabled and not args.merge
    config, model_config, params, critic_params, tokenizer = load_trained_models(
        args.workdir, args.step, merge_lora=not peft
    )
    if peft:
        peft_format.export_peft(
            params, model_config, config.lora, args.output, base_model=config.model.name
        )
        print(f"wrote {args.output} (a PEFT LoRA adapter of {config.model.name})")
    else:
        weights.export_hf(params, model_config, args.output, tokenizer=tokenizer)
        print(f"wrote {args.output}")
    if critic_params is not None:
        folder = args.critic_output or args.output.rstrip("/\\") + "-critic"
        critic.export(critic_params, model_config, folder, tokenizer)
        print(f"wrote {folder} (the critic)")
    return 0


if __name__ == "__main__":
    cli.run(main, absl_flags=False)
