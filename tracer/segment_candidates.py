"""Which modules are checkpointable segments: the rule that picks them from the model's structure alone, before
anything runs ([Note: activation segments] in hplan.artifacts.segments). hplan.tracer.segments watches what the
chosen modules do during the step; this module only decides which they are, so the rule reads (and is tested) on a
bare module tree.
"""

from __future__ import annotations

from typing import Any

from torch import nn

CONTAINERS = (nn.ModuleList, nn.Sequential)


def candidates(model: nn.Module) -> dict[str, nn.Module]:
    """Modules that own parameters and are one of >= 2 same-class children of a plain `nn.ModuleList` or
    `nn.Sequential` (subclasses, e.g. hplan's vocabulary shards, are containers with their own semantics):
    outermost, except that one whose own such groups hold most of its parameters is replaced by them, nested as
    deep as that holds (ConvNeXt's and Swin's stages by their blocks; see [Note: activation segments])."""
    found = same_class_groups(model)
    chosen = outermost(found)
    while True:
        finer = {}
        for p, m in chosen.items():
            inner = outermost({q: n for q, n in found.items() if q.startswith(p + ".")})
            if inner and 2 * param_elements(inner.values()) > param_elements([m]):
                finer.update(inner)
            else:
                finer[p] = m
        if finer.keys() == chosen.keys():
            break
        chosen = finer
    return first_paths(chosen)


def same_class_groups(model: nn.Module) -> dict[str, nn.Module]:
    """Every module that owns parameters and is one of >= 2 same-class children of a plain container (nested
    or not)."""
    found: dict[str, nn.Module] = {}
    for path, container in model.named_modules():
        if type(container) not in CONTAINERS:
            continue
        by_class: dict[type, list[tuple[str, nn.Module]]] = {}
        for name, child in container.named_children():
            by_class.setdefault(type(child), []).append((f"{path}.{name}" if path else name, child))
        for group in by_class.values():
            if len(group) >= 2:
                found.update((p, m) for p, m in group if any(True for _ in m.parameters()))
    return found


def first_paths(modules: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """A module registered twice is one module: its first path."""
    seen: set[int] = set()
    unique = {}
    for p, m in modules.items():
        if id(m) not in seen:
            seen.add(id(m))
            unique[p] = m
    return unique


def outermost(found: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """Those not inside another one (the rule before nested segments, with `same_class_groups`)."""
    return {p: m for p, m in found.items() if not any(p.startswith(q + ".") for q in found)}


def param_elements(modules: Any) -> int:
    """Parameter elements of `modules` (each parameter once)."""
    return sum(p.numel() for p in {id(p): p for m in modules for p in m.parameters()}.values())
