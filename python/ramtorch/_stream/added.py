"""Parameters added to an offloaded model after ``offload`` (peft's ``get_peft_model``,
``register_parameter``, a submodule set in place of another) are in no unit: in a streamed unit
they would stay in host RAM while the unit computes on the device (torch's "Expected all tensors to
be on the same device", or, on the CPU, parameters that ramtorch's gradient path never sees). They
are refused at the next forward, by name.

Finding them costs no walk of the model per pass: torch's global registration hooks
(``register_module_parameter_registration_hook``, ``register_module_module_registration_hook``),
installed while an offloaded model is watched, look the module that registers something up in a
weak map built at ``offload`` (module -> its streamer, unit and parameter names then) and mark it
touched on its streamer; the next forward checks the subtrees of the touched modules only. The map
holds no module alive, and the hooks go when the last watched model is detached (while models are
only collected, they stay, inert: a dictionary lookup per registration). Parameters set directly in
``module._parameters`` bypass torch's hooks and are not seen.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True)
class _Place:
    """Where a module of an offloaded model is: its streamer (weakly), the uid of the unit that
    holds it (``None``: outside the units) and the names of its parameters when it was placed."""

    streamer: weakref.ref[Any]
    uid: int | None
    names: frozenset[str]


# Module -> its place; entries go with their modules (values reference no module).
_PLACES: weakref.WeakKeyDictionary[nn.Module, _Place] = weakref.WeakKeyDictionary()
_HANDLES: list[Any] = []
_LOCK = threading.Lock()


def _on_register(module: nn.Module, name: str, value: Any) -> None:
    """torch's registration hook (a parameter or a submodule set on ``module``)."""
    place = _PLACES.get(module)
    if place is None:
        return
    streamer = place.streamer()
    if streamer is not None and streamer.model_ref() is not None:
        streamer.touched.add(module)


def _elsewhere(m: nn.Module, streamer: Any) -> bool:
    """Whether ``m`` streams itself (``ramtorch.nn`` layers) or is a unit of another model."""
    if getattr(m, "_ramtorch_streams_itself", False):
        return True
    unit = getattr(m, "_ramtorch_unit", None)
    return unit is not None and streamer.by_uid.get(unit.uid) is not unit


def _names(m: nn.Module) -> frozenset[str]:
    return frozenset(n for n, p in m._parameters.items() if p is not None)


def watch(model: nn.Module, streamer: Any) -> None:
    """Maps ``model``'s modules to ``streamer`` and its units, and installs the hooks if needed."""
    ref = weakref.ref(streamer)
    with _LOCK:
        for u in streamer.units:
            mods = [u.module] if u.container else u.module.modules()
            mods = [m for m in mods if m is u.module or not _elsewhere(m, streamer)]
            for m in mods:
                _PLACES[m] = _Place(ref, u.uid, _names(m))
        for m in model.modules():
            if m not in _PLACES or _PLACES[m].streamer is not ref:
                _PLACES[m] = _Place(ref, None, _names(m))
        if not _HANDLES:
            from torch.nn.modules import module as torch_module

            _HANDLES.append(torch_module.register_module_parameter_registration_hook(_on_register))
            _HANDLES.append(torch_module.register_module_module_registration_hook(_on_register))


def unwatch(streamer: Any) -> None:
    """Forgets ``streamer``'s modules; removes the hooks when no watched model is left."""
    with _LOCK:
        for m, place in list(_PLACES.items()):
            s = place.streamer()
            if s is None or s is streamer or s.model_ref() is None:  # its model is gone
                del _PLACES[m]
        if not _PLACES:
            for h in _HANDLES:
                h.remove()
            _HANDLES.clear()


def check(streamer: Any) -> None:
    """Refuses parameters registered since the last check under the modules ``streamer`` saw
    touched: in a streamed unit, any parameter under a name its module did not have at ``offload``
    (a replacement under an existing name is :meth:`_Unit.rebind`'s), or a module of another
    streamed unit moved into it; outside the streamed units, a new parameter not on the compute
    device. Modules added without such parameters are watched from now on."""
    touched = list(streamer.touched)
    if not touched:
        return
    ref = weakref.ref(streamer)
    found: list[tuple[nn.Module, str, Any]] = []  # (touched module, parameter path under it, unit)
    seen: set[tuple[int, int | None]] = set()
    placed: list[tuple[nn.Module, int | None]] = []

    def walk(root: nn.Module, m: nn.Module, path: str, inherited: int | None) -> None:
        if (id(m), inherited) in seen:
            return
        seen.add((id(m), inherited))
        place = _PLACES.get(m)
        ours = place is not None and place.streamer() is streamer
        uid = place.uid if ours and place is not None else inherited
        names = place.names if ours and place is not None else frozenset()
        if _elsewhere(m, streamer):
            return  # streams itself (ramtorch.nn layers), or a unit of another model
        unit = streamer.by_uid.get(uid) if uid is not None else None
        host = streamer.by_uid.get(inherited) if inherited is not None else None
        streamed = unit is not None and not unit.resident
        if uid != inherited and streamed and host is not None and not host.resident:
            # A module of another streamed unit, which swaps in its weights in its own forward only.
            found.extend((root, path + pname, host) for pname, _ in m.named_parameters())
            return
        placed.append((m, uid))
        for pname, p in m._parameters.items():
            if p is None or pname in names:
                continue
            if streamed or p.device != streamer.device:
                found.append((root, path + pname, unit))
        for cname, child in m._modules.items():
            if child is not None:
                walk(root, child, f"{path}{cname}.", uid)

    for m in touched:
        place = _PLACES.get(m)
        if place is not None and place.streamer() is streamer:
            walk(m, m, "", place.uid)
    if found:
        _refuse(streamer, found)
    with _LOCK:
        for m, uid in placed:
            _PLACES[m] = _Place(ref, uid, _names(m))
    for m in touched:
        streamer.touched.discard(m)


def _refuse(streamer: Any, found: list[tuple[nn.Module, str, Any]]) -> None:
    model = streamer.model_ref()
    paths: dict[int, str] = {}
    if model is not None:
        for n, m in model.named_modules(remove_duplicate=False):
            paths.setdefault(id(m), n)
    items = []
    for root, rel, unit in found:
        path = paths.get(id(root))
        name = f"{path}.{rel}" if path else rel
        where = f"unit {unit.name!r}" if unit is not None else "outside the streamed units"
        items.append(f"{name!r} ({where})")
    more = f" and {len(items) - 8} more" if len(items) > 8 else ""
    raise RuntimeError(
        f"ramtorch.offload: parameters {', '.join(items[:8])}{more} were added after ramtorch.offload. "
        "A unit streams the parameters it held when offload packed it (a parameter replaced under "
        "the same name is taken in); these would stay in host RAM, unstreamed. Add adapters "
        "(peft's get_peft_model), parameters and submodules before ramtorch.offload, or offload a "
        "fresh model built with them"
    )
