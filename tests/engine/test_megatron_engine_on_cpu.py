"""OAR on verl's Megatron engine in the packed (THD) layout, and the Megatron seams, on the CPU with a toy model.

The padded (BSHD) layout runs on a real megatron-core ``GPTModel`` in
``tests/engine/test_megatron_real_on_cpu.py``. The packed layout cannot run here with real megatron-core
(its attention over packed sequences needs TransformerEngine, i.e. CUDA), so for THD ``GPTModel`` is
replaced by a toy model with the same interface as ``engines.megatron.forward.MegatronLogits`` sees it:
sequence-first [S, B, H] embeddings that each tensor-parallel rank holds a shard of under sequence
parallelism, a per-sample causal mixer that respects verl's packing, batch-first [B, S, V] logits. What
runs for real:

* OAR-G: ``engines.megatron.gradient.gradient_in_megatron_forward`` (THD layout, masks, per-sequence noise
  sliced to the rank's shard, clean and noisy passes, ``backward`` with frozen parameters, scores,
  all-gather of the shards in rank order) on a 2-rank gloo group standing in for TP = 2, with and
  without sequence parallelism; compared with ``importance.gradient`` run per sequence, unpacked (the
  reference the FSDP engine is checked against); every rank must return the same scores, and
  parameters, grads and MoE router counters (no MoE in the real test) are left as found;
* OAR-P: ``engines.megatron.perturbation.MegatronRowsModel`` under ``batched_perturbation_importance``
  (copies of all samples in shared packed calls) against the naive per-copy loop, THD.

The ranks run in subprocesses (this file's ``__main__``): torch.distributed's group is process-global.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

HIDDEN, VOCAB = 8, 37


class ToyGPT(torch.nn.Module):
    """Stand-in for GPTModel on a packed grid: embedding, tanh layer, causal mean over the same
    sample's earlier positions, output layer. float64, so engine and reference agree to rounding."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64))
        self.layer = torch.nn.Parameter(torch.randn(HIDDEN, HIDDEN, generator=g, dtype=torch.float64) / 3)
        self.out = torch.nn.Parameter(torch.randn(HIDDEN, VOCAB, generator=g, dtype=torch.float64))
        self.router = torch.nn.Module()  # like a MoE router: counts tokens in grad-enabled forwards
        self.router.local_tokens_per_expert = torch.zeros(3)

    def logits(self, x_sb: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        """[S, B, H] embeddings, (B, S) sample of each position (-1 padding) -> [B, S, V]."""
        if torch.is_grad_enabled():
            self.router.local_tokens_per_expert += 1.0
        h = torch.tanh(x_sb @ self.layer)                                   # [S, B, H]
        s = sample.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        same = (sample.unsqueeze(2) == sample.unsqueeze(1)) & (sample.unsqueeze(2) >= 0) & causal  # (B, S, S)
        weights = same.to(h.dtype) / same.sum(-1, keepdim=True).clamp(min=1)
        mixed = torch.einsum("bpq,qbh->pbh", weights, h)
        return ((h + mixed) @ self.out).transpose(0, 1)                     # [B, S, V]

    def sequence_logits(self, embeds: torch.Tensor) -> torch.Tensor:
        """One unpacked sequence, batch-first (1, T, H) -> (1, T, V): the reference's model."""
        return self.logits(embeds.transpose(0, 1), torch.zeros(1, embeds.shape[1], dtype=torch.long))


class _GatherReplicated(torch.autograd.Function):
    """Sequence-parallel all-gather for a model whose later computation every rank repeats in full:
    backward keeps this rank's rows (each rank already holds the whole gradient)."""

    @staticmethod
    def forward(ctx, local, rank, world):
        shards = [torch.empty_like(local) for _ in range(world)]
        torch.distributed.all_gather(shards, local.contiguous())
        ctx.rank, ctx.rows = rank, local.shape[0]
        return torch.cat(shards)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows], None, None


def fake_forward(toy: ToyGPT, tp_size: int, tp_rank: int, sequence_parallel: bool, thd: bool):
    """A ``MegatronLogits`` over the toy model: its real ``layout`` / ``local_rows`` / ``gather_rows``."""
    from verl_oar.engines.megatron.forward import MegatronLogits

    class FakeMegatronLogits(MegatronLogits):
        def __init__(self):  # no megatron: set what the methods read
            self.tp_group, self.tp_size, self.tp_rank = None, tp_size, tp_rank
            self.sequence_parallel, self.thd, self.fp8 = sequence_parallel, thd, False
            self.pad_to_length_bucket, self.hidden_size, self.vocab_size = None, HIDDEN, VOCAB

        def __call__(self, input_ids, layout, select, transform=None, log_prob_batch=None):
            assert log_prob_batch is None
            ids = layout.to_layout(list(input_ids.unbind()), 0)
            sample, _ = layout.owners()
            local = self.local_rows(toy.embed[ids].transpose(0, 1))          # this rank's [S_local, B, H]
            if transform is not None:
                local = transform(local)
            full = _GatherReplicated.apply(local, tp_rank, tp_size) if self.sequence_parallel else local
            logits = toy.logits(full, sample)
            return logits.flatten(0, 1).index_select(0, select), {}

    return FakeMegatronLogits()


def make_micro_batch(seed: int):
    """Rows of prompt + response with reasoning / predicting masks as ``engines.inputs`` builds them:
    reasoning tokens, then answer tokens (their predicting positions are one earlier), then eos. One
    sample has no answer, one no reasoning."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    from verl_oar.engines.inputs import PREDICT, REASONING, nested

    g = torch.Generator().manual_seed(seed)
    ids, reasoning, predict = [], [], []
    shapes = [(4, 9, 3), (2, 5, 1), (6, 14, 2), (3, 4, 0), (5, 0, 2), (1, 11, 4)]  # (prompt, reasoning, answer)
    for p, k, a in shapes:
        n = p + k + a + 1
        ids.append(torch.randint(1, VOCAB, (n,), generator=g))
        r = torch.zeros(n, dtype=torch.long)
        d = torch.zeros(n, dtype=torch.long)
        if a:
            r[p : p + k] = 1
            d[p + k - 1 : p + k + a - 1] = 1
        reasoning.append(r)
        predict.append(d)
    data = TensorDict({"input_ids": nested(ids), REASONING: nested(reasoning), PREDICT: nested(predict)},
                      batch_size=[len(ids)])
    tu.assign_non_tensor(data, temperature=0.7)
    return data, ids, reasoning, predict


def reference_rows(toy, ids, reasoning, predict, oar: dict, step: int, temperature: float):
    """``importance.gradient`` on each sequence alone, unpacked (as the FSDP engine is checked)."""
    from verl_oar.core.config import OARConfig
    from verl_oar.core.gradient import gradient_importance
    from verl_oar.core.noise import sequence_noise

    cfg = OARConfig(**oar)
    out = []
    for x, r, d in zip(ids, reasoning, predict):
        noise = sequence_noise([x], HIDDEN, cfg.seed, step, where=[r.bool()])[0]
        out.append(gradient_importance(
            lambda e: toy.sequence_logits(e) / temperature, toy.embed[x][None].detach(), r.bool()[None], d.bool()[None],
            torch.cat([x[1:], x[:1]])[None], torch.zeros(1, len(x), dtype=torch.long), 1, cfg.gradient_config(),
            noise=noise[None],
        )[0])
    return out


CASES = [
    dict(thd=True, sp=True, objective="noisy_kl", saliency="grad_x_input", outcome="mean"),
    dict(thd=True, sp=False, objective="noisy_kl", saliency="grad_norm", outcome="single"),
    # BSHD (padded) cases: tests/engine/test_megatron_real_on_cpu.py, on real megatron-core
    dict(thd=True, sp=True, objective="noisy_kl", saliency="grad_x_input", outcome="joint"),
]


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    """One simulated TP rank: every case, through the real OAR-G Megatron path."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from verl_oar.core.config import OARConfig
    from verl_oar.engines.megatron.gradient import gradient_in_megatron_forward

    results = []
    for c, case in enumerate(CASES):
        toy = ToyGPT(seed=c)
        oar = dict(objective=case["objective"], saliency=case["saliency"], outcome=case["outcome"], seed=3)
        data, ids, reasoning, predict = make_micro_batch(seed=c)
        forward = fake_forward(toy, world, rank, case["sp"], case["thd"])
        counters = toy.router.local_tokens_per_expert.clone()
        got, outputs = gradient_in_megatron_forward(forward, [toy], data, OARConfig(**oar), step=5, with_log_probs=False)
        untouched = (all(p.grad is None and p.requires_grad for p in toy.parameters())
                     and torch.equal(toy.router.local_tokens_per_expert, counters))
        got = [row.double() for row in got.unbind()]
        want = reference_rows(toy, ids, reasoning, predict, oar, step=5, temperature=0.7)
        torch.save(got, os.path.join(out_dir, f"case{c}_rank{rank}.pt"))
        results.append({
            **case,
            "max_abs_err": max(float((a - b).abs().max()) for a, b in zip(got, want)),
            "scale": max(float(w.abs().max()) for w in want),
            "nonzero_rows": sum(int(bool(row.abs().sum() > 0)) for row in got),
            "untouched": untouched,
            "outputs": outputs,
        })
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def tp2_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron_tp2")
    from _fresh_process import free_port

    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, str(r), "2", str(port), str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    logs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [log[1][-3000:] for log in logs]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return out, ranks


def _name(case):
    return ",".join(f"{k}={case[k]}" for k in ("thd", "sp", "objective", "saliency", "outcome"))


def test_megatron_oar_g_equals_per_sequence_reference_under_simulated_tp2(tp2_results):
    _, ranks = tp2_results
    for rank in ranks:
        for case in rank:
            assert case["scale"] > 0, _name(case)
            # float64 model; the only rounding is the engine's float32 temperature (0.7 -> 0.69999999)
            assert case["max_abs_err"] <= 1e-6 * case["scale"], (_name(case), case)
            # 6 samples: one without an answer, one without reasoning tokens
            assert case["nonzero_rows"] == 4, (_name(case), case)
            assert case["outputs"] is None


def test_megatron_oar_g_scores_are_identical_on_every_tp_rank(tp2_results):
    out, ranks = tp2_results
    for c in range(len(ranks[0])):
        rows = [torch.load(out / f"case{c}_rank{r}.pt") for r in range(2)]
        assert all(torch.equal(a, b) for a, b in zip(*rows)), _name(ranks[0][c])


def test_megatron_oar_g_leaves_parameters_grads_and_router_counters_as_found(tp2_results):
    _, ranks = tp2_results
    assert all(case["untouched"] for rank in ranks for case in rank)


@pytest.mark.parametrize("mode, outcome", [("exact", "mean"), ("chunk", "joint")])
@pytest.mark.parametrize("max_tokens", [1, 10_000])
def test_megatron_oar_p_rows_model_equals_the_naive_loop(mode, outcome, max_tokens):
    """Copies of all samples batched across samples (rows of different lengths in one packed THD call; the
    padded layout on real megatron-core: tests/engine/test_megatron_real_on_cpu.py)."""
    from _oar_p_reference import naive_perturbation_importance

    from verl_oar.core.perturbation import PerturbationConfig, Sample, batched_perturbation_importance, occlusion_spans
    from verl_oar.engines.megatron.perturbation import MegatronRowsModel

    toy = ToyGPT(seed=11)
    model = MegatronRowsModel(fake_forward(toy, tp_size=1, tp_rank=0, sequence_parallel=False, thd=True))
    _, ids, reasoning, predict = make_micro_batch(seed=4)
    cfg = PerturbationConfig(outcome=outcome, mode=mode, budget=3, share_prefix=False)
    samples = [Sample(x, torch.arange(len(x)), occlusion_spans(r.bool(), mode, 3), d.bool(), 0.7)
               for x, r, d in zip(ids, reasoning, predict)]
    got, costs, total = batched_perturbation_importance(model, samples, 0, cfg, max_tokens)
    for sample, importance, cost in zip(samples, got, costs, strict=True):
        want = naive_perturbation_importance(lambda z: toy.sequence_logits(toy.embed[z]), sample.ids, sample.span,
                                             sample.predict, 0, outcome, temperature=0.7)
        torch.testing.assert_close(importance, want, rtol=1e-6, atol=1e-9)
        assert cost.copies == (int(sample.span.max()) + 1 if bool(sample.predict.any()) and bool((sample.span >= 0).any())
                               else 0)
    scored = sum(bool(s.predict.any()) and bool((s.span >= 0).any()) for s in samples)
    # one row per call under a budget of 1 token; otherwise rows share calls
    if max_tokens == 1:
        assert total.forwards == scored + total.copies
    else:
        assert 2 <= total.forwards < (scored + total.copies) / 2


def test_megatron_oar_p_rows_model_refuses_a_prefix_cache_and_shifted_positions():
    from verl_oar.core.perturbation import Row
    from verl_oar.engines.megatron.perturbation import MegatronRowsModel

    model = MegatronRowsModel(fake_forward(ToyGPT(), 1, 0, False, True))
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(RuntimeError, match="share_prefix=False"):
        model([Row(ids, torch.arange(3), keep=1, cache=True)])
    with pytest.raises(ValueError, match="position ids are 0..n-1"):
        model([Row(ids, torch.arange(1, 4), keep=1)])


def test_engine_type_is_recognised_by_class_without_importing_megatron():
    from verl_oar.engines.backend import is_megatron_engine

    megatron_cls = type("MegatronEngine", (), {"__module__": "verl.workers.engine.megatron.transformer_impl"})
    with_lm_head = type("MegatronEngineWithLMHead", (megatron_cls,), {})
    fsdp = type("FSDPEngineWithLMHead", (), {"__module__": "verl.workers.engine.fsdp.transformer_impl"})
    assert is_megatron_engine(with_lm_head()) and not is_megatron_engine(fsdp())



def test_the_backend_seam_hands_megatron_its_micro_batches_with_verls_bshd_row_length(monkeypatch):
    """The driver's seam (``engines.backend.importance_pass``) picks the Megatron pass for verl's Megatron
    engine, which pads every BSHD micro-batch to the batch's longest sample as verl's
    ``forward_backward_batch`` does (``pad_bshd_to_minibatch_max``), and calls the Megatron functions."""
    from types import SimpleNamespace

    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    import verl_oar.engines.megatron.gradient as gradient
    import verl_oar.engines.megatron.perturbation as perturbation
    from verl_oar.core.config import OARConfig
    from verl_oar.engines.backend import importance_pass
    from verl_oar.engines.megatron import MegatronImportancePass

    calls = []
    def record(kind, answer):
        return lambda *a: calls.append((kind, a)) or answer

    monkeypatch.setattr(gradient, "megatron_gradient_micro_batch", record("g", ("G", None)))
    monkeypatch.setattr(perturbation, "megatron_perturbation_micro_batch", record("p", ("P", [])))
    megatron_cls = type("MegatronEngine", (), {"__module__": "verl.workers.engine.megatron.transformer_impl"})

    def batch(lengths):
        ids = torch.nested.as_nested_tensor([torch.zeros(n, dtype=torch.long) for n in lengths], layout=torch.jagged)
        return TensorDict({"input_ids": ids}, batch_size=[len(lengths)])

    cfg = OARConfig()
    for rmpad, pad_to_max, want in ((False, True, 7), (True, True, None), (False, False, None)):
        calls.clear()
        engine = megatron_cls()
        engine.engine_config = SimpleNamespace(use_remove_padding=rmpad, pad_bshd_to_minibatch_max=pad_to_max)
        with importance_pass(engine, batch([3, 7, 5]), cfg) as engine_pass:
            assert isinstance(engine_pass, MegatronImportancePass)
            first, second = batch([3]), batch([7, 5])
            assert engine_pass.gradient(first, cfg, 2, True) == ("G", None)
            assert engine_pass.perturbation(second, cfg, 0, None, 1) == ("P", [])
        assert [c[0] for c in calls] == ["g", "p"] and calls[0][1] == (engine, first, cfg, 2, True), calls
        assert calls[1][1] == (engine, second, cfg, 0, None, 1), calls
        for micro_batch in (first, second):
            assert tu.get_non_tensor_data(micro_batch, key="forced_max_seqlen", default=None) == want

if __name__ == "__main__":
    run_rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
