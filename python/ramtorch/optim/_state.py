"""Host state and precision: the states of host parameters (moments, momentum buffers, the fp32
master copy of a bf16/fp16 parameter, or with ``precision="compact"`` 8-bit block-quantized states
and the bf16 compensation of a bf16 parameter) in host RAM, their format for each precision, one
update of a host parameter through the one kernel entry (``_core.optim_step``), and the loading of
states (each checked against its parameter first)."""

from __future__ import annotations

from typing import Any

import torch

from .. import _arena, _core, _disk, _engine

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def grad_arg(parts: list[torch.Tensor], p: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
    """The kernel's gradient for gradient ``parts`` of ``p`` (host tensors whose sum is its
    gradient): the one tensor; two that the kernel adds in its own pass (as torch's ``add``
    does: the same bits) where it can read them as they are; else their sum, by torch."""
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 2:
        a, b = parts
        if (
            a.dtype is b.dtype
            and a.dtype in _DTYPES
            and a.device.type == "cpu"
            and b.device.type == "cpu"
            and a.is_contiguous()
            and b.is_contiguous()
            and a.numel() == b.numel() == p.numel()
        ):
            return [a, b]
    return sum_parts(parts)


def sum_parts(parts: list[torch.Tensor]) -> torch.Tensor:
    """The gradient whose ``parts`` these are, as one tensor (summed by torch into one new
    tensor; a single part is returned as it is)."""
    if len(parts) == 1:
        return parts[0]
    total = parts[0] + parts[1]
    for g in parts[2:]:
        total += g
    return total


_PRECISIONS = ("fp32-master", "bf16", "compact")

#: Elements per quantization block of a ``precision="compact"`` state (one float32 scale each);
#: ``ramtorch_core::optim::quant::BLOCK``.
BLOCK = 256
#: The state of ``precision="compact"`` that holds a bf16 parameter's rounding error.
COMPENSATION = "compensation"


def scales_name(name: str) -> str:
    """The key of the per-block scales of quantized state ``name``."""
    return f"{name}_block_scales"


def legacy_scales_name(name: str) -> str:
    """The key of the per-block scales of quantized state ``name`` in the first compact format,
    whose codes index a dynamic map (``_core.q8_legacy_map``)."""
    return f"{name}_scales"


def upgrade_legacy_states(saved: Any, names: tuple[str, ...]) -> Any:
    """One parameter's saved states (``state_dict()["state"][i]``) with those of the first compact
    format (codes of a dynamic map, scales under :func:`legacy_scales_name`) recoded in the current
    one, rounded to nearest (``names``: the rule's states; the first is signed, a second one
    unsigned, as the kernels store them). Anything else is returned as it is: a dict with no such
    state, tensors on the ``meta`` device (their keys are renamed only: a loader checking shapes
    before it reads), or tensors that do not fit together (the state check then names the
    problem)."""
    if not isinstance(saved, dict) or not any(
        legacy_scales_name(n) in saved and scales_name(n) not in saved for n in names
    ):
        return saved
    out = dict(saved)
    for k, n in enumerate(names):
        if legacy_scales_name(n) not in out or scales_name(n) in out:
            continue
        scales = out.pop(legacy_scales_name(n))
        out[scales_name(n)] = scales
        codes = out.get(n)
        if not (
            isinstance(codes, torch.Tensor)
            and isinstance(scales, torch.Tensor)
            and codes.dtype == torch.uint8
            and scales.dtype == torch.float32
            and scales.dim() == 1
            and scales.numel() == -(-codes.numel() // BLOCK)
        ) or "meta" in (codes.device.type, scales.device.type):
            continue
        signed = k == 0
        table = torch.tensor(_core.q8_legacy_map(signed), dtype=torch.float32)
        flat = codes.detach().reshape(-1).to("cpu", torch.long)
        per = scales.detach().to("cpu").repeat_interleave(BLOCK)[: flat.numel()]
        x = (table[flat] * per).contiguous()
        new_codes = torch.empty(flat.numel(), dtype=torch.uint8)
        new_scales = torch.empty(scales.numel(), dtype=torch.float32)
        _core.q8_quantize(x, new_codes, new_scales, signed)
        out[n] = new_codes.view(codes.shape)
        out[scales_name(n)] = new_scales
    return out


def state_specs(
    shape: tuple[int, ...], dtype: torch.dtype, precision: str, names: tuple[str, ...]
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of each state (the master included) that a parameter of ``shape`` and
    ``dtype`` keeps in host RAM under ``precision``, for a rule whose states are ``names``: the
    layout of :meth:`HostStates._host_specs`, and what :mod:`ramtorch.plan` counts."""
    if precision == "compact":
        if dtype == torch.float16:
            raise ValueError("precision='compact' needs bfloat16 (or float32) parameters, got float16")
        n = 1
        for d in shape:
            n *= d
        specs = {name: (shape, torch.uint8) for name in names}
        specs.update({scales_name(name): ((-(-n // BLOCK),), torch.float32) for name in names})
        if dtype == torch.bfloat16:
            specs[COMPENSATION] = (shape, torch.bfloat16)
        return specs
    if precision == "bf16" and dtype == torch.float16:
        raise ValueError("precision='bf16' needs bfloat16 parameters, got float16")
    bf16_mode = precision == "bf16" and dtype == torch.bfloat16
    specs = {name: (shape, torch.bfloat16 if bf16_mode else torch.float32) for name in names}
    if dtype != torch.float32 and not bf16_mode:
        specs["master"] = (shape, torch.float32)
    return specs


def _same(a: torch.Tensor, b: Any) -> bool:
    """Whether ``b`` is a tensor over exactly ``a``'s memory (a state loaded onto itself: a kept
    store resumed)."""
    return (
        isinstance(b, torch.Tensor)
        and b.device == a.device
        and b.data_ptr() == a.data_ptr()
        and b.dtype == a.dtype
        and b.shape == a.shape
        and b.stride() == a.stride()
    )


def _is_host(p: torch.Tensor) -> bool:
    return p.device.type == "cpu" and p.dtype in _DTYPES


class HostStates(torch.optim.Optimizer):
    """The per-parameter state of an optimizer whose host parameters are updated by Rust kernels:
    created on a parameter's first update, loaded (checked) from a state dict. A base of the
    optimizer (``_optimizer._HostOptimizer``), which supplies the rule (``_rule``, ``_hyper``), the
    scheduling (``_forget_failed``, ``synchronize``) and ZeRO (``_zero``: None, or the
    ``_zero.Zero`` strategy)."""

    #: Names of the states a rule keeps per parameter, besides ``step`` (and ``master``).
    _state_names: tuple[str, ...] = ()
    precision: str
    _seed: int
    _zero: Any

    #: The rule's name for ``_core.optim_step`` (``"adamw"``, ``"sgd"``, ``"lion"``).
    _rule: str = ""

    #: Where the states of parameters that are not in host RAM live: ``"device"`` (on their
    #: device, updated by torch's kernels) or ``"host"`` (in host RAM, updated by the kernels of
    #: host parameters; ``_resident``).
    states: str = "device"

    def _kept_on_host(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s states live in host RAM in the format of a host parameter (and its
        updates run through the Rust kernels): host parameters, and with ``states="host"`` every
        parameter of a dtype the kernels take, wherever it lives."""
        return _is_host(p) or (self.states == "host" and p.dtype in _DTYPES)

    def _hyper(self, group: dict[str, Any], step: int) -> dict[str, Any]:
        """The rule's hyperparameters for step ``step`` of ``group``, as ``_core.optim_step``
        takes them (besides ``grad_scale`` and ``seed``)."""
        raise NotImplementedError

    def _active_states(self, group: dict[str, Any]) -> int:
        """How many of ``_state_names`` the rule reads with ``group``'s hyperparameters."""
        return len(self._state_names)

    def _state_layout(self, p: torch.Tensor) -> tuple[torch.dtype, bool]:
        """The dtype of a host parameter's states for this precision, and whether it has an fp32
        master copy."""
        if self.precision == "bf16" and p.dtype == torch.float16:
            raise ValueError("precision='bf16' needs bfloat16 parameters, got float16")
        bf16_mode = self.precision == "bf16" and p.dtype == torch.bfloat16
        return (torch.bfloat16 if bf16_mode else torch.float32), p.dtype != torch.float32 and not bf16_mode

    def _compact(self, p: torch.Tensor) -> bool:
        """Whether host parameter ``p`` keeps ``precision="compact"`` states."""
        if self.precision != "compact":
            return False
        if p.dtype == torch.float16:
            raise ValueError("precision='compact' needs bfloat16 (or float32) parameters, got float16")
        return True

    def _host_keys(self) -> tuple[str, ...]:
        """Every state tensor a host parameter may keep, besides ``step`` and ``master``."""
        if self.precision != "compact":
            return self._state_names
        return (*self._state_names, *map(scales_name, self._state_names), COMPENSATION)

    def _host_specs(self, p: torch.Tensor) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of each state of host parameter ``p`` (the master included)."""
        return state_specs(tuple(p.shape), p.dtype, self.precision, self._state_names)

    #: Whether new states are page-locked (the GPU copies them: ``gpu_updates``); else memory
    #: only the CPU touches.
    _pin_states = False

    #: The states of parameters that live on disk with ``optimizer_on_disk=True`` (made by
    #: :meth:`_disk_states_for` when first needed).
    _disk_states: _disk.DiskStates | None = None

    def _disk_states_for(self, p: torch.Tensor) -> _disk.DiskStates | None:
        """The :class:`ramtorch._disk.DiskStates` that holds ``p``'s states, if they live on disk:
        made, for every such parameter of the optimizer at once, when the first of them needs
        its states (a first update or a load)."""
        ds = self._disk_states
        if ds is None:
            if _disk.states_home(p) is None:
                return None
            params = [
                (q, self._host_specs(q))
                for g in self.param_groups
                for q in g["params"]
                if _is_host(q) and _disk.states_home(q) is not None
            ]
            if not params:
                return None
            ds = self._disk_states = _disk.DiskStates(params)
            ds.in_backward = self._updates_in_backward()
        return ds if p in ds else None

    def _updates_in_backward(self) -> bool:
        """Whether host parameters are updated in place during the backward (the scheduler's)."""
        return False

    def _host_state(self, p: torch.nn.Parameter) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            try:
                ds = self._disk_states_for(p)
            except ValueError:
                del self.state[p]
                raise
            if ds is None:
                home = _disk.store_of(p)
                if home is not None and home.kept is not None:
                    del self.state[p]
                    raise ValueError(
                        f"{type(self).__name__}: a parameter of the kept store in {home.directory!r} "
                        "is trained with its optimizer states in host RAM, where a crash would lose "
                        "them; offload with keep=True trains with optimizer_on_disk=True"
                    )
            if ds is not None:
                state.update(ds.make(p))
            for name, (shape, dtype) in self._host_specs(p).items():
                # Zero codes with a zero scale decode to zero; a zero compensation: the weight is
                # the master.
                if ds is None:
                    state[name] = _arena.host_empty(
                        shape, dtype, zeroed=name != "master", pin=self._pin_states
                    )
                if name == "master":
                    state[name].copy_(p.detach())
        return state

    def _update_host(
        self,
        p: torch.nn.Parameter,
        grad: torch.Tensor | list[torch.Tensor],
        group: dict[str, Any],
        scale: float,
        weight: torch.Tensor | None = None,
    ) -> None:
        """Updates host parameter ``p`` with ``grad`` (times ``scale``) through the rule's kernel:
        its states are made on its first update; the seed of its stochastic rounding follows
        the step and its position. ``weight``: the host tensor the kernel reads and writes as
        the weight, when it is not ``p`` itself (the host copy of a parameter on a GPU)."""
        if self._zero is not None:
            self._zero.consolidated = None  # the state changes
        state = self._host_state(p)
        state["step"] += 1
        ds = self._disk_states if weight is None else None
        if isinstance(grad, list) and ds is not None and p in ds:
            grad = sum_parts(grad)
        if ds is not None and p in ds:
            # States on disk: updated piece by piece in staging buffers, read ahead and written
            # back (_disk).
            step = int(state["step"].item())
            if grad.dtype not in _DTYPES or not grad.is_contiguous() or grad.device.type != "cpu":
                grad = grad.detach().to(device="cpu", dtype=p.dtype).contiguous()
            for k in range(ds.npieces(p)):
                staged, span = ds.before(p, k)
                try:
                    self._run_kernel(p, grad, group, step, scale, states=staged, span=span)
                except BaseException:
                    ds.abandon(p, k)
                    raise
                ds.after(p, k)
        else:
            self._run_kernel(p, grad, group, int(state["step"].item()), scale, weight=weight)

    def _update_host_into(
        self,
        p: torch.nn.Parameter,
        grad: torch.Tensor | list[torch.Tensor],
        group: dict[str, Any],
        step: int,
        shadow: dict[str, torch.Tensor],
        weight: torch.Tensor | None = None,
    ) -> None:
        """The update of host parameter ``p`` for step ``step`` with ``grad`` and ``group``'s
        hyperparameters, out of place: the new weight, states and master go to ``shadow``
        (``_speculation``); ``p`` (or ``weight``, its host copy) and its states are read, never
        written. The same bits as :meth:`_update_host` would write in place."""
        self._run_kernel(p, grad, group, step, 1.0, shadow, weight=weight)

    def _run_kernel(
        self,
        p: torch.nn.Parameter,
        grad: torch.Tensor | list[torch.Tensor],
        group: dict[str, Any],
        step: int,
        scale: float,
        into: dict[str, torch.Tensor] | None = None,
        weight: torch.Tensor | None = None,
        states: dict[str, torch.Tensor] | None = None,
        span: tuple[int, int] | None = None,
    ) -> None:
        """Step ``step`` of the rule on ``p`` (whose states exist), in place, or out of place into
        ``into`` (the weight as ``"param"``, the states, ``"master"``). ``weight``: the host
        tensor that stands for ``p``'s weight (default ``p``); ``states``: tensors that stand for
        its states (in place), by name (default its own). ``span``: only elements ``[a, b)`` of
        the flattened parameter, whose states ``states`` holds (a piece: the same bits as those
        elements get from the whole update)."""
        args, kwargs = self._kernel_args(p, grad, group, step, scale, into, weight, states, span)
        _core.optim_step(*args, **kwargs)

    def _kernel_args(
        self,
        p: torch.nn.Parameter,
        grad: torch.Tensor | list[torch.Tensor],
        group: dict[str, Any],
        step: int,
        scale: float,
        into: dict[str, torch.Tensor] | None = None,
        weight: torch.Tensor | None = None,
        states: dict[str, torch.Tensor] | None = None,
        span: tuple[int, int] | None = None,
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments of ``_core.optim_step`` for :meth:`_run_kernel`'s update (the GPU
        kernel takes the same: ``_gpu_step``). ``grad`` may be a list of tensors whose sum is the
        gradient, which the kernel adds in its pass (:func:`grad_arg` says which the CPU's
        takes)."""
        w = p if weight is None else weight
        if not w.is_contiguous():
            raise ValueError(f"{type(self).__name__}: host parameters must be contiguous")
        grad = [_engine.plain(g) for g in grad] if isinstance(grad, list) else _engine.plain(grad)
        if isinstance(grad, list):
            if span is not None:
                raise ValueError("a gradient in parts is for whole parameters")
        elif grad.dtype not in _DTYPES or not grad.is_contiguous() or grad.device.type != "cpu":
            grad = grad.detach().to(device="cpu", dtype=p.dtype).contiguous()
        if span is not None and span != (0, p.numel()):
            a, b = span
            w = w.detach().view(-1)[a:b]
            grad = grad.view(-1)[a:b]
        state = self.state[p] if states is None else {**self.state[p], **states}
        names = self._state_names[: self._active_states(group)]
        states = [state[n] for n in names]
        master = state.get("master")
        comp = state.get(COMPENSATION)
        quantized = bool(names) and state[names[0]].dtype == torch.uint8
        scales = [state[scales_name(n)] for n in names] if quantized else None
        old: dict[str, Any] | None = None
        dst, dst_master, dst_comp, dst_states, dst_scales = w, master, comp, states, scales
        if into is not None:
            # The old values are read where they live; the new ones go to ``into``.
            old = {"master": master} if master is not None else {"param": w.detach()}
            if comp is not None:
                old["comp"] = comp
            old["states"] = states
            if scales is not None:
                old["scales"] = scales
            dst, dst_master, dst_comp = into["param"], into.get("master"), into.get(COMPENSATION)
            dst_states = [into[n] for n in names]
            dst_scales = [into[scales_name(n)] for n in names] if quantized else None
        hyper = self._hyper(group, step)
        hyper["grad_scale"] = scale
        hyper["seed"] = hash((self._seed, step, self._index_of(p))) & ((1 << 63) - 1)
        if span is not None and span[0]:
            hyper["index_offset"] = span[0]
        kwargs = {"master": dst_master, "comp": dst_comp, "scales": dst_scales, "old": old}
        return (self._rule, hyper, dst, grad, dst_states), kwargs

    def _index_of(self, p: torch.nn.Parameter) -> int:
        """Position of ``p`` among the optimizer's parameters (seeds its stochastic rounding)."""
        index = self.__dict__.get("_index_cache")
        if index is None:
            index = {id(q): k for k, q in enumerate(q for g in self.param_groups for q in g["params"])}
            self.__dict__["_index_cache"] = index
        return index.get(id(p), 0)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``, but states of host parameters keep their
        own dtype (fp32 master and moments of a bf16 parameter stay fp32) and live in host RAM, in
        tensors of their own (``state_dict``'s tensors are copied, not shared). A failed update of
        this optimizer is forgotten: the loaded state replaces what it left."""
        self._load_states(state_dict, adopt=False)

    def _load_state_dict_adopting(self, state_dict: dict[str, Any]) -> None:
        """As :meth:`load_state_dict`, but host states become ``state_dict``'s own tensors, with
        no copy: for a loader that has just read them into fresh host memory for this optimizer."""
        self._load_states(state_dict, adopt=True)

    def _kept_state_indices(self) -> set[int] | None:
        """Indices of the parameters whose state a load keeps: a sharded optimizer keeps its own
        share only (None: all)."""
        return None if self._zero is None else self._zero.kept_indices(self.param_groups)

    def _drop_host_states(self) -> None:
        """Frees the states of host parameters (before a load reads new ones: one copy at a time)."""
        self.synchronize()
        for p in [p for p in self.state if self._kept_on_host(p)]:
            del self.state[p]

    def _paired_params(self, state_dict: Any) -> list[tuple[Any, int, torch.nn.Parameter]] | None:
        """(saved id, position, parameter) for each parameter, as ``load_state_dict`` pairs them;
        None if the param groups do not match (torch's ``load_state_dict`` raises on them)."""
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not isinstance(groups, list) or len(groups) != len(self.param_groups):
            return None
        pairs = []
        for ours, saved in zip(self.param_groups, groups):
            ids = saved.get("params") if isinstance(saved, dict) else None
            if not isinstance(ids, list) or len(ids) != len(ours["params"]):
                return None
            pairs += [(i, len(pairs) + k, p) for k, (i, p) in enumerate(zip(ids, ours["params"]))]
        return pairs

    def _check_state_dict(self, state_dict: Any) -> None:
        """Raises a ValueError naming the parameter if a state of ``state_dict`` does not fit the
        parameter it would be loaded for: shape, dtype of this precision, a state missing (a state
        dict of another model, or of an optimizer that lists the parameters in another order).
        Tensors may be on any device, ``meta`` included (a loader checks before reading)."""
        state_dict = self._upgraded(state_dict)
        pairs = self._paired_params(state_dict)
        if pairs is None:
            return
        states = state_dict.get("state", {})
        if not isinstance(states, dict):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: 'state' must be a dict, got {type(states).__name__}"
            )
        kept = self._kept_state_indices()
        for i, pos, p in pairs:
            saved = states.get(i) if isinstance(i, (int, str)) else None
            if saved is None or (kept is not None and pos not in kept):
                continue
            problem = self._state_problem(p, saved)
            if problem is not None:
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict: the state of parameter {pos} (shape "
                    f"{tuple(p.shape)}, {p.dtype}) does not fit it: {problem}. (A state dict of "
                    "another model or precision, or of an optimizer that lists its parameters in "
                    "another order?)"
                )

    def _state_problem(self, p: torch.Tensor, saved: Any) -> str | None:
        """What is wrong with ``saved`` as the state of ``p`` (None: nothing)."""
        if not isinstance(saved, dict):
            return f"it is a {type(saved).__name__}, not a dict of states"
        shape = tuple(p.shape)
        if not self._kept_on_host(p):  # updated by torch: every state but the step has its shape
            for k, v in saved.items():
                if k != "step" and isinstance(v, torch.Tensor) and tuple(v.shape) != shape:
                    return f"{k!r} has shape {tuple(v.shape)}, expected {shape}"
            return None
        try:
            want = self._host_specs(p)
        except ValueError as e:
            return str(e)
        for k in ("master", COMPENSATION, *map(scales_name, self._state_names)):
            if k in saved and k not in want:
                what = "a 'master' copy" if k == "master" else repr(k)
                return (
                    f"it has {what}, which a {p.dtype} parameter has not with "
                    f"precision={self.precision!r} (saved with another precision?)"
                )
        step = saved.get("step")
        if not isinstance(step, torch.Tensor) or step.numel() != 1 or step.is_complex():
            return f"'step' must be a one-element tensor, got {step!r}"
        for k, (kshape, dtype) in want.items():
            v = saved.get(k)
            if k not in saved:
                return f"it has no {k!r} (saved with another precision than {self.precision!r}?)"
            if not isinstance(v, torch.Tensor):
                return f"{k!r} is a {type(v).__name__}, not a tensor"
            if tuple(v.shape) != kshape:
                return f"{k!r} has shape {tuple(v.shape)}, expected {kshape}"
            if v.dtype != dtype:
                return f"{k!r} has dtype {v.dtype}, expected {dtype} (precision={self.precision!r})"
        return None

    def _current_state_key(self, key: str) -> str:
        """The key under which this optimizer keeps what was saved as ``key``: the current name
        of the first compact format's per-block scales (:func:`legacy_scales_name`), else
        ``key`` (``ramtorch.resume`` finds a kept store's states by it)."""
        for n in self._state_names:
            if key == legacy_scales_name(n):
                return scales_name(n)
        return key

    def _upgraded(self, state_dict: Any) -> Any:
        """``state_dict`` with the states of the first compact format recoded in the current one
        (:func:`upgrade_legacy_states`); the same object when it has none."""
        states = state_dict.get("state") if isinstance(state_dict, dict) else None
        if not isinstance(states, dict):
            return state_dict
        new = {i: upgrade_legacy_states(v, self._state_names) for i, v in states.items()}
        if all(new[i] is states[i] for i in states):
            return state_dict
        return {**state_dict, "state": new}

    def _load_states(self, state_dict: dict[str, Any], adopt: bool) -> None:
        state_dict = self._upgraded(state_dict)
        self._check_state_dict(state_dict)  # before anything changes
        self._forget_failed()
        pairs = self._paired_params(state_dict)
        original = state_dict.get("state", {})
        host: dict[Any, torch.nn.Parameter] = {}
        device: dict[Any, torch.nn.Parameter] = {}
        if pairs is not None:  # else torch's load_state_dict raises on the groups
            host = {i: p for i, _, p in pairs if self._kept_on_host(p)}
            device = {i: p for i, _, p in pairs if not self._kept_on_host(p) and p.dtype in _DTYPES}
        # torch's own loading for the rest: it would cast host states to the parameter's dtype.
        rest = dict(state_dict)
        rest["state"] = {i: v for i, v in original.items() if i not in host}
        super().load_state_dict(rest)
        self.__dict__.pop("_ids_cache", None)
        with torch.no_grad():
            # Parameters updated on their device keep their states' dtype too (an fp32 master
            # and fp32 moments for a bf16 parameter): torch's loading cast them to the parameter's.
            for i, p in device.items():
                saved = original.get(i)
                if isinstance(saved, dict) and p in self.state:
                    st = self.state[p]
                    for k, v in saved.items():
                        if k != "step" and isinstance(v, torch.Tensor) and v.is_floating_point():
                            st[k] = v.to(device=p.device, dtype=v.dtype, copy=True)
            for i, p in host.items():
                saved = original.get(i)
                if saved is None:
                    continue
                st = self.state[p]
                ds = self._disk_states_for(p)
                if ds is not None:  # states on disk: copied into the parameter's extent
                    views = ds.make(p, zero=False)
                    same = [k for k in views if _same(views[k], saved.get(k))]
                    if len(same) < len(views):
                        ds.protect(p)  # (a kept store: journaled first)
                    for k, v in saved.items():
                        st[k] = views[k] if k in same else views[k].copy_(v) if k in views else v.clone()
                    ds.settle(p)
                    continue
                for k, v in saved.items():
                    if isinstance(v, torch.Tensor) and (
                        not adopt or v.device.type != "cpu" or not v.is_contiguous()
                    ):  # the kernels take contiguous host buffers
                        if k != "step" and (v.is_floating_point() or v.dtype == torch.uint8):
                            t = _arena.host_empty(tuple(v.shape), v.dtype, pin=False)
                            t.copy_(v)
                            v = t
                        else:
                            v = v.clone()
                    st[k] = v
        if self._zero is not None:  # ZeRO: a whole optimizer's state; this rank keeps its share
            for p in [p for p in self.state if not self._zero.owns(p)]:
                del self.state[p]
            self._zero.consolidated = None
