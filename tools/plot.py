"""Training curves of one or more runs, overlaid, in one PNG.

    python tools/plot.py workdirs/quickstart [workdirs/other ...] [--out curves.png]

Panels, against the step: reward, accuracy (train and held-out), completion length and
entropy; the KL to the reference and the clip fraction only when a run logged them and they
vary (jaxrl4llm/train/infra/plots.py, choose_panels). Each run is one colour, named by its folder.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxrl4llm.config import cli
from jaxrl4llm.train.infra.plots import plot_runs  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdirs", nargs="+", help="training workdirs (with metrics.jsonl)")
    parser.add_argument(
        "--out", default=None, help="output PNG (default: <first workdir>/curves.png)"
    )
    args = parser.parse_args(argv)
    out = args.out or os.path.join(args.workdirs[0], "curves.png")
    print(plot_runs(args.workdirs, out))  # a folder without metrics.jsonl: a UserError
    return 0


if __name__ == "__main__":
    cli.run(main, absl_flags=False)
