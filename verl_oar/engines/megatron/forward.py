"""verl's Megatron forward, for OAR: full-vocabulary logits at chosen positions, embeddings hookable.

Shared by OAR-G (``engines.megatron.gradient``) and OAR-P (``engines.megatron.perturbation``) on
verl's ``MegatronEngineWithLMHead``. verl extension points: ``engine.module`` (the list of model
chunks; one, since virtual pipeline stages are refused), ``verl.models.mcore.get_mcore_engine_forward_fn``
(verl's own packing, called as ``MegatronEngineWithLMHead.forward_step`` calls it) and, when the
pass is also verl's old-log-prob pass, ``engine._lm_head_logits_processor`` (verl's own log-prob /
entropy computation); checked against verl 0.9.1 by reading, and on a GPU by ``tests/gpu``.

Megatron facts this relies on (megatron-core's ``GPTModel``; checked on megatron-core 0.16.1 on the CPU, padded
layout, TP = 1 / 2 with and without sequence parallelism, by ``tests/engine/test_megatron_real_on_cpu.py``):

* ``GPTModel.embedding`` (``LanguageModelEmbedding``) returns [S, B, H]; with sequence
  parallelism it scatters inside the module, so a forward hook sees TP rank r's rows
  [r S/tp, (r+1) S/tp) only. Replacing its output is how noise goes in and the gradient comes out.
* Without sequence parallelism every TP rank holds all S rows and, after Megatron's own
  all-reduces in backward, the same full gradient; with it, each rank holds the full gradient of
  its own rows (reduce-scatter in backward). Hidden size H is never split.
* Logits come back [B, S, V/tp] (``parallel_output``): all S positions on every TP rank, the
  vocabulary split in rank order. They are gathered with megatron's autograd-aware
  ``gather_from_tensor_model_parallel_region`` (all-gather forward, keep-own-slice backward),
  which is exact because every TP rank computes the same objective from the same gathered logits.

The layout is computed here (``verl_oar.engines.megatron.layout``) and checked against what the embedding
actually receives on every call: if verl's packing ever differs, the call fails instead of scoring
the wrong tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
from tensordict import TensorDict
from torch import Tensor

from verl_oar.engines.megatron.layout import (
    MegatronLayout,
    bshd_fp8_align,
    bshd_layout,
    gather_sequence_shards,
    sequence_shard,
    thd_layout,
)


def bshd_forced_max_seqlen(engine, data: TensorDict) -> int | None:
    """The row length verl's Megatron engine pads every BSHD micro-batch to (the batch's longest
    sample, ``pad_bshd_to_minibatch_max``), as ``forward_backward_batch`` sets it; None for THD."""
    config = engine.engine_config
    if config.use_remove_padding or not getattr(config, "pad_bshd_to_minibatch_max", False):
        return None
    return int(data["input_ids"].offsets().diff().max())


class MegatronLogits:
    """Run verl's Megatron model on rows of token ids; return full-vocabulary logits at chosen positions.

    ``transform`` (optional) replaces the embedding output [S_local, B, H] of the call (a forward
    hook on ``GPTModel.embedding``); ``S_local`` is S / TP under sequence parallelism, else S.
    """

    def __init__(self, engine):
        from megatron.core import parallel_state as mpu
        from verl.models.mcore import get_mcore_engine_forward_fn
        from verl.utils.megatron_utils import unwrap_model

        _check_parallelism(engine, mpu)
        hf_config = engine.model_config.hf_config
        if hasattr(hf_config, "vision_config"):
            raise ValueError(
                "OAR importance on verl's Megatron engine supports text-only models; this model has a vision "
                "encoder. Use actor_rollout_ref.actor.strategy=fsdp2 for it, or algorithm.adv_estimator=grpo."
            )
        self.engine = engine
        self.model = engine.module[0]
        self.gpt = unwrap_model(self.model)
        self.embedding = getattr(self.gpt, "embedding", None)
        if self.embedding is None:
            raise RuntimeError(
                f"{type(self.gpt).__name__} has no .embedding: not a megatron-core GPTModel on its first stage"
            )
        self.tp_group = mpu.get_tensor_model_parallel_group()
        self.tp_size = mpu.get_tensor_model_parallel_world_size()
        self.tp_rank = mpu.get_tensor_model_parallel_rank()
        self.sequence_parallel = bool(self.gpt.config.sequence_parallel) and self.tp_size > 1
        self.thd = bool(engine.engine_config.use_remove_padding)
        if self.thd and next(self.gpt.parameters()).device.type == "cpu":
            raise ValueError(
                "OAR importance on verl's Megatron engine on the CPU supports the padded (BSHD) layout only: "
                "the packed (THD) layout needs TransformerEngine's attention, which needs CUDA. Set "
                "actor_rollout_ref.model.use_remove_padding=False (and ref.model the same) to run on the CPU."
            )
        self.fp8 = getattr(self.gpt.config, "fp8", None) in ("e4m3", "hybrid")
        self.vocab_size = int(hf_config.vocab_size)
        self.hidden_size = int(hf_config.hidden_size)
        config = engine.engine_config
        self.pad_to_length_bucket = config.pad_to_length_bucket if (config.pad_to_length and self.thd) else None
        self.forward_fn = get_mcore_engine_forward_fn(hf_config)

    # -- layout ---------------------------------------------------------------------------------

    def layout(self, lengths: list[int], forced_max_seqlen: int | None = None) -> MegatronLayout:
        """The (B, S) grid verl packs these samples into (mirrors ``preprocess_thd_engine`` /
        ``preprocess_bshd_engine`` at context parallel size 1)."""
        align = self.tp_size
        if self.thd:
            total_align = 1
            if self.fp8:
                align, total_align = math.lcm(16, self.tp_size), self.tp_size * 128
            if self.pad_to_length_bucket is not None:
                total_align = math.lcm(total_align, int(self.pad_to_length_bucket))
            return thd_layout(lengths, align, total_align)
        if self.fp8:
            align = bshd_fp8_align(len(lengths), self.tp_size)
        return bshd_layout(lengths, align, forced_max_seqlen)

    def local_rows(self, x: Tensor) -> Tensor:
        """This TP rank's rows of a sequence-first [S, ...] tensor: all under plain TP, its shard under SP."""
        return sequence_shard(x, self.tp_rank, self.tp_size) if self.sequence_parallel else x

    def gather_rows(self, local: Tensor) -> Tensor:
        """Inverse of :meth:`local_rows`: every TP rank gets the whole [S, ...] tensor."""
        if not self.sequence_parallel:
            return local
        local = local.contiguous()
        shards = [torch.empty_like(local) for _ in range(self.tp_size)]
        torch.distributed.all_gather(shards, local, group=self.tp_group)
        return gather_sequence_shards(shards)

    # -- the call -------------------------------------------------------------------------------

    def __call__(
        self,
        input_ids: Tensor,
        layout: MegatronLayout,
        select: Tensor,
        transform: Callable[[Tensor], Tensor] | None = None,
        log_prob_batch: TensorDict | None = None,
    ) -> tuple[Tensor, dict]:
        """One forward pass.

        Args:
            input_ids: nested (bs, len_i) long, on the device; ``layout`` must be ``self.layout`` of its lengths.
            select: (N,) long flat grid positions (``layout``'s row-major B x S) whose logits are wanted.
            transform: replaces the embedding output (see the class docstring); None keeps it.
            log_prob_batch: the micro-batch, when this pass is also verl's old-log-prob pass: verl's
                own logits processor then runs on (a copy of) the logits, under no_grad.

        Returns:
            (N, vocab_size) logits as the model returns them (differentiable if grad is enabled),
            identical on every TP rank; and verl's outputs (``log_probs``, ``entropy``, ... nested
            (bs, len_i), detached), empty without ``log_prob_batch``.
        """
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        expected_ids = layout.to_layout(list(input_ids.unbind()), 0)
        local_len = layout.cols // self.tp_size if self.sequence_parallel else layout.cols
        captured: dict[str, Tensor] = {}

        def on_embedding(_module, args, kwargs, output):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is None or tuple(ids.shape) != layout.shape or not torch.equal(ids, expected_ids.to(ids.device)):
                raise RuntimeError(
                    "verl's Megatron packing does not match verl-oar's layout "
                    f"(embedding input {None if ids is None else tuple(ids.shape)}, expected {layout.shape}); "
                    "this verl version is not supported by OAR on Megatron. Install verl==0.9.1, or use "
                    "actor_rollout_ref.actor.strategy=fsdp2."
                )
            if tuple(output.shape[:2]) != (local_len, layout.rows):
                raise RuntimeError(
                    f"GPTModel.embedding returned {tuple(output.shape)}, expected ({local_len}, {layout.rows}, H): "
                    "[S, B, H] sequence-first, split over the TP ranks under sequence parallelism"
                )
            return transform(output) if transform is not None else output

        verl_processor = self._verl_processor(log_prob_batch) if log_prob_batch is not None else None

        def processor(logits: Tensor, **args) -> dict:
            if tuple(logits.shape[:2]) != layout.shape:
                raise RuntimeError(f"logits have shape {tuple(logits.shape)}, expected {layout.shape} + (V/tp,)")
            picked = logits.flatten(0, 1).index_select(0, select.to(logits.device))  # (N, V/tp)
            if select.numel() == 0:
                captured["logits"] = picked.new_zeros(0, self.vocab_size)
            else:
                if self.tp_size > 1:
                    picked = gather_from_tensor_model_parallel_region(picked)  # the TP group (no group arg: older mcore)
                if picked.shape[-1] < self.vocab_size:
                    raise RuntimeError(f"gathered logits have {picked.shape[-1]} columns, vocab_size={self.vocab_size}")
                captured["logits"] = picked[:, : self.vocab_size]  # drop Megatron's vocabulary padding
            if verl_processor is None:
                return {}
            with torch.no_grad():  # verl divides the logits in place: give it its own copy
                return verl_processor(logits.detach().clone() if torch.is_grad_enabled() else logits, **args)

        args = self._log_prob_args(input_ids, log_prob_batch) if log_prob_batch is not None else {}
        handle = self.embedding.register_forward_hook(on_embedding, with_kwargs=True)
        try:
            outputs = self.forward_fn(
                self.model,
                input_ids,
                {},
                logits_processor=processor,
                logits_processor_args=args,
                vision_model=False,
                pad_token_id=self.engine.model_config.tokenizer.pad_token_id,
                data_format="thd" if self.thd else "bshd",
                mtp_enable_train=False,
                local_cp_size=None,
                forced_max_seqlen=None if self.thd else layout.cols,  # BSHD: the row length of ``layout``
                pad_to_length_bucket=self.pad_to_length_bucket,
                cp_layout="zigzag",
            )
        finally:
            handle.remove()
        if "logits" not in captured:
            raise RuntimeError("verl's Megatron forward returned without calling the logits processor")
        return captured["logits"], {k: v.detach() for k, v in (outputs or {}).items()}

    def _verl_processor(self, batch: TensorDict):
        from verl.utils import tensordict_utils as tu

        for key in ("distillation_use_topk", "distillation_only"):
            if tu.get_non_tensor_data(batch, key=key, default=False):
                raise ValueError(
                    f"OAR importance cannot be fused with a {key} log-prob pass; set algorithm.oar.fuse_log_prob=false"
                )
        return partial(
            self.engine._lm_head_logits_processor,
            calculate_sum_pi_squared=tu.get_non_tensor_data(batch, key="calculate_sum_pi_squared", default=False),
            calculate_entropy=tu.get_non_tensor_data(batch, key="calculate_entropy", default=False),
            distillation_use_topk=False,
            distillation_only=False,
            logits_processor_func=None,
            batch=batch,
            data_format="thd" if self.thd else "bshd",
        )

    @staticmethod
    def _log_prob_args(input_ids: Tensor, batch: TensorDict) -> dict:
        """``label`` and ``temperature`` exactly as ``MegatronEngineWithLMHead.forward_step`` builds them."""
        import verl.utils.torch_functional as verl_F

        temperature = batch["temperature"]
        if not isinstance(temperature, torch.Tensor):
            temperature = torch.tensor([temperature] * input_ids.shape[0], device=input_ids.device)
        temperature = temperature.to(torch.float32).reshape(-1)
        if temperature.numel() == 1 and input_ids.shape[0] > 1:
            temperature = temperature.expand(input_ids.shape[0]).contiguous()
        return {"label": input_ids.clone(), "temperature": verl_F.expand_as_nested(temperature, input_ids)}


def _check_parallelism(engine, mpu) -> None:
    """What the start-up checks refuse, checked again where it matters (a config that bypassed them)."""
    settings = {
        "pipeline_model_parallel_size": mpu.get_pipeline_model_parallel_world_size(),
        "context_parallel_size": mpu.get_context_parallel_world_size(),
        "virtual_pipeline_model_parallel_size (model chunks)": len(engine.module),
    }
    bad = {k: v for k, v in settings.items() if v not in (None, 1)}
    if bad or getattr(engine.engine_config, "dynamic_context_parallel", False):
        raise ValueError(
            "OAR importance on verl's Megatron engine needs one pipeline stage and no context parallelism; "
            f"got {bad or 'dynamic_context_parallel=True'}. "
            "Set actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1, context_parallel_size=1, "
            "virtual_pipeline_model_parallel_size=null, dynamic_context_parallel=False (shard with "
            "tensor_model_parallel_size and sequence_parallel instead)."
        )
