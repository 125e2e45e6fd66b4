"""``run(cfg)``: validate a composed config, then measure one variant at each sequence length.

Everything is validated before any file is written: the workload, the measurement options, the device,
the variant (built, so that its own checks run) and causal support. Bad input raises ``ConfigError`` or
``variants.VariantError``, both ValueErrors with a one-line message naming the problem and the allowed
values. After that, a failure at one point is a result (``oom``, ``skipped``, ``error``), never a crash.
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from omegaconf import DictConfig, OmegaConf

import variants
from variants import VariantError
from variants.blocksparse import MaskedAttention

from . import env as envmod
from .console import Display
from .config import DEFAULT_BUDGET_SHARE, ConfigError, Settings, one_line, settings_from_config
from .measure import measure_point, timer_name
from .results import (BACKWARD_FLOPS_FACTOR, FIELDS, Result, ResultWriter, fit_exponents, tflops,
                      write_json)

OutOfMemoryError = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


@dataclass(frozen=True)
class Sweep:
    rows: list[Result]
    fits: dict[str, Any]
    output_dir: Path


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but CUDA is not available on this machine; allowed here: auto, cpu")
    return torch.device(name)


def build_variant(variant_cfg: Mapping[str, Any]) -> variants.Attention:
    """Instantiates the variant's ``_target_`` with its options; the variant's own VariantError (unknown
    option, bad value) is re-raised as it is, not wrapped in Hydra's multi-line InstantiationException."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        attn = instantiate(dict(variant_cfg))
    except InstantiationException as e:
        cause = e.__cause__
        if isinstance(cause, VariantError):
            raise VariantError(str(cause)) from None
        raise ConfigError(one_line(f"cannot build variant {variant_cfg.get('_target_')!r}: {cause or e}")) from None
    if not isinstance(attn, variants.Attention):
        raise ConfigError(f"variant _target_ {variant_cfg.get('_target_')!r} is not an attention variant; "
                          f"allowed: {', '.join(f'variants.{c.__name__}' for c in variants.REGISTRY.values())}")
    return attn


def validate(cfg: DictConfig | Mapping[str, Any]) -> tuple[Settings, variants.Attention, torch.device]:
    """All the checks of bad input, before any file is written. Raises ConfigError or VariantError."""
    settings = settings_from_config(cfg)
    device = resolve_device(settings.device)
    attn = build_variant(settings.variant)
    if settings.causal and not attn.supports_causal:
        raise VariantError(attn.causal_error())
    available = attn.available_backends(device)
    if attn.backend not in available:
        raise ConfigError(f"{attn.name}: backend {attn.backend!r} needs CUDA; available on {device.type}: "
                          f"{', '.join(available)}")
    return settings, attn, device


# ----- the sweep -----------------------------------------------------------------------------------

def resolve_output_dir(explicit: str | Path | None, settings: Settings) -> Path:
    if explicit is not None:
        return Path(explicit)
    if settings.output_dir is not None:
        return Path(settings.output_dir)
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    raise ConfigError("no output directory: outside Hydra pass run(cfg, output_dir=...) or set output_dir=PATH")


def memory_budget_bytes(settings: Settings, device: torch.device) -> int | None:
    """CPU: the kernel's OOM killer cannot be caught, so points whose analytic memory exceeds this are
    skipped. GPU: OOM is caught, so only an explicit budget applies."""
    if settings.memory_budget_gb is not None:
        return int(settings.memory_budget_gb * 1e9)
    if device.type == "cpu":
        available = envmod.mem_available_bytes()
        return None if available is None else int(DEFAULT_BUDGET_SHARE * available)
    return None


def run(cfg: DictConfig | Mapping[str, Any], output_dir: str | Path | None = None,
        display: Display | None = None) -> Sweep:
    """Measures the configured variant at every sequence length; writes results.jsonl, results.csv,
    env.json and (with two or more lengths) fit.json into ``output_dir`` (default: ``cfg.output_dir``,
    else Hydra's output directory)."""
    settings, attn, device = validate(cfg)
    out_dir = resolve_output_dir(output_dir, settings)
    environment = envmod.collect(device)
    attn.to(device)
    attn.requires_grad_(settings.measure.param_grads)
    budget = memory_budget_bytes(settings, device)
    options = tuple(dataclasses.asdict(attn.options).items())
    shown = ", ".join(f"{k}={v}" for k, v in options if k != "backend")
    title = (f"{attn.name} ({shown + '; ' if shown else ''}backend {attn.backend}) on {device.type} "
             f"({environment.device_name}), {settings.dtype}, "
             f"B={settings.batch_size} H={settings.num_heads} D={settings.head_dim}"
             f"{' causal' if settings.causal else ''} -> {out_dir}")
    display = display or Display(title, len(settings.seq_lens))
    with ResultWriter(out_dir) as writer, display:
        write_json(out_dir / "env.json", {**environment.as_dict(), "date": envmod.now(),
                                          "config": OmegaConf.to_container(cfg, resolve=True)
                                          if isinstance(cfg, DictConfig) else dict(cfg)})
        for seq_len in settings.seq_lens:
            row = run_point(attn, settings, seq_len, device, environment, budget, options,
                            on_phase=lambda phase, n=seq_len: display.phase(n, phase))
            writer.add(row)
            display.add(row)
        fits = fit_exponents(writer.rows)
        if fits:
            write_json(out_dir / "fit.json", {"variant": attn.name, "backend": attn.backend,
                                              "options": dict(options), "fits": fits})
            display.fits(fits, sorted({n for f in fits.values() for n in f["seq_lens"]}))
    return Sweep(writer.rows, fits, out_dir)


def run_point(attn: variants.Attention, s: Settings, seq_len: int, device: torch.device,
              environment: envmod.Environment, budget: int | None, options: tuple,
              on_phase=lambda phase: None) -> Result:
    B, H, N, D = s.batch_size, s.num_heads, seq_len, s.head_dim
    element_size = torch.empty((), dtype=s.torch_dtype).element_size()
    rec: dict[str, Any] = dict.fromkeys(FIELDS)
    rec.update(variant=attn.name, backend=attn.backend, seq_len=N, batch_size=B, num_heads=H, head_dim=D,
               dtype=s.dtype, device=device.type, causal=s.causal, seed=s.seed, status="ok",
               timer=timer_name(device, s.measure),
               **{k: v for k, v in environment.as_dict().items() if k in FIELDS})
    oom = False
    load = envmod.OtherLoad()
    try:
        flops = attn.flops(B, H, N, D, s.causal)
        rec.update(flops_fwd=flops.executed, flops_fwd_useful=flops.useful, density=attn.density(N, s.causal),
                   block_density=attn.block_density(N, s.causal) if isinstance(attn, MaskedAttention) else None,
                   analytic_mem_bytes=attn.memory_bytes(B, H, N, D, element_size))
        # q, k, v and the output gradient are allocated too; the analytic figure counts only the extra.
        needed = rec["analytic_mem_bytes"] + 4 * B * H * N * D * element_size
        if budget is not None and needed > budget:
            rec.update(status="skipped",
                       reason=f"analytic memory {needed / 1e9:.3g} GB (inputs included) exceeds the memory "
                              f"budget {budget / 1e9:.3g} GB (memory_budget_gb)")
        else:
            load.start()
            measure_point(attn, batch_size=B, num_heads=H, seq_len=N, head_dim=D, dtype=s.torch_dtype,
                          device=device, causal=s.causal, seed=s.seed, opts=s.measure, record=rec,
                          on_phase=on_phase)
    except OutOfMemoryError as e:
        oom = True
        rec.update(status="oom", reason=one_line(e)[:500])
    except Exception as e:  # recorded; the next point still runs
        message = str(e) if isinstance(e, VariantError) else f"{type(e).__name__}: {e}"
        rec.update(status="error", reason=one_line(message)[:500])
    if oom or device.type == "cuda":
        gc.collect()  # the exception's frames held the point's tensors until here
        if device.type == "cuda":
            torch.cuda.empty_cache()
    f, fu = rec["flops_fwd"], rec["flops_fwd_useful"]
    if f is not None:
        k = BACKWARD_FLOPS_FACTOR
        rec.update(tflops_fwd=tflops(f, rec["fwd_ms"]), tflops_fwd_useful=tflops(fu, rec["fwd_ms"]),
                   tflops_bwd=tflops(int(k * f), rec["bwd_ms"]), tflops_bwd_useful=tflops(int(k * fu), rec["bwd_ms"]),
                   tflops_fwd_bwd=tflops(int((1 + k) * f), rec["fwd_bwd_ms"]),
                   tflops_fwd_bwd_useful=tflops(int((1 + k) * fu), rec["fwd_bwd_ms"]))
    rec["other_cpu_cores"] = load.stop()
    rec["date"] = envmod.now()
    return Result(**rec, options=options)
