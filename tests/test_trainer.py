"""transformers' ``Trainer`` on an offloaded model with ``ramtorch.optim``
(``ramtorch.integrations.transformers``): default arguments (gradient clipping at 1.0), gradient
accumulation and checkpoint saving train as the same Trainer does on the plain model, and a saved
checkpoint resumes to the same weights."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import ramtorch  # noqa: E402
import ramtorch.optim  # noqa: E402
from conftest import tiny_llama_config  # noqa: E402


def _tiny_llama() -> torch.nn.Module:
    config = tiny_llama_config(tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).float()


def _data(n: int = 16, length: int = 8) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (n, length), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def _args(out, **kw) -> transformers.TrainingArguments:
    base = dict(
        output_dir=str(out),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=4,
        save_steps=2,
        learning_rate=1e-2,
        warmup_steps=1,
        logging_steps=1,
        use_cpu=True,
        report_to="none",
        seed=0,
        data_seed=0,
        disable_tqdm=True,
    )
    base.update(kw)
    return transformers.TrainingArguments(**base)


def _losses(trainer) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def _norms(trainer) -> list[float]:
    return [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]


def _assert_weights_close(model, ref, atol=2e-5) -> None:
    ramtorch.synchronize()
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k].float(), want[k].float(), atol=atol, rtol=1e-4, msg=k)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def test_trainer_matches_plain_model_and_resumes(tmp_path):
    from ramtorch.integrations.transformers import RamtorchTrainer

    data = _data()
    plain = _tiny_llama()
    model = ramtorch.offload(copy.deepcopy(plain), device="cpu")

    ref = transformers.Trainer(model=plain, args=_args(tmp_path / "ref"), train_dataset=data)
    ref.train()
    trainer = RamtorchTrainer(model=model, args=_args(tmp_path / "rt"), train_dataset=data)
    trainer.train()

    assert isinstance(trainer.optimizer.optimizer, ramtorch.optim.AdamW)
    assert len(_losses(trainer)) == 4
    # Clipping at 1.0 (the default) is applied: the norms are above it.
    assert max(_norms(ref)) > 1.0
    assert _losses(trainer) == pytest.approx(_losses(ref), rel=1e-4, abs=1e-5)
    assert _norms(trainer) == pytest.approx(_norms(ref), rel=1e-4, abs=1e-5)
    _assert_weights_close(model, plain)

    # The checkpoint of step 2 resumes, on a fresh offloaded model, to the same weights.
    fresh = ramtorch.offload(_tiny_llama(), device="cpu")
    resumed = RamtorchTrainer(model=fresh, args=_args(tmp_path / "rt2"), train_dataset=data)
    resumed.train(resume_from_checkpoint=str(tmp_path / "rt" / "checkpoint-2"))
    # (the log history of steps 1-2 comes from the checkpoint)
    assert _losses(resumed) == pytest.approx(_losses(trainer), rel=1e-4, abs=1e-5)
    _assert_weights_close(fresh, model)


def test_trainer_without_clipping_keeps_the_overlap(tmp_path):
    """max_grad_norm=0: the Trainer still measures the norm (clip_grad_norm_ with inf), which
    changes no gradient: the overlap stays on, no update computed during backward had to be
    computed again in step(), and the weights match the plain model."""
    from ramtorch.integrations.transformers import RamtorchTrainer

    data = _data()
    plain = _tiny_llama()
    model = ramtorch.offload(copy.deepcopy(plain), device="cpu")
    ref = transformers.Trainer(
        model=plain, args=_args(tmp_path / "ref", max_grad_norm=0.0, save_steps=100), train_dataset=data
    )
    ref.train()
    trainer = RamtorchTrainer(
        model=model, args=_args(tmp_path / "rt", max_grad_norm=0.0, save_steps=100), train_dataset=data
    )
    trainer.train()
    opt = trainer.optimizer.optimizer
    assert opt.overlap and opt.timings["recomputed_updates"] == 0
    assert _losses(trainer) == pytest.approx(_losses(ref), rel=1e-4, abs=1e-5)
    _assert_weights_close(model, plain)


def test_clip_grad_norm_on_the_optimizer_matches_torch():
    """opt.clip_grad_norm_ returns the norm torch's clip_grad_norm_ returns and the step uses the
    clipped gradients; after an overlapped update it refuses to clip (the update already used the
    unclipped gradients) but still measures."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model = ramtorch.offload(copy.deepcopy(plain), device="cpu")
    opt = ramtorch.optim.AdamW(model.parameters(), lr=1e-2, overlap=False)
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    x = torch.randn(4, 8) * 10
    for _ in range(3):
        for m, o in ((model, opt), (plain, ref)):
            o.zero_grad()
            m(x).square().sum().backward()
        norm = opt.clip_grad_norm_(0.5)
        want = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
        torch.testing.assert_close(norm, want, rtol=1e-5, atol=1e-6)
        opt.step()
        ref.step()
    _assert_weights_close(model, plain, atol=1e-5)
    with pytest.raises(ValueError, match="max_norm"):
        opt.clip_grad_norm_(-1.0)
    with pytest.raises(ValueError, match="norm_type"):
        opt.clip_grad_norm_(1.0, norm_type=1.0)

    over = ramtorch.optim.AdamW(model.parameters(), lr=1e-2, overlap="backward")
    for _ in range(2):  # the second step updates during backward
        over.zero_grad()
        model(x).square().sum().backward()
        assert float(over.clip_grad_norm_(float("inf"))) > 0
        over.step()
    over.zero_grad()
    model(x).square().sum().backward()
    with pytest.raises(RuntimeError, match="max_grad_norm="):
        over.clip_grad_norm_(1e-3)


@pytest.mark.parametrize("trainer_class", ["RamtorchTrainer", "Trainer"])
def test_the_users_own_ramtorch_adamw_through_optimizers_trains_as_the_plain_model(tmp_path, trainer_class):
    """optimizers=(ramtorch.optim.AdamW(...), scheduler), the README's way to bring one's own: with
    clipping at 1.0 (the Trainer's default) it trains past step 2 and as the plain model does,
    in RamtorchTrainer (clipping folded into step()) and in a plain Trainer (accelerate rewrites
    the gradients: the step's updates are computed in step())."""
    from ramtorch.integrations.transformers import RamtorchTrainer

    data = _data()
    plain = _tiny_llama()
    model = ramtorch.offload(copy.deepcopy(plain), device="cpu")
    args = _args(tmp_path / "ref", max_steps=5, save_steps=100)
    ref_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.0)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (s + 1))
    ref = transformers.Trainer(model=plain, args=args, train_dataset=data, optimizers=(ref_opt, ref_sched))
    ref.train()
    opt = ramtorch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    cls = RamtorchTrainer if trainer_class == "RamtorchTrainer" else transformers.Trainer
    trainer = cls(
        model=model,
        args=_args(tmp_path / "rt", max_steps=5, save_steps=100),
        train_dataset=data,
        optimizers=(opt, sched),
    )
    trainer.train()
    assert max(_norms(ref)) > 1.0  # the clipping clips
    assert len(_losses(trainer)) == 5
    assert _losses(trainer) == pytest.approx(_losses(ref), rel=1e-4, abs=1e-5)
    _assert_weights_close(model, plain)
