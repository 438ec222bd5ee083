"""python -m experiments.gpu (from the repository root): the round-3 GPU plan (`running.main`)."""

import sys

from .running import main

sys.exit(main())
