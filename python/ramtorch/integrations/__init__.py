"""Integrations of ramtorch with other libraries' training loops.

- :mod:`ramtorch.integrations.transformers`: transformers' ``Trainer`` with ``ramtorch.optim``
  (:class:`~ramtorch.integrations.transformers.RamtorchTrainer`).

Each submodule imports its library only when it is imported itself.
"""
