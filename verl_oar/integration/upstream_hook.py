"""verl-oar through the seams of verl's upstream patch series (``upstream/verl-0.9.1/``), when the
installed verl has them: then the plugin registers its estimators and signal provider through them
and does not touch verl's trainer registry.
"""

from __future__ import annotations


def available() -> bool:
    """True when the imported verl offers the upstream series' token-field hook."""
    return False


def install() -> None:
    """Register OAR through the upstream hook (only called when :func:`available`)."""
    raise NotImplementedError("verl's upstream token-field hook is not wired yet")
