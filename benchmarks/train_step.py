"""Training-step speed, MoD against its dense twin at several capacities and lengths, with the
FLOP-predicted speed-up beside each measured one: the ``train`` section of ``mod bench``
(`mixture_of_depths.bench.suite`). Flags as ``mod bench``; the last line is JSON."""

import sys

from mixture_of_depths.bench.suite import main

if __name__ == "__main__":
    main(["--sections", "train", *sys.argv[1:]])
