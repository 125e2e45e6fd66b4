from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
VARIANT_YAMLS = sorted((CONF / "variant").glob("*.yaml"))


def pytest_configure(config):
    """The CPU suite runs on the CPU, on a CUDA machine too: unless the run selects the GPU tests
    (``-m gpu``), CUDA is hidden from this process and from the harness processes its tests start, so
    ``device=auto`` means the CPU the tests were written for (rows on "cpu", the CPU timer, gloo ranks).
    Set here, before anything initialises CUDA (importing torch does not)."""
    if not re.search(r"(?<!not )\bgpu\b", config.getoption("markexpr") or ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES") == ""
    skip = pytest.mark.skip(reason="a GPU test: on a CUDA machine run python -m pytest -m gpu" if hidden
                            else "needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def qkv(B, H, N, D, dtype=torch.float64, seed=0, device="cpu"):
    """Fresh random inputs that require grad (never zeros: zeros hide wrong indexing)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return tuple(torch.randn(B, H, N, D, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
                 .requires_grad_() for _ in range(3))
