"""Keep an FSDP2 model unsharded for a whole importance pass, so that the pass issues no collective.

Why: with more than one data-parallel rank, every forward of an FSDP2 module all-gathers its
parameters (and its backward may all-gather again), so every rank must make the same number of
model calls in the same order. OAR-P makes a data-dependent number of calls per sample and OAR-G
skips its forwards on a micro-batch with nothing to score; ranks would then wait on collectives
the others never issue (a hang under NCCL). Instead, all FSDP2 modules are all-gathered once,
in the same (module-tree) order on every rank, before the pass and freed after it; in between
the parameters stay unsharded, and the forwards and backwards make no collective at all
(checked against torch 2.13 ``_fully_shard/_fsdp_param_group.py``: ``unshard`` returns at once when
the group ``is_unsharded``; ``reshard`` in forward returns when ``reshard_after_forward`` is off;
``post_backward`` reshards only with ``reshard_after_backward`` and reduce-scatters nothing when no
parameter has a gradient -- OAR-G differentiates w.r.t. the input embeddings only).

Memory: the full (``param_dtype``, e.g. bf16) parameters stay on each GPU for the pass: about
2 bytes x parameter count (a 7B model: ~15 GB), on top of verl's usual log-prob activations.

FSDP1 (``strategy=fsdp``) has no equivalent (it refuses forwards inside ``summon_full_params``), so
OAR refuses it with more than one data-parallel rank at start-up (``importance_signal``); on one
rank, and on Megatron, this context does nothing.
"""

from __future__ import annotations

from contextlib import contextmanager


def fsdp2_modules(module) -> list:
    """Every FSDP2 (``fully_shard``) module in ``module``'s tree, root first, in ``modules()`` order
    (the same on every rank)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return []
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


@contextmanager
def unsharded_for_importance(engine):
    """Unshard every FSDP2 module of ``engine.module`` for the body, then reshard and restore verl's
    reshard settings (``engine.engine_config.reshard_after_forward``; FSDP2's default
    ``reshard_after_backward=True``). Call it inside ``engine.eval_mode()`` (after parameter
    offload is undone), on every DP rank at the same point. A no-op when the model has no FSDP2 module."""
    modules = fsdp2_modules(engine.module)
    if not modules:
        yield
        return
    reshard_after_forward = bool(getattr(engine.engine_config, "reshard_after_forward", True))
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
        module.set_reshard_after_backward(False, recurse=False)
    try:
        for module in modules:  # one all-gather per module, the same sequence on every rank
            module.unshard()
        yield
    finally:
        # restore first: a group left in FORWARD state by an exception reshards only if its
        # reshard_after_forward is on
        for module in modules:
            module.set_reshard_after_forward(reshard_after_forward, recurse=False)
            module.set_reshard_after_backward(True, recurse=False)
        for module in modules:  # frees the unsharded parameters; no collective
            module.reshard()
