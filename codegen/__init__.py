"""Generated kernels: Triton packed (varlen) causal attention, its torch.library custom op and a pure-torch
reference. May import torch and triton only."""
