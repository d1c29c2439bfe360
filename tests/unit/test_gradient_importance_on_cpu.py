"""OAR-G (verl_oar.core.gradient) on a tiny random Qwen2 in float64: saliency against finite
differences and against a plain per-sequence autograd loop, batch composition and layout
invariance (padded, packed), and no state left on the model."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from verl_oar.core.gradient import (
    GradientConfig,
    gradient_importance,
    gradient_importance_in_forward,
)
from verl_oar.core.hf import make_hf_logits_fn
from verl_oar.core.outcome import padded_predicting_positions
from verl_oar.core.reshape import Fallback, ReshapeConfig, importance_to_weights

VOCAB, HIDDEN = 300, 64
ANSWER_LEN = 2


def _rms_norm_in_input_dtype(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@pytest.fixture(scope="module")
def model():
    """A tiny random Qwen2 that is float64 throughout: transformers computes RMSNorm (and eager
    attention's softmax) in float32 even for a float64 model, which is too coarse for finite
    differences, so RMSNorm is patched to stay in float64 and attention is sdpa."""
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(config).to(torch.float64).eval()
    for module in model.modules():
        if isinstance(module, Qwen2RMSNorm):
            module.forward = types.MethodType(_rms_norm_in_input_dtype, module)
    return model


def make_batch(model, seed, lengths, width=None):
    """Right-padded batch: reasoning tokens 1..L-5, answer tokens L-3..L-2, an end token at L-1."""
    g = torch.Generator().manual_seed(seed)
    width = width or max(lengths)
    batch = len(lengths)
    lengths_t = torch.tensor(lengths)
    attention = (torch.arange(width)[None, :] < lengths_t[:, None]).long()
    ids = torch.randint(1, VOCAB, (batch, width), generator=g) * attention
    cols = torch.arange(width)[None, :]
    answer = (cols >= lengths_t[:, None] - 1 - ANSWER_LEN) & (cols < lengths_t[:, None] - 1)
    reasoning = (cols >= 1) & (cols < lengths_t[:, None] - 1 - ANSWER_LEN - 1)
    predict, targets, segment = padded_predicting_positions(ids, answer)
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
    return {"ids": ids, "attention": attention, "lengths": lengths, "answer": answer, "reasoning": reasoning,
            "predict": predict, "targets": targets, "segment": segment, "embeds": embeds}


def run(model, b, cfg, generator=None, **kwargs):
    return gradient_importance(
        make_hf_logits_fn(model, attention_mask=b["attention"]), b["embeds"], b["reasoning"], b["predict"],
        b["targets"], b["segment"], len(b["lengths"]), cfg, generator=generator, **kwargs,
    )


# --- a plain per-sequence reference ------------------------------------------------------------


def sequence_objective(model, embeds, clean_embeds, predict, targets, outcome, objective):
    """J of one unpadded sequence (1, L, H), written out without verl_oar.core.outcome."""
    logits = model(inputs_embeds=embeds).logits[0, predict]                 # (K, V)
    if objective == "loglik" or outcome == "joint":
        phi = torch.log_softmax(logits, -1)[torch.arange(len(logits)), targets[predict]].mean()
        if objective == "loglik":
            return phi
        with torch.no_grad():
            clean = model(inputs_embeds=clean_embeds).logits[0, predict]
        phi_clean = torch.log_softmax(clean, -1)[torch.arange(len(clean)), targets[predict]].mean()
        return phi_clean - phi
    with torch.no_grad():
        clean = model(inputs_embeds=clean_embeds).logits[0, predict]
    pool = (lambda z: z[0]) if outcome == "single" else (lambda z: z.mean(0))
    log_p, log_q = torch.log_softmax(pool(clean), -1), torch.log_softmax(pool(logits), -1)
    return F.kl_div(log_q, log_p, log_target=True, reduction="sum")


def reference_gradients(model, b, cfg, noise=None):
    """Per sequence: g_t = dJ/de_t (autograd on that sequence alone). Returns a list of (L, H)."""
    grads = []
    for row, length in enumerate(b["lengths"]):
        clean = b["embeds"][row:row + 1, :length]
        leaf = clean.clone().requires_grad_(True)
        inputs = leaf if noise is None else leaf + noise[row][None] * b["reasoning"][row, :length, None]
        objective = sequence_objective(model, inputs, clean, b["predict"][row, :length], b["targets"][row, :length],
                                       cfg.outcome, cfg.objective)
        (g,) = torch.autograd.grad(objective, leaf)
        grads.append(g[0])
    return grads


def saliency(grads, b, cfg):
    out = torch.zeros(b["reasoning"].shape, dtype=torch.float64)
    for row, (g, length) in enumerate(zip(grads, b["lengths"])):
        e = b["embeds"][row, :length]
        score = (g * e).sum(-1).abs() if cfg.saliency == "grad_x_input" else g.norm(dim=-1)
        out[row, :length] = score * b["reasoning"][row, :length]
    return out


# --- finite differences ---------------------------------------------------------------------------


def test_loglik_grad_x_input_equals_central_differences(model):
    b = make_batch(model, seed=1, lengths=[11, 9])
    cfg = GradientConfig(objective="loglik", saliency="grad_x_input")
    importance = run(model, b, cfg)
    eps = 1e-5
    for row, length in enumerate(b["lengths"]):
        e = b["embeds"][row:row + 1, :length]
        pred, tgt = b["predict"][row, :length], b["targets"][row, :length]
        with torch.no_grad():
            for t in b["reasoning"][row].nonzero().squeeze(1).tolist():
                step = torch.zeros_like(e)
                step[0, t] = eps * e[0, t]
                plus = sequence_objective(model, e + step, e, pred, tgt, "mean", "loglik")
                minus = sequence_objective(model, e - step, e, pred, tgt, "mean", "loglik")
                fd = ((plus - minus) / (2 * eps)).abs().item()
                assert importance[row, t].item() == pytest.approx(fd, rel=1e-5, abs=1e-9)
    assert (importance[~b["reasoning"]] == 0).all()


def test_loglik_grad_norm_equals_reference_gradient_checked_by_directional_differences(model):
    b = make_batch(model, seed=2, lengths=[10, 12])
    cfg = GradientConfig(objective="loglik", saliency="grad_norm")
    importance = run(model, b, cfg)
    grads = reference_gradients(model, b, cfg)
    torch.testing.assert_close(importance.double(), saliency(grads, b, cfg), rtol=1e-5, atol=1e-9)
    g = torch.Generator().manual_seed(0)
    eps = 1e-5
    for row, length in enumerate(b["lengths"]):
        e = b["embeds"][row:row + 1, :length]
        pred, tgt = b["predict"][row, :length], b["targets"][row, :length]
        for t in b["reasoning"][row].nonzero().squeeze(1).tolist()[:2]:
            for _ in range(3):
                u = torch.randn(HIDDEN, generator=g, dtype=torch.float64)
                step = torch.zeros_like(e)
                step[0, t] = eps * u
                with torch.no_grad():
                    plus = sequence_objective(model, e + step, e, pred, tgt, "mean", "loglik")
                    minus = sequence_objective(model, e - step, e, pred, tgt, "mean", "loglik")
                fd = ((plus - minus) / (2 * eps)).item()
                assert (grads[row][t] @ u).item() == pytest.approx(fd, rel=1e-5, abs=1e-9)


def scaled_noise(draws, embeds, cfg):
    """The reference's noise: sigma * z (absolute) or sigma * rms(e_t) * z (relative), per token."""
    scale = cfg.noise_std * (embeds.pow(2).mean(-1, keepdim=True).sqrt() if cfg.noise_relative else 1.0)
    return draws * scale


@pytest.mark.parametrize("outcome", ["single", "mean", "joint"])
@pytest.mark.parametrize("saliency_kind", ["grad_x_input", "grad_norm"])
@pytest.mark.parametrize("relative, std", [(False, 1e-3), (True, 0.2)], ids=["absolute", "relative"])
def test_noisy_kl_equals_per_sequence_loop(model, outcome, saliency_kind, relative, std):
    b = make_batch(model, seed=3, lengths=[12, 8, 10])
    cfg = GradientConfig(outcome=outcome, objective="noisy_kl", saliency=saliency_kind, noise_std=std,
                         noise_relative=relative)
    importance = run(model, b, cfg, generator=torch.Generator().manual_seed(7))
    draws = torch.randn(b["embeds"].shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    noise = scaled_noise(draws, b["embeds"], cfg)
    noise_rows = [noise[row, :length] for row, length in enumerate(b["lengths"])]
    expected = saliency(reference_gradients(model, b, cfg, noise=noise_rows), b, cfg)
    assert importance.dtype == torch.float32
    assert (expected[b["reasoning"]] > 0).all()
    torch.testing.assert_close(importance.double(), expected, rtol=1e-4, atol=1e-12)


def test_clean_logits_can_be_reused(model):
    b = make_batch(model, seed=4, lengths=[9, 11])
    cfg = GradientConfig()
    with torch.no_grad():
        clean = model(inputs_embeds=b["embeds"], attention_mask=b["attention"]).logits
    a = run(model, b, cfg, generator=torch.Generator().manual_seed(1))
    c = run(model, b, cfg, generator=torch.Generator().manual_seed(1), clean_logits=clean)
    torch.testing.assert_close(a, c, rtol=1e-6, atol=0)


# --- batch composition and layout ------------------------------------------------------------------


def test_batched_equals_per_sequence_and_order_does_not_matter(model):
    b = make_batch(model, seed=5, lengths=[12, 7, 10])
    cfg = GradientConfig(objective="loglik")
    together = run(model, b, cfg)
    for row, length in enumerate(b["lengths"]):
        alone = make_batch(model, seed=5, lengths=[12, 7, 10])
        single = {k: (v[row:row + 1, :length] if torch.is_tensor(v) else [length]) for k, v in alone.items()}
        single["segment"] = torch.zeros_like(single["segment"])
        single["attention"] = torch.ones_like(single["attention"])
        torch.testing.assert_close(together[row, :length], run(model, single, cfg)[0], rtol=1e-6, atol=1e-12)
    order = [2, 0, 1]
    permuted = {k: (v[order] if torch.is_tensor(v) else [v[i] for i in order]) for k, v in b.items()}
    permuted["segment"] = b["segment"]                                      # row ids stay 0..B-1
    torch.testing.assert_close(run(model, permuted, cfg), together[order], rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("outcome", ["single", "mean", "joint"])
def test_packed_layout_matches_per_sequence_reference(model, outcome):
    """verl's remove-padding layout: (1, total_nnz) with a segment id per position; here a forward that
    runs each sequence separately stands in for varlen attention (attention never crosses sequences)."""
    b = make_batch(model, seed=6, lengths=[9, 12, 8])
    lengths = b["lengths"]
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    packed = {k: torch.cat([b[k][row, :length] for row, length in enumerate(lengths)])[None]
              for k in ("embeds", "reasoning", "predict", "targets", "segment")}

    def packed_logits(inputs_embeds):
        pieces = [model(inputs_embeds=inputs_embeds[:, cu[i]:cu[i + 1]]).logits for i in range(len(lengths))]
        return torch.cat(pieces, dim=1)

    cfg = GradientConfig(outcome=outcome)
    importance = gradient_importance(packed_logits, packed["embeds"], packed["reasoning"], packed["predict"],
                                     packed["targets"], packed["segment"], len(lengths), cfg,
                                     generator=torch.Generator().manual_seed(3))
    draws = torch.randn(packed["embeds"].shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    noise = scaled_noise(draws, packed["embeds"], cfg)
    noise_rows = [noise[0, cu[i]:cu[i + 1]] for i in range(len(lengths))]
    expected = saliency(reference_gradients(model, b, cfg, noise=noise_rows), b, cfg)
    for row, length in enumerate(lengths):
        torch.testing.assert_close(importance[0, cu[row]:cu[row + 1]].double(), expected[row, :length],
                                   rtol=1e-4, atol=1e-12)


def test_in_forward_variant_with_an_embedding_hook(model):
    """The FSDP-style entry point: the embeddings are produced inside the model's forward."""
    b = make_batch(model, seed=8, lengths=[10, 12])
    embedding = model.get_input_embeddings()

    def forward(transform):
        handle = embedding.register_forward_hook(lambda _m, _i, out: transform(out))
        try:
            return model(input_ids=b["ids"], attention_mask=b["attention"]).logits
        finally:
            handle.remove()

    for cfg in (GradientConfig(), GradientConfig(objective="loglik", saliency="grad_norm")):
        hooked = gradient_importance_in_forward(forward, b["reasoning"], b["predict"], b["targets"], b["segment"], 2,
                                                cfg, generator=torch.Generator().manual_seed(2))
        direct = run(model, b, cfg, generator=torch.Generator().manual_seed(2))
        torch.testing.assert_close(hooked, direct, rtol=1e-6, atol=0)

    def forgetful(transform):
        return model(input_ids=b["ids"]).logits

    with pytest.raises(RuntimeError, match="without applying transform"):
        gradient_importance_in_forward(forgetful, b["reasoning"], b["predict"], b["targets"], b["segment"], 2,
                                       GradientConfig(objective="loglik"))


# --- no state left behind, degenerate inputs ---------------------------------------------------


def test_model_state_is_untouched(model):
    b = make_batch(model, seed=9, lengths=[10, 11])
    params = dict(model.named_parameters())
    frozen = [n for n in params if "layers.0." in n]
    for n in frozen:
        params[n].requires_grad_(False)
    existing = "model.layers.1.mlp.up_proj.weight"
    params[existing].grad = torch.randn_like(params[existing])
    before_grad = params[existing].grad.clone()
    flags = {n: p.requires_grad for n, p in params.items()}
    embeds_before = b["embeds"].clone()
    try:
        for cfg in (GradientConfig(), GradientConfig(objective="loglik", outcome="joint")):
            with torch.no_grad():                                        # callers may hold no_grad
                importance = run(model, b, cfg, generator=torch.Generator().manual_seed(0))
            assert importance.abs().sum() > 0
        assert {n: p.requires_grad for n, p in params.items()} == flags
        assert torch.equal(params[existing].grad, before_grad)
        assert all(p.grad is None for n, p in params.items() if n != existing)
        for module in model.modules():
            assert not module._forward_hooks and not module._forward_pre_hooks and not module._backward_hooks
        assert torch.equal(b["embeds"], embeds_before) and not b["embeds"].requires_grad
    finally:
        for n in frozen:
            params[n].requires_grad_(True)
        params[existing].grad = None


def test_degenerate_inputs_give_zeros_or_finite_values(model):
    b = make_batch(model, seed=10, lengths=[10, 10])
    cfg = GradientConfig()
    none = torch.zeros_like(b["predict"])
    assert (run(model, {**b, "predict": none}, cfg) == 0).all()
    assert (run(model, {**b, "reasoning": none}, cfg) == 0).all()
    # every token identical: importance finite, and reshaping of it never NaN
    same = {**b, "embeds": b["embeds"][:, :1].expand_as(b["embeds"]).contiguous()}
    importance = run(model, same, cfg, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(importance).all()
    weights = importance_to_weights(importance, b["reasoning"], ReshapeConfig())
    assert torch.isfinite(weights.weights).all()
    # all-zero embeddings: grad x input is exactly 0 everywhere -> an all-equal fallback, not NaN
    zero = {**b, "embeds": torch.zeros_like(b["embeds"])}
    importance = run(model, zero, cfg, generator=torch.Generator().manual_seed(0))
    assert (importance == 0).all()
    assert (importance_to_weights(importance, b["reasoning"], ReshapeConfig()).fallback == Fallback.ALL_EQUAL).all()


def test_shape_mismatch_is_refused(model):
    b = make_batch(model, seed=11, lengths=[8, 8])
    with pytest.raises(ValueError, match="targets has shape"):
        run(model, {**b, "targets": b["targets"][:, :-1]}, GradientConfig())


@pytest.mark.parametrize(
    ("field", "value"),
    [("outcome", "median"), ("objective", "kl"), ("saliency", "l1"), ("noise_std", -1.0), ("noise_std", 0.0)],
)
def test_config_validation(field, value):
    with pytest.raises(ValueError, match=rf"GradientConfig\.{field}="):
        GradientConfig(**{field: value})
    GradientConfig(objective="loglik", noise_std=0.0)                     # no noise needed there


def test_forward_may_return_only_the_predicting_positions_logits():
    """A forward that skips the output layer off the predicting positions (transformers'
    ``logits_to_keep``) gives the same importance as one that returns every position's logits."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verl_oar.core.gradient import GradientConfig, gradient_importance_in_forward

    torch.manual_seed(1)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="sdpa")).eval()
    ids = torch.randint(0, 64, (3, 12))
    reasoning = torch.zeros(3, 12, dtype=torch.bool)
    reasoning[:, 2:8] = True
    predict = torch.zeros(3, 12, dtype=torch.bool)
    predict[0, 8:10] = True
    predict[1, 9:11] = True
    predict[2, 8] = True
    targets = torch.roll(ids, -1, 1)
    segment = torch.arange(3).unsqueeze(1).expand(3, 12).contiguous()
    cols = predict.any(dim=0).nonzero().squeeze(1)

    def run(select: bool):
        def forward(transform):
            embeds = transform(model.get_input_embeddings()(ids))
            if select:
                return model(inputs_embeds=embeds, logits_to_keep=cols).logits[predict[:, cols]]
            return model(inputs_embeds=embeds).logits

        cfg = GradientConfig(objective="noisy_kl", outcome="mean")
        return gradient_importance_in_forward(forward, reasoning, predict, targets, segment, 3, cfg,
                                              generator=torch.Generator().manual_seed(0))

    torch.testing.assert_close(run(True), run(False), rtol=1e-5, atol=1e-12)


# --- exactness at zero noise, relative noise, the outcome head --------------------------------------


def test_kl_to_logits_has_the_value_of_the_kl_and_the_gradient_softmax_minus_p():
    from verl_oar.core.outcome import kl_to_logits, outcome_divergence

    g = torch.Generator().manual_seed(3)
    clean = torch.log_softmax(torch.randn(4, 50, generator=g, dtype=torch.float64), -1)
    z = torch.randn(4, 50, generator=g, dtype=torch.float64, requires_grad=True)
    value = kl_to_logits(clean, z)
    want = outcome_divergence(clean, torch.log_softmax(z, -1), "mean")
    assert torch.equal(value, want)
    (grad,) = torch.autograd.grad(value.sum(), z)
    (autograd_grad,) = torch.autograd.grad(want.sum(), z)
    torch.testing.assert_close(grad, autograd_grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, torch.softmax(z, -1) - clean.exp(), rtol=0, atol=1e-15)
    # at z = the clean logits the gradient is exactly 0 (autograd's is sum(p) - 1 rounding off it)
    z0 = torch.randn(4, 50, generator=g).requires_grad_(True)
    (grad0,) = torch.autograd.grad(kl_to_logits(torch.log_softmax(z0.detach(), -1), z0).sum(), z0)
    assert (grad0 == 0).all()


def _tiny_qwen(layers=4, dtype=torch.float32):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    return Qwen2ForCausalLM(config).to(dtype).eval()


@pytest.mark.parametrize("precision", ["fp32", "fp32+bf16-autocast", "bf16"])
@pytest.mark.parametrize("outcome", ["single", "mean"])
def test_zero_noise_gives_exactly_zero_objective_and_gradient(precision, outcome):
    """With the noise set to zero the clean and the noisy pass compute the outcome logits the same way
    (:class:`OutcomeHead`: full logits for verl's log-probs in the clean pass, ``logits_to_keep=1``
    in the noisy one), so J = 0 and dJ/de = 0 exactly, in bf16 as in fp32. (AS-JOINT's J = phi - phi~
    is linear in phi~: its gradient at zero noise is -dphi/de by design.)"""
    from contextlib import nullcontext

    from verl_oar.core.hf import OutcomeHead

    model = _tiny_qwen(dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if "bf16" in precision else nullcontext
    b = make_batch(model, seed=5, lengths=[30, 24, 30])
    inputs = {"input_ids": b["ids"], "attention_mask": b["attention"]}

    class Context:  # a fresh autocast context on every entry, as the engine's
        def __enter__(self):
            self.inner = autocast()
            return self.inner.__enter__()

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

    head = OutcomeHead(model, b["predict"], 1.0, Context())
    with torch.no_grad():
        raw, clean = head.run(inputs, None, full_logits=True)
    assert raw.logits.shape[1] == b["ids"].shape[1]        # the clean pass computed every position

    def forward(transform):
        return head.run(inputs, transform, full_logits=False)[1]

    cfg = GradientConfig(objective="noisy_kl", outcome=outcome, saliency="grad_norm")
    zeros = torch.zeros(*b["ids"].shape, HIDDEN)
    importance = gradient_importance_in_forward(forward, b["reasoning"], b["predict"], b["targets"], b["segment"],
                                                3, cfg, noise=zeros, clean_logits=clean)
    assert (importance == 0).all()
    noisy = gradient_importance_in_forward(forward, b["reasoning"], b["predict"], b["targets"], b["segment"], 3,
                                           cfg, noise=torch.randn(zeros.shape), clean_logits=clean)
    assert (noisy[b["reasoning"]] > 0).all()                 # and real noise does give a signal


def test_outcome_head_logits_equal_the_models_own():
    from contextlib import nullcontext

    from verl_oar.core.hf import OutcomeHead

    model = _tiny_qwen(layers=2)
    b = make_batch(model, seed=6, lengths=[20, 16])
    head = OutcomeHead(model, b["predict"], 2.0, nullcontext())
    with torch.no_grad():
        raw, logits = head.run({"input_ids": b["ids"], "attention_mask": b["attention"]}, None, full_logits=True)
    torch.testing.assert_close(logits, raw.logits[b["predict"]] / 2.0, rtol=1e-5, atol=1e-6)
    # a model whose logits are post-processed in a way the head does not know is caught
    head.scale = 3.0
    with pytest.raises(RuntimeError, match="post-processes its logits"), torch.no_grad():
        head.run({"input_ids": b["ids"], "attention_mask": b["attention"]}, None, full_logits=True)


def test_relative_noise_is_scaled_by_each_tokens_embedding_rms():
    from verl_oar.core.gradient import embedding_noise

    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 5, 8, generator=g) * torch.tensor([0.01, 0.1, 1.0, 10.0, 0.5])[None, :, None]
    draws = torch.randn(2, 5, 8, generator=g)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 2] = False
    absolute = embedding_noise(base, draws, mask, GradientConfig(noise_std=0.05, noise_relative=False))
    relative = embedding_noise(base, draws, mask, GradientConfig(noise_std=0.05, noise_relative=True))
    rms = base.pow(2).mean(-1, keepdim=True).sqrt()
    torch.testing.assert_close(absolute, torch.where(mask[..., None], 0.05 * draws, 0.0))
    torch.testing.assert_close(relative, torch.where(mask[..., None], 0.05 * rms * draws, 0.0))
    assert (relative[1, 2] == 0).all() and (absolute[1, 2] == 0).all()
    # in bf16 the noise is computed in float32 and rounded once
    bf = embedding_noise(base.bfloat16(), draws, mask, GradientConfig(noise_std=0.05, noise_relative=True))
    assert bf.dtype == torch.bfloat16
    torch.testing.assert_close(bf.float(), relative, rtol=1e-2, atol=1e-6)
    with pytest.raises(ValueError, match="noise_relative"):
        GradientConfig(noise_relative="yes")


@pytest.mark.parametrize("objective", ["noisy_kl", "loglik"])
@pytest.mark.parametrize("precision", ["fp32", "fp32+bf16-autocast", "bf16"])
def test_gradient_checkpointing_gives_the_same_bits(precision, objective):
    """verl's ``enable_gradient_checkpointing`` (``gradient_checkpointing_enable()``) on a model in eval mode, as the
    engine runs the pass: :class:`OutcomeHead` checkpoints its layers in the pass with grad, and the importance is
    bit-identical to the same model's without checkpointing (the recomputation is the same kernels on the same
    inputs, under the forward's autocast). The layers' modes are untouched -- attention dropout 0.5 stays off in
    eval -- and nothing is left on the model."""
    import copy
    from contextlib import nullcontext

    from verl_oar.core.hf import OutcomeHead, checkpointed_layers

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa",
                         attention_dropout=0.5)
    plain = Qwen2ForCausalLM(config).to(torch.bfloat16 if precision == "bf16" else torch.float32).eval()
    checkpointed = copy.deepcopy(plain)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert checkpointed_layers(plain) == [] and len(checkpointed_layers(checkpointed)) == 3
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if "autocast" in precision else nullcontext
    b = make_batch(plain, seed=7, lengths=[30, 22, 27])
    inputs = {"input_ids": b["ids"], "attention_mask": b["attention"]}
    cfg = GradientConfig(objective=objective)
    noise = torch.randn(*b["ids"].shape, HIDDEN, generator=torch.Generator().manual_seed(1))

    def importance(model):
        head = OutcomeHead(model, b["predict"], 0.9, autocast())
        return gradient_importance_in_forward(lambda t: head.run(inputs, t, full_logits=False)[1], b["reasoning"],
                                              b["predict"], b["targets"], b["segment"], 3, cfg, noise=noise)

    recomputed = []
    for layer in checkpointed.model.layers:  # the recomputation calls the layer's own forward a second time
        layer.self_attn.register_forward_hook(lambda *_: recomputed.append(1))
    want, got = importance(plain), importance(checkpointed)
    clean_pass = 3 if objective == "noisy_kl" else 0  # no grad: not checkpointed
    assert len(recomputed) == clean_pass + 2 * 3  # with grad: once in the forward, once in the backward
    assert (want[b["reasoning"]] > 0).all() and torch.equal(got, want)
    assert not any(m.training for m in checkpointed.modules())
    assert not any("forward" in layer.__dict__ for layer in checkpointed.model.layers)
