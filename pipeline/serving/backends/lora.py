"""LoRA adapters served next to one base model, chosen per request, swapped between requests.

The trainer writes adapters with peft (``adapter_config.json`` + ``adapter_model.safetensors``).
Serving them through peft's own layers would be the natural choice, but peft selects the
adapter either globally (``set_adapter``) or through forward hooks that it registers on every
layer for the duration of a call; both are shared by all threads, and the hf backend runs
several generations at once, each of which must use the adapter of the version it started
with. So the target projections are wrapped once in :class:`LoraLinear`, which adds
``scale * B(A(x))`` for the adapter that the *calling thread* has selected: a request keeps
its adapter to the end, a new version is one dict of tensors away, and an adapter nobody
uses any more is freed by reference counting. The base weights are loaded once.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."

_local = threading.local()


def is_adapter_dir(path: Path) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()


@dataclass(frozen=True)
class Adapter:
    """One adapter version: ``module name -> (A [r, in], B [out, r])`` and its scale."""

    version: int
    scale: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    target_modules: frozenset[str]


def load_adapter(
    path: Path, version: int, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> Adapter:
    """Read a peft LoRA folder; refuse variants this server does not compute (DoRA, biases)."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg = json.loads((path / CONFIG_FILE).read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {cfg.get('peft_type')!r} is not LoRA")
    if cfg.get("use_dora") or cfg.get("bias", "none") != "none":
        raise ValueError(f"{path}: DoRA and LoRA biases are not supported by the hf backend")
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    tensors = load_file(str(path / WEIGHTS_FILE), device=str(device))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(_PEFT_PREFIX)
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in name:
                module = name.split(marker)[0]
                pairs.setdefault(module, {})[part] = tensor if dtype is None else tensor.to(dtype)
                break
        else:
            raise ValueError(f"{path}: unexpected tensor {key} (only lora_A/lora_B are served)")
    weights = {}
    for module, ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"{path}: {module} lacks lora_A or lora_B")
        weights[module] = (ab["lora_A"], ab["lora_B"])
    targets = frozenset(m.rsplit(".", 1)[-1] for m in weights)
    return Adapter(version=version, scale=scale, weights=weights, target_modules=targets)


class LoraLinear(nn.Module):
    """A base ``nn.Linear`` plus the calling thread's adapter, if it has one for this layer."""

    def __init__(self, base: nn.Linear, name: str) -> None:
        super().__init__()
        self.base = base
        self.name = name

    @property
    def weight(self) -> torch.Tensor:  # code that inspects the layer sees the base weights
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        adapter: Adapter | None = getattr(_local, "adapter", None)
        if adapter is None:
            return out
        ab = adapter.weights.get(self.name)
        if ab is None:
            return out
        a, b = ab
        return out + (x.to(a.dtype) @ a.T @ b.T).to(out.dtype) * adapter.scale


def wrap_targets(model: nn.Module, adapter: Adapter) -> int:
    """Wrap every layer the adapter touches (idempotent); returns how many were wrapped now."""
    wrapped = 0
    for name in adapter.weights:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = getattr(parent, child, None)
        if isinstance(layer, LoraLinear):
            continue
        if not isinstance(layer, nn.Linear):
            raise ValueError(f"adapter targets {name}, which is not a Linear layer of the model")
        a, b = adapter.weights[name]
        if a.shape[1] != layer.in_features or b.shape[0] != layer.out_features:
            raise ValueError(
                f"adapter shapes for {name} ({tuple(a.shape)}, {tuple(b.shape)}) do not fit "
                f"the layer ({layer.in_features} -> {layer.out_features})"
            )
        setattr(parent, child, LoraLinear(layer, name))
        wrapped += 1
    return wrapped


def check_fits(model: nn.Module, adapter: Adapter) -> None:
    """Every adapted module exists and has matching shapes (before anything is swapped)."""
    for name, (a, b) in adapter.weights.items():
        try:
            layer = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"adapter targets {name}, which the base model lacks") from None
        base = layer.base if isinstance(layer, LoraLinear) else layer
        if not isinstance(base, nn.Linear):
            raise ValueError(f"adapter targets {name}, which is not a Linear layer")
        if a.shape[1] != base.in_features or b.shape[0] != base.out_features:
            raise ValueError(f"adapter shapes for {name} do not fit the base model")


@contextmanager
def active(adapter: Adapter | None) -> Iterator[None]:
    """Select ``adapter`` for forward passes made by this thread."""
    previous = getattr(_local, "adapter", None)
    _local.adapter = adapter
    try:
        yield
    finally:
        _local.adapter = previous


def adapter_bytes(adapter: Adapter) -> int:
    return sum(
        a.numel() * a.element_size() + b.numel() * b.element_size()
        for a, b in adapter.weights.values()
    )


def describe(adapter: Any) -> str:
    return (
        f"LoRA v{adapter.version}: {len(adapter.weights)} layers, scale {adapter.scale:g}, "
        f"{adapter_bytes(adapter) / 1e6:.1f} MB"
    )
