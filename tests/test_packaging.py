"""pyproject.toml's dependency ranges admit the tested versions of constraints.txt: each range has a lower bound
at the tested major.minor and an upper bound, and the pinned version satisfies it (so ``pip install -e .`` cannot
resolve an older release or a release past the bound, and ``pip install -c constraints.txt`` never conflicts).
torch and transformers are bounded at their next major, so that a GPU stack's own versions fit (docs/scaling.md)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
PINS = {canonicalize_name(name): version for name, _, version in
        (line.split("#")[0].strip().partition("==") for line in (ROOT / "constraints.txt").read_text().splitlines())
        if version}
RUNTIME = [Requirement(r) for r in PROJECT["dependencies"]]
EXTRAS = [Requirement(r) for extra in ("textworld", "convert") for r in PROJECT["optional-dependencies"][extra]]


@pytest.mark.parametrize("req", RUNTIME + EXTRAS, ids=str)
def test_range_is_bounded_and_admits_the_pinned_version(req):
    name = canonicalize_name(req.name)
    assert name in PINS, f"{req.name} is not pinned in constraints.txt"
    operators = {spec.operator for spec in req.specifier}
    assert "==" in operators or ({">=", "<"} <= operators), f"{req}: needs a lower and an upper bound"
    pinned = PINS[name].split("+")[0]
    assert req.specifier.contains(pinned), f"{req} excludes the tested {name}=={pinned}"
    lower = next((s.version for s in req.specifier if s.operator in (">=", "==")), None)
    assert lower.split(".")[:2] == pinned.split(".")[:2], f"{req}: lower bound {lower} is not the tested {pinned}"


def test_the_example_range_checks_by_hand():
    assert Requirement("torch>=2.13,<2.14").specifier.contains("2.13.0")
    assert not Requirement("torch>=2.13,<2.14").specifier.contains("2.5.0")
