"""Test-process settings shared by every test module."""

import torch

# In-process computations (value checks, simulations, single-process models) are tiny: one
# intra-op thread is as fast, and it does not fight the multi-process tests' workers for the
# machine's cores (two threads under load made a value check 40x slower).
torch.set_num_threads(1)
