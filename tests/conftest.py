"""Shared test settings."""

import torch

# The test models are tiny: intra-op threads only add overhead, and on a loaded machine OpenMP
# threads contending for the same cores make a 69x32 matmul take milliseconds, not microseconds.
torch.set_num_threads(1)
