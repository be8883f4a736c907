"""tools/score.py on checkpoints from an INDEPENDENT writer of the official layout reproduces transformers.

The writer below shares no code with dsv4: its own FP8 (128x128 E8M0), MXFP4 (1x32 E8M0, low nibble =
even element) and NVFP4 (1x16 e4m3 + fp32 global scales) quantizers, shards, index and config, from
SPEC §3. transformers runs on the same dequantized weights; score.py's exact fp32 logits (full and
incremental) must match within TOLERANCES["logits_exact_fp32"].
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from dsv4.testing import assert_close_rel, tiny_config

pytest.importorskip("transformers")

from dsv4.hf_reference import build_hf_model, export_official, hf_logits, load_official_into_hf  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
# SPEC §3.2: the FP8 projections (everything else but the routed experts stays BF16/F32)
FP8_RE = re.compile(r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)$|\.shared_experts\.w[123]$|\.(e_proj|h_proj)$")


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(x)))


def e8m0(s: torch.Tensor) -> torch.Tensor:  # exact powers of two -> E8M0 bytes
    return (torch.log2(s).round().to(torch.int32) + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def fp8_block(w):
    N, K = w.shape
    pn, pk = -N % 128, -K % 128
    wp = torch.nn.functional.pad(w, (0, pk, 0, pn)).view((N + pn) // 128, 128, (K + pk) // 128, 128)
    s = pow2_ceil(wp.abs().amax((1, 3)).clamp_min(1e-10) / 448)
    q = (wp / s[:, None, :, None]).to(torch.float8_e4m3fn)
    deq = (q.float() * s[:, None, :, None]).view(N + pn, K + pk)[:N, :K]
    return {"weight": q.view(N + pn, K + pk)[:N, :K].contiguous(), "scale": e8m0(s)}, deq


def e2m1_codes(x):  # nearest grid point (ties: the lower magnitude; the test dequantizes the same codes)
    mag = (x.abs()[..., None] - E2M1[:8]).abs().argmin(-1)
    return mag.to(torch.uint8) | (x < 0).to(torch.uint8) << 3


def pack(codes):
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def mxfp4(w):
    N, K = w.shape
    b = w.view(N, K // 32, 32)
    s = pow2_ceil(b.abs().amax(-1).clamp_min(1e-10) / 6)
    codes = e2m1_codes(b / s[..., None]).view(N, K)
    deq = (E2M1[codes.long()].view(N, K // 32, 32) * s[..., None]).view(N, K)
    return {"weight": pack(codes).view(torch.int8), "scale": e8m0(s)}, deq


def nvfp4(w, amax):
    N, K = w.shape
    g = torch.tensor(amax / (6 * 448), dtype=torch.float32)
    b = w.view(N, K // 16, 16)
    bs = (b.abs().amax(-1) / (6 * g)).clamp(1e-3, 448).to(torch.float8_e4m3fn)
    codes = e2m1_codes(b / (bs.float() * g)[..., None]).view(N, K)
    deq = (E2M1[codes.long()].view(N, K // 16, 16) * (bs.float() * g)[..., None]).view(N, K)
    return {"weight": pack(codes), "weight_scale": bs, "weight_scale_2": g,
            "input_scale": torch.tensor(1.0 / (6 * 448), dtype=torch.float32)}, deq


def write_independent(raw, tensors, fmt, out: Path):
    """Official layout from float tensors; returns the dequantized weights transformers should use."""
    stored, deq = {}, {}
    for name, t in tensors.items():
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        expert = ".ffn.experts." in name
        if fmt != "bf16" and base and (expert or FP8_RE.search(base)):
            if not expert:
                parts, d = fp8_block(t)
            elif fmt == "fp8":
                parts, d = mxfp4(t)
            else:  # w1 and w3 of one expert share the global scales
                e = base.rsplit(".", 1)[0]
                amax = max(tensors[f"{e}.w1.weight"].abs().max().item(), tensors[f"{e}.w3.weight"].abs().max().item()) \
                    if not base.endswith("w2") else t.abs().max().item()
                parts, d = nvfp4(t, amax)
            for sfx, v in parts.items():
                stored[f"{base}.{sfx}"] = v
            deq[name] = d
        else:
            keep = t if (t.dtype != torch.float32 or t.dim() < 2 or "hc_" in name) else t.to(torch.bfloat16)
            stored[name] = keep
            deq[name] = keep.float() if keep.is_floating_point() else keep
    names = sorted(stored)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    out.mkdir(parents=True, exist_ok=True)
    for fname, keys in shards.items():
        save_file({k: stored[k].contiguous() for k in keys}, str(out / fname))
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in stored.values())},
             "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = dict(raw)
    if fmt != "bf16":
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                      "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
        cfg["expert_dtype"] = "fp4"
        if fmt == "nvfp4":
            cfg["quantization_config"]["moe_quant_algo"] = "NVFP4"
    (out / "config.json").write_text(json.dumps(cfg))
    return deq


def score(model_dir, ids_path, out, *extra):
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "score.py"), "--model", str(model_dir), "--input",
                        str(ids_path), "--output", str(out), "--numerics", "exact", "--dtype", "float32", *extra],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return torch.from_numpy(np.load(out))


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_score_reproduces_transformers_on_independently_written_checkpoints(fmt, tmp_path):
    # a config no other test uses: HCA(32) first, CSA, two SWA; 128-wide so every FP8 block is full
    raw = tiny_config([32, 4, 0, 0], n_mtp=0, hidden=128, heads=2, head_dim=128, rope_dim=32, window=24,
                      index_topk=6, index_dim=64, experts=6, topk=3, num_hash_layers=1, yarn=(8.0, 128))
    raw["moe_intermediate_size"] = 128
    hf = build_hf_model(raw, seed=21)
    deq = write_independent(raw, export_official(hf), fmt, tmp_path / "ckpt")
    load_official_into_hf(hf, deq)
    T = 200
    ids = torch.randint(0, raw["vocab_size"], (1, T), generator=torch.Generator().manual_seed(5))
    (tmp_path / "ids.json").write_text(json.dumps(ids[0].tolist()))
    ref = hf_logits(hf, ids)[0]
    full = score(tmp_path / "ckpt", tmp_path / "ids.json", tmp_path / "full.npy", "--mode", "full")
    assert full.shape == (T, raw["vocab_size"]) and full.dtype == torch.float32
    assert_close_rel(full, ref, "logits_exact_fp32")
    inc = score(tmp_path / "ckpt", tmp_path / "ids.json", tmp_path / "inc.npy", "--mode", "incremental",
                "--prefill", "150", "--chunk", "37")
    assert_close_rel(inc, ref, "logits_exact_fp32")


@pytest.mark.parametrize("args, message", [
    (["--mode", "incremental", "--chunk", "129"], "--chunk must be in [1, 128], got 129"),
    (["--mode", "incremental", "--prefill", "9"], "--prefill must be in [0, 3] for 3 tokens, got 9"),
])
def test_score_bad_arguments(tmp_path, args, message):
    (tmp_path / "ids.json").write_text("[1, 2, 3]")
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "score.py"), "--model", str(tmp_path), "--input",
                        str(tmp_path / "ids.json"), "--output", str(tmp_path / "o.npy"), *args],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip() == f"error: {message}"


def test_score_bad_model_dir_and_input(tmp_path):
    (tmp_path / "ids.json").write_text("[1, 2, 3]")
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "score.py"), "--model", str(tmp_path / "none"),
                        "--input", str(tmp_path / "ids.json"), "--output", str(tmp_path / "o.npy")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr
    (tmp_path / "bad.json").write_text('{"ids": 1}')
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "score.py"), "--model", str(tmp_path), "--input",
                        str(tmp_path / "bad.json"), "--output", str(tmp_path / "o.npy")], capture_output=True, text=True)
    assert r.returncode == 2 and "must hold a non-empty JSON list of integer token ids" in r.stderr
