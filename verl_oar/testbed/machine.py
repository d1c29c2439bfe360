"""The machine a result was measured on, recorded beside every committed result (no torch import)."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata

__all__ = ["machine_info"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


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
