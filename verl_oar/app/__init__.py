"""The top layer: the `verl-oar` command (its dispatcher) and `verl-oar compare`, which may import every other layer."""
