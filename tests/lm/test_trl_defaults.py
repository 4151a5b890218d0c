"""What the pages say about TRL's and verl's defaults, held to their own code: the defaults of the
book's GRPOConfig that differ from TRL's, CISPO's cap at TRL's default epsilon_high, and verl's
DAPO reward manager penalising overlong completions rather than filtering them."""

import dataclasses
import importlib.util
import inspect
from pathlib import Path

import pytest

from grpo_companion.lm.config import (
    DEFAULTS_UNLIKE_TRL,
    RUN_DEFAULTS_UNLIKE_TRL,
    GRPOConfig,
)

ROOT = Path(__file__).resolve().parents[2]
trl = pytest.importorskip("trl")


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory()


def test_the_defaults_unlike_trls_are_exactly_those_listed():
    theirs = {field.name: _default(field) for field in dataclasses.fields(trl.GRPOConfig)}
    ours = GRPOConfig()
    differ = {
        field.name: (getattr(ours, field.name), theirs[field.name])
        for field in dataclasses.fields(GRPOConfig)
        if field.name in theirs and getattr(ours, field.name) != theirs[field.name]
    }
    assert differ == {**DEFAULTS_UNLIKE_TRL, **RUN_DEFAULTS_UNLIKE_TRL}


def test_chapter_4_states_each_default_unlike_trls():
    text = " ".join((ROOT / "book" / "04_testbed.md").read_text().split())
    for name, (ours, theirs) in DEFAULTS_UNLIKE_TRL.items():
        shown = {str: lambda v: f'`"{v}"`', bool: str, int: str}[type(ours)]
        assert f"`{name}` {shown(ours)} (TRL: {shown(theirs)}" in text, name


def test_trls_cispo_caps_the_ratio_at_epsilon_high_which_defaults_to_epsilon():
    fields = {field.name: field for field in dataclasses.fields(trl.GRPOConfig)}
    assert fields["epsilon_high"].default is None and fields["epsilon"].default == 0.2
    source = inspect.getsource(trl.GRPOTrainer)
    assert (
        "self.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon"
        in source
    )
    assert "torch.clamp(coef_1, max=self.epsilon_high)" in source
    variants = (ROOT / "book" / "variants.md").read_text()
    assert "torch.clamp(coef_1, max=self.epsilon_high)" in variants


def test_verls_dapo_reward_penalises_overlong_completions():
    spec = importlib.util.find_spec("verl")
    if spec is None:
        pytest.skip("verl is not installed")
    folder = Path(spec.submodule_search_locations[0])
    source = (folder / "workers" / "reward_manager" / "dapo.py").read_text()
    assert "overlong_buffer_cfg" in source and "overlong_reward" in source
    assert "overlong_buffer_cfg" in (ROOT / "book" / "variants.md").read_text()
