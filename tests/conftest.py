from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
VARIANT_YAMLS = sorted((CONF / "variant").glob("*.yaml"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def qkv(B, H, N, D, dtype=torch.float64, seed=0, device="cpu"):
    """Fresh random inputs that require grad (never zeros: zeros hide wrong indexing)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return tuple(torch.randn(B, H, N, D, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
                 .requires_grad_() for _ in range(3))
