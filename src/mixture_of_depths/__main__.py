"""`python -m mixture_of_depths`: the `mod` command (what `torchrun -m mixture_of_depths` runs)."""

from mixture_of_depths.cli import entry

entry()
