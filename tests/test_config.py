"""ModelConfig: the official Flash config parses with the right schedule; bad configs name the field."""

import json

import pytest
import torch

from dsv4.config import ConfigError, ModelConfig
from dsv4.model.layers import rope_inv_freq
from dsv4.testing import tiny_config

@pytest.fixture
def flash(shared_dsv4):
    """A fresh dict of the official Flash config.json (../shared/dsv4/files)."""
    return lambda: json.loads((shared_dsv4 / "files" / "config.json").read_text())


def test_flash_config_schedule(flash):
    c = ModelConfig.from_dict(flash())
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.head_dim) == (4096, 43, 64, 512)
    assert len(c.layers) == 43 and len(c.mtp_layers) == 1
    assert [s.attn for s in c.layers[:4]] == ["swa", "swa", "csa", "hca"]
    assert all(s.attn == "csa" and s.ratio == 4 for s in c.layers[2::2])
    assert all(s.attn == "hca" and s.ratio == 128 for s in c.layers[3::2])
    assert [s.routing for s in c.layers[:4]] == ["hash", "hash", "hash", "score"]
    assert [s.rope for s in c.layers[:3]] == ["main", "main", "compress"]
    mtp = c.mtp_layers[0]
    assert (mtp.index, mtp.attn, mtp.rope, mtp.routing, mtp.is_mtp) == (43, "swa", "main", "score", True)
    assert c.quant is not None and c.quant.expert_format == "mxfp4" and c.quant.fp8_scale_dtype == "e8m0"
    assert c.rope_scaling.factor == 16 and c.rope_scaling.original_max_position_embeddings == 65536
    assert ModelConfig.from_dict(c.to_dict()) == c


def test_flash_yarn_frequencies(flash):
    # SPEC §2.3.3: theta 160000, pairs 0..15 unchanged, pairs >= 25 divided by 16, linear blend between
    c = ModelConfig.from_dict(flash())
    base = 1.0 / (160000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    f = rope_inv_freq(64, c.compress_rope_theta, c.rope_scaling)
    assert torch.equal(f[:16], base[:16])
    assert torch.allclose(f[25:], base[25:] / 16, rtol=1e-6)
    ramp = (20 - 15) / (25 - 15)
    assert f[20].item() == pytest.approx(base[20].item() * (1 - ramp) + base[20].item() / 16 * ramp, rel=1e-6)
    assert torch.equal(rope_inv_freq(64, 10000.0, None), 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)))


def test_nvfp4_and_base_quant_configs(flash):
    raw = flash()
    raw["quantization_config"] = dict(raw["quantization_config"], moe_quant_algo="NVFP4")
    assert ModelConfig.from_dict(raw).quant.expert_format == "nvfp4"
    raw = flash()
    raw.pop("expert_dtype")
    del raw["quantization_config"]["scale_fmt"]
    q = ModelConfig.from_dict(raw).quant
    assert (q.expert_format, q.fp8_scale_dtype) == ("fp8", "f32")


def test_any_compress_ratio():
    c = ModelConfig.from_dict(tiny_config([16, 4, 0, 8, 128]))
    assert [(s.attn, s.ratio) for s in c.layers] == [("hca", 16), ("csa", 4), ("swa", 0), ("hca", 8), ("hca", 128)]


@pytest.mark.parametrize("edit, message", [
    (lambda r: r.update(compress_ratios=r["compress_ratios"][:-1]), "'compress_ratios' has 3 entries; expected num_hidden_layers + num_nextn_predict_layers = 4"),
    (lambda r: r.update(compress_ratios=[4, -1, 0, 0]), "'compress_ratios' entry 1 must be an integer >= 0"),
    (lambda r: r.update(num_key_value_heads=2), "'num_key_value_heads' must be 1"),
    (lambda r: r.pop("hidden_size"), "missing required field 'hidden_size'"),
    (lambda r: r.update(hidden_size="big"), "'hidden_size' must be an integer"),
    (lambda r: r.update(scoring_func="relu"), "'scoring_func' 'relu' is not supported"),
    (lambda r: r.update(o_groups=3), "'o_groups' must divide"),
    (lambda r: r.update(rope_scaling={"type": "linear", "factor": 2}), "'rope_scaling' type 'linear' is not supported"),
    (lambda r: r.update(index_head_dim=48), "'index_head_dim' must be a power of two"),
    (lambda r: r.update(num_experts_per_tok=9), "'num_experts_per_tok' (9) must not exceed n_routed_experts (8)"),
    (lambda r: r.update(quantization_config={"quant_method": "awq"}), "quant_method 'awq' is not supported"),
    (lambda r: r.update(dspark_block_size=5), "'dspark_block_size' (DeepSeek-V4-Flash-0731 DSpark layers)"),
    (lambda r: r.update(model_type="llama"), "'model_type' is 'llama'"),
])
def test_bad_config_names_the_field(edit, message):
    raw = tiny_config([4, 0, 16])
    edit(raw)
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(raw)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_from_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        ModelConfig.from_file(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        ModelConfig.from_file(tmp_path)
