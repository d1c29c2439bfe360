"""The "hf" rollout backend: transformers ``generate`` on CPU behind verl's LLM-server interface.

Extension points (checked against verl 0.9.1): ``RolloutReplicaRegistry.register("hf", ...)`` for the
server side (done by ``verl_oar.cpu.platform``), chosen by ``actor_rollout_ref.rollout.name=hf``; the
worker-side adapter is entered in ``verl.workers.rollout.base._ROLLOUT_REGISTRY`` by
``verl_oar.cpu.verl_patches``.

verl 0.9 generates through "LLM servers": the agent loop sends token ids to a server actor's
``generate`` and gets ``TokenOutput(token_ids, log_probs)`` back; weights reach the server through
the trainer worker's rollout adapter (``update_weights``, the checkpoint engine's "naive" path in the
sync trainer). Here:

- ``HFServer`` (a Ray actor, one per replica) holds a transformers causal LM and answers
  ``generate`` requests with ``model.generate`` (temperature, top_p, top_k from the request, ``n``
  comes from the agent loop sending n requests, stops at EOS or at the response length), returning
  the log-probability of every sampled token; concurrent requests are batched;
- ``HFServerAdapter`` (in each trainer worker) gathers the full parameters from the training engine
  and sends them to the server, so the rollout policy is the trainer's policy;
- ``HFReplica`` starts the server actor.

Log-probs are ``log_softmax(logits / temperature)`` over the whole vocabulary, the quantity verl's
actor computes for ``old_log_probs``; top-k/top-p truncation affects sampling only. (Greedy requests,
temperature 0, return unscaled log-probs.) With fp32 weights on both sides the two agree to float
rounding.

Sleep/wake-up are no-ops: on CPU there is no device memory to give back, and the weights stay loaded.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Generator
from typing import Any

import ray
import torch
from transformers import GenerationConfig
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARN"))

ROLLOUT_NAME = "hf"


def server_actor_name(replica_rank: int, name_suffix: str = "") -> str:
    """Ray actor name of a replica's server; the adapter in the trainer worker looks it up by name."""
    return f"{ROLLOUT_NAME}_server_{replica_rank}_0{name_suffix}"


def _torch_dtype(name: str) -> torch.dtype:
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if name not in table:
        raise ValueError(f"hf rollout: unsupported dtype {name!r}; use one of {sorted(table)}")
    return table[name]


class HFServer:
    """A transformers model answering verl's token-in/token-out ``generate`` requests.

    Concurrent requests (the agent loop sends a step's prompts x n at once) are generated in batches
    of up to ``rollout.max_num_seqs`` left-padded rows with equal settings, one ``model.generate``
    each; a request's tokens and log-probs equal an unbatched generation's up to float rounding.

    Runs as a Ray actor (``ray.remote(HFServer)``); methods mirror the vLLM server's control surface
    that verl calls (wake_up, sleep, clear_kv_cache, abort_all_requests, ...).
    """

    BATCH_WAIT_S = 0.005
    """how long the first request of a batch waits for others (seconds)"""

    def __init__(self, config, model_config, replica_rank: int) -> None:
        from transformers import AutoModelForCausalLM
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import HFModelConfig, RolloutConfig

        self.config: RolloutConfig = (
            omega_conf_to_dataclass(config, RolloutConfig) if not isinstance(config, RolloutConfig) else config
        )
        self.model_config: HFModelConfig = (
            model_config if isinstance(model_config, HFModelConfig) else omega_conf_to_dataclass(model_config)
        )
        self.replica_rank = replica_rank
        self.global_steps: int | None = None
        self.weight_version = 0
        self._lock = threading.Lock()  # one generate or weight update at a time
        self._pending: list[tuple[list[int], tuple, asyncio.Future]] = []  # (prompt ids, settings key, result)
        self._server_task: asyncio.Task | None = None
        self.max_batch_rows = max(1, int(getattr(self.config, "max_num_seqs", 0) or 256))

        override = dict(self.model_config.override_config or {})
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_config.local_path,
            dtype=_torch_dtype(self.config.dtype),
            attn_implementation=override.get("attn_implementation", "sdpa"),
            trust_remote_code=self.model_config.trust_remote_code,
        )
        self.model.eval()
        self.model.requires_grad_(False)
        model_generation_config = self.model.generation_config
        # transformers fills every field a request leaves unset from model.generation_config (a real
        # checkpoint's top_k, repetition_penalty, eos...): start from a clean one so that only the
        # request's sampling parameters apply
        self.model.generation_config = GenerationConfig()

        tokenizer = self.model_config.tokenizer
        eos = set()
        for source in (getattr(tokenizer, "eos_token_id", None), model_generation_config.eos_token_id):
            if isinstance(source, int):
                eos.add(source)
            elif source is not None:
                eos.update(int(x) for x in source)
        self.eos_token_ids = sorted(eos)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = pad if pad is not None else (self.eos_token_ids[0] if self.eos_token_ids else 0)
        self.max_positions = getattr(self.model.config, "max_position_embeddings", None)
        torch.manual_seed(self.config.seed + replica_rank)
        print(
            f"[verl-oar hf rollout] replica {replica_rank}: {type(self.model).__name__} from "
            f"{self.model_config.local_path} ({self.config.dtype}), eos {self.eos_token_ids}",
            flush=True,
        )

    # -------------------------------------------------------------------------------------------
    # generation
    # -------------------------------------------------------------------------------------------

    def _max_new_tokens(self, prompt_len: int, sampling_params: dict[str, Any]) -> int:
        cfg = self.config
        if "max_tokens" in sampling_params:
            max_tokens = int(sampling_params.pop("max_tokens"))
        elif "max_new_tokens" in sampling_params:
            max_tokens = int(sampling_params.pop("max_new_tokens"))
        else:
            max_tokens = min(cfg.response_length, cfg.prompt_length + cfg.response_length - prompt_len)
        limit = cfg.max_model_len or cfg.prompt_length + cfg.response_length
        if self.max_positions:
            limit = min(limit, self.max_positions)
        return max(1, min(max_tokens, cfg.response_length, limit - prompt_len))

    def _request_key(self, prompt_len: int, sampling_params: dict[str, Any]) -> tuple:
        """The generation settings of a request, as a hashable key: requests with equal keys share a
        batch. (max_new_tokens, temperature, top_p, top_k, repetition_penalty, ignore_eos)"""
        params = dict(sampling_params)
        max_new_tokens = self._max_new_tokens(prompt_len, params)
        temperature = float(params.get("temperature", self.config.temperature))
        top_p = params.get("top_p", self.config.top_p)
        top_k = params.get("top_k", self.config.top_k)
        return (
            max_new_tokens,
            temperature,
            float(top_p) if top_p is not None and float(top_p) < 1.0 else 1.0,
            int(top_k) if top_k is not None and int(top_k) > 0 else 0,  # 0 disables top-k
            float(params.get("repetition_penalty", 1.0) or 1.0),
            bool(params.get("ignore_eos", self.config.ignore_eos)),
        )

    @torch.no_grad()
    def _generate_batch(self, prompts: list[list[int]], key: tuple) -> list[tuple[list[int], list[float]]]:
        """One ``model.generate`` over left-padded prompts that share ``key``; per prompt, the new
        token ids (cut after the first EOS) and the log-probability of each."""
        max_new_tokens, temperature, top_p, top_k, repetition_penalty, ignore_eos = key
        greedy = temperature <= 0.0
        fields: dict[str, Any] = {
            "eos_token_id": None if ignore_eos else self.eos_token_ids,
            "pad_token_id": self.pad_token_id,
            "bos_token_id": None,
            "max_new_tokens": max_new_tokens,
            "do_sample": not greedy,
            "return_dict_in_generate": True,
            "output_logits": True,
            "repetition_penalty": repetition_penalty,
        }
        if not greedy:
            fields.update(temperature=temperature, top_p=top_p, top_k=top_k)
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = 1
        with self._lock:
            out = self.model.generate(
                input_ids=input_ids, attention_mask=attention_mask, generation_config=GenerationConfig(**fields)
            )
        new_tokens = out.sequences[:, width:]
        logits = torch.stack(out.logits, dim=1).float()  # (rows, new_tokens, vocab), before any warper
        if not greedy:
            logits = logits / temperature
        log_probs = torch.log_softmax(logits, dim=-1).gather(-1, new_tokens[:, : logits.shape[1], None]).squeeze(-1)
        results = []
        for row in range(len(prompts)):
            token_ids = new_tokens[row].tolist()
            if not ignore_eos:  # a finished row is padded up to the batch's longest
                for i, tok in enumerate(token_ids):
                    if tok in self.eos_token_ids:
                        token_ids = token_ids[: i + 1]
                        break
            results.append((token_ids, log_probs[row, : len(token_ids)].tolist()))
        return results

    async def _serve_pending(self) -> None:
        """Run the queued requests in batches until none is left: requests that arrive while a batch
        generates wait for the next one (vLLM-style batching, without continuous batching)."""
        try:
            while self._pending:
                await asyncio.sleep(self.BATCH_WAIT_S)  # let the rest of a burst of requests arrive
                pending, self._pending = self._pending, []
                groups: dict[tuple, list] = {}
                for request in pending:
                    groups.setdefault(request[1], []).append(request)
                for key, requests in groups.items():
                    for first in range(0, len(requests), self.max_batch_rows):
                        chunk = requests[first : first + self.max_batch_rows]
                        try:
                            results = await asyncio.to_thread(self._generate_batch, [r[0] for r in chunk], key)
                        except Exception as error:  # the callers see the error, the server keeps serving
                            for request in chunk:
                                if not request[2].done():
                                    request[2].set_exception(error)
                            continue
                        for request, result in zip(chunk, results):
                            if not request[2].done():
                                request[2].set_result(result)
        finally:
            self._server_task = None

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: list[Any] | None = None,
        video_data: list[Any] | None = None,
        audio_data: list[Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        priority: int = 0,
        **kwargs: Any,
    ) -> TokenOutput:
        """Token-in/token-out generation for one request (verl's LLM-server contract); concurrent
        requests with the same settings are generated as one batch."""
        if image_data or video_data or audio_data:
            raise NotImplementedError("the hf CPU rollout is text-only")
        prompt_ids = [int(t) for t in prompt_ids]
        want_log_probs = bool(sampling_params.get("logprobs", False))
        done = asyncio.get_running_loop().create_future()
        self._pending.append((prompt_ids, self._request_key(len(prompt_ids), sampling_params), done))
        if self._server_task is None:
            self._server_task = asyncio.create_task(self._serve_pending())
        token_ids, log_probs = await done
        return TokenOutput(
            token_ids=token_ids,
            log_probs=log_probs if want_log_probs else None,
            stop_reason="completed",
            num_preempted=0,
            extra_fields={"global_steps": self.global_steps, "weight_version": self.weight_version},
        )

    # -------------------------------------------------------------------------------------------
    # weights
    # -------------------------------------------------------------------------------------------

    def update_weights(self, named_tensors: dict[str, torch.Tensor], global_steps: int | None = None) -> dict:
        """Load full (unsharded) HF-named tensors into the model; returns {"loaded", "seconds"}.

        Raises on a name the model does not have, or a model parameter left without a value
        (tied weights, e.g. ``lm_head.weight`` tied to the embeddings, may be absent).
        """
        start = time.time()
        with self._lock:
            expected = set(self.model.state_dict().keys())
            unexpected = sorted(set(named_tensors) - expected)
            missing = sorted(expected - set(named_tensors) - set(_tied_parameter_names(self.model)))
            if unexpected or missing:  # checked before loading: a rejected update changes nothing
                raise RuntimeError(
                    f"hf rollout weight update does not match the model: unexpected {unexpected[:5]}, "
                    f"missing {missing[:5]}"
                )
            self.model.load_state_dict(named_tensors, strict=False)
            self.weight_version += 1
        if global_steps is not None:
            self.global_steps = global_steps
        return {"loaded": len(named_tensors), "seconds": time.time() - start}

    def get_state_dict_checksum(self) -> float:
        """Sum of all parameters (a cheap check in tests that a weight update arrived)."""
        with self._lock:
            return float(sum(p.double().sum() for p in self.model.parameters()))

    # -------------------------------------------------------------------------------------------
    # control surface verl calls on servers; nothing to do on CPU
    # -------------------------------------------------------------------------------------------

    def get_server_address(self) -> str:
        return f"hf-replica-{self.replica_rank}"

    async def wake_up(self, tags: list[str] | None = None) -> None:
        return None

    async def sleep(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def wait_for_requests_to_drain(self) -> None:
        return None

    async def abort_all_requests(self, reject_request: bool = False, **kwargs: Any) -> dict[str, Any]:
        return {"aborted_count": 0, "request_ids": []}

    async def abort_request(self, request_id: str, **kwargs: Any) -> dict[str, Any]:
        return {"aborted": False, "request_id": request_id}

    async def resume_generation(self) -> None:
        return None

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None


def _tied_parameter_names(model) -> list[str]:
    names = []
    if getattr(model.config, "tie_word_embeddings", False):
        output = model.get_output_embeddings()
        for name, param in model.named_parameters(remove_duplicate=False):
            if output is not None and param is output.weight:
                names.append(name)
    return names


class HFReplica(RolloutReplica):
    """One hf rollout server (a Ray actor on the trainer's node); verl's ``RolloutReplica`` contract."""

    async def launch_servers(self) -> None:
        name = server_actor_name(self.replica_rank, self.name_suffix)
        server_cls = ray.remote(HFServer)
        server = server_cls.options(
            name=name,
            num_cpus=0,  # shares the trainer's cores; Ray CPU slots are budgeted for verl's own actors
            max_concurrency=self.max_concurrency,
        ).remote(config=self.config, model_config=self.model_config, replica_rank=self.replica_rank)
        self.servers = [server]
        self._server_handle = server
        self._server_address = await server.get_server_address.remote()

    async def sleep(self) -> None:
        await asyncio.gather(*[server.sleep.remote() for server in self.servers])


class HFServerAdapter(BaseRollout):
    """Trainer-worker side of the hf rollout: pushes the engine's full weights to the server actor.

    Every rank iterates the weight generator (FSDP gathers each full tensor collectively); the
    first rank of each replica sends them.
    """

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1) -> None:
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        rollout_world_size = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank = rank // rollout_world_size if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % rollout_world_size
        self._has_server = self.rollout_rank == 0
        self.server_handle = None

    def _server(self):
        if self._has_server and self.server_handle is None:
            self.server_handle = ray.get_actor(server_actor_name(self.replica_rank))
        return self.server_handle

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None

    @torch.no_grad()
    async def update_weights(
        self,
        weights: Generator[tuple[str, torch.Tensor], None, None],
        wire_format: str = "named_tensors",
        global_steps: int | None = None,
        peft_config: Any = None,
        **kwargs: Any,
    ) -> None:
        from verl.workers.rollout.utils import ensure_async_iterator

        if wire_format != "named_tensors":
            raise NotImplementedError(f"hf rollout supports wire_format='named_tensors' only, got {wire_format!r}")
        if peft_config is not None:
            raise NotImplementedError(
                "hf rollout takes merged weights only (set actor_rollout_ref.model.lora.merge=True)"
            )
        named: dict[str, torch.Tensor] = {}
        async for name, tensor in ensure_async_iterator(weights):
            if self._has_server:
                named[name] = tensor.detach().to("cpu").clone()
        server = self._server()
        if server is not None:
            info = await server.update_weights.remote(named, global_steps)
            logger.info("hf rollout: replica %d loaded %d tensors", self.replica_rank, info["loaded"])
