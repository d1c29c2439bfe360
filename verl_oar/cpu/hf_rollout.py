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

Sampling is reproducible, so that a run resumed from a checkpoint rolls out what the uninterrupted
run did. Each sampled request draws from a ``torch.Generator`` of its own, one uniform number per
token (inverse CDF after temperature, top-k and top-p), seeded from a hash of: ``rollout.seed``, the
replica, the trainer step of the loaded weights (the ``global_steps`` verl's sync trainer passes with
the weight update after start-up or checkpoint loading and after every step), the request's settings,
its prompt ids, and its rank among the requests with this prompt and these settings since the last
weight update. Requests with one prompt are interchangeable (the agent loop sends each prompt n times),
so a step's multiset of (prompt, response) depends on that alone: not on torch's global RNG, on the
order in which requests arrive, or on how they are batched. A batch closes once no request has arrived
for ``BATCH_WAIT_S`` and its rows are sorted by (prompt, seed), so a step's burst of requests becomes
the same batch in both runs, with bit-identical tokens and log-probs (fp32, same torch build and
thread count). Limits: a burst split differently (requests more than ``BATCH_WAIT_S`` apart, or more
than ``max_num_seqs`` of them) changes log-probs by float rounding, which can flip a token sampled
within that rounding of a boundary of its cumulative distribution; without a ``global_steps`` the count
of weight updates stands in for the step, and a resumed run restarts that count; equal prompts of two
groups in one step may swap responses between the groups; several replicas need the same routing of
requests to replicas in both runs.

Sleep/wake-up are no-ops: on CPU there is no device memory to give back, and the weights stay loaded.

Why this loop stays beside verl's own vLLM rollout on vLLM's CPU build (``launch --rollout vllm``): vLLM's CPU
attention takes head widths of 32, 64, 80, ... only, and the CPU workspace's and the testbed's models have 16-wide
heads; vLLM is an optional extra of 2.2 GB; and the seeded sampling above is what lets the resume tests compare a
resumed run with an uninterrupted one bit for bit. On a model both take, the two decode the same greedy
continuations and return the actor's log-probs (tests/engine/test_hf_loop_vs_vllm_on_cpu.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import threading
import time
from collections.abc import Generator
from typing import Any, NamedTuple

import ray
import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
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


class _Row(NamedTuple):
    """One request as a row of a batch: its prompt ids and its sampling seed (unused when greedy)."""

    prompt_ids: list[int]
    seed: int


class _SeededSampler(LogitsProcessor):
    """Samples each row's next token from the row's own ``torch.Generator``, so that a row's tokens
    depend on its seed and its own logits only, not on the other rows or on torch's global RNG.

    Applies temperature, top-k and top-p with transformers' own warpers (the order ``generate`` uses
    when sampling), then picks by inverse CDF with one uniform number per row and token; returns
    scores that are 0 at the picked token and -inf elsewhere, so that ``generate`` in greedy mode
    takes exactly that token. ``output_logits`` still returns the model's raw logits.
    """

    def __init__(self, seeds: list[int], temperature: float, top_k: int, top_p: float) -> None:
        self.generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        warpers = []
        if temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(temperature))
        if top_k > 0:
            warpers.append(TopKLogitsWarper(top_k=top_k))
        if top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=top_p))
        self.warpers = LogitsProcessorList(warpers)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = self.warpers(input_ids, scores)
        cdf = torch.softmax(scores.double(), dim=-1).cumsum(dim=-1)
        uniform = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in self.generators])
        # the first token whose cumulative probability exceeds u * total: never a zero-probability one
        picks = torch.searchsorted(cdf, (uniform * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
        picks = picks.clamp_(max=scores.shape[-1] - 1)
        chosen = torch.full_like(scores, float("-inf"))
        chosen[torch.arange(scores.shape[0]), picks] = 0.0
        return chosen


class HFServer:
    """A transformers model answering verl's token-in/token-out ``generate`` requests.

    Concurrent requests (the agent loop sends a step's prompts x n at once) are generated in batches
    of up to ``rollout.max_num_seqs`` left-padded rows with equal settings, one ``model.generate``
    each; a request's tokens and log-probs equal an unbatched generation's up to float rounding.
    Sampling is seeded per request (module docstring): reproducible across runs and resumption.

    Runs as a Ray actor (``ray.remote(HFServer)``); methods mirror the vLLM server's control surface
    that verl calls (wake_up, sleep, clear_kv_cache, abort_all_requests, ...).
    """

    BATCH_WAIT_S = 0.02
    """a batch closes once no request has arrived for this long (seconds)..."""
    BATCH_MAX_WAIT_S = 1.0
    """...or this long after its first request"""

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
        self._pending: list[tuple[_Row, tuple, asyncio.Future]] = []  # (row, settings key, result)
        self._seen_since_update: dict[tuple, int] = {}  # (settings key, prompt ids) -> requests so far
        self._seen_for: Any = None  # the (weights' step, weight version) _seen_since_update counts for
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
        print(
            f"[verl-oar hf rollout] replica {replica_rank}: {type(self.model).__name__} from "
            f"{self.model_config.local_path} ({self.config.dtype}), eos {self.eos_token_ids}, "
            f"torch threads {torch.get_num_threads()}",
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

    def _weights_step(self) -> Any:
        """The trainer step of the loaded weights, as verl passed it with the last weight update;
        the number of weight updates where verl passed none."""
        return self.global_steps if self.global_steps is not None else ("weight_updates", self.weight_version)

    def _request_seed(self, prompt_ids: list[int], key: tuple) -> int:
        """The sampling seed of a request: a hash of (rollout seed, replica, the weights' step, the
        settings, the prompt, and how many requests with this prompt and these settings came before
        it since the last weight update). Called once per request, on arrival, on the event loop."""
        step = self._weights_step()
        if (step, self.weight_version) != self._seen_for:
            self._seen_since_update.clear()
            self._seen_for = (step, self.weight_version)
        count_key = (key, tuple(prompt_ids))
        occurrence = self._seen_since_update.get(count_key, 0)
        self._seen_since_update[count_key] = occurrence + 1
        digest = hashlib.blake2b(digest_size=8)
        digest.update(repr((int(self.config.seed), self.replica_rank, step, key, occurrence)).encode())
        digest.update(torch.tensor(prompt_ids, dtype=torch.int64).numpy().tobytes())
        return int.from_bytes(digest.digest(), "little") >> 1  # torch seeds are < 2**64; keep it positive

    @torch.no_grad()
    def _generate_batch(self, rows: list[_Row], key: tuple) -> list[tuple[list[int], list[float]]]:
        """One ``model.generate`` over left-padded prompts that share ``key``; per row, the new
        token ids (cut after the first EOS) and the log-probability of each. A sampled row draws
        from its own generator (``_SeededSampler``)."""
        max_new_tokens, temperature, top_p, top_k, repetition_penalty, ignore_eos = key
        greedy = temperature <= 0.0
        fields: dict[str, Any] = {
            "eos_token_id": None if ignore_eos else self.eos_token_ids,
            "pad_token_id": self.pad_token_id,
            "bos_token_id": None,
            "max_new_tokens": max_new_tokens,
            "do_sample": False,  # sampling is _SeededSampler's, which hands generate a one-hot choice
            "return_dict_in_generate": True,
            "output_logits": True,
            "repetition_penalty": repetition_penalty,
        }
        processors = LogitsProcessorList()
        if not greedy:  # runs after generate's own processors (repetition penalty), as its warpers would
            processors.append(_SeededSampler([r.seed for r in rows], temperature, top_k, top_p))
        prompts = [r.prompt_ids for r in rows]
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = 1
        with self._lock:
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=GenerationConfig(**fields),
                logits_processor=processors,
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
                await self._wait_for_burst()
                pending, self._pending = self._pending, []
                groups: dict[tuple, list] = {}
                for request in pending:
                    groups.setdefault(request[1], []).append(request)
                for key in sorted(groups, key=repr):
                    # rows in an order that does not depend on arrival: the same burst, the same batches
                    requests = sorted(groups[key], key=lambda r: (r[0].prompt_ids, r[0].seed))
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

    async def _wait_for_burst(self) -> None:
        """Wait until no request has arrived for ``BATCH_WAIT_S`` (at most ``BATCH_MAX_WAIT_S``):
        the agent loop's requests of a step reach the server over some milliseconds."""
        waited, seen = 0.0, -1
        while len(self._pending) != seen and waited < self.BATCH_MAX_WAIT_S:
            seen = len(self._pending)
            await asyncio.sleep(self.BATCH_WAIT_S)
            waited += self.BATCH_WAIT_S

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
        key = self._request_key(len(prompt_ids), sampling_params)
        self._pending.append((_Row(prompt_ids, self._request_seed(prompt_ids, key)), key, done))
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
            if global_steps is not None:
                self.global_steps = global_steps
            self.weight_version += 1
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


def replica_setters_available() -> bool:
    """True when verl's ``RolloutReplica.server_handle`` / ``server_address`` have setters (the upstream PR
    ``replica-servers``): the replica then publishes its server through them, not verl's private attributes."""
    return all(isinstance(getattr(RolloutReplica, name, None), property) and getattr(RolloutReplica, name).fset
               for name in ("server_handle", "server_address"))


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
        address = await server.get_server_address.remote()
        if replica_setters_available():
            self.server_handle, self.server_address = server, address
        else:  # verl without the replica-servers PR: its replicas' contract is the private attributes
            self._server_handle, self._server_address = server, address

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
