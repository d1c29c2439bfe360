"""Every change megatron-core needs to run on the CPU, in one place (checked against megatron-core 0.16.1).

megatron-core assumes CUDA in five places that a local-spec ``GPTModel`` (``get_gpt_layer_local_spec``,
``TransformerConfig(use_cpu_initialization=True)``) reaches in forward and backward. Each patch names
what it replaces and why; ``tests/engine/test_megatron_real_on_cpu.py`` checks that each still applies
(its target exists) and is still needed (the unpatched call still fails on the CPU).

1. ``megatron.core.tensor_parallel.random``: the model-parallel RNG tracker keeps CUDA generator
   states (``model_parallel_cuda_manual_seed``, ``_get_cuda_rng_state``, ``_set_cuda_rng_state``);
   attention and embedding dropout fork it even at p = 0. Routed to the CPU generator (so with dropout
   > 0 megatron warns "CPU RNG state changed within GPU RNG context": here they are one generator).
2. ``torch.cuda.current_device``: the rotary embedding and many ``torch.empty(device=...)`` calls ask
   for the current CUDA device; on a CPU-only torch it raises. Answers ``"cpu"`` while no CUDA is
   available (only then: on a GPU machine torch's own function is kept).
3. ``megatron.core.transformer.utils.get_default_causal_mask`` hard-codes ``device="cuda"``; rebuilt
   on the CPU (and rebound in ``megatron.core.fusions.fused_softmax``, which imported it by name).
4. ``megatron.core.transformer.torch_norm.WrappedTorchNorm``: without apex the local spec uses torch's
   norm, which refuses sequence parallelism. Under sequence parallelism a norm works on the rank's
   own rows and needs nothing from the others; its weights get ``sequence_parallel = True`` as
   megatron's own ``FusedLayerNorm`` sets it (their gradients are then all-reduced over the TP group).
5. ``megatron.core.transformer.dot_product_attention.DotProductAttention.forward``: the local attention
   expects a [B, 1, S, S] boolean mask (True = masked) where verl's padded (BSHD) forward passes
   [B, S] (True = a real token). A [B, S] mask becomes key-is-padding, OR causal for causal attention.

All patches are idempotent and applied only by :func:`apply_megatron_patches` (CPU mode); the packed
(THD) layout is not among what runs: it needs TransformerEngine's attention (CUDA).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch

from verl_oar.cpu.patch import Patch, apply_patches, is_marked, mark

SUPPORTED_MEGATRON_SERIES = "0.16."
"""megatron-core versions these patches were written for (prefix of ``megatron.core.__version__``)."""


class MegatronPatchError(RuntimeError):
    """A megatron-core internal that CPU mode patches is missing or has changed."""


class MegatronPatch(Patch):
    """One monkeypatch of megatron-core (:class:`~verl_oar.cpu.patch.Patch`)."""

    library = "megatron-core"
    series = SUPPORTED_MEGATRON_SERIES
    error = MegatronPatchError
    source = "verl_oar/cpu/megatron_patches.py"

    @staticmethod
    def installed_version() -> str:
        from megatron.core import package_info

        return package_info.__version__


def check_megatron_version() -> str:
    """Return megatron-core's version; raise ``MegatronPatchError`` unless it is a 0.16.x release."""
    return MegatronPatch.check_version()


# 1. RNG tracker ---------------------------------------------------------------------------------


def _patch_rng_tracker(random: Any) -> None:
    # ``random``: megatron.core.tensor_parallel.random (its private names are megatron-core's, not verl's)
    if is_marked(random.model_parallel_cuda_manual_seed):
        return

    def _get_cuda_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def _set_cuda_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    original = random.model_parallel_cuda_manual_seed

    @functools.wraps(original)
    def model_parallel_cuda_manual_seed(seed: int, te_rng_tracker: bool = False, inference_rng_tracker: bool = False,
                                        use_cudagraphable_rng: bool = False, tp_rank: int | None = None,
                                        ep_rank: int | None = None, etp_rank: int | None = None,
                                        force_reset_rng: bool = False) -> None:
        """megatron's seeds (data parallel: ``seed``; tensor parallel: ``seed + 2718 + tp_rank``; expert:
        ``seed + 1024 + 100 ep_rank + etp_rank``), kept as CPU generator states."""
        from megatron.core import parallel_state as mpu

        tp_rank = mpu.get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
        ep_rank = mpu.get_expert_model_parallel_rank() if ep_rank is None else ep_rank
        etp_rank = mpu.get_expert_tensor_parallel_rank() if etp_rank is None else etp_rank
        random.initialize_rng_tracker(te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng,
                                      force_reset=force_reset_rng)
        tracker = random.get_cuda_rng_tracker()
        tracker.reset()
        torch.manual_seed(seed)
        seeds = {
            random._DATA_PARALLEL_RNG_TRACKER_NAME: seed,
            random._MODEL_PARALLEL_RNG_TRACKER_NAME: seed + 2718 + tp_rank,
            random._EXPERT_PARALLEL_RNG_TRACKER_NAME: seed + 1024 + 100 * ep_rank + etp_rank,
        }
        tracker._is_initialized = True
        for name, value in seeds.items():
            orig = torch.get_rng_state()
            torch.manual_seed(value)
            tracker.seeds_.add(value)
            tracker.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

    random._get_cuda_rng_state = mark(_get_cuda_rng_state)
    random._set_cuda_rng_state = mark(_set_cuda_rng_state)
    random.model_parallel_cuda_manual_seed = mark(model_parallel_cuda_manual_seed)
    tensor_parallel = importlib.import_module("megatron.core.tensor_parallel")
    if getattr(tensor_parallel, "model_parallel_cuda_manual_seed", None) is original:
        tensor_parallel.model_parallel_cuda_manual_seed = model_parallel_cuda_manual_seed


# 2. torch.cuda.current_device ---------------------------------------------------------------------


def _patch_current_device(module: Any) -> None:
    original = module.current_device
    if is_marked(original):
        return

    @functools.wraps(original)
    def current_device():
        return original() if module.is_available() else "cpu"

    module.current_device = mark(current_device)


# 3. the causal mask -------------------------------------------------------------------------------
# a megatron-core bug, unlike the other four; its upstream fix: upstream/megatron-core-0.16.1/01-causal-mask-device/


def _patch_causal_mask(module: Any) -> None:
    original = module.get_default_causal_mask
    if is_marked(original):
        return

    @functools.lru_cache(maxsize=8)
    def cpu_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    @functools.wraps(original)
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return original(sq) if torch.cuda.is_available() else cpu_causal_mask(sq)

    module.get_default_causal_mask = mark(get_default_causal_mask)
    fused_softmax = importlib.import_module("megatron.core.fusions.fused_softmax")
    if fused_softmax.get_default_causal_mask is original:
        fused_softmax.get_default_causal_mask = get_default_causal_mask


# 4. torch norms under sequence parallelism --------------------------------------------------------


def _patch_torch_norm(module: Any) -> None:
    cls = module.WrappedTorchNorm
    original = cls.__dict__["__new__"]
    if is_marked(original):
        return

    def __new__(klass, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        sequence_parallel = bool(config.sequence_parallel)
        if sequence_parallel:
            import dataclasses

            config = dataclasses.replace(config, sequence_parallel=False)
        norm = original(klass, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma, normalization)
        for param in norm.parameters():
            setattr(param, "sequence_parallel", sequence_parallel)
        return norm

    cls.__new__ = mark(__new__)


# 5. the attention mask of the padded layout -------------------------------------------------------


def _patch_attention_mask(module: Any) -> None:
    cls = module.DotProductAttention
    original = cls.forward
    if is_marked(original):
        return

    from megatron.core.transformer.enums import AttnMaskType

    @functools.wraps(original)
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, *args, **kwargs):
        if attention_mask is not None and attention_mask.dim() == 2:   # verl's BSHD [B, S]: True = a token
            s = attention_mask.shape[1]
            masked = ~attention_mask.bool()[:, None, None, :].expand(-1, 1, s, s)   # [B, 1, S, S]: padding keys
            if (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal:
                masked = masked | torch.ones(s, s, dtype=torch.bool, device=masked.device).triu(1)
            attention_mask = masked
        return original(self, query, key, value, attention_mask, attn_mask_type, *args, **kwargs)

    cls.forward = mark(forward)


PATCHES: tuple[MegatronPatch, ...] = (
    MegatronPatch(
        name="rng_tracker_on_cpu",
        module="megatron.core.tensor_parallel.random",
        attribute="model_parallel_cuda_manual_seed",
        why="the model-parallel RNG tracker stores CUDA generator states (torch.cuda.get_rng_state)",
        apply=_patch_rng_tracker,
    ),
    MegatronPatch(
        name="current_device_is_cpu",
        module="torch.cuda",
        attribute="current_device",
        why="rotary embeddings and torch.empty(device=torch.cuda.current_device()) raise on a CPU-only torch",
        apply=_patch_current_device,
    ),
    MegatronPatch(
        name="causal_mask_on_cpu",
        module="megatron.core.transformer.utils",
        attribute="get_default_causal_mask",
        why='get_default_causal_mask builds its mask with device="cuda"',
        apply=_patch_causal_mask,
    ),
    MegatronPatch(
        name="torch_norm_with_sequence_parallel",
        module="megatron.core.transformer.torch_norm",
        attribute="WrappedTorchNorm.__new__",
        why="without apex the local spec uses torch's norm, which asserts 'sequence parallel not supported'",
        apply=_patch_torch_norm,
    ),
    MegatronPatch(
        name="padded_attention_mask",
        module="megatron.core.transformer.dot_product_attention",
        attribute="DotProductAttention.forward",
        why="the local attention expects a [B, 1, S, S] mask; verl's padded forward passes [B, S]",
        apply=_patch_attention_mask,
    ),
)


def apply_megatron_patches() -> None:
    """Apply every patch in ``PATCHES`` (idempotent); raise ``MegatronPatchError`` if one cannot apply."""
    apply_patches(PATCHES)


def patches_applied() -> dict[str, bool]:
    """Name -> whether the patch is in effect in this process (for tests and diagnostics)."""
    return {patch.name: patch.applied() for patch in PATCHES}
