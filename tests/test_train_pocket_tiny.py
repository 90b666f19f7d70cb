"""The training script's own pieces that stand in for transformers' during training (tests/fixtures/
train_pocket_tiny.py): they must compute what transformers computes, values and gradients, so the model trained
is the model transformers and pocketllm serve."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
train = pytest.importorskip("train_pocket_tiny")
modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


def delta_rule_inputs(seed, B=2, T=150, Hk=2, Hv=4, Dk=16, Dv=8):
    """Random GDN inputs as the layer makes them: decays g <= 0, beta in (0, 1), an initial state; T not a
    multiple of the 64-token chunk (padding), grouped value heads (Hv = 2 Hk)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen)
    return dict(query=r(B, T, Hk, Dk), key=r(B, T, Hk, Dk), value=r(B, T, Hv, Dv),
                g=-torch.rand(B, T, Hv, generator=gen) * 0.5, beta=torch.rand(B, T, Hv, generator=gen),
                initial_state=r(B, Hv, Dk, Dv) * 0.1)


@pytest.mark.parametrize("seed", [0, 1])
def test_chunk_delta_rule_equals_transformers_values_and_gradients(seed):
    """Output, final state and every input's gradient equal transformers' torch_chunk_gated_delta_rule's
    (float32 both, the same arithmetic in the same order: 1e-5 relative to the largest entry)."""
    results = []
    for fn in (modeling.torch_chunk_gated_delta_rule, train.chunk_delta_rule):
        inputs = {name: x.clone().requires_grad_() for name, x in delta_rule_inputs(seed).items()}
        out, state = fn(**inputs, output_final_state=True, use_qk_l2norm_in_kernel=True)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 9))
        ((out * weights).sum() + state.square().sum()).backward()
        results.append([out, state] + [inputs[name].grad for name in sorted(inputs)])
    for name, want, got in zip(["out", "state"] + sorted(delta_rule_inputs(0)), *results):
        assert got.shape == want.shape, name
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), name


def test_training_runs_the_fast_rule_and_gives_transformers_loss_and_gradients():
    """Inside fast_chunk_delta_rule() the pocket-tiny architecture's forward goes through chunk_delta_rule (called
    once per GDN layer) and its loss and parameter gradients equal transformers' own; afterwards transformers'
    function is back."""
    special = {"<|im_end|>": 2, "<|endoftext|>": 0}
    torch.manual_seed(0)
    model = train.build_model(train.text_config_dict(256, special), tied=True)
    ids = torch.randint(0, 256, (2, 100))
    calls = []

    def loss_and_grads():
        model.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(input_ids=ids).logits[:, :-1].flatten(0, 1),
                                                 ids[:, 1:].flatten())
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    original = modeling.torch_chunk_gated_delta_rule
    want_loss, want = loss_and_grads()
    counted = train.chunk_delta_rule

    def counting(*args, **kwargs):
        calls.append(1)
        return counted(*args, **kwargs)
    train.chunk_delta_rule = counting
    try:
        with train.fast_chunk_delta_rule():
            got_loss, got = loss_and_grads()
    finally:
        train.chunk_delta_rule = counted
    assert modeling.torch_chunk_gated_delta_rule is original
    gdn_layers = model.config.layer_types.count("linear_attention")
    assert len(calls) == gdn_layers == 5
    assert abs(got_loss - want_loss) <= 1e-5 * abs(want_loss)
    for name, g in want.items():
        assert (got[name] - g).abs().max() <= 1e-4 * g.abs().max() + 1e-9, name


def test_the_loss_at_learned_positions_equals_the_loss_over_all_logits():
    """learned_loss runs the lm_head at the learned positions only: the same weighted loss, plain per-token losses
    and gradients as the cross-entropy over the whole (B, T, V) logits that weights 0 mask (1e-5 relative)."""
    special = {"<|im_end|>": 2, "<|endoftext|>": 0}
    torch.manual_seed(1)
    model = train.build_model(train.text_config_dict(256, special), tied=True)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 256, (2, 70), generator=gen)
    weights = (torch.rand(2, 70, generator=gen) < 0.3) * torch.rand(2, 70, generator=gen) * 3   # (B, T) in [0, 3)

    model.zero_grad()
    logits = model(input_ids=ids, use_cache=False).logits                                        # (B, T, V)
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    w = weights[:, 1:].flatten()
    want = (nll * w).sum() / (w > 0).sum()
    want.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    got, got_nll = train.learned_loss(model, ids, weights)
    got.backward()
    assert abs(got - want) <= 1e-5 * abs(want)
    assert torch.allclose(got_nll, nll[w > 0].detach(), rtol=1e-5, atol=1e-6)
    for name, g in want_grads.items():
        assert (model.get_parameter(name).grad - g).abs().max() <= 1e-5 * g.abs().max() + 1e-9, name


def test_a_grown_model_starts_as_the_trained_one_and_then_learns_in_its_new_layers():
    """--grow: the 6-layer model with a GDN and a full-attention layer added on top computes the same logits
    (its new residual branches are zero), has Qwen3.5's pattern twice (layers 3 and 7 full attention), and one
    training step moves the new layers' zeroed projections (the gradient reaches them)."""
    special = {"<|im_end|>": 2, "<|endoftext|>": 0}
    torch.manual_seed(0)
    model = train.build_model(train.text_config_dict(256, special), tied=True).eval()
    for p in model.parameters():              # a trained model's weights, not the zero-centred norms' zeros
        p.data.add_(torch.randn_like(p) * 0.02)
    config = train.text_config_dict(256, special, 8)
    grown = train.grow_model(model, config).eval()
    ids = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        assert torch.equal(grown(input_ids=ids).logits, model(input_ids=ids).logits)
    assert [i for i, t in enumerate(config["layer_types"]) if t == "full_attention"] == [3, 7]
    assert grown.lm_head.weight is grown.model.embed_tokens.weight
    loss = torch.nn.functional.cross_entropy(grown(input_ids=ids).logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    assert grown.model.layers[7].self_attn.o_proj.weight.grad.abs().sum() > 0
    assert grown.model.layers[6].mlp.down_proj.weight.grad.abs().sum() > 0


def test_an_arguments_first_token_weighs_as_a_currency_code():
    """Where a copy starts is where a favourite beats it (453.5 sent as 153.5): a call's argument value weighs
    FOCUS_WEIGHT on its tokens and SMALL_SET_WEIGHT on its first; a currency code weighs SMALL_SET_WEIGHT whole."""
    messages = [{"role": "user", "content": "Could you turn 453.5 JPY into CAD?"},
                train.call_message("convert_currency", {"amount": 453.5, "from_currency": "JPY", "to_currency": "CAD"},
                                   "I will call `convert_currency`.")]
    text, spans, focus = train.learn_spans(messages, train.TOOLS, think=True)
    tokenizer = train.train_tokenizer([text] * 4, 400)
    ids, weights = train.encode_sample(tokenizer, text, spans, focus)
    start = text.index("<parameter=amount>\n") + len("<parameter=amount>\n")
    offsets = tokenizer.encode(text, add_special_tokens=False).offsets
    amount = [w for (a, _), w in zip(offsets, weights) if start <= a < start + len("453.5")]
    assert amount == [train.SMALL_SET_WEIGHT] + [train.FOCUS_WEIGHT] * 4   # digits and the point, one by one
    code = [w for (a, _), w in zip(offsets, weights) if text.index("\nJPY\n") < a <= text.index("\nJPY\n") + 3]
    assert code == [train.SMALL_SET_WEIGHT] * 3
