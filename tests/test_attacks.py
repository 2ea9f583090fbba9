"""Every hostile file of ``attacks/`` (see attacks/README.md), loaded with ``ramtorch.load`` or
``ramtorch.load_checkpoint``: a clear exception naming the file, and the model, the optimizer and
torch's RNG exactly as they were."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import ramtorch
import torch
from conftest import changes, not_hanging, snapshot

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "attacks"))
import make_attacks  # noqa: E402

#: The exceptions a hostile file may raise (CheckpointError is a RuntimeError).
CLEAR = (ValueError, OSError, RuntimeError)


@pytest.fixture(scope="module")
def attacks(tmp_path_factory: pytest.TempPathFactory) -> list[make_attacks.Attack]:
    return make_attacks.build(tmp_path_factory.mktemp("attacks"))


@pytest.mark.parametrize("target", ["load", "checkpoint"])
def test_hostile_files_are_clear_errors_and_change_nothing(attacks, target):
    mine = [a for a in attacks if a.target == target]
    assert len(mine) > 20
    failures = []
    for attack in mine:
        model, opt = make_attacks.victim(0)
        before = snapshot(model, opt)
        if target == "load":
            error = not_hanging(lambda a=attack, m=model: ramtorch.load(m, a.path), attack.path)
        else:
            error = not_hanging(
                lambda a=attack, m=model, o=opt: ramtorch.load_checkpoint(a.path, m, o), attack.path
            )
        problem = ""
        if not isinstance(error, CLEAR):
            problem = f"raised {error!r}"
        elif not re.search(attack.expect, str(error)):
            problem = f"message does not match {attack.expect!r}: {error}"
        elif str(attack.path) not in str(error):
            problem = f"message does not name the file: {error}"
        problem = problem or changes(before, model, opt)
        if problem:
            failures.append(f"{attack.name} ({attack.about}): {problem}")
    assert not failures, "\n".join(failures)


def test_the_valid_files_the_attacks_start_from_load(attacks, tmp_path):
    """The attacks are hostile, not their base: the same victim's valid files load and match."""
    src, src_opt = make_attacks.victim(1)
    ramtorch.save_checkpoint(tmp_path / "c.safetensors", src, src_opt)
    model, opt = make_attacks.victim(0)
    ramtorch.load_checkpoint(tmp_path / "c.safetensors", model, opt)
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), model.state_dict().values()))
    base = Path(attacks[0].path).parent / "good.pretrained"
    model, _ = make_attacks.victim(0)
    ramtorch.load(model, base)
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), model.state_dict().values()))
