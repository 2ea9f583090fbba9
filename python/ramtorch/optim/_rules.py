"""The update rules, AdamW, SGD and Lion: for each, its hyperparameters, its Rust kernel call
(``_rule`` and ``_hyper``, which ``_state.HostStates._run_kernel`` passes to ``_core.optim_step``
for host parameters) and its torch fallback (``_update_torch``, parameters elsewhere). The
hyperparameter checks and the options every optimizer takes are written once, here."""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from torch.optim.adamw import adamw as _torch_adamw
from torch.optim.sgd import sgd as _torch_sgd

from ._optimizer import _HostOptimizer

if TYPE_CHECKING:
    from typing_extensions import Unpack  # in typing from Python 3.11

#: Hyperparameters checked when a param group is added: name -> (lowest, lowest allowed, highest,
#: highest allowed). Each must be a finite real number in that interval.
_LIMITS: dict[str, tuple[float, bool, float, bool]] = {
    "lr": (0.0, True, math.inf, False),
    "eps": (0.0, False, math.inf, False),
    "weight_decay": (0.0, True, math.inf, False),
    "momentum": (0.0, True, math.inf, False),
    "dampening": (0.0, True, math.inf, False),
    "betas": (0.0, True, 1.0, False),  # each of the two
}


def _real(owner: str, name: str, value: Any) -> float:
    """``value`` as a float; a TypeError naming ``name`` if it is not a real number."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{owner}: {name} must be a real number, got {value!r}")
    return float(value)


def _check_hyperparameters(owner: str, group: dict[str, Any]) -> None:
    """Raises a ValueError (TypeError for a value that is no number) naming the first hyperparameter
    of ``group`` out of its range (see ``_LIMITS``): before any update could use it."""
    for name, (lo, lo_ok, hi, hi_ok) in _LIMITS.items():
        if name not in group:
            continue
        value = group[name]
        if name == "betas":
            if isinstance(value, torch.Tensor) or not isinstance(value, (tuple, list)):
                raise TypeError(f"{owner}: betas must be a pair of numbers, got {value!r}")
            if len(value) != 2:
                raise ValueError(f"{owner}: betas must be a pair (beta1, beta2), got {tuple(value)!r}")
            items = [(f"betas[{i}]", v) for i, v in enumerate(value)]
        else:
            items = [(name, value)]
        for label, v in items:
            x = _real(owner, label, v)
            if not (math.isfinite(x) and (x > lo or (lo_ok and x == lo)) and (x < hi or (hi_ok and x == hi))):
                interval = f"in {'[' if lo_ok else '('}{lo:g}, {hi:g}{']' if hi_ok else ')'}"
                if hi == math.inf:
                    interval = f"{'>=' if lo_ok else '>'} {lo:g}"
                raise ValueError(f"{owner}: invalid {label}: {v!r} (must be a finite number {interval})")


class HostOptions(TypedDict, total=False):
    """The options of every ramtorch optimizer, besides its rule's hyperparameters (see
    :class:`AdamW`)."""

    precision: str
    overlap: bool | str
    pipeline: bool
    max_grad_norm: float | None
    states: str
    gpu_updates: bool


#: Arguments of torch's optimizers that ramtorch's rules do not implement, with the value that
#: asks for nothing beyond what ramtorch does (given so, they are accepted and ignored), and what
#: another value would ask for.
_TORCH_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "amsgrad": ((False,), "AMSGrad (the running maximum of the second moments) is not implemented"),
    "fused": (
        (None, False),
        "it picks one of torch's kernels; ramtorch always runs its own (Rust kernels on all cores "
        "for host parameters, torch's fused kernels for parameters on a GPU): leave it out",
    ),
    "foreach": (
        (None, False),
        "it picks one of torch's kernels; ramtorch always runs its own: leave it out",
    ),
    "capturable": ((False,), "updates cannot be captured in a CUDA graph"),
    "differentiable": ((False,), "updates are not differentiable (autograd does not record them)"),
}


class _Rule(_HostOptimizer):
    """What every update rule shares: its hyperparameters checked against ``_LIMITS`` wherever
    a param group is added, and its options checked by name (``_torch_only``: the arguments of
    the torch optimizer of the same name that it does not implement)."""

    _torch_only: tuple[str, ...] = ()

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], **options: Any) -> None:
        owner = type(self).__name__
        accepted_by_base = inspect.signature(_HostOptimizer.__init__).parameters.values()
        known = {q.name for q in accepted_by_base if q.kind is inspect.Parameter.KEYWORD_ONLY}
        open_ended = any(q.kind is inspect.Parameter.VAR_KEYWORD for q in accepted_by_base)
        for name in list(options):
            if name in known or (open_ended and name not in self._torch_only):
                continue
            if name in self._torch_only:
                accepted, why = _TORCH_ONLY[name]
                value = options.pop(name)
                if not any(value is a or (type(value) is type(a) and value == a) for a in accepted):
                    raise ValueError(f"ramtorch.optim.{owner}: {name}={value!r} is not supported: {why}")
                continue
            raise TypeError(
                f"ramtorch.optim.{owner} got an unexpected keyword argument {name!r}; it takes "
                f"{', '.join(sorted(defaults))} and {', '.join(sorted(known))}"
            )
        super().__init__(params, defaults, **options)

    def _check_group(self, group: dict[str, Any]) -> None:
        _check_hyperparameters(type(self).__name__, group)


class AdamW(_Rule):
    """AdamW (decoupled weight decay, as :class:`torch.optim.AdamW`) with host parameters updated
    by Rust kernels, overlapped with backward (see the module documentation).

    Args:
        params: parameters or param groups.
        lr, betas, eps, weight_decay, maximize: as in ``torch.optim.AdamW``.
        precision: how host state is kept. ``"fp32-master"`` (default): an fp32 master copy
            of a bf16/fp16 parameter and fp32 moments (16 bytes a parameter besides the bf16
            weight; a step moves 28 host bytes a parameter). ``"bf16"``: bf16 moments, and the
            bf16 weight written with stochastic rounding (no master). ``"compact"``: both
            moments in 8 bits, block-quantized with one fp32 scale per block of 256 elements
            (each a small float relative to its block's largest magnitude: ``exp_avg`` a sign, 4
            exponent and 3 mantissa bits, ``exp_avg_sq`` 5 and 3), and the master kept as the
            bf16 weight plus
            a bf16 compensation (the rounding error of its last write; their sum has about 16
            significant bits). For a bf16 parameter that is 6 + 8/256 = 6.03 bytes a parameter
            held (weight 2, compensation 2, moments 1 + 1, scales 0.03), 8.03 with its bf16
            gradient; a step reads 8.03 and writes 6.03 host bytes a parameter (14.06 in all).
            A float32 parameter is its own master (4 + 2.03 bytes held). Needs bf16 or fp32
            parameters; parameters updated on a GPU keep ``"fp32-master"`` state. In the default
            (speculative) mode each parameter also has a shadow of the same format (another
            6.03 bytes).
        overlap: ``True`` (default): updates computed during backward, out of place, and
            committed by ``step()`` when their inputs are unchanged, or computed in ``step()``,
            whichever the run measures cheaper: bitwise ``overlap=False``, nothing changes
            before ``step()``. ``"backward"``: committed during backward as gradients land
            (faster when host memory bounds the step; the weights change before ``step()``).
            ``False``: every update in ``step()``.
        pipeline: commit during backward and let ``step()`` return while the last updates run
            on; the next forward waits for each unit's update before streaming it (see the
            module documentation).
        max_grad_norm: clip the global gradient norm to this (with ``overlap="backward"`` or
            ``pipeline``, the updates then run in ``step()``).
        states: where the states of parameters that live on a GPU (a model on the GPU, units
            that ``offload`` keeps resident) are kept. ``"device"`` (default): on the GPU, updated
            by torch's kernels (an fp32 master and moments: 12-16 bytes a parameter of device
            memory). ``"host"``: in host RAM, in the format of a host parameter (``precision``
            applies), updated by the Rust kernels. Each gradient is copied to the host as
            backward produces it, the update is computed on a CPU thread during the rest of
            backward (committed by ``step()``: nothing changes before it, as in the default
            mode) and ``step()`` copies the new weights back (``opt.upload_wait`` says what
            waits for them). With ``overlap="backward"`` or ``pipeline`` each update is instead
            made in place during backward and its weight copied back then (``step()`` waits for
            them all). The GPU then holds only the weights and their gradients. Not with ZeRO
            (``shard()``).
        gpu_updates: ``True``: the GPU makes a share of AdamW's updates beside the CPU's cores,
            with the same bits (a Triton port of the Rust kernel). Each update goes to whichever
            worker is free: host parameters' operands cross the link in pieces, and a weight on
            the GPU (``states="host"``) is updated where it is, only its states crossing. States
            and spare buffers are then page-locked, and the GPU keeps up to 470 MB of staging
            buffers outside ``gpu_budget``. Streamed units' updates committed during backward
            (``overlap="backward"``, ``pipeline``) stay the CPU's. ``False`` (default): the CPU
            makes every update.

    ``torch.optim.AdamW``'s ``amsgrad``, ``fused``, ``foreach``, ``capturable`` and
    ``differentiable`` are accepted at the values that ask for nothing more (``False``, or
    ``None``), so a loop written for torch runs as it is; other values are a ``ValueError``
    saying what is not supported (AMSGrad is not implemented; the kernels are always ramtorch's).
    """

    _state_names = ("exp_avg", "exp_avg_sq")
    _rule = "adamw"
    _torch_only = ("amsgrad", "fused", "foreach", "capturable", "differentiable")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        maximize: bool = False,
        **options: Unpack[HostOptions],
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "maximize": maximize}
        super().__init__(params, defaults, **options)

    def _hyper(self, group: dict[str, Any], step: int) -> dict[str, Any]:
        b1, b2 = group["betas"]
        return {
            "step": step,
            "lr": float(group["lr"]),
            "beta1": float(b1),
            "beta2": float(b2),
            "eps": float(group["eps"]),
            "weight_decay": float(group["weight_decay"]),
            "maximize": bool(group["maximize"]),
        }

    def _update_torch(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        states: list[dict[str, Any]],
        group: dict[str, Any],
    ) -> None:
        for p, st in zip(params, states):
            if "exp_avg" not in st:
                st["step"] = torch.tensor(0.0, device=p.device) if p.is_cuda else torch.tensor(0.0)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        b1, b2 = group["betas"]
        _torch_adamw(
            params,
            grads,
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            [s["step"] for s in states],
            foreach=None,
            fused=all(p.is_cuda for p in params) or None,
            amsgrad=False,
            beta1=b1,
            beta2=b2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
        )


class SGD(_Rule):
    """SGD with momentum (as :class:`torch.optim.SGD`), host parameters updated by Rust kernels,
    overlapped with backward. Arguments as ``torch.optim.SGD`` plus ``precision``, ``overlap``,
    ``pipeline``, ``max_grad_norm``, ``states`` (see :class:`AdamW`); its ``fused``, ``foreach`` and
    ``differentiable`` are accepted at ``False``/``None`` only, as in :class:`AdamW`."""

    _state_names = ("momentum_buffer",)
    _rule = "sgd"
    _torch_only = ("fused", "foreach", "differentiable")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        **options: Unpack[HostOptions],
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            "maximize": maximize,
        }
        super().__init__(params, defaults, **options)

    def _hyper(self, group: dict[str, Any], step: int) -> dict[str, Any]:
        return {
            "step": 0,  # the rounding stream: the seed already follows the step
            "lr": float(group["lr"]),
            "momentum": float(group["momentum"]),
            "dampening": float(group["dampening"]),
            "weight_decay": float(group["weight_decay"]),
            "nesterov": bool(group["nesterov"]),
            "maximize": bool(group["maximize"]),
            "first_step": step == 1,
        }

    def _active_states(self, group: dict[str, Any]) -> int:
        return 1 if group["momentum"] != 0 else 0

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        if group.get("nesterov") and (group.get("momentum", 0) <= 0 or group.get("dampening", 0) != 0):
            raise ValueError("SGD: nesterov needs momentum > 0 and dampening = 0")

    def _update_torch(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        states: list[dict[str, Any]],
        group: dict[str, Any],
    ) -> None:
        bufs = [st.get("momentum_buffer") for st in states]
        _torch_sgd(
            params,
            grads,
            bufs,
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            lr=group["lr"],
            dampening=group["dampening"],
            nesterov=group["nesterov"],
            maximize=group["maximize"],
        )
        for st, b in zip(states, bufs):
            if b is not None:
                st["momentum_buffer"] = b


class Lion(_Rule):
    """Lion (Chen et al., 2023): ``p -= lr * (sign(b1*m + (1-b1)*g) + wd*p)``, then
    ``m = b2*m + (1-b2)*g``. Host parameters through Rust kernels, overlapped with backward;
    ``precision``, ``overlap``, ``pipeline``, ``max_grad_norm``, ``states`` as in :class:`AdamW`."""

    _state_names = ("exp_avg",)
    _rule = "lion"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
        **options: Unpack[HostOptions],
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "weight_decay": weight_decay, "maximize": maximize}
        super().__init__(params, defaults, **options)

    def _hyper(self, group: dict[str, Any], step: int) -> dict[str, Any]:
        b1, b2 = group["betas"]
        return {
            "step": 0,  # the rounding stream: the seed already follows the step
            "lr": float(group["lr"]),
            "beta1": float(b1),
            "beta2": float(b2),
            "weight_decay": float(group["weight_decay"]),
            "maximize": bool(group["maximize"]),
        }

    def _update_torch(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        states: list[dict[str, Any]],
        group: dict[str, Any],
    ) -> None:
        b1, b2 = group["betas"]
        for p, g, st in zip(params, grads, states):
            if "exp_avg" not in st:
                st["exp_avg"] = torch.zeros_like(p)
            g = -g if group["maximize"] else g
            m = st["exp_avg"]
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(torch.sign(m * b1 + g * (1 - b1)), alpha=-group["lr"])
            m.mul_(b2).add_(g, alpha=1 - b2)
