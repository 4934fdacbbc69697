"""constraints-lowest.txt (what `make test-lowest` installs) pins each runtime
dependency of pyproject.toml at the oldest release its ">=" bound allows: the
same names, each version at or above the bound and in the bound's own release
line (">=3.4" is 3.4.x), so neither file can move without the other."""

from __future__ import annotations

import re
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (make test-pythons)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
_BOUND = re.compile(r"^([A-Za-z0-9_.-]+)>=([0-9][0-9.]*)(;.*)?$")


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def test_the_lowest_constraints_pin_each_runtime_dependency_at_its_floor() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floors = {}
    for spec in project["dependencies"]:
        spec = spec.replace(" ", "")
        if "python_version<" in spec:  # a backport older Pythons alone need
            continue
        found = _BOUND.match(spec)
        assert found, f"{spec}: a runtime dependency is bounded below only (name>=version)"
        floors[found.group(1).lower()] = found.group(2)
    pins = {}
    for line in (ROOT / "constraints-lowest.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[name.lower()] = version
    assert pins.keys() == floors.keys()
    for name, floor in floors.items():
        pinned, bound = _release(pins[name]), _release(floor)
        assert pinned >= bound and pinned[: len(bound)] == bound, (name, pins[name], floor)
