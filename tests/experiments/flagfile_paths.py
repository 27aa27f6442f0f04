"""The shipped flagfiles, for the flagfile tests of tests/experiments/."""

import glob
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGFILES = sorted(glob.glob(os.path.join(REPO, "experiments", "configs", "*.flags")))
