"""python -m mixture_of_depths.studies.gpu: the round-3 GPU plan (`running.main`)."""

import sys

from .running import main

sys.exit(main())
