#!/usr/bin/env python3
"""Decode benchmark at full DeepSeek-V4-Flash width: batch 1, per-layer and per-token latency, eager vs
CUDA graphs, weight bytes read per token and achieved GB/s against the HBM floor.

Random weights in the official formats (FP8 projections, MXFP4 experts) are generated on the device for
the first --layers layers of the Flash config (all 43 need ~150 GB: spread them with --device
cuda:0,cuda:1, or run them on one H200 with --share-experts). For each context the state is filled with random cache
contents at position ctx-1, so the step reads a full context. Prints a table and writes JSON (--json). A benchmark,
not a test. Needs a CUDA GPU.

--share-experts gives every layer on a device the routed-expert stacks of the first layer on it (one set of 256
MXFP4 experts, ~3.4 GB, instead of one per layer), so that all 43 layers fit on one GPU (~12 GB of weights). A step
still reads each layer's k chosen experts from HBM: between two layers' expert reads more than 100 MB of other
weights pass through the 50 MB L2, so no layer finds the previous layer's experts there, and the bytes counted per
token are the same (its logits mean no more than any random model's; its time is that of the layers it runs).
On an H200, from a process's fourth graph-capturing DecodeRunner on (one per context with --no-eager; more with eager
rows or --prefill not measured), the whole steps came out ~1 ms slower on the GPU, their per-layer times unchanged
(docs/performance.md, sixty-first pass): time at most three contexts a run for the whole-step rows (a warning says so).

With a context that is a multiple of 128, the step at ctx-1 closes every compressor's window (each emits an
entry: its costliest step, run in the emitting schedule). The graph rows therefore also time each layer at ctx-2
("open": every window stays open, the compressors only keep their input unless --no-defer) and project 43
layers over a 128-token cycle, "(cycle)": a layer of compression ratio r emits at one step in r. The whole step
(embedding, every layer's graph, head, a sync) is also timed at one position of each kind the cycle holds (Flash:
ctx-1 closes every window, ctx-5 only the ratio-4 windows, ctx-2 none) and weighted by how often each comes:
"token ms (cycle)", measured end to end where the projection adds per-layer figures.

--prefill N also times the chunked prefill of an N-token prompt that ends at each context (chunks of up to
128 tokens; the state filled at random before the prompt), eager and (fast MoE) as the engine runs it, the full
chunks after the first through the prefill graphs (dsv4/graphs.py PrefillRunner): per layer ms per 1K prompt
tokens (CUDA events between layers), the whole prefill's wall time, and the projection to 43 layers in ms and
prompt tokens per second; with --profile also one eager chunk's GPU time per layer kind split by op; with
--timeline also how busy the GPU is over one prefill through the prefill graphs (the union of its kernels' intervals
against their span) and its largest idle gaps, which tells a prefill that waits on the host from one bound by its
kernels.

--fuse-pre times the model with each layer's attention input made by the FFN op of the layer before
(Transformer.fuse_pre, ops.moe_post_pre; off by default): so that the last benchmarked layer then does the work it
does inside the model, its next layer is a stand-in that holds only the first layer's mHC pre parameters (the step
computes that input and nothing reads it).

--layer-us N times each layer's decode graph to 0.1 us (the median of 7 runs of N back-to-back replays: the yardstick
for one kernel change, where the 0.01 ms rows do not resolve it); --timeline prints, per layer kind, every kernel of
the layer's graph as its replays run them (start and end), which shows what overlaps what (at ctx-1, and at ctx-2
for the layer kinds whose step there replays their other schedule, the compressors deferred to the closing step); --launches prints
each of those kernels' launch (CTAs, threads, registers, shared memory) with the CTAs an SM holds, and marks a kernel
of one wave whose CTAs can crowd onto fewer SMs than an even spread needs ("pile": launched programmatically into a
busy device, its CTAs land on the SMs that free up first).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4.cli import Parser  # noqa: E402  (argparse errors in one line)

FLOOR_GB_PER_TOKEN = 11.21  # PERFORMANCE.md §2.1 scenario A (official precisions, batch 1)


def tensor_bytes(t) -> int:
    return t.numel() * t.element_size()


def module_bytes(mod) -> int:
    return sum(tensor_bytes(b) for b in mod.buffers())


def layer_read_bytes(layer) -> int:
    """Weight bytes one decode step of `layer` reads: everything but the unchosen routed experts."""
    experts = layer.ffn.experts
    k = layer.cfg.num_experts_per_tok
    total = module_bytes(layer) - module_bytes(experts)
    return total + k * module_bytes(experts) // experts.n_experts


def state_read_bytes(st, pos: int, spec, kept: bool = False) -> int:
    """Cache bytes one step reads at position pos (window + visible compressed entries + indexer keys + the
    compressors' open rows); kept: the step closes a window after deferring steps and also reads their kept input rows
    (BlockState.x_ring)."""
    n = st.window.shape[1] * st.window.shape[2] * st.window.element_size()
    for c in (st.compressor, st.indexer):
        if c is not None:
            visible = (pos + 1) // c.ratio
            n += visible * c.entries.shape[2] * c.entries.element_size() + tensor_bytes(c.kv) + tensor_bytes(c.score)
    if kept and st.x_ring is not None:
        n += tensor_bytes(st.x_ring)
    return n


def fill_state(state, pos: int, seed: int) -> None:
    """Random values in every row of the state; packed rows (uint8) hold packed random rows of their kind (FP8 K = V
    rows, FP4 indexer keys), so their readers see realistic values."""
    import torch

    from dsv4.ops.fp4_quant import fp4_act_quant_ref
    from dsv4.ops.kv_pack import key_pack_parts, kv_pack_ref, packed_row_dim

    def packed(t, key_dim: int | None):
        if key_dim:
            return key_pack_parts(*fp4_act_quant_ref(torch.randn(*t.shape[:-1], key_dim, generator=g), 32))
        return kv_pack_ref(torch.randn(*t.shape[:-1], packed_row_dim(t.shape[-1]), generator=g).to(torch.bfloat16))

    g = torch.Generator(device="cpu").manual_seed(seed)
    for st in state.blocks:
        tensors = [(st.window, None)] + ([(st.x_ring, None)] if st.x_ring is not None else [])
        st.lagging = False  # (the kept rows and the open rows are both random: nothing to catch up)
        for c in (st.compressor, st.indexer):
            if c is not None:
                tensors += [(c.entries, c.dim if c is st.indexer else None), (c.kv, None), (c.score, None)]
        for t, key_dim in tensors:
            t.copy_(packed(t, key_dim) if t.dtype == torch.uint8 else torch.randn(t.shape, generator=g).to(t.dtype))
    state.pos = pos


def cycle_positions(ctx: int, ratios) -> list[tuple[int, float, int]]:
    """The step positions whose times, weighted, give the mean step over a cycle of lcm(ratios) tokens ending at ctx:
    [(pos, weight, largest ratio whose window the step at pos closes; 0: none)], weights summing to 1. A step at pos
    closes the windows of every ratio r with (pos + 1) % r == 0. Needs ratios (>= 2) that divide each other and ctx a
    multiple of the largest; [] otherwise (or without ratios). For Flash's 4 and 128: ctx-1 (all close, 1/128), ctx-5
    (only the ratio-4 windows, 31/128), ctx-2 (none, 96/128)."""
    rs = sorted(set(int(r) for r in ratios if r))
    if not rs or rs[0] < 2 or any(b % a for a, b in zip(rs, rs[1:])) or ctx % rs[-1] or ctx < rs[-1]:
        return []
    out = [(ctx - 1, 1.0 / rs[-1], rs[-1])]
    for r, nxt in zip(rs, rs[1:]):  # the largest ratio closing is r: (pos + 1) = ctx - r, a multiple of r, not of nxt
        out.append((ctx - 1 - r, 1.0 / r - 1.0 / nxt, r))
    out.append((ctx - 2, 1.0 - 1.0 / rs[0], 0))
    return out


def share_experts(model, devices) -> int:
    """Give every layer the routed-expert stacks (`ffn.experts`, one module) of the first layer on its device, as
    `Transformer.place(devices)` will spread them; call it on the meta model, before place. -> layers that share."""
    owner: dict = {}
    shared = 0
    for layer, dev in zip(model.layers, model.split_layers(devices)):
        if dev in owner:
            layer.ffn.experts = owner[dev]
            shared += 1
        else:
            owner[dev] = layer.ffn.experts
    return shared


def balance_routing(model, tokens: int = 128, steps: int = 200) -> list[tuple[int, int]]:
    """Set every score-routed gate's bias so that a prompt chunk spreads over the experts as a trained layer's does
    (DeepSeek balances its experts' loads through this bias, which only the selection reads). In a random model the
    hidden states of a chunk share one large component, which random gate weights turn into the same few experts for
    every token: a 128-token chunk hit ~35-90 of the 256 experts (the hash-routed layers ~245), so its prefill read a
    quarter of a real layer's expert bytes. One random chunk runs eagerly through the layers in order; at each
    score-routed gate the bias is set from that chunk's scores (each expert's mean score removed, then `steps` sign
    steps on the loads, shrinking) before the chunk goes on, so each layer is balanced on the inputs it then sees.
    -> [(distinct experts the chunk hits, its busiest expert's rows)] per score-routed layer, after."""
    import torch

    from dsv4.model.moe import Gate

    gates = [m for layer in model.layers for m in layer.modules() if isinstance(m, Gate) and not m.hash]
    if not gates:
        return []
    out = []

    def balanced(gate):
        def forward(x, ids):
            logits = x.float() @ gate.weight.float().T
            scores = {"softmax": lambda v: v.softmax(-1), "sigmoid": torch.sigmoid}.get(
                gate.func, lambda v: torch.nn.functional.softplus(v).sqrt())(logits)
            bias = -scores.mean(0)
            mean = scores.shape[0] * gate.topk / scores.shape[1]
            u = float(scores.std()) * 0.1
            for i in range(steps):
                load = torch.bincount((scores + bias).topk(gate.topk, -1).indices.flatten(), minlength=scores.shape[1])
                bias -= u * (1 - i / steps) * torch.sign(load - mean)
            gate.bias.copy_(bias.to(gate.bias.dtype))
            idx = (scores + gate.bias.float()).topk(gate.topk, -1).indices
            out.append((int(idx.unique().numel()), int(torch.bincount(idx.flatten()).max())))
            return Gate.forward(gate, x, ids)
        return forward

    tokens = min(tokens, model.max_pos)
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, model.cfg.vocab_size, (1, tokens), generator=g).to(model.embed.weight.device)
    model.prepare()
    state = model.new_state(tokens)
    try:
        for gate in gates:
            gate.forward = balanced(gate)
        with torch.no_grad():
            model.forward_streams(ids, state)
    finally:
        for gate in gates:
            vars(gate).pop("forward", None)
    return out


def timed_wall(fn, n: int, devices) -> float:
    """Mean milliseconds of fn() over n calls, wall clock between full syncs of every device (a
    decode step spread over GPUs ends on another device than it starts on)."""
    import torch

    def sync():
        for d in dict.fromkeys(devices):
            torch.cuda.synchronize(d)

    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t0) * 1e3 / n


def timed(fn, n: int, device) -> float:
    """Mean milliseconds of fn() over n calls, timed with CUDA events on `device` (single-device work)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.device(device):
        torch.cuda.synchronize()
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def median_us(fn, n: int, device, runs: int = 7) -> float:
    """Median over `runs` of the mean microseconds of fn() over n back-to-back calls (CUDA events; one warm call
    first): the per-layer yardstick that resolves a change of a few tenths of a microsecond."""
    import statistics

    fn()
    return statistics.median(timed(fn, n, device) for _ in range(runs)) * 1e3


def copy_bandwidth(device) -> float:
    """Device-to-device copy GB/s (bytes read + written) of a 2 GiB buffer."""
    import torch

    a = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = timed(lambda: b.copy_(a), 10, device)
    return 2 * a.numel() / (ms * 1e-3) / 1e9


# op -> the part of a layer it belongs to, for the per-layer time split
CATEGORY = {
    "linear": "linear", "norm_linear": "linear", "wo_a": "linear", "head": "linear", "act_quant": "linear",
    "router": "moe", "moe_experts": "moe", "moe_post": "moe", "moe_post_pre": "moe",
    "sparse_attn": "attention", "indexer_scores": "attention", "topk_select": "attention",
    "compressor": "attention", "qkv_norm_rope": "attention", "rope": "attention",
    "rotate_fp4": "attention",
    "mhc_pre": "mhc+norm", "mhc_post": "mhc+norm", "mhc_head": "mhc+norm", "rmsnorm": "mhc+norm",
    "rmsnorm_quant": "mhc+norm",
    "mhc_pre_norm": "mhc+norm", "mhc_post_pre_norm": "mhc+norm",
}
PARTS = ("linear", "moe", "attention", "mhc+norm", "other")


class NextPre:
    """Stands in for a block after the model's last one: its mHC pre parameters (Block.pre_args), copies of the first
    layer's on the last layer's device. The last layer's decode step then makes that block's attention input as
    every other layer's step makes the next one's; nothing reads it."""

    def __init__(self, model):
        dev = model.layers[-1].attn_norm.weight.device
        self.args = tuple(a.to(dev) if hasattr(a, "to") else a for a in model.layers[0].pre_args())

    def pre_args(self) -> tuple:
        return self.args


def stand_in_next(model) -> None:
    """model.next_block(last layer) -> a NextPre (an instance attribute over the method: this benchmark only)."""
    nxt, last, own = NextPre(model), len(model.layers) - 1, model.next_block
    model.next_block = lambda i: nxt if i == last and model.fuse_pre else own(i)


def profile_layer(run, device) -> dict:
    """One decode step of a layer, eager (the kernels its graph replays): the kernels it launches (profiler)
    and its GPU time split by op category. For the split the whole step is queued behind a ~100 ms GPU sleep
    with a CUDA event pair around every op call (the ops hook), so the GPU then runs it back to back as a graph
    replay does and each pair times that op's kernels; "other" is the rest of the step (torch glue between
    ops, and the gaps). Per op name too (`ops_ms`). The split runs the side branches in line (one stream), so
    its step time is the serial one; the kernel count and times come from the run as configured."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from dsv4 import ops
    from dsv4.model.layers import set_overlap

    with torch.cuda.device(device):  # the layer's GPU current: its Triton kernels launch there (as on_device)
        run()  # warm
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize(device)
    kern = [e for e in prof.events() if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower()
            and "memset" not in e.name.lower()]
    kernels = len(kern)
    # each kernel's own GPU time (eager, no overlap): what the graph's layer time holds besides launch gaps
    kernel_us: dict[str, float] = {}
    for e in kern:
        name = short_kernel_name(e.name)
        kernel_us[name] = kernel_us.get(name, 0.0) + e.time_range.elapsed_us()

    recs = []

    def hook(op, args, kwargs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = op.impl(*args, **kwargs)
        b.record()
        recs.append((op.name, a, b))
        return out

    with torch.cuda.device(device):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ops.set_hook(hook)
        overlap = set_overlap(False)  # one stream: each op's events bracket its kernels alone
        try:
            torch.cuda._sleep(200_000_000)  # ~100 ms of GPU clock: the step is queued before the GPU reaches it
            start.record()
            run()
            end.record()
        finally:
            ops.set_hook(None)
            set_overlap(overlap)
        torch.cuda.synchronize(device)
        step = start.elapsed_time(end)
    per_op: dict[str, float] = {}
    for name, a, b in recs:
        per_op[name] = per_op.get(name, 0.0) + a.elapsed_time(b)
    split = dict.fromkeys(PARTS, 0.0)
    for name, ms in per_op.items():
        split[CATEGORY.get(name, "other")] += ms
    split["other"] += max(step - sum(per_op.values()), 0.0)
    return {"kernels": kernels, "step_ms": step, "split_ms": split, "ops_ms": per_op, "kernel_us": kernel_us}


def graph_timeline(graph, device, replays: int = 5) -> list[dict]:
    """The kernels of one captured graph as its replays run them (CUPTI records through the torch profiler): per
    kernel (ordered by start) its name and the median over `replays` back-to-back replays of its start and end, us
    from the replay's first kernel start. Shows what programmatic launch and the side stream overlap, which the
    eager per-op split cannot. A replay runs the graph's nodes on the executor's own streams (recorded as `stream`,
    the key that tells one replay's same-named kernels apart), not on the streams they were captured from."""
    import statistics

    import torch
    from torch.profiler import ProfilerActivity, profile

    with torch.cuda.device(device):
        graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                graph.replay()
            torch.cuda.synchronize()
    kern = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower()
                   and "memset" not in e.name.lower()), key=lambda e: e.time_range.start)
    n = len(kern) // replays
    if n == 0 or n * replays != len(kern):
        return []  # the profiler did not see every replay's kernels
    # one replay's kernels keyed by (name, executor stream, occurrence): parallel branches may start in another order
    per_key: dict[tuple, list[tuple[float, float]]] = {}
    for r in range(replays):
        run = kern[r * n:(r + 1) * n]
        t0, seen = run[0].time_range.start, {}
        for e in run:
            k = (short_kernel_name(e.name), getattr(e, "device_resource_id", 0))
            seen[k] = seen.get(k, 0) + 1
            per_key.setdefault((*k, seen[k]), []).append((e.time_range.start - t0, e.time_range.end - t0))
    if any(len(v) != replays for v in per_key.values()):
        return []
    out = [{"kernel": name, "stream": stream, "start_us": statistics.median(a for a, _ in v),
            "end_us": statistics.median(b for _, b in v)} for (name, stream, _), v in per_key.items()]
    return sorted(out, key=lambda k: k["start_us"])


def pf_ids(model, ctx: int, tokens: int):
    """The benchmark's prompt for context ctx: `tokens` random ids on the embedding's device."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(ctx)
    return torch.randint(0, model.cfg.vocab_size, (1, tokens), generator=g).to(model.embed.weight.device)


def prefill_run(model, state, ids, p0: int, events: bool, keep: dict | None = None, runner=None):
    """Prefill ids [1, P] at positions p0.. in chunks of the engine's PREFILL_CHUNK tokens as the engine does: through
    the prefill graphs (runner: a PrefillRunner) where they apply, else Transformer.forward_streams (no head).
    events: a CUDA event pair around every layer's call of every chunk, returned as [(layer, start, end)] (read after
    a sync); else []. keep: filled with each layer's arguments in the last eager chunk."""
    import torch

    from dsv4.engine import PREFILL_CHUNK

    recs = []

    def timed_call(i, work):
        # the model and the runner call this in layer i's device context, after the streams reached that device: the
        # events are recorded on the layer's own device (per-layer times are right with the layers spread over GPUs)
        if not events:
            return work()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = work()
        b.record()
        recs.append((i, a, b))
        return out

    def call(i, layer, args):
        if keep is not None:
            keep[i] = args
        return timed_call(i, lambda: layer(*args))

    state.pos = p0
    for c0 in range(0, ids.shape[1], PREFILL_CHUNK):
        chunk = ids[:, c0:c0 + PREFILL_CHUNK]
        if runner is not None and runner.applies(chunk.shape[1], p0 + c0):
            runner.run(chunk, p0 + c0, timed_call if events else None)
        else:
            model.forward_streams(chunk, state, call)
    return recs


def time_prefill(model, state, ctx: int, tokens: int, devices, runner=None) -> dict:
    """The prefill of a `tokens`-token prompt ending at position ctx (random state before it): per layer ms
    (summed over the chunks, CUDA events) and the wall time of the whole prefill (median of 3 runs after a
    warm-up; every run rewrites the same positions). runner: through the prefill graphs (else eager)."""
    import statistics

    import torch

    p0 = ctx - tokens
    ids = pf_ids(model, ctx, tokens)
    model.prepare()
    fill_state(state, p0, seed=ctx)
    prefill_run(model, state, ids, p0, False, runner=runner)  # warm-up
    walls, layer_runs = [], []
    for _ in range(3):
        for d in dict.fromkeys(devices):
            torch.cuda.synchronize(d)
        t0 = time.perf_counter()
        prefill_run(model, state, ids, p0, False, runner=runner)
        for d in dict.fromkeys(devices):
            torch.cuda.synchronize(d)
        walls.append((time.perf_counter() - t0) * 1e3)
        recs = prefill_run(model, state, ids, p0, True, runner=runner)
        for d in dict.fromkeys(devices):
            torch.cuda.synchronize(d)
        per = [0.0] * len(model.layers)
        for i, a, b in recs:
            per[i] += a.elapsed_time(b)
        layer_runs.append(per)
    layer_ms = [statistics.median(r[i] for r in layer_runs) for i in range(len(model.layers))]
    from dsv4.engine import PREFILL_CHUNK

    return {"tokens": tokens, "chunk": PREFILL_CHUNK, "start": p0, "wall_ms": statistics.median(walls),
            "layer_ms": layer_ms, "mode": "graphs" if runner is not None else "eager"}


def busy_gaps(kernels: list[tuple[float, float, str]], top: int = 10) -> dict:
    """How busy the GPU was over a run: kernels as (start, end, name), us, from any number of streams. The busy time is
    the union of their intervals; the span runs from the first start to the last end; every idle stretch (no kernel
    running on any stream) is a gap, summed by size (<1, 1-5, 5-20, 20-100, >=100 us) and the `top` largest listed with
    the kernels that end before and start after it (at_us: from the first start)."""
    ks = sorted(kernels, key=lambda k: k[0])
    if not ks:
        return {"span_us": 0.0, "busy_us": 0.0, "kernels": 0, "idle_us_by_gap": {}, "top_gaps": []}
    t0 = ks[0][0]
    busy, gaps, cur_end, last = 0.0, [], ks[0][0], ks[0][2]
    for start, end, name in ks:
        if start > cur_end:
            gaps.append((start - cur_end, last, name, cur_end - t0))
        if end > cur_end:
            busy += end - max(start, cur_end)
            cur_end, last = end, name
    by_size: dict[str, float] = {}
    for g, *_ in gaps:
        size = "<1" if g < 1 else "1-5" if g < 5 else "5-20" if g < 20 else "20-100" if g < 100 else ">=100"
        by_size[size] = by_size.get(size, 0.0) + g
    gaps.sort(key=lambda g: -g[0])
    return {"span_us": cur_end - t0, "busy_us": busy, "kernels": len(ks), "idle_us_by_gap": by_size,
            "top_gaps": [{"us": g, "after": a, "before": b, "at_us": at} for g, a, b, at in gaps[:top]]}


def prefill_busy(model, state, ctx: int, tokens: int, devices, runner=None) -> dict:
    """One prefill of the benchmark's prompt (after time_prefill ran it: warm) under the profiler: busy_gaps over
    its kernels on the first device. Whether the GPU waits on the host (an eager chunk's launches) or on nothing."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    ids = pf_ids(model, ctx, tokens)
    for d in dict.fromkeys(devices):
        torch.cuda.synchronize(d)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        prefill_run(model, state, ids, ctx - tokens, False, runner=runner)
        for d in dict.fromkeys(devices):
            torch.cuda.synchronize(d)
    dev = torch.device(devices[0]).index or 0
    kern = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
            if e.device_type.name == "CUDA" and getattr(e, "device_index", dev) == dev]
    return busy_gaps(kern)


def project_prefill(pf: dict, cfg, kinds: dict, tokens: int) -> dict:
    """Adds the 43-layer projection (ms per 1K prompt tokens, tok/s) from the per-layer times by layer kind."""
    by_kind = {}
    for s, ms in zip(cfg.layers, pf["layer_ms"]):
        by_kind.setdefault(s.attn, []).append(ms * 1000 / tokens)
    mean = {k: sum(v) / len(v) for k, v in by_kind.items()}
    if all(k in mean for k in kinds):
        pf["projected_43_layer_ms_per_1k"] = sum(kinds[k] * mean[k] for k in kinds)
        pf["projected_43_layer_tok_s"] = 1e6 / pf["projected_43_layer_ms_per_1k"]
    return pf


# what one SM holds (sm_80 / sm_90; the device's own figures replace these where torch reports them)
SM_DEFAULT = {"threads": 2048, "regs": 65536, "smem": 233472, "ctas": 32}
CTA_CAP = {(8, 6): 16, (8, 7): 16, (8, 9): 24}  # CTAs per SM where not 32 (sm_86 / sm_87 / sm_89)
SMEM_RESERVED = 1024  # shared memory the driver reserves per CTA (sm_80+)


def sm_limits(device) -> dict:
    """Per-SM capacities of a CUDA device: SM count, threads, registers, shared memory (bytes), CTAs."""
    import torch

    pr = torch.cuda.get_device_properties(device)
    lim = dict(SM_DEFAULT, sms=pr.multi_processor_count, ctas=CTA_CAP.get((pr.major, pr.minor), 32))
    for key, attr in (("threads", "max_threads_per_multi_processor"), ("regs", "regs_per_multiprocessor"),
                      ("smem", "shared_memory_per_multiprocessor")):
        lim[key] = int(getattr(pr, attr, 0) or lim[key])
    return lim


def ctas_per_sm(threads: int, regs: int, smem: int, sm: dict) -> tuple[int, str]:
    """How many CTAs of a launch one SM holds at once, and the resource that sets it ("threads", "regs", "smem",
    "ctas"): the occupancy calculator's arithmetic for sm_80 / sm_90 (a warp's registers allocated in units of 256,
    each of the four schedulers' quarters of the register file holding whole warps; shared memory in units of 128
    plus SMEM_RESERVED per CTA). threads per CTA, registers per thread, shared memory per CTA (static + dynamic,
    bytes). Clusters are not counted."""
    warps = -(-threads // 32)
    by = {"ctas": sm["ctas"], "threads": sm["threads"] // (warps * 32)}
    if regs:
        by["regs"] = 4 * (sm["regs"] // 4 // (-(-regs * 32 // 256) * 256)) // warps
    by["smem"] = sm["smem"] // (-(-smem // 128) * 128 + SMEM_RESERVED)
    limit = min(by, key=lambda k: (by[k], k == "ctas"))
    return by[limit], limit


def launch_configs(trace: dict) -> list[dict]:
    """The kernels of a profiler trace (torch.profiler's export_chrome_trace: kineto's kernel events) in start order,
    each with its name, CTAs, threads per CTA, registers per thread and shared memory per CTA (static + dynamic)."""
    def size(v):
        if isinstance(v, (list, tuple)):
            n = 1
            for x in v:
                n *= int(x)
            return n
        return int(v) if v is not None else 0

    ks = sorted((e for e in trace.get("traceEvents", []) if str(e.get("cat", "")).lower() == "kernel"),
                key=lambda e: e.get("ts", 0))
    out = []
    for e in ks:
        a = e.get("args", {})
        out.append({"kernel": short_kernel_name(e.get("name", "")), "ctas": size(a.get("grid")),
                    "threads": size(a.get("block")), "regs": int(a.get("registers per thread", 0)),
                    "smem": int(a.get("shared memory", 0))})
    return out


def launch_rows(kernels: list[dict], sm: dict) -> list[dict]:
    """Per kernel: CTAs an SM holds (`per_sm`, `limit`), waves over the device, the CTAs per SM of an even spread
    (`even`) and the fewest SMs its CTAs can sit on (`min_sms`). `pile`: a kernel of one wave or less, with at least
    half as many CTAs as SMs (not the small latency kernels), whose SMs take more CTAs than an even spread needs, so that, launched while its predecessor still holds
    most SMs (programmatic launch), its CTAs can crowd onto the SMs that free up first (the forty-eighth pass: the
    decode experts' down kernel at three CTAs per SM instead of two, +6.4 us a layer)."""
    rows = []
    for k in kernels:
        per_sm, limit = ctas_per_sm(k["threads"], k["regs"], k["smem"], sm) if k["threads"] else (0, "?")
        r = dict(k, per_sm=per_sm, limit=limit)
        if per_sm and k["ctas"]:
            r["waves"] = k["ctas"] / (per_sm * sm["sms"])
            r["even"] = -(-k["ctas"] // sm["sms"])
            r["min_sms"] = -(-k["ctas"] // per_sm)
            r["pile"] = r["waves"] <= 1.0 and 2 * k["ctas"] >= sm["sms"] and per_sm > r["even"]
        rows.append(r)
    return rows


def graph_launches(graph, device) -> list[dict]:
    """The launch configuration of every kernel of one captured graph (one replay under the profiler; its trace's
    kernel events: launch_configs)."""
    import os
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    with torch.cuda.device(device):
        graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        return launch_configs(json.loads(Path(path).read_text()))
    finally:
        os.unlink(path)


def short_kernel_name(name: str) -> str:
    """A kernel's name without namespaces, template arguments or parameters ("void dsv4::(anonymous
    namespace)::gemv_kernel<1, 2, false>(dsv4::GemvArgs)" -> "gemv_kernel")."""
    depth, out = 0, []
    for ch in name:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    base = "".join(out).split()[-1] if "".join(out).split() else name
    return base.split("::")[-1][:40]


def main(argv=None) -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4, help="first N layers of Flash (default 4: SWA, SWA, CSA, HCA)")
    p.add_argument("--device", default="cuda:0",
                   help="cuda device or comma list (layers split evenly) (default: cuda:0)")
    p.add_argument("--contexts", default="1024,16384,131072",
                   help="comma list of context lengths (default: 1024,16384,131072)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per measurement (default: 10)")
    p.add_argument("--no-eager", action="store_true", help="skip the (slow) eager measurements")
    p.add_argument("--numerics", choices=("reference", "exact"), default="reference",
                   help="reference: DeepSeek's quantization simulation (default); exact: plain float math")
    p.add_argument("--profile", action="store_true",
                   help="also count the kernels of one layer step per layer kind (profiler) and split its GPU time "
                        "into linear / moe / attention / mhc+norm / other and per op (the eager step queued behind "
                        "a GPU sleep, CUDA events around every op)")
    p.add_argument("--kernels", default=None, metavar="SPEC",
                   help="op backends: ref, fast, or e.g. fast,sparse_attn=ref (default: fast on CUDA)")
    p.add_argument("--no-overlap", action="store_true",
                   help="run what the model puts on a second stream (the step plan, the compressors, the indexer) in "
                        "line, for an A/B of the overlap (default: overlapped)")
    p.add_argument("--fuse-pre", action="store_true",
                   help="each layer's attention input (mHC pre + RMSNorm) made by the FFN op of the layer before "
                        "(ops.moe_post_pre) instead of by the layer itself, for an A/B of that fusion (default: off)")
    p.add_argument("--prefill", type=int, default=0, metavar="N",
                   help="also time the chunked prefill (128-token chunks) of an N-token prompt ending at each context, "
                        "eager and through the prefill graphs (default: 0, decode only)")
    p.add_argument("--kv-fp8", action="store_true",
                   help="keep the K = V rows (window ring, compressed entries) as packed FP8 rows (default: bf16)")
    p.add_argument("--keys-fp4", action="store_true",
                   help="keep the indexer's keys as packed FP4 rows (default: bf16)")
    p.add_argument("--layer-us", type=int, default=0, metavar="N",
                   help="also time each layer's decode graph (steps at ctx-1 and ctx-2) as the median of 7 runs of N "
                        "back-to-back replays, printed in us to 0.1 (the A/B yardstick for one kernel change; "
                        "default 0: off)")
    p.add_argument("--timeline", action="store_true",
                   help="also print the kernels of one layer's decode graph per layer kind as its replays run them "
                        "(start and end of each, median of 5 replays: what overlaps what; at ctx-2 too where a layer "
                        "defers its compressors there); with --prefill, also how busy the GPU is over one prefill "
                        "through the prefill graphs (the union of its kernels' intervals against their span) and its "
                        "largest idle gaps")
    p.add_argument("--launches", action="store_true",
                   help="also print the launch of every kernel of one layer's decode graph per layer kind (at ctx-1): "
                        "CTAs, threads, registers, shared memory, the CTAs an SM holds (occupancy arithmetic) and "
                        "'pile' where a kernel of one wave (and at least half as many CTAs as SMs) can crowd onto fewer SMs "
                        "than an even spread needs")
    p.add_argument("--no-defer", action="store_true",
                   help="one decode schedule per layer: the compressors run at every step (by default a step that "
                        "closes none of a CSA or HCA layer's compressor windows only keeps its input, and the closing "
                        "step runs them over the window's kept rows: dsv4/graphs.py)")
    p.add_argument("--share-experts", action="store_true",
                   help="every layer on a device uses the routed-expert stacks of the first layer on it, so that all "
                        "43 layers fit on one GPU (each step still reads its chosen experts' bytes from HBM; see "
                        "above) (default: one set per layer)")
    p.add_argument("--json", metavar="F", help="write the results as JSON to F (default: none)")
    args = p.parse_args(argv)

    import torch

    from dsv4.config import ModelConfig
    from dsv4.graphs import DecodeRunner, defer_ratios
    from dsv4.model.layers import Numerics, set_overlap
    from dsv4.model.transformer import Transformer
    from dsv4.testing import randomize_
    from dsv4.writer import FLASH_CONFIG, truncate_layers

    if not torch.cuda.is_available():
        print("error: bench_decode needs a CUDA device", file=sys.stderr)
        return 2
    from dsv4 import ops

    try:
        backend, overrides = ops.parse_kernels(args.kernels)
        kernel_report = ops.configure(backend, "cuda", overrides)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(ops.banner(kernel_report), file=sys.stderr)
    set_overlap(not args.no_overlap)
    # the prefill graphs need host-sync-free ops (the reference MoE syncs), as the engine decides
    from dsv4.graphs import prefill_graphs_apply

    prefill_graphs = prefill_graphs_apply()
    print(f"side branches (step plan, compressors, indexer): {'in line' if args.no_overlap else 'on a second stream'}",
          file=sys.stderr)
    devices = [d.strip() for d in args.device.split(",") if d.strip()]
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.prefill < 0 or any(args.prefill > c for c in contexts):
        print(f"error: --prefill must be in [0, the smallest context], got {args.prefill}", file=sys.stderr)
        return 2
    if (args.kv_fp8 or args.keys_fp4) and args.numerics != "reference":
        print("error: --kv-fp8 / --keys-fp4 need --numerics reference (the rows they pack are quantization-simulated)",
              file=sys.stderr)
        return 2
    raw = truncate_layers(FLASH_CONFIG, args.layers)
    raw["compress_ratios"] = raw["compress_ratios"][: args.layers]  # no MTP block in the benchmark
    raw["num_nextn_predict_layers"] = 0
    cfg = ModelConfig.from_dict(raw)
    dtype = torch.bfloat16 if args.numerics == "reference" else torch.float32

    t0 = time.perf_counter()
    with torch.device("meta"):
        model = Transformer(cfg, Numerics(args.numerics, dtype), max_pos=max(contexts))
    sharing = share_experts(model, devices) if args.share_experts else 0
    model.place(devices)
    randomize_(model, seed=0)
    balance = balance_routing(model)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    print(f"built {args.layers} Flash layers with random FP8/MXFP4 weights on {','.join(devices)} "
          f"in {build_s:.0f}s: {module_bytes(model) / 1e9:.1f} GB of weights"
          + (f" ({sharing} layers on another layer's routed experts)" if sharing else ""), file=sys.stderr)
    if balance:
        print(f"score-routed gates balanced (balance_routing): a 128-token chunk hits {min(u for u, _ in balance)}-"
              f"{max(u for u, _ in balance)} of {cfg.n_routed_experts} experts, the busiest "
              f"{max(m for _, m in balance)} rows", file=sys.stderr)

    model.fuse_pre = args.fuse_pre
    if model.fuse_pre:
        stand_in_next(model)
    per_layer_bytes = [layer_read_bytes(layer) for layer in model.layers]
    head_bytes = module_bytes(model.head) + module_bytes(model.norm) + cfg.hidden_size * 2 + sum(
        tensor_bytes(model.get_buffer(n)) for n in ("hc_head_fn", "hc_head_base", "hc_head_scale"))
    bw = copy_bandwidth(devices[0])
    kinds = {"swa": 0, "csa": 0, "hca": 0}
    for s in ModelConfig.from_dict(FLASH_CONFIG).layers:
        kinds[s.attn] += 1

    results = []
    if len(contexts) > 3:
        print("warning: from a process's fourth graph-capturing decode runner on, whole steps have measured ~1 ms "
              "slower on an H200 (per-layer rows unaffected): time at most three contexts a run for the token rows",
              file=sys.stderr)
    for ctx in contexts:
        state = model.new_state(ctx, kv_fp8=args.kv_fp8, keys_fp4=args.keys_fp4)
        row = {"context": ctx}
        for mode in (["eager"] if not args.no_eager else []) + ["graph"]:
            runner = DecodeRunner(model, state, use_graphs=(mode == "graph"), defer=not args.no_defer)
            fill_state(state, ctx - 1, seed=ctx)
            n = args.steps if mode == "graph" else max(2, args.steps // 5)
            for _ in range(2):
                runner.step(1, ctx - 1)
            # a real decode step waits for its logits (the sampled token feeds the next step), so each
            # timed step ends with a sync: latency, not the throughput of steps pipelined across GPUs
            row[f"{mode}_token_ms"] = timed_wall(
                lambda r=runner, c=ctx: torch.cuda.synchronize(r.step(1, c - 1).device), n, devices)
            layer_ms = []
            for i in range(len(model.layers)):  # x_in[i] still holds the last step's input of layer i
                layer_ms.append(timed(runner.layer_fn(i, ctx - 1), n, runner.devices[i]))
            row[f"{mode}_layer_ms"] = layer_ms
            if mode == "graph":
                row["graph_head_ms"] = timed(runner.graphs["head"].replay, n, runner.head_dev)
                if args.layer_us:
                    row["graph_layer_us"] = [median_us(runner.layer_fn(i, ctx - 1), args.layer_us, runner.devices[i])
                                             for i in range(len(model.layers))]
            if mode == "graph" and args.timeline:
                seen, tl = set(), {}
                for i, spec_i in enumerate(cfg.layers):
                    if spec_i.attn not in seen:
                        seen.add(spec_i.attn)
                        tl[spec_i.attn] = {"layer": i, "kernels": graph_timeline(runner.layer_graph(i, ctx - 1),
                                                                                 runner.devices[i])}
                row["timeline"] = tl
            if mode == "graph" and args.launches:
                seen, ln = set(), {}
                for i, spec_i in enumerate(cfg.layers):
                    if spec_i.attn not in seen:
                        seen.add(spec_i.attn)
                        ln[spec_i.attn] = {"layer": i, "kernels": launch_rows(
                            graph_launches(runner.layer_graph(i, ctx - 1), runner.devices[i]),
                            sm_limits(runner.devices[i]))}
                row["launches"] = ln
            if mode == "graph" and args.profile:
                seen, prof = set(), {}
                for i, spec_i in enumerate(cfg.layers):
                    if spec_i.attn not in seen:
                        seen.add(spec_i.attn)
                        prof[spec_i.attn] = profile_layer(lambda i=i, r=runner, c=ctx: r._run_layer(i, r.defers(i, c - 1)),
                                                          runner.devices[i])
                row["profile"] = prof
            if mode == "graph" and ctx >= 2:
                # a step at ctx - 2, where every compressor's window stays open (with ctx a multiple of 128 the
                # step at ctx - 1 closes them all and each emits an entry: a compressor's costliest step)
                for _ in range(2):
                    runner.step(1, ctx - 2)
                row["graph_layer_ms_open"] = [timed(runner.layer_fn(i, ctx - 2), n, runner.devices[i])
                                              for i in range(len(model.layers))]
                if args.layer_us:
                    row["graph_layer_us_open"] = [median_us(runner.layer_fn(i, ctx - 2), args.layer_us,
                                                            runner.devices[i]) for i in range(len(model.layers))]
                if args.timeline:  # the layers whose step there runs its other schedule (compressors deferred)
                    seen, tl = set(), {}
                    for i, spec_i in enumerate(cfg.layers):
                        if spec_i.attn not in seen and runner.layer_graph(i, ctx - 2) is not runner.layer_graph(i, ctx - 1):
                            seen.add(spec_i.attn)
                            tl[spec_i.attn] = {"layer": i, "kernels": graph_timeline(runner.layer_graph(i, ctx - 2),
                                                                                     runner.devices[i])}
                    row["timeline_open"] = tl
            cyc_pos = cycle_positions(ctx, [s_.ratio for s_ in cfg.layers]) if mode == "graph" else []
            if cyc_pos:  # the whole step at each kind of position the cycle holds, weighted by its share
                by_pos = []
                for pos, weight, closes in cyc_pos:
                    for _ in range(2):
                        runner.step(1, pos)
                    ms = timed_wall(lambda r=runner, q=pos: torch.cuda.synchronize(r.step(1, q).device), n, devices)
                    by_pos.append({"pos": pos, "weight": weight, "closes": closes, "token_ms": ms})
                row["graph_token_ms_by_position"] = by_pos
                row["graph_token_ms_cycle"] = sum(b["weight"] * b["token_ms"] for b in by_pos)
            runner = None  # free this mode's graphs and their memory pools before the next
        if args.prefill:
            pf = time_prefill(model, state, ctx, args.prefill, devices)
            project_prefill(pf, cfg, kinds, args.prefill)
            if prefill_graphs:
                from dsv4.engine import PREFILL_CHUNK
                from dsv4.graphs import PrefillRunner

                runner = PrefillRunner(model, state, PREFILL_CHUNK)
                row["prefill_graphs"] = project_prefill(time_prefill(model, state, ctx, args.prefill, devices, runner),
                                                        cfg, kinds, args.prefill)
                if args.timeline:
                    row["prefill_graphs"]["busy"] = prefill_busy(model, state, ctx, args.prefill, devices, runner)
                runner = None
            if args.profile:
                keep: dict = {}
                prefill_run(model, state, pf_ids(model, ctx, args.prefill), ctx - args.prefill, False, keep)
                seen, prof = set(), {}
                for i, spec_i in enumerate(cfg.layers):
                    if spec_i.attn not in seen:
                        seen.add(spec_i.attn)
                        prof[spec_i.attn] = profile_layer(lambda f=model.layers[i], a=keep[i]: f(*a), keep[i][0].device)
                pf["profile"] = prof
            row["prefill"] = pf
        # (the step at ctx - 1 closes every window; a deferring layer's reads the rows its earlier steps kept)
        kept = [0] * len(cfg.layers) if args.no_defer else defer_ratios(model)
        cache = [state_read_bytes(st, ctx - 1, s, r > 0 and ctx % r == 0)
                 for st, s, r in zip(state.blocks, cfg.layers, kept)]
        row["layer_weight_bytes"] = per_layer_bytes
        row["layer_cache_bytes"] = cache
        by_kind = {}
        for s, ms in zip(cfg.layers, row["graph_layer_ms"]):
            by_kind.setdefault(s.attn, []).append(ms)
        mean = {k: sum(v) / len(v) for k, v in by_kind.items()}
        if all(k in mean for k in kinds):
            proj = sum(kinds[k] * mean[k] for k in kinds) + row["graph_head_ms"]
            row["projected_43_layer_token_ms"] = proj
            if "graph_layer_ms_open" in row and ctx % 128 == 0:
                # averaged over a 128-token cycle: a layer of compression ratio r emits at 1 step in r (the step
                # at ctx - 1), its window stays open at the others (the step at ctx - 2)
                cyc = {}
                for s_, e, o in zip(cfg.layers, row["graph_layer_ms"], row["graph_layer_ms_open"]):
                    f = 1.0 / s_.ratio if s_.ratio else 0.0
                    cyc.setdefault(s_.attn, []).append(f * e + (1 - f) * o)
                row["projected_43_layer_token_ms_cycle"] = (
                    sum(kinds[k] * sum(v) / len(v) for k, v in cyc.items()) + row["graph_head_ms"])
        measured_bytes = sum(per_layer_bytes) + sum(cache) + head_bytes
        row["token_bytes"] = measured_bytes
        row["achieved_GBps"] = measured_bytes / (row["graph_token_ms"] * 1e-3) / 1e9
        results.append(row)
        del state
        torch.cuda.empty_cache()

    dev_name = torch.cuda.get_device_name(devices[0])
    floor_ms = FLOOR_GB_PER_TOKEN * 1e9 / (bw * 1e9) * 1e3
    print(f"\ndsv4 decode benchmark: {dev_name} x{len(set(devices))}, torch {torch.__version__}, "
          f"{args.layers} Flash layers ({', '.join(s.attn for s in cfg.layers)}), numerics {args.numerics}, batch 1, "
          f"K = V rows {'FP8 packed' if args.kv_fp8 else 'bf16'}, "
          f"indexer keys {'FP4 packed' if args.keys_fp4 else 'bf16'}")
    print(f"device copy bandwidth {bw:.0f} GB/s -> floor for {FLOOR_GB_PER_TOKEN} GB/token: {floor_ms:.2f} ms")
    hdr = f"{'context':>8} | {'mode':>5} | {'token ms':>9} | {'per-layer ms (' + ','.join(s.attn for s in cfg.layers) + ')':<40} | {'GB/tok':>7} | {'GB/s':>7} | {'% copy BW':>9} | {'proj. 43L ms':>12}"
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        gb = r["token_bytes"] / 1e9
        for mode in ("eager", "graph"):
            if f"{mode}_token_ms" not in r:
                continue
            ms = r[f"{mode}_token_ms"]
            gbps = r["token_bytes"] / (ms * 1e-3) / 1e9
            layers = ",".join(f"{x:.2f}" for x in r[f"{mode}_layer_ms"])
            proj = f"{r['projected_43_layer_token_ms']:.1f}" if mode == "graph" and "projected_43_layer_token_ms" in r else ""
            print(f"{r['context']:>8} | {mode:>5} | {ms:>9.2f} | {layers:<40} | {gb:>7.3f} | {gbps:>7.1f} | "
                  f"{100 * gbps / bw:>8.2f}% | {proj:>12}")
            if mode == "graph" and "graph_layer_ms_open" in r:
                layers = ",".join(f"{x:.2f}" for x in r["graph_layer_ms_open"])
                cyc = r.get("projected_43_layer_token_ms_cycle")
                print(f"{'':>8} | {'open':>5} | {'':>9} | {layers:<40} | {'':>7} | {'':>7} | {'':>9} | "
                      f"{'' if cyc is None else f'{cyc:.1f} (cycle)':>12}")
            if mode == "graph" and "graph_token_ms_cycle" in r:
                parts = ", ".join(f"ctx{b['pos'] - r['context']:+d} x {b['weight']:.4f}: {b['token_ms']:.2f}"
                                  for b in r["graph_token_ms_by_position"])
                print(f"{'':>8} | {'cycle':>5} | {r['graph_token_ms_cycle']:>9.2f} | whole steps, ms: {parts}")
    if args.layer_us:
        print(f"\nper layer, us (median of 7 runs of {args.layer_us} back-to-back replays of the layer's decode graph)")
        for r in results:
            for key, step in (("graph_layer_us", "ctx-1"), ("graph_layer_us_open", "ctx-2")):
                if key in r:
                    us = " / ".join(f"{x:.1f}" for x in r[key])
                    print(f"{r['context']:>8} | {step:>5} | {' / '.join(s.attn for s in cfg.layers)}: {us}")
    for r, (key, step) in ((r, k) for r in results for k in (("timeline", "ctx-1"), ("timeline_open", "ctx-2"))):
        for kind, tl in r.get(key, {}).items():
            ks = tl["kernels"]
            if not ks:
                print(f"\ntimeline ctx {r['context']} {kind}: the profiler did not record every replay's kernels")
                continue
            print(f"\ntimeline ctx {r['context']} ({step}) {kind} (layer {tl['layer']}): {len(ks)} kernels, "
                  f"{max(k['end_us'] for k in ks):.1f} us from the first start to the last end (us from the "
                  f"replay's first kernel start, median of 5 replays)")
            for k in ks:
                print(f"    {k['start_us']:7.1f} -> {k['end_us']:7.1f}  ({k['end_us'] - k['start_us']:5.1f})  "
                      f"{k['kernel']}")
    for r in results:
        for kind, ln in r.get("launches", {}).items():
            print(f"\nlaunches ctx {r['context']} (ctx-1) {kind} (layer {ln['layer']}): per kernel in start order, its "
                  f"CTAs and threads, registers per thread, shared memory per CTA, the CTAs an SM holds and what sets "
                  f"that, waves, and for one wave or less the CTAs per SM of an even spread and the fewest SMs its CTAs fit on")
            print(f"    {'kernel':<40} {'CTAs':>5} {'thr':>4} {'regs':>4} {'smem KB':>7} {'/SM':>3} {'by':<7} "
                  f"{'waves':>5} {'even':>4} {'min SMs':>7}")
            for k in ln["kernels"]:
                waves = f"{k['waves']:.2f}" if "waves" in k else ""
                one = k.get("waves", 2.0) <= 1.0  # even spread and fewest SMs: for one wave or less
                print(f"    {k['kernel']:<40} {k['ctas']:>5} {k['threads']:>4} {k['regs']:>4} {k['smem'] / 1024:>7.1f} "
                      f"{k['per_sm']:>3} {k['limit']:<7} {waves:>5} "
                      f"{k['even'] if one else '':>4} {k['min_sms'] if one else '':>7}"
                      f"{'  pile' if k.get('pile') else ''}")
    if args.prefill:
        chunk = results[0]["prefill"]["chunk"]
        print(f"\nprefill of a {args.prefill}-token prompt ending at the context, chunks of {chunk} tokens: eager, and "
              f"graphs (full chunks after the first through the prefill graphs, as the engine runs them)")
        hdr = (f"{'context':>8} | {'mode':>6} | {'wall ms':>8} | "
               f"{'per-layer ms per 1K tokens (' + ','.join(s.attn for s in cfg.layers) + ')':<48}"
               f" | {'proj. 43L ms/1K':>15} | {'proj. 43L tok/s':>15}")
        print(hdr)
        print("-" * len(hdr))
        for r in results:
            for pf in (r["prefill"], r.get("prefill_graphs")):
                if pf is None:
                    continue
                layers = ",".join(f"{x * 1000 / args.prefill:.2f}" for x in pf["layer_ms"])
                proj = pf.get("projected_43_layer_ms_per_1k")
                print(f"{r['context']:>8} | {pf['mode']:>6} | {pf['wall_ms']:>8.2f} | {layers:<48} | "
                      f"{'' if proj is None else f'{proj:.1f}':>15} | "
                      f"{'' if proj is None else f'{1e6 / proj:.0f}':>15}")
    for r in results:
        busy = r.get("prefill_graphs", {}).get("busy")
        if busy and busy["span_us"] > 0:
            sizes = ", ".join(f"{k} us: {v / 1e3:.2f}" for k, v in busy["idle_us_by_gap"].items())
            print(f"prefill ctx {r['context']} (graphs), one profiled run: GPU busy {busy['busy_us'] / 1e3:.2f} of "
                  f"{busy['span_us'] / 1e3:.2f} ms ({100 * busy['busy_us'] / busy['span_us']:.0f}%), {busy['kernels']} "
                  f"kernels; idle ms by gap size: {sizes}")
            for g in busy["top_gaps"]:
                print(f"    gap {g['us']:8.1f} us at {g['at_us'] / 1e3:8.3f} ms: after {g['after'][:56]:<56} "
                      f"before {g['before'][:56]}")
    for r in results:
        for kind, pr in r.get("prefill", {}).get("profile", {}).items():
            parts = ", ".join(f"{k} {v:.3f}" for k, v in pr["split_ms"].items())
            top = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in sorted(pr["ops_ms"].items(), key=lambda kv: -kv[1])[:10])
            print(f"prefill profile ctx {r['context']} {kind}: {pr['kernels']} kernels per chunk; queued chunk "
                  f"{pr['step_ms']:.3f} ms by part, ms: {parts}; top ops, us: {top}")
    for r in results:
        for kind, pr in r.get("profile", {}).items():
            parts = ", ".join(f"{k} {v:.3f}" for k, v in pr["split_ms"].items())
            top = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in sorted(pr["ops_ms"].items(), key=lambda kv: -kv[1])[:8])
            print(f"profile ctx {r['context']} {kind}: {pr['kernels']} kernels per layer step; queued step "
                  f"{pr['step_ms']:.3f} ms by part, ms: {parts}; top ops, us: {top}")
            ku = pr.get("kernel_us", {})
            kt = ", ".join(f"{k} {v:.1f}" for k, v in sorted(ku.items(), key=lambda kv: -kv[1])[:14])
            print(f"    kernels' own GPU time {sum(ku.values()):.0f} us (eager, summed by name): {kt}")
    out = {"device": dev_name, "devices": devices, "torch": torch.__version__, "python": platform.python_version(),
           "layers": args.layers, "layer_kinds": [s.attn for s in cfg.layers], "numerics": args.numerics,
           "copy_GBps": bw, "floor_GB_per_token": FLOOR_GB_PER_TOKEN, "floor_ms_at_copy_bw": floor_ms,
           "build_s": build_s, "results": results, "command": " ".join(sys.argv), "kernels": kernel_report,
           "overlap": not args.no_overlap, "defer": not args.no_defer, "fuse_pre": args.fuse_pre, "kv_fp8": args.kv_fp8,
           "keys_fp4": args.keys_fp4, "share_experts": args.share_experts}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
