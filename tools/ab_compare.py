#!/usr/bin/env python3
"""Kernel A/B comparison: every op's fast backend against its reference, in lockstep, on a real model.

Runs prefill + N decode steps of a prompt through the model with a hook on every op call: the selected
ops run both backends on the same inputs (the fast one on copies), the reference result flows on, and
each call is scored (max abs error, relative error max|fast-ref|/max|ref|, relative L2, cosine, time); a fused
op whose later stage reads its own earlier output (mhc_post_pre_norm) is scored stage by stage (staged_reference).
Prints one row per op and layer kind, the first op/layer over its tolerance (dsv4/testing.py), then an
end-to-end run of each backend alone (the reference greedy, the fast one fed the reference's tokens so that
every step compares like with like): the logits error, the steps whose greedy picks agree and, where they
differ, each run's margin for its pick. Expert and indexer top-k choices make a model amplify op-level rounding
differences (a near-tied choice flips), so greedy picks of a random-weight model can differ between two correct
backends, or between the reference on two devices (docs/performance.md).
Exit 1 when an op is over tolerance, 2 on a usage error. On a CPU the Triton kernels run under
TRITON_INTERPRET=1 (set here when absent); CUDA-only ops are listed as unavailable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4.cli import Parser  # noqa: E402  (argparse errors in one line)


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(
        description="Compare every op's fast backend with its reference, in lockstep, on a model "
                    "(prefill + N decode steps); exit 1 if an op is over tolerance.")
    p.add_argument("--model", metavar="DIR", help="checkpoint directory (default: the demo model)")
    p.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog.",
                   help="prompt text, fed raw (default: a pangram)")
    p.add_argument("--tokens", type=int, default=4, metavar="N", help="decode steps after the prefill (default 4)")
    p.add_argument("--ops", default="all", help="all, or a comma list of ops to compare (default all)")
    p.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    p.add_argument("--numerics", choices=("reference", "exact"), default="reference",
                   help="model numerics (default reference)")
    p.add_argument("--json", metavar="F", help="also write the rows and the summary as JSON to F")
    p.add_argument("--list", action="store_true", help="list every op with the backends available here and exit")
    return p.parse_args(argv)


def fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def _tensors(x) -> list:
    import torch

    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensors(v)]
    return []


def _clone(x):
    import torch

    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, tuple):
        vals = tuple(_clone(v) for v in x)
        return type(x)(*vals) if hasattr(x, "_fields") else vals  # a NamedTuple (QuantAct) keeps its type
    if isinstance(x, list):
        return [_clone(v) for v in x]
    return x


def tolerance_for(op: str, t, args: tuple = (), index: int = 0) -> str:
    """The TOLERANCES entry output `index` of op is held to ('bitwise' for integers)."""
    import torch

    if not t.is_floating_point() or t.dtype == torch.float8_e4m3fn:
        return "bitwise"
    w = args[1] if op == "linear" and len(args) > 1 else args[3] if op == "norm_linear" and len(args) > 3 else None
    fmt = getattr(w, "fmt", None)
    if fmt == "fp8" and t.dtype == torch.bfloat16:  # Hopper FP8 tensor-core dots (see the table entry)
        return "op_fp8_mma_bf16_out"
    if op == "sparse_attn":
        return "op_attention"
    if op == "qkv_norm_rope" and index == 0 and t.dtype == torch.bfloat16:  # q: the statistic in bf16
        return "op_bf16_stat"
    return "op_fp32_out" if t.dtype == torch.float32 else "op_bf16_out"


def compare(op: str, fast, ref, args: tuple = ()) -> dict:
    """Scores of one call (its arguments pick the tolerance): the worst over its outputs."""
    import torch

    from dsv4.testing import tol

    worst = {"max_abs": 0.0, "rel": 0.0, "rel_l2": 0.0, "cos": 1.0, "over": False, "tol": None}
    for i, (a, b) in enumerate(zip(_tensors(fast), _tensors(ref))):
        # rmsnorm_quant's codes and scales (after its norm) are held bit for bit to the quantization of its own norm
        name = "bitwise" if op == "rmsnorm_quant" and i > 0 else tolerance_for(op, b, args, i)
        if name == "bitwise":
            if a.dtype == torch.float8_e4m3fn:  # compared as codes (torch.equal has no fp8 kernel everywhere)
                a, b = a.view(torch.uint8), b.view(torch.uint8)
            bad = a.shape != b.shape or not torch.equal(a, b)
            worst["over"] |= bad
            worst["tol"] = worst["tol"] or "bitwise"
            if bad:
                worst["rel"] = float("inf")
            continue
        if a.dtype == torch.uint8 and b.dtype == torch.uint8 and a.shape == b.shape:  # packed FP8 K = V rows: values
            from dsv4.ops.kv_pack import kv_unpack_ref, packed_row_dim

            dim = packed_row_dim(a.shape[-1])
            a, b = kv_unpack_ref(a, dim), kv_unpack_ref(b, dim)
        af, bf = a.float().flatten(), b.float().flatten()
        d = torch.where(af == bf, 0.0, (af - bf).abs())  # equal infinities (e.g. -inf gate scores) agree
        finite = bool(torch.isfinite(d).all())
        keep = torch.isfinite(af) & torch.isfinite(bf)  # the scale, L2 and cosine over the finite values
        af, bf, d = af[keep], bf[keep], d[keep]
        mab = d.max().item() if d.numel() else 0.0
        scale = bf.abs().max().item() if bf.numel() else 0.0
        rel = mab / max(scale, 1e-30) if finite else float("inf")
        l2 = (d.norm() / bf.norm().clamp_min(1e-30)).item()
        cos = torch.nn.functional.cosine_similarity(af, bf, dim=0).item() if af.numel() else 1.0
        worst["max_abs"] = max(worst["max_abs"], mab)
        worst["rel"] = max(worst["rel"], rel)
        worst["rel_l2"] = max(worst["rel_l2"], l2)
        worst["cos"] = min(worst["cos"], cos)
        worst["over"] |= rel > tol(name)
        worst["tol"] = name
    return worst


def staged_reference(op: str, fast_out, ref_out, args: tuple, kwargs: dict | None = None):
    """The reference a fused op's outputs are held to. mhc_post_pre_norm writes the new streams, then runs
    mhc_pre_norm on them: its streams are held to the reference's, its later outputs to the reference pre + norm of
    the streams the fast op wrote, as its tests do (one bf16 ulp in a stream, within op_bf16_out, moves the fp32
    mixing weights after 20 Sinkhorn rounds by ~1e-5..4e-5 at Flash width, beyond op_fp32_out's summation-order
    bound; judged on its own streams the fast pre is held to that bound); moe_post_pre (the FFN's post, then the next
    block's pre + norm) likewise. rmsnorm_quant's norm is held to the
    reference's, its codes and scales to the quantization of its own norm (one ulp of the norm may move a code)."""
    if op == "rmsnorm_quant":  # the norm against the reference's; the codes against the quantization of its own
        from dsv4.ops.act_quant import quant_act_ref

        own = quant_act_ref(fast_out.x)
        return type(ref_out)(ref_out.x, own.q, own.s)
    if op == "mhc_post_pre_norm":
        import inspect

        from dsv4.ops.mhc import mhc_post_pre_norm_ref, mhc_pre_norm_ref

        bound = inspect.signature(mhc_post_pre_norm_ref).bind(*args, **(kwargs or {})).arguments
        pre = {k: v for k, v in bound.items() if k not in ("f", "x", "post", "comb")}  # mhc_pre_norm_ref's names
        return (ref_out[0], *mhc_pre_norm_ref(fast_out[0], **pre))
    if op == "moe_post_pre":
        import inspect

        from dsv4.ops.mhc import mhc_pre_norm_ref
        from dsv4.ops.moe import moe_post_pre_ref

        bound = inspect.signature(moe_post_pre_ref).bind(*args, **(kwargs or {})).arguments
        names = ("fn", "base", "scale", "hc", "iters", "hc_eps", "norm_eps", "w", "eps")  # mhc_pre_norm_ref's
        return (ref_out[0], *mhc_pre_norm_ref(fast_out[0], **{k: bound[k] for k in names}))
    return ref_out


class Lockstep:
    """The ops hook: runs fast (on copies) and ref, records scores per (op, layer kind), returns ref."""

    def __init__(self, selected: set[str], device_type: str):
        self.selected, self.device_type = selected, device_type
        self.kind = "model"  # the layer kind running now (set by module pre-hooks)
        self.rows: dict = {}
        self.first_over = None

    def _time(self, fn):
        import torch

        if self.device_type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if self.device_type == "cuda":
            torch.cuda.synchronize()
        return out, (time.perf_counter() - t0) * 1e6

    def __call__(self, op, args, kwargs):
        available, _ = op.fast_available(self.device_type)
        if op.name not in self.selected or not available:
            return op.ref(*args, **kwargs)
        fargs, fkwargs = _clone(args), _clone(kwargs)
        fast_out, fast_us = self._time(lambda: op.fast(*fargs, **fkwargs))
        ref_ret, ref_us = self._time(lambda: op.ref(*args, **kwargs))
        ref_out = ref_ret
        if ref_ret is None or (isinstance(ref_ret, tuple) and any(v is None for v in ref_ret)):
            # an op that (also) updates its arguments in place: its outputs, then those
            fast_out, ref_out = _tensors(fast_out) + _tensors(fargs), _tensors(ref_ret) + _tensors(args)
        score = compare(op.name, fast_out, staged_reference(op.name, fast_out, ref_out, args, kwargs), args)
        key = (op.name, self.kind)
        row = self.rows.setdefault(key, {"op": op.name, "layer": self.kind, "calls": 0, "max_abs": 0.0, "rel": 0.0,
                                         "rel_l2": 0.0, "cos": 1.0, "ref_us": 0.0, "fast_us": 0.0, "over": False,
                                         "tol": score["tol"]})
        row["calls"] += 1
        for k in ("max_abs", "rel", "rel_l2"):
            row[k] = max(row[k], score[k])
        row["cos"] = min(row["cos"], score["cos"])
        row["ref_us"] += ref_us
        row["fast_us"] += fast_us
        row["over"] |= score["over"]
        if score["over"] and self.first_over is None:
            self.first_over = f"{op.name} in {self.kind} (call {row['calls']}, rel {score['rel']:.3g})"
        return ref_ret


def layer_kind(spec) -> str:
    if spec.is_mtp:
        return "mtp"
    return {0: "swa"}.get(spec.ratio, "csa" if spec.has_indexer else "hca")


def run_model(model, ids: list[int], tokens: int, device, force: list[int] | None = None, what: str = "run"):
    """Prefill (chunks of 128) + decode: (logits [tokens+1, V] fp32, the greedy pick of every step). Decode feeds
    the greedy picks, or `force` (teacher forcing: another run's tokens, so that both runs see the same inputs).
    `what` names the run in the progress line on stderr."""
    import torch

    print(f"{what}: prefill {len(ids)} tokens + {tokens} decode steps ...", file=sys.stderr, flush=True)
    state = model.new_state(len(ids) + tokens + 1)
    outs, gen = [], []
    with torch.no_grad():
        x = torch.tensor([ids], device=device)
        for p in range(0, len(ids), 128):
            logits = model(x[:, p:p + 128], state, last_only=True)
        for step in range(tokens + 1):
            outs.append(logits[0, -1].float().cpu())
            gen.append(int(outs[-1].argmax()))
            if step == tokens:
                break
            nxt = gen[-1] if force is None else force[step]
            logits = model(torch.tensor([[nxt]], device=device), state)
    return torch.stack(outs), gen


def end_to_end(ref_logits, ref_tokens: list[int], fast_logits, fast_tokens: list[int]) -> dict:
    """The fast run teacher-forced on the reference's tokens against the reference, step by step: the logits error
    and, at each step whose greedy pick differs, each run's margin for its own pick over the other's."""
    from dsv4.testing import rel_err

    steps = []
    for i, (a, b) in enumerate(zip(ref_tokens, fast_tokens)):
        if a != b:
            steps.append({"step": i, "ref": a, "fast": b, "ref_gap": (ref_logits[i, a] - ref_logits[i, b]).item(),
                          "fast_gap": (fast_logits[i, b] - fast_logits[i, a]).item()})
    return {"logits_rel_err": rel_err(fast_logits, ref_logits),
            "logits_max_abs_err": (fast_logits - ref_logits).abs().max().item(),
            "agree_steps": len(ref_tokens) - len(steps), "steps": len(ref_tokens), "differ": steps}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev not in ("cpu", "cuda") and not dev.startswith("cuda:"):
        fail(f"--device must be cpu or cuda, got {args.device!r}")
    if dev.startswith("cuda") and not torch.cuda.is_available():
        fail("--device cuda requested but CUDA is not available on this machine")
    dtype_ = "cuda" if dev.startswith("cuda") else "cpu"
    if dtype_ == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

    from dsv4 import ops

    if args.list:
        if dtype_ == "cuda":
            from dsv4.kernels import cuda as cuda_kernels

            cuda_kernels.load()
        for name, op in ops.OPS.items():
            ok, why = op.fast_available(dtype_)
            print(f"{name:16s} ref: yes   fast: {'yes' if ok else 'no (' + why + ')'}   {op.doc}")
        print(ops.cuda_line() or "CUDA kernels: not used on the CPU (the fast ops run Triton under TRITON_INTERPRET=1)")
        return 0
    selected = set(ops.OPS) if args.ops == "all" else {s.strip() for s in args.ops.split(",") if s.strip()}
    unknown = sorted(selected - set(ops.OPS))
    if unknown:
        fail(f"unknown op(s) {', '.join(unknown)}; see --list")
    if args.tokens < 0:
        fail("--tokens must be >= 0")

    from dsv4.demo import demo_checkpoint
    from dsv4.loader import load_model
    from encoding import load_tokenizer

    from dsv4.cli import describe
    from dsv4.config import ConfigError
    from dsv4.loader import CheckpointError

    path = Path(args.model) if args.model else demo_checkpoint()
    try:
        model = load_model(path, numerics=args.numerics, dtype=torch.bfloat16, devices=[dev], progress=False)
    except (ConfigError, CheckpointError, OSError, ValueError) as e:
        fail(describe(e))
    ids = [0] + load_tokenizer(path).encode(args.prompt)
    if len(ids) + args.tokens + 1 > model.cfg.max_position_embeddings:
        fail(f"prompt + --tokens exceed the model's {model.cfg.max_position_embeddings} positions")

    # 1) lockstep: every selected op scored on the reference run's inputs
    ops.configure("ref", dtype_)
    hook = Lockstep(selected, dtype_)
    for layer in list(model.layers) + list(model.mtp):
        kind = layer_kind(layer.spec)
        layer.register_forward_pre_hook(lambda m, a, kind=kind: setattr(hook, "kind", kind))
        layer.register_forward_hook(lambda m, a, o: setattr(hook, "kind", "model"))
    ops.set_hook(hook)
    try:
        run_model(model, ids, args.tokens, dev, what="1/3 lockstep (every selected op on the reference's inputs)")
    finally:
        ops.set_hook(None)

    # 2) each backend alone, end to end: the reference greedy, the fast run fed the reference's tokens
    ops.configure("ref", dtype_)
    ref_logits, ref_tokens = run_model(model, ids, args.tokens, dev, what="2/3 the reference alone")
    report = ops.configure("fast", dtype_, {n: "ref" for n in ops.OPS if n not in selected})
    fast_logits, fast_tokens = run_model(model, ids, args.tokens, dev, force=ref_tokens,
                                         what="3/3 the fast ops alone, on the reference's tokens")
    e2e = end_to_end(ref_logits, ref_tokens, fast_logits, fast_tokens)
    rows = sorted(hook.rows.values(), key=lambda r: (list(ops.OPS).index(r["op"]), r["layer"]))
    print(ops.banner(report))
    print(f"{'op':15s} {'layer':6s} {'calls':>5s} {'max abs':>9s} {'rel':>9s} {'rel L2':>9s} {'cosine':>9s} "
          f"{'ref us':>9s} {'fast us':>9s} {'speedup':>7s}  tolerance")
    for r in rows:
        n = r["calls"]
        speed = r["ref_us"] / r["fast_us"] if r["fast_us"] else float("nan")
        flag = "OVER" if r["over"] else "ok"
        print(f"{r['op']:15s} {r['layer']:6s} {n:5d} {r['max_abs']:9.3g} {r['rel']:9.3g} {r['rel_l2']:9.3g} "
              f"{r['cos']:9.6f} {r['ref_us'] / n:9.1f} {r['fast_us'] / n:9.1f} {speed:7.2f}  {r['tol']} {flag}")
    skipped = [n for n in sorted(selected) if not ops.OPS[n].fast_available(dtype_)[0]]
    if skipped:
        print(f"no fast path here (not compared): {', '.join(skipped)}")
    over = [r for r in rows if r["over"]]
    print(f"first over tolerance: {hook.first_over or 'none'}")
    agree = fast_tokens == ref_tokens
    print(f"end to end ({len(ids)} prompt tokens + {args.tokens} decode steps, the fast run fed the reference's "
          f"tokens): logits rel err {e2e['logits_rel_err']:.3g} (max abs {e2e['logits_max_abs_err']:.3g}); greedy "
          f"picks agree at {e2e['agree_steps']}/{e2e['steps']} steps (ref {ref_tokens}, fast {fast_tokens})")
    for d in e2e["differ"]:
        print(f"  step {d['step']}: ref picks {d['ref']} by {d['ref_gap']:.3g} over fast's {d['fast']}, which fast "
              f"picks by {d['fast_gap']:.3g}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "device": dev, "model": str(path), "prompt_tokens": len(ids), "decode_steps": args.tokens,
            "rows": rows, "first_over": hook.first_over, "e2e_logits_rel_err": e2e["logits_rel_err"],
            "e2e": e2e, "greedy_agree": agree, "ref_tokens": ref_tokens, "fast_tokens": fast_tokens,
            "kernels": report,
        }, indent=1))
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
