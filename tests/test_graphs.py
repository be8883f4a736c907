"""The static (CUDA-graph-safe) decode step and the per-layer CUDA-graph runner.

CPU: the static decode step, run eagerly, equals the chunked reference path at every position,
across compressor emission boundaries; the deferring schedule (compressors only at the steps that close a window,
over its kept rows) equals one schedule up to fp32 summation order, also where a chunk or a one-schedule runner
continues a state it left behind. GPU: graph replay equals the eager static step bitwise for
2 x 128 + 5 steps with ratios 4 and 128 and with ratio 16, with the reference and with the fast ops;
two GPUs when present. The compressors and the indexer run on a side stream (SideBranch) with the same bits as in line.
Prefill: full chunks through the prefill graphs equal the eager chunks bitwise (streams and state).
"""

import pytest
import torch

from dsv4.config import ModelConfig
from dsv4.graphs import DecodeRunner, PrefillRunner
from dsv4.model.layers import Numerics
from dsv4.model.transformer import Transformer
from dsv4.testing import assert_close_rel, randomize_, tiny_config


def _model(ratios, seed, window=16, **kw):
    raw = tiny_config(ratios, index_topk=3, window=window, max_pos=512, **kw)
    return raw, randomize_(Transformer(ModelConfig.from_dict(raw), Numerics("exact", torch.float32)), seed)


def _ids(raw, T, seed=0):
    return torch.randint(0, raw["vocab_size"], (T,), generator=torch.Generator().manual_seed(seed)).tolist()


def _chunked(model, ids, device="cpu"):
    st = model.new_state(len(ids))
    x = torch.tensor([ids], device=device)
    with torch.no_grad():
        return torch.cat([model(x[:, p:p + 1], st) for p in range(len(ids))], 1)[0]


def test_static_decode_step_equals_chunked_path():
    # ratios 4 (CSA + indexer with top-3 < entries), 16 and 8 (HCA), SWA; 2 x 16 + 5 steps
    raw, model = _model([4, 16, 0, 8], seed=2)
    ids = _ids(raw, 37)
    ref = _chunked(model, ids)
    runner = DecodeRunner(model, model.new_state(len(ids)), use_graphs=False)
    out = torch.stack([runner.step(t) for t in ids])
    assert_close_rel(out, ref, "logits_incremental_fp32")


def _compressor_positions(runner, ids):
    """Eager steps of `runner` over ids -> (logits, per step: for each `compressor` op call, how many qkv_norm_rope
    calls (one a layer, the last op of its query path) came before it in the step, sorted; per step: every block's
    `lagging` flag after it)."""
    from dsv4 import ops

    seen: list[str] = []

    def hook(op, args, kwargs):
        seen.append(op.name)
        return op.impl(*args, **kwargs)

    out, where, lagging = [], [], []
    ops.set_hook(hook)
    try:
        for t in ids:
            seen.clear()
            out.append(runner.step(t).clone())
            n_attn, w = 0, []
            for name in seen:
                n_attn += name == "qkv_norm_rope"
                if name == "compressor":
                    w.append(n_attn)
            where.append(sorted(w))
            lagging.append([b.lagging for b in runner.state.blocks])
    finally:
        ops.set_hook(None)
    return torch.stack(out), where, lagging


def test_deferred_compressors_keep_x_until_the_window_closes():
    # a decode step that closes no window of a layer's compressors (CSA or HCA) only keeps its x (a CSA layer's indexer
    # projects its head weights alone): no compressor op runs in it, and the layer's state is marked lagging. The step
    # that closes the window projects the window's kept rows and runs the compressors over them, ahead of the layer's
    # query path (the attention reads the entry). The logits are the one-schedule runner's (compressors at every step)
    # up to the projections' fp32 summation order, across emission boundaries. Layer 0 (SWA here) builds the step plan
    # and keeps one schedule; a compressor layer first on its device would too.
    raw, model = _model([0, 4, 8, 16], seed=4)
    ids = _ids(raw, 37, seed=2)
    one = DecodeRunner(model, model.new_state(len(ids)), use_graphs=False, defer=False)
    two = DecodeRunner(model, model.new_state(len(ids)), use_graphs=False)
    assert one.defer_ratio == [0, 0, 0, 0] and two.defer_ratio == [0, 4, 8, 16]
    ref, ref_where, ref_lag = _compressor_positions(one, ids)
    out, where, lagging = _compressor_positions(two, ids)
    assert_close_rel(out, ref, "logits_incremental_fp32")
    for p, (w, rw) in enumerate(zip(where, ref_where)):
        # layer k's compressor calls (CSA: two, HCA: one) follow k qkv_norm_rope calls: ahead of its query path
        closes = [(p + 1) % r == 0 for r in (4, 8, 16)]
        assert rw == [1, 1, 2, 3] and ref_lag[p] == [False] * 4, (p, rw)
        assert w == sorted([1, 1] * closes[0] + [2] * closes[1] + [3] * closes[2]), (p, w)
        assert lagging[p] == [False] + [not c for c in closes], (p, lagging[p])
    assert where[15] == [1, 1, 2, 3] and where[14] == []  # every window closes / none does
    # a compressor layer first on its device (it builds the plan) keeps one schedule: on one device, and across two
    # (the device rule only: layers placed on "meta" stand for a second GPU)
    from dsv4.graphs import defer_ratios

    _, first = _model([8, 16, 0], seed=4)
    assert DecodeRunner(first, first.new_state(8), use_graphs=False).defer_ratio == [0, 16, 0]
    _, split = _model([0, 8, 16, 16], seed=4)
    assert defer_ratios(split.place(["cpu", "meta"])) == [0, 8, 0, 16]


@pytest.mark.parametrize("then", ["chunk", "one_schedule"])
def test_a_state_left_lagging_is_caught_up(then):
    # deferring decode steps leave the compressors' open rows in x_ring only; what reads the state next catches it up
    # (Transformer.catch_up): a prefill chunk (a conversation's next turn) or a one-schedule runner. Both continue as
    # the chunked path over the whole sequence (1 + 2 x 8 + 1 steps: mid-window for ratios 4, 8 and 16)
    raw, model = _model([0, 4, 8, 16], seed=5)
    ids = _ids(raw, 40, seed=3)
    ref = _chunked(model, ids)
    st = model.new_state(len(ids))
    x = torch.tensor([ids])
    with torch.no_grad():
        head = model(x[:, :7], st)  # a chunk ending mid-window: its x rows kept, its state rows written
        runner = DecodeRunner(model, st, use_graphs=False)
        steps = [runner.step(t) for t in ids[7:18]]  # positions 7..17: every ratio's window left open
        assert [b.lagging for b in st.blocks] == [False, True, True, True]
        if then == "chunk":
            rest = model(x[:, 18:], st)[0]
        else:
            other = DecodeRunner(model, st, use_graphs=False, defer=False)
            rest = torch.stack([other.step(t) for t in ids[18:]])
        assert [b.lagging for b in st.blocks] == [False] * 4
    out = torch.cat([head[0], torch.stack(steps), rest])
    assert_close_rel(out, ref, "logits_incremental_fp32")


def test_a_one_schedule_step_on_a_lagging_state_is_refused():
    # outside a runner (which catches up first), a step that runs a layer's compressors at its position on a state
    # that deferring steps left behind would pool a window missing its first rows: refused in one line until
    # Transformer.catch_up; the deferring and closing schedules take it as it is
    raw, model = _model([0, 4, 8, 16], seed=5)
    ids = _ids(raw, 6, seed=3)
    st = model.new_state(len(ids))
    runner = DecodeRunner(model, st, use_graphs=False)
    with torch.no_grad():
        for t in ids[:2]:
            runner.step(t)
        assert [b.lagging for b in st.blocks] == [False, True, True, True]
        x = runner.x_out[0]
        pos = runner._pos(x.device)
        with pytest.raises(ValueError, match=r"^layer 1: deferring decode steps left its compressor state behind; "
                                             r"call Transformer\.catch_up\(state\)"):
            model.layer_step(1, x, runner._ids(x.device), pos, st.blocks[1])
        model.layer_step(1, x, runner._ids(x.device), pos, st.blocks[1], defer=True)  # keeps x: allowed
        model.catch_up(st)
        assert [b.lagging for b in st.blocks] == [False] * 4
        model.layer_step(1, x, runner._ids(x.device), pos, st.blocks[1])


def test_next_layers_pre_made_by_the_ffn_op_same_bits():
    # Transformer.fuse_pre: each layer's attention input (mhc_pre_norm) made by the FFN op of the layer before
    # (ops.moe_post_pre) in the decode step and in prefill chunks; on the reference backend the op is the composition
    # of the two references, so the logits are the unfused model's bit for bit. Only the first layer runs its own
    # mhc_pre_norm; the last layer's FFN (no next layer) is a plain moe_post
    from dsv4 import ops

    raw, model = _model([4, 16, 0, 8], seed=7)
    ids = _ids(raw, 21, seed=3)
    n = len(model.layers)
    seen: list[str] = []

    def hook(op, args, kwargs):
        seen.append(op.name)
        return op.impl(*args, **kwargs)

    def run(fuse):
        model.fuse_pre = fuse
        runner = DecodeRunner(model, model.new_state(len(ids) + 9), use_graphs=False)
        out = [runner.step(t).clone() for t in ids[:-1]]
        seen.clear()
        ops.set_hook(hook)
        try:
            out.append(runner.step(ids[-1]).clone())
        finally:
            ops.set_hook(None)
        calls = {name: seen.count(name) for name in ("mhc_pre_norm", "moe_post", "moe_post_pre")}
        st = model.new_state(len(ids))  # and a prefill of three chunks
        with torch.no_grad():
            chunks = [model(torch.tensor([ids[p:p + 8]]), st) for p in range(0, len(ids), 8)]
        return torch.stack(out), calls, torch.cat(chunks, 1)

    default = model.fuse_pre
    try:
        fused, fused_calls, fused_chunks = run(True)
        plain, plain_calls, plain_chunks = run(False)
    finally:
        model.fuse_pre = default
    # an eager runner whose model stops fusing: every layer makes its own pre again (none is carried over)
    model.fuse_pre = True
    runner = DecodeRunner(model, model.new_state(len(ids)), use_graphs=False)
    for t in ids[:3]:
        runner.step(t)
    model.fuse_pre = False
    try:
        again = torch.stack([runner.step(t).clone() for t in ids[3:6]])
    finally:
        model.fuse_pre = default
    assert torch.equal(again, plain[3:6])
    assert fused_calls == {"mhc_pre_norm": 1, "moe_post": 1, "moe_post_pre": n - 1}
    assert plain_calls == {"mhc_pre_norm": n, "moe_post": n, "moe_post_pre": 0}
    assert torch.equal(fused, plain)
    assert torch.equal(fused_chunks, plain_chunks)


def test_q_norm_and_wq_b_run_as_one_op():
    # the query's low-rank norm and wq_b || the indexer's wq_b: one norm_linear call per layer and prefill chunk, and
    # in a decode step one for each (the CSA layer's indexer queries first, their chain forked after them), never a
    # separate norm of q_a
    from dsv4 import ops

    raw = tiny_config([4, 0], index_topk=3, window=16, max_pos=64, hidden=256, head_dim=128, rope_dim=64,
                      index_dim=64, n_mtp=0,
                      quantization_config=dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                               scale_fmt="ue8m0", weight_block_size=[128, 128]))
    model = randomize_(Transformer(ModelConfig.from_dict(raw), Numerics("reference", torch.bfloat16)), 3).eval()
    ids = torch.tensor([_ids(raw, 9, seed=1)])
    seen = []

    def hook(op, args, kwargs):
        seen.append((op.name, tuple(args[0].shape)))
        return op.impl(*args, **kwargs)

    ops.set_hook(hook)
    try:
        with torch.no_grad():
            st = model.new_state(10)
            model(ids, st)
            model(ids[:, :1], st)  # the decode step after it
    finally:
        ops.set_hook(None)
    q_lora = raw["q_lora_rank"]
    assert [s for name, s in seen if name == "norm_linear"] == [(1, 9, q_lora)] * 2 + [(1, 1, q_lora)] * 3
    assert not [s for name, s in seen if name in ("rmsnorm", "rmsnorm_quant") and s[-1] == q_lora]


def test_runner_rejects_bad_use():
    raw, model = _model([4], seed=1)
    with pytest.raises(ValueError, match="batch 1"):
        DecodeRunner(model, model.new_state(8, batch=2), use_graphs=False)
    with pytest.raises(ValueError, match="CUDA graphs need the model on CUDA"):
        DecodeRunner(model, model.new_state(8), use_graphs=True)
    runner = DecodeRunner(model, model.new_state(2), use_graphs=False)
    runner.step(3)
    runner.step(4)
    with pytest.raises(ValueError, match="past the state's max_len 2"):
        runner.step(5)


def _graph_vs_eager(model, raw, T, devices):
    model.place(devices)
    ids = _ids(raw, T, seed=T)
    eager = DecodeRunner(model, model.new_state(T), use_graphs=False)
    ref = torch.stack([eager.step(t).clone() for t in ids])
    graphs = DecodeRunner(model, model.new_state(T), use_graphs=True)
    # on one device each graph reads the previous one's output in place (no copy between them); across devices the
    # streams hop into the next device's own buffer
    for i, dev in enumerate(graphs.devices):
        prev = graphs.embed_out if i == 0 else graphs.x_out[i - 1]
        assert (graphs.x_in[i] is prev) == (prev.device == dev)
    assert (graphs.x_head is graphs.x_out[-1]) == (graphs.x_out[-1].device == graphs.head_dev)
    out = torch.stack([graphs.step(t).clone() for t in ids])
    assert torch.equal(out, ref), f"graph replay differs from eager at {(out != ref).any(-1).nonzero()[:5].tolist()}"
    # and the graphs are right at every position (not just the warm-up path): chunked reference path
    assert_close_rel(out.cpu(), _chunked(model, ids, devices[0]).cpu(), "logits_incremental_fp32")
    # a second sequence after reset replays the same graphs from position 0
    graphs.state.reset()
    again = torch.stack([graphs.step(t).clone() for t in ids[:20]])
    assert torch.equal(again, out[:20])


@pytest.fixture
def kernels(request):
    """Bind the op backends for one test ("ref" or "fast"), restored afterwards."""
    from dsv4 import ops

    ops.configure(request.param, "cuda" if torch.cuda.is_available() else "cpu")
    yield request.param
    ops.configure("ref", "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernels", ["ref", "fast"], indirect=True)
@pytest.mark.parametrize("ratios", [[4, 128, 0], [16, 4]], ids=["ratios-4-128", "ratio-16"])
def test_graph_decode_equals_eager_decode(ratios, kernels):
    raw, model = _model(ratios, seed=3)
    _graph_vs_eager(model, raw, 2 * 128 + 5, ["cuda:0"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernels", ["ref", "fast"], indirect=True)
def test_graph_decode_defers_compressors(kernels):
    # two schedules per compressor layer (deferring and emitting graphs) against one (the compressors at every step):
    # the same logits up to the projections' fp32 summation order at every position, each step replaying the graph
    # its position calls for
    raw, model = _model([0, 4, 8, 16], seed=4)
    model.place(["cuda:0"])
    T = 2 * 16 + 5
    ids = _ids(raw, T, seed=9)
    one = DecodeRunner(model, model.new_state(T), use_graphs=True, defer=False)
    ref = torch.stack([one.step(t).clone() for t in ids])
    assert set(one.graphs) == {"embed", "head", 0, 1, 2, 3}
    one = None
    two = DecodeRunner(model, model.new_state(T), use_graphs=True)
    assert set(two.graphs) == {"embed", "head", 0, 1, 2, 3, (1, "emit"), (2, "emit"), (3, "emit")}
    for i in range(1, 4):  # the next graph reads one tensor whichever schedule ran
        assert two.x_in[i] is two.x_out[i - 1]
    assert [two.layer_graph(2, p) is two.graphs[(2, "emit")] for p in range(16)] == ([False] * 7 + [True]) * 2
    out = torch.stack([two.step(t).clone() for t in ids])
    assert_close_rel(out, ref, "logits_incremental_fp32")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernels", ["fast"], indirect=True)
def test_graph_decode_with_the_next_pre_in_the_ffn_op(kernels):
    # Transformer.fuse_pre: each layer's graph also makes the next layer's attention input (ops.moe_post_pre), which
    # the next graph reads in place (this tiny model's experts take the composed path; the CUDA kernel with the next
    # pre is graph-tested at Flash shapes in tests/ops/test_moe_cuda.py)
    raw, model = _model([4, 128, 0], seed=3)
    model.fuse_pre = True
    _graph_vs_eager(model, raw, 2 * 128 + 5, ["cuda:0"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernels", ["fast"], indirect=True)
def test_graph_decode_with_the_next_pre_in_the_down_kernel(kernels, monkeypatch):
    # Transformer.fuse_pre at a width where the experts' CUDA kernels run (D 2048, inter 512, MXFP4 + FP8 shared): the
    # down kernel's last CTA makes the next layer's attention input, which the next graph reads in place; graph ==
    # eager, and both took the fused kernel (a spy on moe_cuda.moe_decode: each step's first two layers hand it pre)
    from dsv4.ops import moe_cuda

    raw = tiny_config([4, 128, 0], index_topk=3, window=16, max_pos=512, hidden=2048, head_dim=128, rope_dim=64,
                      index_dim=64, expert_dtype="fp4", moe_intermediate_size=512,
                      quantization_config=dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                               scale_fmt="ue8m0", weight_block_size=[128, 128]))
    model = randomize_(Transformer(ModelConfig.from_dict(raw), Numerics("reference", torch.bfloat16)).place(["cuda:0"]), 6)
    model.fuse_pre = True
    calls = []
    real = moe_cuda.moe_decode

    def spy(*a, **k):
        calls.append((a[9] if len(a) > 9 else k.get("pre")) is not None)
        return real(*a, **k)

    monkeypatch.setattr(moe_cuda, "moe_decode", spy)
    ids = _ids(raw, 140, seed=10)
    eager = DecodeRunner(model, model.new_state(len(ids)), use_graphs=False)
    ref = torch.stack([eager.step(t).clone() for t in ids])
    assert calls.count(True) == 2 * len(ids) and calls.count(False) == len(ids), (calls.count(True), len(calls))
    calls.clear()
    graphs = DecodeRunner(model, model.new_state(len(ids)), use_graphs=True)  # warm-ups and capture
    # per captured piece (two warm-ups and the capture) three calls: layer 0 (CSA, first on the device: one schedule)
    # and layer 1 (HCA: deferring and emitting schedules, the latter copying the next pre into the former's) make the
    # next pre, layer 2 (the last) does not
    assert graphs.defer_ratio == [0, 128, 0]
    assert calls.count(True) == 3 * 3 and calls.count(False) == 3, calls
    calls.clear()
    out = torch.stack([graphs.step(t).clone() for t in ids])
    assert not calls  # replays only
    assert torch.equal(out, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernels", ["fast"], indirect=True)
def test_graph_decode_reference_numerics_bf16(kernels):
    # the CLI's default numerics at a width where every fast kernel tiles (FP8 + MXFP4 weights; 32 experts: the CUDA
    # router, whose gate copy starts before the boundary kernel ends)
    raw = tiny_config([4, 128, 0], index_topk=3, window=16, max_pos=512, hidden=256, head_dim=128, rope_dim=64,
                      index_dim=64, expert_dtype="fp4", experts=32,
                      quantization_config=dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                               scale_fmt="ue8m0", weight_block_size=[128, 128]))
    model = randomize_(Transformer(ModelConfig.from_dict(raw), Numerics("reference", torch.bfloat16)).place(["cuda:0"]), 5)
    ids = _ids(raw, 140, seed=9)
    eager = DecodeRunner(model, model.new_state(len(ids)), use_graphs=False)
    ref = torch.stack([eager.step(t).clone() for t in ids])
    graphs = DecodeRunner(model, model.new_state(len(ids)), use_graphs=True)
    out = torch.stack([graphs.step(t).clone() for t in ids])
    assert torch.equal(out, ref)
    # packed FP4 indexer keys (the same values) through the graphs: the same logits. (Packed FP8 K = V rows would not
    # be: at this head_dim the Triton attention runs, whose dots may be scheduled apart for the two row forms.)
    packed = DecodeRunner(model, model.new_state(len(ids), keys_fp4=True), use_graphs=True)
    assert torch.equal(torch.stack([packed.step(t).clone() for t in ids]), ref)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("kernels", ["ref", "fast"], indirect=True)
def test_graph_decode_two_gpus(kernels):
    raw, model = _model([4, 128, 0, 16], seed=4)
    _graph_vs_eager(model, raw, 2 * 128 + 5, ["cuda:0", "cuda:1"])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("kernels", ["fast"], indirect=True)
def test_two_gpus_compute_what_one_gpu_computes(kernels):
    # the fast kernels (Triton launches on the current device, whatever its tensors' device) of layers on the second
    # GPU: eager prefill chunks, the prefill graphs, eager and replayed decode steps, the head; the same bits as the
    # same model on one GPU
    one = _bf16_model([4, 16, 0, 8], 6)[1].place(["cuda:0"])
    raw, two = _bf16_model([4, 16, 0, 8], 6)
    two.place(["cuda:0", "cuda:1"])
    assert {layer.attn_norm.weight.device.index for layer in two.layers} == {0, 1}
    prompt = _ids(raw, 2 * 32 + 7, seed=3)
    steps = _ids(raw, 2 * 16 + 5, seed=4)

    def run(model, graphs):
        state = model.new_state(128)
        dec = DecodeRunner(model, state, use_graphs=graphs)  # its capture resets the state: made first
        runner = PrefillRunner(model, state, 32) if graphs else None
        ids = torch.tensor([prompt], device="cuda:0")
        chunks = [c.cpu() for c in _prefill(model, state, ids, 0, 32, runner)]
        with torch.no_grad():
            chunks.append(model(torch.tensor([steps[:1]], device="cuda:0"), state, last_only=True).cpu())
        logits = [dec.step(t).clone().cpu() for t in steps[1:]]
        return chunks, torch.stack(logits), [t.cpu() for t in _state_tensors(state)]

    from dsv4 import ops

    ref = run(one, False)
    launched = []  # (the current device, the device of the op's first tensor) at every op call

    def hook(op, args, kwargs):
        t = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        launched.append((torch.cuda.current_device(), t.device.index))
        return op.impl(*args, **kwargs)

    for graphs in (False, True):
        ops.set_hook(hook)
        try:
            got = run(two, graphs)
        finally:
            ops.set_hook(None)
        assert {dev for _, dev in launched} == {0, 1} and all(cur == dev for cur, dev in launched)
        assert all(torch.equal(a, b) for a, b in zip(got[0], ref[0])), "prefill streams or head logits differ"
        assert torch.equal(got[1], ref[1]), "decode logits differ"
        assert all(torch.equal(a, b) for a, b in zip(got[2], ref[2])), "states differ"


def test_side_branch_runs_in_line_on_cpu_and_when_off():
    from dsv4.model.layers import SideBranch, set_overlap

    b = SideBranch(torch.device("cpu"))
    with b:
        y = torch.ones(3) * 2
    b.join()
    assert b.side is None and torch.equal(y, torch.full((3,), 2.0))
    prev = set_overlap(False)
    try:
        assert prev is True  # the default
        assert set_overlap(False) is False
        if torch.cuda.is_available():
            assert SideBranch(torch.device("cuda:0")).side is None
    finally:
        set_overlap(prev)


def _op_streams(model, ids):
    """(op name, ran on the step's stream?) for every op call of one eager decode step after ids."""
    from dsv4 import ops

    runner = DecodeRunner(model, model.new_state(len(ids) + 1), use_graphs=False)
    for t in ids:
        runner.step(t)
    calls = []

    def hook(op, args, kwargs):
        calls.append((op.name, torch.cuda.current_stream() == main))
        return op.impl(*args, **kwargs)

    main = torch.cuda.current_stream()
    ops.set_hook(hook)
    try:
        runner.step(ids[-1])
    finally:
        ops.set_hook(None)
    return calls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernels", ["fast"], indirect=True)
def test_compressors_and_indexer_run_on_a_side_stream_with_the_same_bits(kernels, monkeypatch):
    from dsv4.model.layers import set_overlap

    raw, model = _model([4, 128, 0], seed=6)
    model.place(["cuda:0"])
    ids = _ids(raw, 40, seed=5)
    calls = _op_streams(model, ids)
    side = {name for name, on_main in calls if not on_main}
    # the step plan (first layer), compress_proj, the compressors (the CSA layer's two: it is first on its device, so
    # its compressors run every step; the HCA layer's step at position 40 closes no window and only keeps x), the
    # indexer (its queries' RoPE, scores, top-k)
    assert side == {"step_plan", "linear", "compressor", "rope", "indexer_scores", "topk_select"}, calls
    assert [m for name, m in calls if name == "step_plan"] == [False]  # once per step, beside the first layer
    assert sum(name == "compressor" and not m for name, m in calls) == 2
    assert all(not m for name, m in calls if name in ("indexer_scores", "topk_select"))
    assert all(m for name, m in calls if name in ("sparse_attn", "qkv_norm_rope", "mhc_pre_norm"))
    # every branch is on a second stream, the plan's joined in the first layer's attention
    from dsv4.model.layers import SideBranch

    made = []
    enter = SideBranch.__enter__
    monkeypatch.setattr(SideBranch, "__enter__", lambda self: made.append(self) or enter(self))
    _op_streams(model, ids[:3])
    monkeypatch.undo()
    # 4 steps x (the plan, CSA's compressors, CSA's indexer), each on a second stream; the HCA layer's steps close no
    # window and open no branch (its kept row is written by the op that makes its input, mhc_pre_norm's keep)
    assert len(made) == 12 and all(b.side is not None for b in made)
    assert model._step_plans[torch.device("cuda:0")][1].pending is None  # joined
    prev = set_overlap(False)
    try:
        assert all(m for _, m in _op_streams(model, ids))
        # in line vs side stream: the same bits, eager and replayed, over compressor boundaries
        T = 2 * 128 + 5
        ids = _ids(raw, T, seed=11)
        inline = DecodeRunner(model, model.new_state(T), use_graphs=False)
        ref = torch.stack([inline.step(t).clone() for t in ids])
    finally:
        set_overlap(prev)
    eager = DecodeRunner(model, model.new_state(T), use_graphs=False)
    assert torch.equal(torch.stack([eager.step(t).clone() for t in ids]), ref)
    graphs = DecodeRunner(model, model.new_state(T), use_graphs=True)
    assert torch.equal(torch.stack([graphs.step(t).clone() for t in ids]), ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_side_stream_has_its_own_counters_and_never_aliases():
    from dsv4 import ops
    from dsv4.ops import linear_cuda, triton_util

    dev = torch.device("cuda:0")
    side = ops.side_stream(dev)
    # torch hands out default-priority streams round-robin from a pool of 32: none of them is the side stream
    assert all(torch.cuda.Stream(dev) != side for _ in range(80))
    main_c = triton_util.arrival_counters(dev, "test side counters", 8)
    main_g = linear_cuda._counters(dev)
    assert ops.stream_role(dev) == "main"
    with torch.cuda.stream(side):
        assert ops.stream_role(dev) == "side"
        side_c = triton_util.arrival_counters(dev, "test side counters", 8)
        side_g = linear_cuda._counters(dev)
    # a split-K launch on the side stream may run during one on the main stream: separate counters
    assert side_c.data_ptr() != main_c.data_ptr() and side_g.data_ptr() != main_g.data_ptr()
    assert triton_util.arrival_counters(dev, "test side counters", 8).data_ptr() == main_c.data_ptr()


def _state_tensors(state) -> list[torch.Tensor]:
    out = []
    for b in state.blocks:
        out.append(b.window)
        for c in (b.compressor, b.indexer):
            if c is not None:
                out += [c.kv, c.score, c.entries]
    return out


def _prefill(model, state, ids, p0, chunk, runner=None):
    # ids [1, P] at positions p0..: each chunk's final streams (cloned), as the engine's loop runs them
    state.pos = p0
    outs = []
    with torch.no_grad():
        for s in range(0, ids.shape[1], chunk):
            part = ids[:, s:s + chunk]
            if runner is not None and runner.applies(part.shape[1], p0 + s):
                outs.append(runner.run(part, p0 + s).clone())
            else:
                outs.append(model.forward_streams(part, state).clone())
    return outs


def _bf16_model(ratios, seed, window=16):
    raw = tiny_config(ratios, index_topk=3, window=window, max_pos=512, hidden=256, head_dim=128, rope_dim=64,
                      index_dim=64, expert_dtype="fp4", experts=32,
                      quantization_config=dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                               scale_fmt="ue8m0", weight_block_size=[128, 128]))
    return raw, randomize_(Transformer(ModelConfig.from_dict(raw), Numerics("reference", torch.bfloat16)), seed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernels", ["fast"], indirect=True)
@pytest.mark.parametrize("numerics,window", [("reference-bf16", 16), ("exact-fp32", 16), ("exact-fp32", 64)])
def test_graph_prefill_equals_eager_prefill(kernels, numerics, window):
    # CSA (indexer, top-3) + HCA + SWA layers, 32-token chunks: the full chunks run through the graphs, a 7-token tail
    # eagerly, and the first chunk through the graphs where it covers the window (16), else eagerly (64: its window
    # lists are shorter); then a prompt continuing from position 45 (a reused prefix: chunks not aligned to 32) and
    # a fresh one after a reset
    if numerics == "reference-bf16":
        raw, model = _bf16_model([4, 16, 0, 8], 6, window)
    else:
        raw, model = _model([4, 16, 0, 8], seed=6, window=window)
    model.place(["cuda:0"])
    ids = torch.tensor([_ids(raw, 5 * 32 + 7, seed=11)], device="cuda:0")
    eager_state, graph_state = model.new_state(320), model.new_state(320)
    runner = PrefillRunner(model, graph_state, 32)
    assert runner.applies(32, 0) == (window <= 32) and runner.applies(32, 45) and not runner.applies(7, 160)
    assert graph_state.pos == 0 and all(not t.any() or t.isinf().all() for t in _state_tensors(graph_state))
    ref = _prefill(model, eager_state, ids, 0, 32)
    out = _prefill(model, graph_state, ids, 0, 32, runner)
    for k, (a, b) in enumerate(zip(out, ref)):
        assert torch.equal(a, b), f"chunk {k} differs"
    for a, b in zip(_state_tensors(graph_state), _state_tensors(eager_state)):
        assert torch.equal(a, b)
    assert graph_state.pos == eager_state.pos == ids.shape[1]
    # a continuation from a reused prefix of 45 tokens (both states hold the same 167 tokens; positions 45.. are
    # rewritten with other ids)
    more = torch.tensor([_ids(raw, 3 * 32, seed=12)], device="cuda:0")
    for st in (eager_state, graph_state):
        st.pos = 45
    ref = _prefill(model, eager_state, more, 45, 32)
    out = _prefill(model, graph_state, more, 45, 32, runner)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    assert all(torch.equal(a, b) for a, b in zip(_state_tensors(graph_state), _state_tensors(eager_state)))
    # the graphs ran (not the eager fallback) and follow new ids: a chunk's streams depend on its tokens
    graph_state.reset()
    eager_state.reset()
    again = _prefill(model, graph_state, ids, 0, 32, runner)
    assert all(torch.equal(a, b) for a, b in zip(again, _prefill(model, eager_state, ids, 0, 32)))
    assert not torch.equal(again[1], out[1])


def test_prefill_runner_rejects_bad_use():
    raw, model = _model([4], seed=1)
    with pytest.raises(ValueError, match="batch 1"):
        PrefillRunner(model, model.new_state(128, batch=2), 32)
    with pytest.raises(ValueError, match="CUDA graphs need the model on CUDA"):
        PrefillRunner(model, model.new_state(128), 32)


def test_attention_keeps_its_input_until_the_side_branch_joins():
    # the compressors' GEMM reads the attention's input on the side stream until attend() joins the branch: begin()
    # must keep that tensor referenced (a freed input could be handed to the main stream's next allocation while the
    # side GEMM still reads it)
    import weakref

    from dsv4.model.layers import StepPlan

    raw, model = _model([4, 16], seed=3)
    st = model.new_state(64)
    layer = model.layers[0]
    y = torch.randn(1, 5, raw["hidden_size"])
    ref = weakref.ref(y)
    plan = StepPlan.build(torch.zeros(1, dtype=torch.int64), 5, model.cfg.sliding_window, 0)
    with torch.no_grad():
        a = layer.attn.begin(y, plan, st.blocks[0], model.rope(layer.spec.rope, torch.device("cpu")))
        del y
        assert ref() is not None and a.x is ref()
        o = layer.attn.attend(a, plan, st.blocks[0])
    assert o.shape[:2] == (1, 5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefill_graphs_need_the_fast_moe():
    # the reference MoE syncs with the host; moe_post's reference calls it too, so either op on ref rules graphs out
    from dsv4 import ops
    from dsv4.graphs import prefill_graphs_apply

    try:
        assert ops.configure("fast", "cuda") and prefill_graphs_apply()
        for op in ("moe_post", "moe_experts"):
            ops.configure("fast", "cuda", {op: "ref"})
            assert not prefill_graphs_apply()
    finally:
        ops.configure("ref", "cpu")
