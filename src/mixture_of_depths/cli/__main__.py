"""`python -m mixture_of_depths.cli`: the `mod` command, as `python -m mixture_of_depths` is."""

from mixture_of_depths.cli import entry

entry()
