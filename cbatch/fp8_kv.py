"""The fp8 KV cache's element format (--kv-cache-dtype fp8), shared by the model's backends and the kernels:
e4m3 with finite values only, the format Hopper's tensor cores read."""
from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = 448.0  # its largest finite value: stores saturate here (a plain cast of a larger value is NaN)
