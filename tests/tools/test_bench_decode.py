"""tools/bench_decode.py: the launch report (--launches: the occupancy arithmetic, the trace's kernel events, the
rows), the state bytes a step reads, the cycle's step positions and the routed experts shared across layers
(--share-experts)."""

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_decode", ROOT / "tools" / "bench_decode.py")
bd = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bd)

H200 = dict(bd.SM_DEFAULT, sms=132)


def test_ctas_per_sm_follows_each_resource():
    # the decode experts' down kernel as the tree builds it: 72 registers, 91 KB of dynamic + 384 B of static shared
    # memory -> shared memory allows two (2 x 92,544 B; three would need 277,632)
    assert bd.ctas_per_sm(256, 72, 91136 + 384, H200) == (2, "smem")
    # its wgmma form (48th pass): 74,752 + 384 B fit three; at 80 registers a warp takes 2,560 -> 6 warps in each
    # scheduler's 16,384, 24 warps, 3 CTAs; at 82 it takes 2,816 (units of 256) -> 5 per scheduler, 20 warps, 2 CTAs
    assert bd.ctas_per_sm(256, 80, 74752 + 384, H200)[0] == 3
    assert bd.ctas_per_sm(256, 82, 74752 + 384, H200) == (2, "regs")
    assert bd.ctas_per_sm(256, 0, 74752 + 384 + 2048, H200) == (2, "smem")  # 3 x 78,208 > 233,472
    assert bd.ctas_per_sm(1024, 32, 0, H200) == (2, "threads")
    assert bd.ctas_per_sm(32, 16, 0, H200) == (32, "ctas")
    assert bd.ctas_per_sm(33, 16, 0, H200) == (32, "threads")  # 2 warps: 32 CTAs take 2,048 threads (a tie names
    # the resource, not the CTA cap)
    assert bd.ctas_per_sm(256, 255, 0, H200) == (1, "regs")
    # warps not a multiple of 4: whole warps per scheduler (96 registers: 5 x 4 = 20 warps -> 6 CTAs of 3, not 7)
    assert bd.ctas_per_sm(96, 96, 0, H200) == (6, "regs")
    assert bd.ctas_per_sm(64, 40, 0, H200) == (24, "regs")


def test_launch_configs_reads_the_kernel_events_in_start_order():
    """kineto's kernel events (category "kernel", "Kernel" in older versions): grid and block as lists, shared memory
    static + dynamic; other events ignored."""
    trace = {"traceEvents": [
        {"cat": "kernel", "name": "void dsv4::(anonymous namespace)::moe_down_kernel<false>(dsv4::MoeArgs)",
         "ts": 20.5, "args": {"grid": [256, 1, 1], "block": [256, 1, 1], "registers per thread": 72,
                              "shared memory": 91520}},
        {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 1.0, "args": {}},
        {"cat": "kernel", "name": "void dsv4::(anonymous namespace)::moe_up_kernel<true>(dsv4::MoeArgs)", "ts": 3.0,
         "args": {"grid": [896, 1, 1], "block": [256, 1, 1], "registers per thread": 66, "shared memory": 63632}},
        {"cat": "Kernel", "name": "_pool_kernel", "ts": 9.0, "args": {"grid": [2, 3, 1], "block": [128, 1, 1]}},
    ]}
    got = bd.launch_configs(trace)
    assert [k["kernel"] for k in got] == ["moe_up_kernel", "_pool_kernel", "moe_down_kernel"]
    assert got[0] == {"kernel": "moe_up_kernel", "ctas": 896, "threads": 256, "regs": 66, "smem": 63632}
    assert got[1] == {"kernel": "_pool_kernel", "ctas": 6, "threads": 128, "regs": 0, "smem": 0}
    assert bd.launch_configs({}) == []


def test_launch_rows_mark_one_wave_kernels_that_can_crowd():
    ks = [{"kernel": "down3", "ctas": 256, "threads": 256, "regs": 80, "smem": 75136},
          {"kernel": "down2", "ctas": 256, "threads": 256, "regs": 72, "smem": 91520},
          {"kernel": "up", "ctas": 896, "threads": 256, "regs": 66, "smem": 63632},
          {"kernel": "unknown", "ctas": 4, "threads": 0, "regs": 0, "smem": 0},
          {"kernel": "small", "ctas": 64, "threads": 128, "regs": 32, "smem": 0},
          {"kernel": "wq_a", "ctas": 96, "threads": 256, "regs": 54, "smem": 67379}]
    down3, down2, up, unknown, small, wq_a = bd.launch_rows(ks, H200)
    assert (down3["per_sm"], down3["even"], down3["min_sms"], down3["pile"]) == (3, 2, 86, True)
    assert abs(down3["waves"] - 256 / 396) < 1e-12
    assert (down2["per_sm"], down2["even"], down2["min_sms"], down2["pile"]) == (2, 2, 128, False)
    assert (up["per_sm"], up["pile"]) == (3, False) and up["waves"] > 2  # more than a wave: the scheduler spreads it
    assert unknown["per_sm"] == 0 and "pile" not in unknown
    assert small["min_sms"] == 4 and not small["pile"]  # fewer than half as many CTAs as SMs: not flagged
    # the decode step's wq_a || wkv GEMV as the H200 ran it: 96 CTAs, three per SM (shared memory) -> 32 SMs at least
    assert (wq_a["per_sm"], wq_a["limit"], wq_a["even"], wq_a["min_sms"], wq_a["pile"]) == (3, "smem", 1, 32, True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_launches_reads_a_captured_graph():
    """On a device: a captured graph of two known launches (torch's spin kernel, <<<1, 1>>>, then an elementwise add
    over 2^20 floats) comes back in that order with their CTAs, threads and registers; the device's limits are read."""
    dev = torch.device("cuda")
    x = torch.zeros(1 << 20, device=dev)
    torch.cuda._sleep(1000)  # warm: the kernels loaded before the capture
    x.add_(1.0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        torch.cuda._sleep(1000)
        x.add_(1.0)
    got = bd.graph_launches(g, dev)
    assert len(got) == 2
    assert (got[0]["ctas"], got[0]["threads"]) == (1, 1)
    assert got[1]["ctas"] > 1 and got[1]["ctas"] * got[1]["threads"] * 16 >= 1 << 20  # it covers the tensor
    assert all(k["regs"] > 0 for k in got)
    sm = bd.sm_limits(dev)
    assert sm["sms"] == torch.cuda.get_device_properties(dev).multi_processor_count and sm["smem"] >= 100 * 1024
    rows = bd.launch_rows(got, sm)
    assert rows[0]["per_sm"] >= 1 and rows[0]["waves"] < 1


def test_busy_gaps_takes_the_union_over_streams_and_sizes_the_idle_gaps():
    # two streams overlapping (0-10 and 4-12), a 3 us gap, a kernel inside another (20-30 holds 22-25), a 150 us gap,
    # and a 0.5 us one
    ks = [(20.0, 30.0, "c"), (4.0, 12.0, "b"), (0.0, 10.0, "a"), (22.0, 25.0, "inner"), (15.0, 20.0, "c0"),
          (180.0, 190.0, "d"), (190.5, 191.0, "e")]
    got = bd.busy_gaps(ks, top=2)
    assert got["kernels"] == 7
    assert got["span_us"] == 191.0
    assert got["busy_us"] == 12.0 + 15.0 + 10.0 + 0.5  # 0-12, 15-30, 180-190, 190.5-191
    assert got["idle_us_by_gap"] == {"1-5": 3.0, ">=100": 150.0, "<1": 0.5}
    assert got["top_gaps"] == [{"us": 150.0, "after": "c", "before": "d", "at_us": 30.0},
                               {"us": 3.0, "after": "b", "before": "c0", "at_us": 12.0}]
    # back to back: no gap; nothing: an empty report
    assert bd.busy_gaps([(0.0, 1.0, "x"), (1.0, 2.0, "y")])["idle_us_by_gap"] == {}
    assert bd.busy_gaps([]) == {"span_us": 0.0, "busy_us": 0.0, "kernels": 0, "idle_us_by_gap": {}, "top_gaps": []}


def test_state_read_bytes_counts_the_kept_rows_where_a_window_closes():
    # a tiny state (CSA layer: compressor + indexer): the window, the visible entries and the open rows of each
    # compressor; a step that closes a window after deferring steps also reads the kept input rows (x_ring)
    from dsv4.config import ModelConfig
    from dsv4.state import ModelState
    from dsv4.testing import tiny_config

    cfg = ModelConfig.from_dict(tiny_config([4]))
    st = ModelState(cfg, batch=1, max_len=32, dtype=torch.bfloat16).blocks[0]
    spec_ = cfg.layers[0]
    base = bd.state_read_bytes(st, 15, spec_)
    want = st.window.numel() * 2
    for c in (st.compressor, st.indexer):
        want += 4 * c.entries.shape[2] * c.entries.element_size() + c.kv.numel() * 4 + c.score.numel() * 4
    assert base == want
    assert bd.state_read_bytes(st, 15, spec_, kept=True) == base + st.x_ring.numel() * 2


def test_cycle_positions_weight_each_kind_of_step_by_its_share_of_the_cycle():
    # Flash (ratios 4 and 128 beside SWA layers): the step at ctx-1 closes every window, ctx-5 only the ratio-4 ones
    assert bd.cycle_positions(1024, [0, 0, 4, 128, 4]) == [(1023, 1 / 128, 128), (1019, 1 / 4 - 1 / 128, 4),
                                                           (1022, 3 / 4, 0)]
    # every position class of a cycle, counted over one cycle ending at ctx, has the weight given to it
    for ratios, ctx in (([4, 128], 131072), ([2, 8, 64], 1024), ([16], 32)):
        got = bd.cycle_positions(ctx, ratios)
        assert abs(sum(w for _, w, _ in got) - 1.0) < 1e-12
        cycle = max(ratios)
        assert len({pos for pos, _, _ in got}) == len(got)  # one position a kind
        for pos, w, closes in got:
            assert ctx - cycle <= pos < ctx  # inside the cycle that ends at ctx (a step past it is refused)
            assert max([r for r in ratios if (pos + 1) % r == 0], default=0) == closes
            same = [q for q in range(ctx - cycle, ctx)
                    if max([r for r in ratios if (q + 1) % r == 0], default=0) == closes]
            assert len(same) == round(w * cycle)
    # no cycle to weight: ctx not a multiple of the largest ratio, ratios that do not nest, none, or below 2
    assert bd.cycle_positions(1000, [4, 128]) == []
    assert bd.cycle_positions(64, [4, 128]) == []
    assert bd.cycle_positions(1024, [4, 6]) == []
    assert bd.cycle_positions(1024, [0, 0]) == []
    assert bd.cycle_positions(1024, [1, 4]) == []


def test_share_experts_gives_each_layer_the_first_stacks_on_its_device():
    from dsv4.config import ModelConfig
    from dsv4.model.layers import Numerics
    from dsv4.model.transformer import Transformer
    from dsv4.testing import randomize_, tiny_config

    cfg = ModelConfig.from_dict(tiny_config([0, 4, 128, 4, 0], n_mtp=0))
    with torch.device("meta"):
        model = Transformer(cfg, Numerics("exact", torch.float32))
    # the split place() makes: contiguous runs of about equal count
    assert model.split_layers(["cpu", "meta"]) == [torch.device(d) for d in ("cpu",) * 3 + ("meta",) * 2]
    own = [layer.ffn.experts for layer in model.layers]
    assert bd.share_experts(model, ["cpu", "meta"]) == 3
    assert [layer.ffn.experts for layer in model.layers] == [own[0]] * 3 + [own[3]] * 2
    assert all(layer.ffn.experts is own[0] for layer in model.layers[:3])
    assert model.layers[3].ffn.experts is own[3] and model.layers[4].ffn.experts is own[3]
    # on one device: one set of stacks, materialised once by place and filled once by randomize_, the rest intact
    with torch.device("meta"):
        model = Transformer(cfg, Numerics("exact", torch.float32))
    first = model.layers[0].ffn.experts
    assert bd.share_experts(model, ["cpu"]) == 4
    model.place(["cpu"])
    randomize_(model, seed=0)
    stacks = {layer.ffn.experts.w1.weight.data_ptr() for layer in model.layers}
    assert stacks == {first.w1.weight.data_ptr()} and not first.w1.weight.is_meta
    assert all(not b.is_meta for b in model.buffers())
    assert len({layer.ffn.gate.weight.data_ptr() for layer in model.layers}) == len(model.layers)


def test_balance_routing_spreads_a_random_models_chunk_over_the_experts():
    from dsv4.config import ModelConfig
    from dsv4.model.layers import Numerics
    from dsv4.model.moe import Gate
    from dsv4.model.transformer import Transformer
    from dsv4.testing import randomize_, tiny_config

    cfg = ModelConfig.from_dict(tiny_config([0, 4, 128, 4, 0], n_mtp=0, experts=32))
    model = Transformer(cfg, Numerics("exact", torch.float32))
    randomize_(model, seed=0)
    gates = [layer.ffn.gate for layer in model.layers]
    assert [g.hash for g in gates] == [True, False, False, False, False]
    tid2eid = gates[0].tid2eid.clone()

    def chunk_hits(seed):  # (distinct experts, busiest expert's rows) per layer for a fresh 64-token chunk
        hits = []
        for g in gates:
            g.forward = lambda x, ids, g=g: hits.append(Gate.forward(g, x, ids)) or hits[-1]
        try:
            ids = torch.randint(0, cfg.vocab_size, (1, 64), generator=torch.Generator().manual_seed(seed))
            model.forward_streams(ids, model.new_state(64))
        finally:
            for g in gates:
                del g.forward
        return [(int(e.unique().numel()), int(torch.bincount(e.flatten()).max())) for _, e in hits]

    before = chunk_hits(5)
    # random gate weights send the chunk's tokens to a few experts (the hash-routed layer: nearly all 32)
    assert before[0][0] >= 28 and all(u <= 16 and m >= 30 for u, m in before[1:])
    out = bd.balance_routing(model, tokens=64)
    assert len(out) == 4 and all(u >= 30 and m <= 6 for u, m in out)  # its own chunk: ~4 rows an expert (64 x 2 / 32)
    assert all("forward" not in vars(g) for g in gates) and torch.equal(gates[0].tid2eid, tid2eid)
    after = chunk_hits(5)
    assert after[0] == before[0]  # the hash-routed layer sees the same tokens and inputs
    assert all(u >= 24 and m <= 20 for u, m in after[1:])
