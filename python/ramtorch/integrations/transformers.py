"""transformers' ``Trainer`` with ``ramtorch.optim``.

``Trainer`` clips gradients before every ``optimizer.step()`` (``max_grad_norm=1.0`` by default)
and measures their norm even when it does not clip, through accelerate's ``clip_grad_norm_``,
which rewrites every gradient in place (multiplying by the clip coefficient, 1.0 included). A
ramtorch optimizer may have updated parameters during backward with the gradients as they were,
so its ``step()`` refuses the rewritten ones. :class:`RamtorchTrainer` wires the two:

- its default optimizer is :class:`ramtorch.optim.AdamW` with the ``TrainingArguments``
  (``learning_rate``, ``adam_beta1``/``adam_beta2``, ``adam_epsilon``, ``weight_decay`` with the
  same no-decay parameters as ``Trainer``) and ``max_grad_norm=args.max_grad_norm``: ramtorch
  clips, folding the coefficient into its update kernels;
- the Trainer's ``clip_grad_norm_`` calls go to the optimizer's
  :meth:`~ramtorch.optim.AdamW.clip_grad_norm_`, which returns the same norm (logged as
  ``grad_norm``) and leaves the gradients alone.

Gradient accumulation, LR schedules, checkpoint saving (``save_steps``) and resuming work as with
``Trainer``. An optimizer of your own (``optimizers=(ramtorch.optim.AdamW(...), scheduler)``) is
recognised too. Without clipping (``max_grad_norm=0``) the updates stay overlapped with backward.

::

    from ramtorch.integrations.transformers import RamtorchTrainer

    model = ramtorch.offload(model)
    trainer = RamtorchTrainer(model=model, args=TrainingArguments(...), train_dataset=data)
    trainer.train()
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import transformers

from ..optim import AdamW
from ..optim._optimizer import _HostOptimizer

__all__ = ["RamtorchTrainer", "create_optimizer", "host_optimizer"]


def host_optimizer(optimizer: Any) -> _HostOptimizer | None:
    """The ramtorch optimizer inside ``optimizer`` (itself, or the optimizer that accelerate's
    ``AcceleratedOptimizer`` or another wrapper holds as ``.optimizer``); None if there is none."""
    seen = 0
    while optimizer is not None and seen < 8:
        if isinstance(optimizer, _HostOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
        seen += 1
    return None


def create_optimizer(
    model: torch.nn.Module, args: transformers.TrainingArguments, decay_parameters: Iterable[str]
) -> AdamW:
    """:class:`ramtorch.optim.AdamW` for ``model``'s trainable parameters with the hyperparameters
    of ``args``, as ``Trainer`` groups them (weight decay on ``decay_parameters`` only), clipping
    the gradient norm to ``args.max_grad_norm`` (none if it is 0 or None)."""
    decay = set(decay_parameters)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    clip = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
    return AdamW(
        [g for g in groups if g["params"]],
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        weight_decay=args.weight_decay,
        max_grad_norm=clip,
    )


class RamtorchTrainer(transformers.Trainer):
    """``transformers.Trainer`` whose optimizer is :class:`ramtorch.optim.AdamW` (unless one is
    passed in ``optimizers``) and whose gradient clipping is done by the ramtorch optimizer (see
    the module documentation). Arguments as ``transformers.Trainer``; ``args.optim`` is not
    used for the default optimizer (it is always ramtorch's AdamW)."""

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer: :func:`create_optimizer` for the model, unless one was given."""
        if self.optimizer is None:
            opt_model = self.model if model is None else model
            self.optimizer = create_optimizer(opt_model, self.args, self.get_decay_parameter_names(opt_model))
        return self.optimizer

    def create_accelerator_and_postprocess(self) -> None:
        """As ``Trainer``'s, then routes the accelerator's ``clip_grad_norm_`` to the ramtorch
        optimizer (see :func:`_clip_through`)."""
        super().create_accelerator_and_postprocess()
        _clip_through(self)


def _clip_through(trainer: transformers.Trainer) -> None:
    """Replaces ``trainer.accelerator.clip_grad_norm_`` (on this accelerator only) by one that
    hands the clipping to the trainer's ramtorch optimizer, when it has one and the parameters
    to clip include some of its own; otherwise accelerate's runs unchanged."""
    accelerator = trainer.accelerator
    inner = accelerator.clip_grad_norm_

    def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2, **kwargs: Any) -> Any:
        opt = host_optimizer(getattr(trainer, "optimizer", None))
        if opt is None or kwargs or float(norm_type) != 2.0:
            return inner(parameters, max_norm, norm_type=norm_type, **kwargs)
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        owned = opt._param_ids()
        if not any(id(p) in owned for p in params):
            return inner(params, max_norm, norm_type=norm_type)
        return opt.clip_grad_norm_(max_norm, parameters=params)

    accelerator.clip_grad_norm_ = clip_grad_norm_
