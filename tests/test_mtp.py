"""MTP block: runs on the main model's residual streams, chunk-invariant like the main layers."""

import torch

from dsv4.checkpoint import load_state
from dsv4.config import ModelConfig
from dsv4.hf_reference import build_hf_model, export_official
from dsv4.model.layers import Numerics
from dsv4.model.transformer import Transformer
from dsv4.testing import assert_close_rel, tiny_config


def test_mtp_full_equals_incremental_and_depends_on_next_token():
    raw = tiny_config([4, 16], n_mtp=1)
    model = Transformer(ModelConfig.from_dict(raw), Numerics("exact", torch.float32))
    load_state(model, export_official(build_hf_model(raw, seed=3)))  # HF has no MTP weights
    g = torch.Generator().manual_seed(0)
    for name, t in model.state_dict().items():
        if name.startswith("mtp."):
            fan_in = t.shape[-1] if t.dim() > 1 else 1
            if name.endswith("tid2eid"):
                continue
            val = torch.randn(t.shape, generator=g) / fan_in ** 0.5
            if "norm" in name:
                val = 1 + 0.1 * val
            model.get_buffer(name).copy_(val.to(t.dtype))
    T = 40
    ids = torch.randint(0, raw["vocab_size"], (1, T + 1), generator=g)
    with torch.no_grad():
        st = model.new_state(T, with_mtp=True)
        streams = model.forward_streams(ids[:, :T], st)
        full = model.forward_mtp(ids[:, 1:], streams, st, 0)
        assert full.shape == (1, T, raw["vocab_size"]) and torch.isfinite(full).all()

        st.reset()
        outs = []
        for p0, p1 in [(0, 17), (17, 18), (18, T)]:
            s = model.forward_streams(ids[:, p0:p1], st)
            outs.append(model.forward_mtp(ids[:, p0 + 1:p1 + 1], s, st, p0))
        assert_close_rel(torch.cat(outs, 1), full, "logits_incremental_fp32")

        st.reset()
        other = ids.clone()
        other[0, T] = (ids[0, T] + 1) % raw["vocab_size"]
        streams = model.forward_streams(ids[:, :T], st)
        changed = model.forward_mtp(other[:, 1:], streams, st, 0)
        assert torch.equal(changed[:, :-1], full[:, :-1]) and not torch.equal(changed[:, -1], full[:, -1])
