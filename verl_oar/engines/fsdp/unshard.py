"""What stays unsharded during an importance pass on an FSDP2 model.

Default (:func:`root_unsharded_for_importance`): only the FSDP2 *root* group. verl's ``apply_fsdp2`` wraps
each decoder layer, and ``embed_tokens`` and ``lm_head`` when they are not tied, then the whole model (the
root: what is left, the final norm; with tied embeddings the shared embedding matrix too), all with verl's
``reshard_after_forward`` (default True), so the root is resharded after every forward. OAR-G takes its
outcome logits inside the model's forward (``core.hf.OutcomeHead``: a hook on the decoder) and
differentiates them, not the model's output, w.r.t. the input embeddings; the root's pre-backward hook
(registered on the model's output) then never fires and its backward would read the freed final-norm
weight. So the root is kept unsharded for the pass, as FSDP2 does by default for a root
(``_fsdp_state._lazy_init``), and resharded at its end. Memory: the root's parameters are unsharded
throughout every forward anyway, so the pass's largest unsharded set is a forward's: root + one other
FSDP2 module. The other modules gather and reshard in every model call as in verl's own forward, the
calls kept equal across ranks by ``engines.fsdp.lockstep``.

Opt-in (``algorithm.oar.gather_params=True``, :func:`unsharded_for_importance`): every FSDP2 module
all-gathered once, in the same (module-tree) order on every rank, before the pass and freed after it;
in between the forwards and backwards make no collective at all, so call counts may differ. Memory: the
full ``param_dtype`` parameters on each GPU for the pass, 2 bytes x parameter count in bf16 (7B: ~15 GB).

Checked against torch 2.13 ``_fully_shard/_fsdp_param_group.py``: ``unshard`` returns at once when the
group ``is_unsharded``; ``reshard`` in forward returns when ``reshard_after_forward`` is off;
``post_backward`` reshards only with ``reshard_after_backward`` and reduce-scatters only parameters with a
gradient (none: OAR-G calls ``autograd.grad`` w.r.t. the input embeddings; ``reduce_scatter_unused_params``
is off by default). FSDP1 (``strategy=fsdp``) has no FSDP2 module: both contexts do nothing there (OAR
refuses FSDP1 with several data-parallel ranks at start-up).
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


def _reshard_after_forward(engine) -> bool:
    return bool(getattr(engine.engine_config, "reshard_after_forward", True))


@contextmanager
def root_unsharded_for_importance(engine):
    """Keep the FSDP2 root group of ``engine.module`` unsharded from the pass's first forward to its end
    (no reshard after forward or backward), then reshard it (no collective) and restore verl's settings
    (``engine.engine_config.reshard_after_forward``; FSDP2's default ``reshard_after_backward=True``). A
    no-op when the model has no FSDP2 module."""
    modules = fsdp2_modules(engine.module)
    if not modules:
        yield
        return
    root = modules[0]  # the outermost: FSDP2's root
    root.set_reshard_after_forward(False, recurse=False)
    root.set_reshard_after_backward(False, recurse=False)
    try:
        yield
    finally:
        root.set_reshard_after_forward(_reshard_after_forward(engine), recurse=False)
        root.set_reshard_after_backward(True, recurse=False)
        root.reshard()


@contextmanager
def unsharded_for_importance(engine):
    """Unshard every FSDP2 module of ``engine.module`` for the body, then reshard and restore verl's
    reshard settings. Call it inside ``engine.eval_mode()`` (after parameter offload is undone), on every
    DP rank at the same point. A no-op when the model has no FSDP2 module."""
    modules = fsdp2_modules(engine.module)
    if not modules:
        yield
        return
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
            module.set_reshard_after_forward(_reshard_after_forward(engine), recurse=False)
            module.set_reshard_after_backward(True, recurse=False)
        for module in modules:  # frees the unsharded parameters; no collective
            module.reshard()
