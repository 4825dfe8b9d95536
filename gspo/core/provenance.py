"""Where a run ran: the code, the packages and the machine, as summary.json's `machine` records them.

A run is a function of its seed and config only on one machine and package set (docs/contracts.md, `seed`): another
CPU model, instruction set, GPU, torch or transformers computes other float sums, and the same seed's run parts
from it. So every start and resume records all of it (`machine`), a resume on another is recorded in the run's
`resumes` (gspo/train/run/resume.py), and `gspo compare` shows which machines a group's runs ran on.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Optional

# CPU features that change which kernels torch and oneDNN run, and so the float sums: vector width (AVX2,
# AVX-512), fused multiply-add, and the low-precision units (AVX-512-bf16, AMX) a bf16 or int8 sampler uses
FLOAT_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
               "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
               "asimd", "sve", "sve2", "bf16", "i8mm")  # (the last four: ARM's names)
PACKAGES = ("torch", "transformers", "vllm", "peft")
# what changes a run's numbers when it changes under a resume (the rest, e.g. gspo's commit, is recorded only)
NUMERICS = ("cpu", "cpu_id", "cpu_flags", "cpu_capability", "gpu", "torch", "transformers")
# recorded for the reader, not a property of the machine a resume compares (the config's hardware.threads is)
NOT_COMPARED = ("threads",)


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo ({} where there is none: not Linux)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu() -> dict[str, Optional[str]]:
    """The CPU: its model name, `vendor family/model/stepping` (one name covers several generations: "AMD EPYC"
    is both an AVX2-only and an AVX-512 part), the float-relevant flags it has, and the kernel level torch picks."""
    info = _cpuinfo()
    name = info.get("model name") or platform.processor() or platform.machine()
    if "vendor_id" in info:
        ident = f"{info['vendor_id']} {info.get('cpu family', '?')}/{info.get('model', '?')}/{info.get('stepping', '?')}"
    elif "CPU implementer" in info:  # ARM
        ident = f"arm {info['CPU implementer']}/{info.get('CPU part', '?')}/{info.get('CPU variant', '?')}"
    else:
        ident = platform.machine()
    have = set((info.get("flags") or info.get("Features") or "").split())
    try:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()  # the ATen kernels' dispatch level
    except (ImportError, AttributeError):
        capability = None
    return {"cpu": name, "cpu_id": ident, "cpu_flags": " ".join(f for f in FLOAT_FLAGS if f in have),
            "cpu_capability": capability}


def _version(package: str) -> Optional[str]:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def code() -> dict[str, object]:
    """gspo's version, and where it runs from a git checkout, its commit and whether the code differs from it
    (`dirty`: the package, the CLI or the presets changed; results and docs do not count)."""
    found: dict[str, object] = {"gspo": _version("gspo"), "commit": None, "dirty": None}
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return found

    def git(*args: str) -> Optional[str]:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    found["commit"] = git("rev-parse", "HEAD")
    if found["commit"] is not None:
        status = git("status", "--porcelain", "--", "gspo", "cli", "conf", "pyproject.toml")
        found["dirty"] = None if status is None else bool(status)
    return found


def machine(threads: Optional[int] = None) -> dict[str, object]:
    """Everything that computes the run besides its config: the CPU (model, identity, flags, torch's kernel
    level), the GPU (None where none is visible), torch's threads (`threads`, where given), Python and the
    packages' versions, and gspo's own version and commit. Flat, so that a resume's record names each change."""
    import torch

    found: dict[str, object] = dict(cpu())
    found["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    if threads is not None:
        found["threads"] = threads
    found["python"] = platform.python_version()
    found |= {p: _version(p) for p in PACKAGES}
    found["torch"] = torch.__version__  # the running build's, e.g. 2.13.0+cpu
    found |= code()
    return found


def label(m: dict) -> str:
    """A machine in a few words, for tables: `AMD EPYC (AuthenticAMD 25/17/1, avx512_bf16)`; the CPU model alone
    for a run recorded before the rest was; the GPU where there was one."""
    if not m:
        return "not recorded"
    if m.get("gpu"):
        return str(m["gpu"])
    name = str(m.get("cpu") or "?")
    if not m.get("cpu_id"):
        return name
    flags = set(str(m.get("cpu_flags") or "").split())
    top = next((f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags), "no avx2")
    return f"{name} ({m['cpu_id']}, {top})"


def history(summary: dict) -> list[dict]:
    """The machines a run ran on, first to last, from its summary.json: the latest (`machine`) and, back through its
    resumes, each one before (a resume's `machine.*` changes say what it was before); [{}] where none is recorded."""
    latest = dict(summary.get("machine") or {})
    found = [latest]
    for entry in reversed(summary.get("resumes") or []):
        was = {k.removeprefix("machine."): v.get("was") for k, v in (entry.get("changes") or {}).items()
               if k.startswith("machine.")}
        if was:
            latest = {**latest, **was}
            found.append(latest)
    return found[::-1]


def compared(was: dict, now: dict) -> dict[str, dict]:
    """key -> {was, now} for the keys both records hold whose values differ (a record from before a key was
    recorded says nothing about it)."""
    return {k: {"was": was[k], "now": now[k]} for k in sorted(was.keys() & now.keys())
            if k not in NOT_COMPARED and was[k] != now[k]}


if __name__ == "__main__":  # python -m gspo.core.provenance: this machine as a run would record it
    import json

    json.dump(machine(), sys.stdout, indent=2)
    print()
