"""The fast runner's rollout and reward: CPU mode's "hf" rollout server called in-process, without Ray.

Every piece is the one ``python -m verl.trainer.main_ppo`` runs in CPU mode, called directly:

- prompts: verl's single-turn agent loop's tokenization (``SingleTurnAgentLoop.run``): its Continuous Token
  builder (``create_continuous_token_builder`` for the model's ``model_type``) renders the dataset row's
  ``raw_prompt``, capped at ``rollout.prompt_length`` as ``AgentLoopBase._cap_text_prompt_length`` does;
- sampling: :class:`verl_oar.cpu.hf_rollout.HFServer` itself (an instance, not a Ray actor), through its
  own ``generate`` coroutine: the same per-request seeds (``rollout.seed``, replica 0, the step of the loaded
  weights, the request's settings, its prompt ids and its rank among equal prompts) and the same burst
  batching (a step's requests all arrive at once, as the agent loop sends them: one batch, rows sorted by
  (prompt, seed)); sampling parameters as verl's ``AgentLoopWorkerTQ.generate_sequences`` builds them
  (``val_kwargs`` for validation, greedy here);
- responses: the builder's ``merge_assistant_tokens`` / ``align_response_metadata``, cut at
  ``rollout.response_length``, as the agent loop;
- reward: ``reward.custom_reward_function`` loaded by verl's ``get_custom_reward_fn``, called as verl's naive
  reward manager calls it (the response decoded with ``skip_special_tokens=True``; a float result is the
  score and its ``acc``), placed on the last response token (``rm_scores``).

Rows are plain Python (token id lists); the actor side (``fast_actor``) turns them into verl's tensors.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Rollout", "Sample"]


@dataclass
class Sample:
    """One rollout: a prompt's row and one response, as verl's agent loop stores it in TransferQueue."""

    uid: str
    """the prompt's uid (one GRPO group)"""
    session: int
    """0..n-1: the response's session id (the TransferQueue key is ``{uid}_{session}_0``)"""
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    rollout_log_probs: list[float] | None
    score: float = 0.0
    reward_extra_info: dict = field(default_factory=dict)
    row: dict = field(default_factory=dict, repr=False)
    """the dataset row (``raw_prompt``, ``data_source``, ``reward_model``, ``extra_info``, ...)"""

    @property
    def key(self) -> str:
        return f"{self.uid}_{self.session}_0"


class Rollout:
    """The hf rollout server, tokenization and reward of one run (``config``: verl's composed ppo config)."""

    def __init__(self, config) -> None:
        from verl.trainer.ppo.reward import get_custom_reward_fn
        from verl.utils.config import omega_conf_to_dataclass
        from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

        from verl_oar.cpu.hf_rollout import HFServer

        self.config = config
        self.model_config = omega_conf_to_dataclass(config.actor_rollout_ref.model)
        rollout = config.actor_rollout_ref.rollout
        self.server = HFServer(rollout, self.model_config, replica_rank=0)
        self.tokenizer = self.model_config.tokenizer
        model_type = getattr(self.model_config.hf_config, "model_type", None)
        self.builder = create_continuous_token_builder(
            self.tokenizer,
            hf_model_type=model_type if isinstance(model_type, str) else None,
            chat_template_kwargs=config.data.get("apply_chat_template_kwargs", {}),
            mm_processor_kwargs=config.data.get("mm_processor_kwargs", {}),
            processor=self.model_config.processor,
        )
        self.prompt_length = int(rollout.prompt_length)
        self.response_length = int(rollout.response_length)
        self.n = int(rollout.n)
        self.val_n = int(rollout.val_kwargs.n)
        self.reward_fn = get_custom_reward_fn(config)
        if self.reward_fn is None:
            raise ValueError("the fast runner scores with reward.custom_reward_function (the testbed's reward.py); "
                             "this config has none: run main_ppo for a reward model or another reward manager")
        self.train_params = dict(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                                 repetition_penalty=1.0, logprobs=rollout.calculate_log_probs)
        self.val_params = dict(self.train_params, top_p=rollout.val_kwargs.top_p, top_k=rollout.val_kwargs.top_k,
                               temperature=rollout.val_kwargs.temperature)

    # -------------------------------------------------------------------------------------------
    # weights
    # -------------------------------------------------------------------------------------------

    def load_weights(self, named_tensors: dict, global_steps: int) -> None:
        """The trainer's weights after ``global_steps`` steps (what the sync trainer's ``update_weights`` sends)."""
        self.server.update_weights(named_tensors, global_steps)

    # -------------------------------------------------------------------------------------------
    # rollout
    # -------------------------------------------------------------------------------------------

    def prompt_ids(self, raw_prompt) -> list[int]:
        """The agent loop's prompt ids of one dataset row's ``raw_prompt`` (chat messages)."""
        ids = self.builder.build_initial_tokens(list(raw_prompt))
        return ids[-self.prompt_length:] if len(ids) > self.prompt_length else ids

    def rollout(self, rows: list[dict], uids: list[str], *, validate: bool) -> list[Sample]:
        """Sample ``n`` responses per row (``val_kwargs.n`` with ``validate``) as one burst of requests, score them.

        Returns the samples prompt-major (row 0's sessions 0..n-1, then row 1's, ...)."""
        params = self.val_params if validate else self.train_params
        n = self.val_n if validate else self.n
        prompts = [self.prompt_ids(row["raw_prompt"]) for row in rows]
        requests = [(i, s) for i in range(len(rows)) for s in range(n)]
        outputs = asyncio.run(self._generate([prompts[i] for i, _ in requests], params))
        samples = []
        for (i, session), output in zip(requests, outputs, strict=True):
            merged = self.builder.merge_assistant_tokens(prompts[i], output.token_ids)
            mask, log_probs = self.builder.align_response_metadata(
                merged, [], [] if output.log_probs else None,
                assistant_logprobs=output.log_probs if output.log_probs else None,
            )
            response = merged.token_ids[-len(mask):] if mask else []
            prompt = merged.token_ids[: len(merged.token_ids) - len(mask)]
            samples.append(Sample(
                uid=uids[i], session=session, prompt_ids=list(prompt),
                response_ids=list(response[: self.response_length]), response_mask=list(mask[: self.response_length]),
                rollout_log_probs=list(log_probs[: self.response_length]) if log_probs else None, row=rows[i],
            ))
        for sample in samples:
            self.score(sample)
        return samples

    async def _generate(self, prompts: list[list[int]], params: dict) -> list:
        """All requests at once, as the agent loop sends a step's: the server batches them as one burst."""
        return await asyncio.gather(*(
            self.server.generate(prompt_ids=p, sampling_params=dict(params), request_id=f"fast-{i}")
            for i, p in enumerate(prompts)
        ))

    def score(self, sample: Sample) -> None:
        """verl's naive reward manager (``run_single``) on one sample."""
        row = sample.row
        extra_info = dict(row.get("extra_info") or {})
        extra_info.update(num_turns=2, rollout_reward_scores={})  # single-turn agent loop: 2 turns
        text = self.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
        result: Any = self.reward_fn(data_source=row["data_source"], solution_str=text,
                                     ground_truth=row["reward_model"]["ground_truth"], extra_info=extra_info)
        if isinstance(result, dict):
            sample.score = float(result["score"])
            sample.reward_extra_info = dict(result)
        else:
            sample.score = float(result)
            sample.reward_extra_info = {"acc": result}
