"""Check that a folder of wheels, installed with `pip install --target`, has all it needs here.

For every wheel in the folder: is its own version the one Python imports (the --target copy
shadows an older one on the machine), and is every requirement it declares for this Python met
by an installed distribution? Exits 1 and names what is missing or of the wrong version.

On the GPU machine, after installing the wheels (docs/benchmarks.md, "On a GPU"):
  python3 scripts/bench_env.py .whl
Offline, against a described machine (one `name` or `name==version` per line; `name` alone
means installed, version unknown), nothing but the wheels installed:
  PYTHONPATH=/tmp/gpu_site python3.12 scripts/bench_env.py .whl --assume gpu_packages.txt
"""

from __future__ import annotations

import argparse
import re
import sys
import zipfile
from importlib import metadata
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # a bare Python: pip carries its own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name


def wheel_metadata(path: Path) -> tuple[str, str, list[Requirement]]:
    """(name, version, requirements for this Python and platform, extras excluded) of a wheel file."""
    with zipfile.ZipFile(path) as z:
        text = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    field = lambda key: [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith(key + ":")]  # noqa: E731
    reqs = [Requirement(r) for r in field("Requires-Dist")]
    reqs = [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]
    return field("Name")[0], field("Version")[0], reqs


def installed(assume: dict[str, str | None]) -> dict[str, str | None]:
    """Canonical name -> version of every distribution Python sees (first on sys.path wins), plus `assume`."""
    found: dict[str, str | None] = {}
    for dist in metadata.distributions():
        found.setdefault(canonicalize_name(dist.metadata["Name"] or ""), dist.version)
    return {**assume, **found}


def check(wheels: list[Path], assume: dict[str, str | None]) -> list[str]:
    """Problems, one line each (empty: all met). Requirements met by an assumed package of unknown version are
    listed as notes, not problems."""
    have, problems, notes = installed(assume), [], []
    own = {canonicalize_name(wheel_metadata(w)[0]): wheel_metadata(w)[1] for w in wheels}
    for w in wheels:
        name, version, reqs = wheel_metadata(w)
        if have.get(canonicalize_name(name)) != version:
            problems.append(f"{w.name}: Python sees {name} {have.get(canonicalize_name(name))}, not {version} "
                            "(is the --target folder first on PYTHONPATH?)")
        for r in reqs:
            key = canonicalize_name(r.name)
            v = own.get(key) or have.get(key)
            if key not in have and key not in own:
                problems.append(f"{name} {version} needs {r}: not installed")
            elif v is None:
                notes.append(f"{name} {version} needs {r}: present, version unknown")
            elif not r.specifier.contains(v, prereleases=True):
                problems.append(f"{name} {version} needs {r}: found {v}")
    for n in sorted(set(notes)):
        print("note:", n)
    return problems


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("wheels", type=Path, help="the folder of .whl files")
    p.add_argument("--assume", type=Path, help="a file of `name` or `name==version` lines taken as installed")
    a = p.parse_args()
    assume: dict[str, str | None] = {}
    if a.assume:
        for line in a.assume.read_text().splitlines():
            m = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(?:==\s*(\S+))?", line)
            if m and m.group(1):
                assume[canonicalize_name(m.group(1))] = m.group(2)
    wheels = sorted(a.wheels.glob("*.whl"))
    problems = check(wheels, assume)
    for prob in problems:
        print("MISSING:", prob)
    print(f"{len(wheels)} wheels checked: " + ("all requirements met" if not problems else f"{len(problems)} problem(s)"))
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
