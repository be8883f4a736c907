"""Bridge to Hugging Face transformers' `DeepseekV4ForCausalLM`, the independent implementation the
exact numerics are tested against (tests and tools only; transformers is the `test` extra).

Builds the HF model for an official-style config dict, randomizes EVERY parameter and buffer (the
library's init leaves sinks, biases, hc base/scale and ape at 0 or 1, which would hide bugs), and
exports its weights under the official checkpoint names (SPEC §3.2, §3.4).
"""

from __future__ import annotations

import re
from typing import Any

import torch


def hf_config(raw: dict[str, Any]):
    """transformers.DeepseekV4Config for an official-style config.json dict (main layers only)."""
    from transformers import DeepseekV4Config

    n = raw["num_hidden_layers"]
    ratios = raw["compress_ratios"][:n]
    hca = sorted({r for r in ratios if r not in (0, 4)})
    if len(hca) > 1:
        raise ValueError(f"transformers supports one HCA ratio per model, config has {hca}")
    kw = {k: v for k, v in raw.items() if k not in ("compress_ratios", "quantization_config", "expert_dtype",
                                                  "architectures", "model_type", "torch_dtype", "rope_scaling")}
    layer_types = [{0: "sliding_attention", 4: "compressed_sparse_attention"}.get(r, "heavily_compressed_attention")
                   for r in ratios]
    rope = {"rope_theta": raw.get("compress_rope_theta", 160000.0)}
    if raw.get("rope_scaling"):
        rs = raw["rope_scaling"]
        rope.update(rope_type="yarn", factor=rs["factor"], beta_fast=rs.get("beta_fast", 32),
                    beta_slow=rs.get("beta_slow", 1), original_max_position_embeddings=rs["original_max_position_embeddings"],
                    attention_factor=1.0)
    else:
        rope["rope_type"] = "default"
    rope["partial_rotary_factor"] = raw["qk_rope_head_dim"] / raw["head_dim"]
    main = {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0),
            "partial_rotary_factor": raw["qk_rope_head_dim"] / raw["head_dim"]}
    kw.pop("qk_rope_head_dim", None)
    kw.pop("compress_rope_theta", None)
    kw.pop("rope_theta", None)
    cfg = DeepseekV4Config(
        **kw,
        layer_types=layer_types,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": hca[0] if hca else 128},
        mlp_layer_types=["hash_moe" if i < raw.get("num_hash_layers", 0) else "moe" for i in range(n)],
        rope_parameters={"main": main, "compress": rope},
        partial_rotary_factor=raw["qk_rope_head_dim"] / raw["head_dim"],
    )
    cfg._attn_implementation = "eager"
    return cfg


def build_hf_model(raw: dict[str, Any], seed: int = 0):
    """A randomized fp32 transformers model for `raw` (every tensor drawn from a seeded generator)."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(hf_config(raw)).float().eval()
    g = torch.Generator().manual_seed(seed)
    D = raw["hidden_size"]
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name:
                continue
            if name.endswith("tid2eid"):
                E, k = raw["n_routed_experts"], t.shape[1]
                t.copy_(torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t.shape[0])]))
            elif name.endswith(("fn", "hc_fn")):
                t.copy_(torch.randn(t.shape, generator=g) * (0.5 / (t.shape[-1] ** 0.5)))
            elif name.endswith(("base", "hc_base")):
                t.copy_(torch.randn(t.shape, generator=g) * 0.5)
            elif name.endswith(("scale", "hc_scale")):
                t.copy_(1.0 + 0.3 * torch.randn(t.shape, generator=g))
            elif name.endswith("sinks"):
                t.copy_(torch.randn(t.shape, generator=g))
            elif "norm" in name:
                t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=g))
            elif name.endswith(("position_bias", "e_score_correction_bias")):
                t.copy_(0.5 * torch.randn(t.shape, generator=g))
            elif name.endswith("embed_tokens.weight"):
                t.copy_(torch.randn(t.shape, generator=g))
            else:  # projections: fan-in scaled so activations stay O(1)
                t.copy_(torch.randn(t.shape, generator=g) / (t.shape[-1] ** 0.5))
    del D
    return model


_RENAMES = [  # (HF pattern, official replacement), applied in order to the key without "model."
    (r"^embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.sinks$", ".attn_sink"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.compressor\.kv_proj\.", ".compressor.wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.position_bias$", ".ape"),
    (r"\.attn\.kv_proj\.", ".attn.wkv."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
]


def export_official(model) -> dict[str, torch.Tensor]:
    """HF state dict -> {official name: tensor} (experts split per expert, fp32 as stored in HF)."""
    out: dict[str, torch.Tensor] = {}
    sd = model.state_dict()
    for key, t in sd.items():
        if "inv_freq" in key:
            continue
        k = key[len("model."):] if key.startswith("model.") else key
        m = re.match(r"^(layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", k)
        if m:
            prefix = m.group(1)
            for e in range(t.shape[0]):
                if m.group(2) == "gate_up_proj":
                    inter = t.shape[1] // 2
                    out[f"{prefix}.ffn.experts.{e}.w1.weight"] = t[e, :inter].clone()
                    out[f"{prefix}.ffn.experts.{e}.w3.weight"] = t[e, inter:].clone()
                else:
                    out[f"{prefix}.ffn.experts.{e}.w2.weight"] = t[e].clone()
            continue
        for pat, rep in _RENAMES:
            k = re.sub(pat, rep, k)
        out[k] = t.detach().clone()
    return out


@torch.no_grad()
def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Full-sequence (stateless) logits [B,S,vocab] fp32 of the HF model."""
    return model(input_ids=ids, use_cache=False).logits.float()


def official_name(hf_key: str) -> str:
    """Official checkpoint name of a (non-expert) HF state-dict key."""
    k = hf_key[len("model."):] if hf_key.startswith("model.") else hf_key
    for pat, rep in _RENAMES:
        k = re.sub(pat, rep, k)
    return k


@torch.no_grad()
def load_official_into_hf(model, tensors: dict[str, torch.Tensor]) -> None:
    """Copy {official name: float tensor} into the HF model (inverse of export_official)."""
    for key, t in model.state_dict().items():
        if "inv_freq" in key:
            continue
        m = re.match(r"^model\.(layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", key)
        if m:
            prefix = f"{m.group(1)}.ffn.experts"
            for e in range(t.shape[0]):
                if m.group(2) == "gate_up_proj":
                    new = torch.cat([tensors[f"{prefix}.{e}.w1.weight"], tensors[f"{prefix}.{e}.w3.weight"]])
                else:
                    new = tensors[f"{prefix}.{e}.w2.weight"]
                t[e].copy_(new)
            continue
        t.copy_(tensors[official_name(key)].to(t.dtype))
