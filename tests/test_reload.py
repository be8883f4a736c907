"""Weights prepared once are re-made when the weights change: a reload (new tensors assigned under the
official names, routed experts included) or an in-place write is seen by the next forward and by a new
decode runner."""

import torch

from dsv4.checkpoint import load_state
from dsv4.config import ModelConfig
from dsv4.graphs import DecodeRunner
from dsv4.model.layers import Numerics
from dsv4.model.transformer import Transformer
from dsv4.testing import randomize_, tiny_config


def _model(raw, seed, numerics="reference"):
    return randomize_(Transformer(ModelConfig.from_dict(raw), Numerics(numerics, torch.bfloat16)), seed)


def _decode(model, ids):
    runner = DecodeRunner(model, model.new_state(len(ids)), use_graphs=False)
    return torch.stack([runner.step(t).clone() for t in ids])


def test_reloaded_weights_reach_the_decode_runner():
    raw = tiny_config([4, 16, 0], quantization_config=dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                                            scale_fmt="ue8m0", weight_block_size=[128, 128]),
                      hidden=256, head_dim=128, rope_dim=64, index_dim=64, expert_dtype="fp4")
    a, b = _model(raw, 0), _model(raw, 1)
    ids = list(range(3, 15))
    before = _decode(a, ids)
    want = _decode(b, ids)
    assert not torch.equal(before, want)
    load_state(a, {k: v.clone() for k, v in b.state_dict().items()})  # official names, experts included
    assert torch.equal(_decode(a, ids), want)
    # an in-place write into a routed expert's stacked weight is seen too
    a.layers[0].ffn.experts.w1.weight.zero_()
    assert not torch.equal(_decode(a, ids), want)


def test_state_dict_keeps_the_official_expert_names():
    raw = tiny_config([4], experts=3)
    model = _model(raw, 0, "exact")
    names = set(model.state_dict())
    assert {f"layers.0.ffn.experts.{e}.w{j}.weight" for e in range(3) for j in (1, 2, 3)} <= names
    assert not any(n.startswith("layers.0.ffn.experts.w1") for n in names)
    view = model.get_submodule("layers.0.ffn.experts.2.w3")
    assert torch.equal(view.weight, model.layers[0].ffn.experts.w3.weight[2])
    assert torch.equal(model.get_buffer("layers.0.ffn.experts.1.w2.weight"), model.layers[0].ffn.experts.w2.weight[1])


def test_wo_a_hands_over_its_fp8_twin_where_exact():
    # the fast wo_a reads the stored FP8 weight where it holds exactly the bf16 copy's values (power-of-two block
    # scales, bf16 activations); a reload re-makes both; an fp32 scale that is not a power of two, or fp32
    # activations, leave only the bf16 copy
    from dsv4.ops.linear import pow2_scales

    raw = tiny_config([0, 0], quantization_config=dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                                        scale_fmt="ue8m0", weight_block_size=[128, 128]),
                      hidden=256, head_dim=128, rope_dim=64, index_dim=64, expert_dtype="fp4")
    a, b = _model(raw, 0), _model(raw, 1)
    attn = a.layers[0].attn
    g, w8 = attn.wo_a_grouped()
    assert w8 is not None and w8.fmt == "fp8" and pow2_scales(w8)
    assert torch.equal(w8.dequantize().to(g.dtype).unflatten(0, g.shape[:2]), g)
    load_state(a, {k: v.clone() for k, v in b.state_dict().items()})
    g2, w82 = attn.wo_a_grouped()
    assert torch.equal(g2, b.layers[0].attn.wo_a_grouped()[0]) and not torch.equal(g2, g)
    assert torch.equal(w82.weight, b.layers[0].attn.wo_a.weight)
    w = w82.scale.clone()
    w[0, 0] *= 1.5
    assert not pow2_scales(type(w82)(w82.fmt, w82.n, w82.k, w82.weight, w))
    f32 = randomize_(Transformer(ModelConfig.from_dict(raw), Numerics("reference", torch.float32)), 0)
    assert f32.layers[0].attn.wo_a_grouped()[1] is None
