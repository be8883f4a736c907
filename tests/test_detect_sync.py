"""tools/detect_sync.py: the decode step has no violations, and planted ones are found by line."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from dsv4.config import ModelConfig
from dsv4.model.layers import Numerics
from dsv4.model.transformer import Transformer
from dsv4.testing import randomize_, tiny_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

spec = importlib.util.spec_from_file_location("detect_sync", Path(__file__).resolve().parents[1] / "tools" / "detect_sync.py")
detect_sync = importlib.util.module_from_spec(spec)
sys.modules["detect_sync"] = detect_sync
spec.loader.exec_module(detect_sync)


def _model():
    raw = tiny_config([0, 4, 128, 16], hidden=256, head_dim=128, rope_dim=64, index_dim=64, index_topk=4,
                      max_pos=1024, expert_dtype="fp4",
                      quantization_config=dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                               scale_fmt="ue8m0", weight_block_size=[128, 128]))
    model = randomize_(Transformer(ModelConfig.from_dict(raw), Numerics("reference", torch.bfloat16)), 0)
    return model.place(["cuda:0"])


@pytest.mark.parametrize("kernels", ["ref", "fast"])
def test_decode_step_is_clean(kernels):
    from dsv4 import ops

    ops.configure(kernels, "cuda")
    try:
        found = detect_sync.check(_model(), 300)
    finally:
        ops.configure("ref", "cpu")
    assert found == [], "\n".join(f"{v.kind} {v.piece}: {v.where}" for v in found)


def test_planted_violations_are_reported_with_module_and_line():
    model = _model()
    attn = model.layers[2].attn
    original = attn.attend

    def bad_step(a, plan, st):
        if plan.start.item() > 1_000_000:  # a Python branch on a tensor value: host sync, breaks capture
            pass
        return original(a, plan, st)

    attn.attend = bad_step
    found = detect_sync.check(model, 300)
    kinds = {(v.kind, v.piece) for v in found}
    # both of the layer's decode schedules (dsv4/graphs.py: its compressors ahead of the attention, or deferred)
    for piece in ("layers.2 (hca, ratio 128)", "layers.2 (hca, ratio 128, compressors deferred)"):
        assert ("host sync", piece) in kinds
        assert ("capture failure", piece) in kinds
    assert all(v.piece.startswith("layers.2 (hca, ratio 128") for v in found)
    assert any("test_detect_sync.py" in v.where and "plan.start.item()" in v.where for v in found)
