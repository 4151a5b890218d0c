"""Checkpoints of `trainer.train`: model, optimizer, RNG states and history, written atomically,
and the checks that a resumed run continues the run that wrote them."""

import json
import os
from collections.abc import Callable
from dataclasses import asdict, fields
from pathlib import Path

import torch

HISTORY = "history.json"


def save_checkpoint(path: Path, model, optimizer, config, reference, history: list[dict]) -> None:
    """Write model, optimizer, RNG states and history to `path`, and the history alone to
    history.json beside it; each file is written under a temporary name, then renamed, so an
    interrupted save leaves the previous checkpoint intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "config": asdict(config),
        "reference": _fingerprint(reference),
        "history": history,
    }
    _atomic_write(path, lambda scratch: torch.save(state, scratch))
    _atomic_write(
        path.with_name(HISTORY), lambda scratch: scratch.write_text(json.dumps(history, indent=1))
    )


def load_checkpoint(path: Path, model, optimizer, config, reference) -> list[dict]:
    state = torch.load(path, map_location="cpu", weights_only=True)
    changed = [
        field.name
        for field in fields(config)
        if field.name != "max_steps"
        # A checkpoint written before a setting existed ran with its default.
        and state["config"].get(field.name, field.default) != getattr(config, field.name)
    ]
    if changed:
        raise ValueError(
            f"cannot resume from {path}: its config differs in {', '.join(changed)} "
            f"(only max_steps may change)"
        )
    if state["reference"] != _fingerprint(reference):
        raise ValueError(
            f"cannot resume from {path}: the model passed is not the initial model of "
            f"that run, and with beta > 0 it is the KL reference"
        )
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    if state["cuda_rng"]:
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return state["history"]


def _fingerprint(reference) -> float | None:
    """A checksum of the reference weights (None without a reference)."""
    if reference is None:
        return None
    return sum(parameter.double().sum().item() for parameter in reference.parameters())


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    scratch = path.with_name(path.name + ".tmp")
    write(scratch)
    os.replace(scratch, path)
