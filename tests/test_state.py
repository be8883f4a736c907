"""ModelState.mark / rewind: a state rewound to a mark is the state of a run that never went past it, bit for bit.

After the mark, the run goes on far enough to wrap the window ring, close windows of every compressor (CSA's
previous window with them) and emit entries past the mark; then it rewinds, and both the logits of a different
continuation and every state tensor the rewound run can read equal those of a run that stopped at the mark, with the
same chunks. Marks sit inside a CSA window, at a CSA boundary, at an HCA boundary and one past it.
"""

import pytest
import torch

from dsv4.config import ModelConfig
from dsv4.graphs import DecodeRunner
from dsv4.model.layers import Numerics
from dsv4.model.transformer import Transformer
from dsv4.testing import randomize_, tiny_config

VOCAB = 300


@pytest.fixture(scope="module")
def model():
    # sliding-window, CSA (ratio 4, an indexer) and HCA (ratio 16) layers; window 16, so 40 positions wrap the ring
    raw = tiny_config([0, 4, 16], n_mtp=0, vocab=VOCAB, max_pos=256, hidden=256, head_dim=128, rope_dim=64,
                      index_dim=64, index_topk=3, expert_dtype="fp4", experts=16,
                      quantization_config=dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                               scale_fmt="ue8m0", weight_block_size=[128, 128]))
    return randomize_(Transformer(ModelConfig.from_dict(raw), Numerics("reference", torch.bfloat16)), 2).eval()


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(2, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def run(model, state, tokens: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Feed `tokens` in chunks of the given lengths -> the logits of every position, [1, n, vocab]. A chunk of one
    token is a decode step of an eager DecodeRunner (whose CSA and HCA layers defer their compressors' work at the
    positions that close no window: BlockState.lagging)."""
    out, s = [], 0
    runner = DecodeRunner(model, state, use_graphs=False)
    for n in chunks:
        if n == 1:
            out.append(runner.step(int(tokens[0, s])).view(1, 1, -1))
        else:
            out.append(model(tokens[:, s:s + n], state))
        s += n
    assert s == tokens.shape[1]
    return torch.cat(out, 1)


def readable(state, pos: int) -> dict[str, torch.Tensor]:
    """Every state tensor a run from `pos` on can read before it writes it: the window rows of the W positions
    before pos, the compressors' open windows and input rows, the entries of the windows closed before pos."""
    out = {}
    for i, b in enumerate(state.blocks):
        W = b.window.shape[1]
        slots = [p % W for p in range(max(0, pos - W), pos)]
        out[f"{i}.window"] = b.window[:, slots]
        if b.x_ring is not None:
            out[f"{i}.x_ring"] = b.x_ring
        for name, c in (("compressor", b.compressor), ("indexer", b.indexer)):
            if c is not None:
                out[f"{i}.{name}.kv"], out[f"{i}.{name}.score"] = c.kv, c.score
                out[f"{i}.{name}.entries"] = c.entries[:, :pos // c.ratio]
    return out


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("mark_at,step", [(37, False), (40, False), (48, False), (49, False), (38, True)])
def test_rewind_equals_a_run_that_stopped_at_the_mark(model, mark_at, step, packed):
    # marks in a CSA window, at a CSA boundary, at an HCA boundary, past it; and after a one-token step that left the
    # compressors' work to a later step (BlockState.lagging)
    prefix = ids(mark_at, seed=mark_at)
    past = ids(45, seed=1)  # run on past the mark: wraps the ring, closes CSA and HCA windows
    nxt = ids(23, seed=2)  # what runs after the rewind
    chunks = [32, mark_at - 33, 1] if step else [32, mark_at - 32]  # the prefix in chunks that end at the mark
    with torch.no_grad():
        a = model.new_state(128, kv_fp8=packed, keys_fp4=packed)
        run(model, a, prefix, chunks)
        assert any(b.lagging for b in a.blocks) == step
        mark = a.mark()
        # chunks and one-token steps; the run ends with the other `lagging` than the mark's
        run(model, a, past, [20, 1, 1, 23] if step else [20, 1, 1, 22, 1])
        assert any(b.lagging for b in a.blocks) != step
        assert a.pos == mark_at + 45
        a.rewind(mark)
        assert a.pos == mark_at
        got_state = {k: v.clone() for k, v in readable(a, mark_at).items()}
        got = run(model, a, nxt, [22, 1])

        b = model.new_state(128, kv_fp8=packed, keys_fp4=packed)
        run(model, b, prefix, chunks)
        want_state = {k: v.clone() for k, v in readable(b, mark_at).items()}
        want = run(model, b, nxt, [22, 1])
    for k, v in want_state.items():
        assert torch.equal(got_state[k], v), k
    assert torch.equal(got, want)
    # the run past the mark did change what the rewind restores (else this test could not fail)
    with torch.no_grad():
        c = model.new_state(128, kv_fp8=packed, keys_fp4=packed)
        run(model, c, prefix, chunks)
        run(model, c, past, [45])
        c.pos = mark_at
        stale = run(model, c, nxt, [22, 1])
    assert not torch.equal(stale, want)


def test_mark_reuses_its_buffers_and_belongs_to_its_state(model):
    with torch.no_grad():
        a, b = model.new_state(64), model.new_state(64)
        run(model, a, ids(10, seed=3), [10])
        first = a.mark()
        run(model, a, ids(5, seed=4), [5])
        second = a.mark(into=first)
        assert second.pos == 15 and all(x is y for x, y in zip(second.tensors, first.tensors))
        assert b.mark(into=first).tensors[0] is not first.tensors[0]  # another state's mark: new buffers
        with pytest.raises(ValueError, match="another state"):
            b.rewind(second)
        a.rewind(second)  # (again: a mark holds until the state is reset)
        a.reset()
        with pytest.raises(ValueError, match="before the state's last reset"):
            a.rewind(second)
