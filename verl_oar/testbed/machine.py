"""The machine a result was measured on, recorded beside every committed result (no torch import)."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata

__all__ = ["cpu_id", "machine_info"]


def _cpuinfo() -> dict[str, str]:
    """The first processor's block of /proc/cpuinfo (empty off Linux)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def _cpu_model() -> str:
    return _cpuinfo().get("model name") or platform.processor() or platform.machine() or "unknown"


def cpu_id() -> str:
    """The CPU as float32 kernels see it: vendor, family, model, stepping and the widest vector ISA, e.g.
    ``"AuthenticAMD family 26 model 2 stepping 1 avx512"``. Machines share a model name across generations
    ("AMD EPYC" for Zen 3 and Zen 5 alike) whose kernels round differently; ``"unknown"`` off Linux."""
    fields = _cpuinfo()
    if not fields:
        return "unknown"
    flags = set(fields.get("flags", "").split())
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "baseline"
    return " ".join([fields.get("vendor_id", "?"), "family", fields.get("cpu family", "?"), "model",
                     fields.get("model", "?"), "stepping", fields.get("stepping", "?"), isa])


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine_info() -> dict:
    """{"cpu", "cores" (usable by this process), "python", "platform", "torch", "transformers", "verl"}."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": _cpu_model(),
        "cores": cores,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "verl": _version("verl"),
    }
