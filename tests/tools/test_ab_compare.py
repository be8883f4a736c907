"""tools/ab_compare.py: lockstep scoring of fast vs reference ops, its tolerance verdicts and its CLI."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ab_compare", ROOT / "tools" / "ab_compare.py")
ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ab)


def test_compare_scores_and_tolerances():
    ref = torch.tensor([1.0, -2.0, 4.0]).to(torch.bfloat16)
    ok = ab.compare("linear", ref.clone(), ref)
    assert ok["max_abs"] == 0 and ok["cos"] == pytest.approx(1.0) and not ok["over"] and ok["tol"] == "op_bf16_out"
    off = ab.compare("linear", torch.tensor([1.0, -2.0, 4.25]).to(torch.bfloat16), ref)
    assert off["over"] and off["rel"] == pytest.approx(0.25 / 4)
    ints = torch.tensor([3, 1, -1], dtype=torch.int32)
    assert not ab.compare("topk_select", ints.clone(), ints)["over"]
    assert ab.compare("topk_select", ints.flip(0), ints)["over"]
    assert ab.compare("sparse_attn", ref, ref)["tol"] == "op_attention"


def test_lockstep_returns_the_reference_and_flags_a_wrong_fast_op():
    from dsv4.ops import Op

    op = Op("linear", ref=lambda x: x * 2, fast=lambda x: x * 2 + 1, fast_on=("cpu",))
    hook = ab.Lockstep({"linear", "compressor"}, "cpu")
    hook.kind = "csa"
    x = torch.ones(4)
    assert torch.equal(hook(op, (x,), {}), x * 2)  # the reference result flows on
    row = hook.rows[("linear", "csa")]
    assert row["calls"] == 1 and row["over"] and row["max_abs"] == 1.0
    assert hook.first_over.startswith("linear in csa")
    def bump(t):
        t.add_(1)

    inplace = Op("compressor", ref=bump, fast=bump, fast_on=("cpu",))
    t = torch.zeros(3)
    assert hook(inplace, (t,), {}) is None and torch.equal(t, torch.ones(3))  # compared through its argument
    assert not hook.rows[("compressor", "csa")]["over"]


def test_fused_mhc_boundary_is_scored_on_its_own_streams():
    # mhc_post_pre_norm: the streams against the reference's, the pre + norm against the reference pre + norm of the
    # streams the fast op wrote (a fast op one bf16 ulp off in a stream is judged on that stream)
    from dsv4.ops.mhc import mhc_post_pre_norm_ref, mhc_pre_norm_ref

    g = torch.Generator().manual_seed(0)
    hc, D = 4, 256
    x = torch.randn(1, 3, hc, D, generator=g).to(torch.bfloat16)
    f = torch.randn(1, 3, D, generator=g).to(torch.bfloat16)
    post, comb = torch.rand(1, 3, hc, generator=g), torch.rand(1, 3, hc, hc, generator=g)
    fn = torch.randn((2 + hc) * hc, hc * D, generator=g) * (hc * D) ** -0.5
    tail = (fn, torch.randn((2 + hc) * hc, generator=g) * 0.5, 1 + torch.randn(3, generator=g) * 0.3, hc, 20, 1e-6,
            1e-6, (1 + 0.3 * torch.randn(D, generator=g)).to(torch.bfloat16), 1e-6)
    args = (f, x, post, comb) + tail
    ref = mhc_post_pre_norm_ref(*args)
    streams = ref[0].clone()
    streams.view(torch.int16)[0, 1, 2, 7] += 1  # one ulp
    fast = (streams, *mhc_pre_norm_ref(streams, *tail))
    staged = ab.staged_reference("mhc_post_pre_norm", fast, ref, args)
    assert staged[0] is ref[0] and all(torch.equal(a, b) for a, b in zip(staged[1:], fast[1:]))
    assert not ab.compare("mhc_post_pre_norm", fast, staged, args)["over"]
    named = dict(zip(("fn", "base", "scale", "hc", "iters", "hc_eps", "norm_eps", "w", "eps"), tail))
    by_name = ab.staged_reference("mhc_post_pre_norm", fast, ref, (f, x, post, comb), named)  # keyword arguments
    assert all(torch.equal(a, b) for a, b in zip(by_name, staged))
    assert ab.staged_reference("linear", fast, ref, args) is ref


def test_end_to_end_scores_each_step_on_the_same_inputs():
    ref = torch.tensor([[3.0, 1.0, 0.0], [2.0, 1.95, 0.0], [2.0, 0.0, 1.0]])
    fast = ref.clone()
    fast[1, 1] = 2.05  # a 0.1 error flips a 0.05 margin
    res = ab.end_to_end(ref, [0, 0, 0], fast, [0, 1, 0])
    assert (res["agree_steps"], res["steps"]) == (2, 3)
    assert res["logits_max_abs_err"] == pytest.approx(0.1) and res["logits_rel_err"] == pytest.approx(0.1 / 3)
    (d,) = res["differ"]
    assert (d["step"], d["ref"], d["fast"]) == (1, 0, 1)
    assert d["ref_gap"] == pytest.approx(0.05) and d["fast_gap"] == pytest.approx(0.05)
    assert ab.end_to_end(ref, [0, 0, 0], ref, [0, 0, 0])["differ"] == []


def test_run_model_teacher_forcing_feeds_the_given_tokens():
    class Toy(torch.nn.Module):  # logits favour the token after the last input
        def new_state(self, n):
            return None

        def forward(self, x, state, last_only=False):
            out = torch.zeros(1, x.shape[1], 8)
            out[0, -1, (int(x[0, -1]) + 1) % 8] = 1.0
            return out

    _, free = ab.run_model(Toy(), [0, 3], 3, "cpu")
    assert free == [4, 5, 6, 7]
    _, forced = ab.run_model(Toy(), [0, 3], 3, "cpu", force=[1, 1, 1])
    assert forced == [4, 2, 2, 2]


def _run(*args, env=None):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "ab_compare.py"), *args], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=900)


def test_list_names_every_op():
    r = _run("--list", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    from dsv4 import ops

    for name in ops.OPS:
        assert any(line.startswith(name + " ") for line in r.stdout.splitlines()), name


def test_cli_errors():
    r = _run("--ops", "nope", "--device", "cpu")
    assert r.returncode == 2 and r.stderr.strip() == "error: unknown op(s) nope; see --list"


def test_demo_model_linear_interpreted_on_cpu(tmp_path):
    from dsv4 import ops

    if ops.OPS["linear"].fast is None:
        pytest.skip("no fast linear on this machine (Triton missing)")
    out = tmp_path / "ab.json"
    r = _run("--device", "cpu", "--tokens", "1", "--ops", "linear", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    kinds = {row["layer"] for row in res["rows"] if row["op"] == "linear"}
    assert {"swa", "csa", "hca"} <= kinds
    assert all(not row["over"] and row["calls"] > 0 for row in res["rows"])
    assert res["first_over"] is None and res["greedy_agree"]
    assert "first over tolerance: none" in r.stdout
    phases = [line.split(":")[0] for line in r.stderr.splitlines() if " decode steps ..." in line]
    assert phases == ["1/3 lockstep (every selected op on the reference's inputs)", "2/3 the reference alone",
                      "3/3 the fast ops alone, on the reference's tokens"]  # progress while it runs
