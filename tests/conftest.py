"""Suite-wide settings: one intra-op thread per process (tiny tensors on a shared 2-core
machine only lose time to thread hand-offs), as every distributed worker also uses."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
