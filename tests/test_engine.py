"""Engine behaviour on tiny random models with the real tokenizer (vocab 129,280).

Greedy decoding equals step-by-step argmax of the stateless full forward (chunked prefill crosses
the 128-token boundary); seeds make sampling reproducible; EOS, max-new-tokens and the context limit
stop generation with the right finish_reason; scripted outputs (logits forced by a forward hook)
check the streamed reasoning / content / tool-call deltas and the parsed result.
"""

import math
from contextlib import contextmanager

import pytest
import torch

from dsv4.config import ModelConfig
from dsv4.engine import (
    DEFAULT_CONTEXT, NO_OP_EFFORTS, PREFILL_CHUNK, REASONING_EFFORTS, ContextLengthError, Engine, EngineError,
    StopStrings, _common_prefix, _defaults_from, check_devices, default_max_context, inspect_model_dir, parse_devices,
    reencode, render_conversation,
)
from dsv4.model.layers import Numerics
from dsv4.model.transformer import Transformer
from dsv4.sampling import SamplingParams
from dsv4.testing import randomize_, tiny_config
from encoding import RELEASES, encode_messages, load_tokenizer

VOCAB = 129280
EOS = 1


def random_model(raw: dict, numerics: Numerics, seed: int = 0) -> Transformer:
    return randomize_(Transformer(ModelConfig.from_dict(raw), numerics), seed).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def model():
    # CSA, sliding-window and HCA layers; window 16 so long prompts wrap the KV ring
    return random_model(tiny_config([4, 0, 16], n_mtp=0, vocab=VOCAB, max_pos=1024),
                        Numerics("exact", torch.float32), seed=1)


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    return Engine(model, tokenizer, max_context=512)


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(2, 120000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@contextmanager
def forced(model, script: list[int], start: int):
    """Make the model emit `script` from position `start` on: the logits of the forward that ends at
    position start+i get token script[i] pushed far above everything else."""
    def hook(_module, args, logits):
        i = args[1].pos - start
        if 0 <= i < len(script):
            logits = logits.clone()
            logits[:, -1, script[i]] += 1e6
        return logits

    handle = model.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def recorded(model):
    """The logits of every forward of `model` (the prompt's last chunk, each decode step), in a list."""
    out: list[torch.Tensor] = []
    handle = model.register_forward_hook(lambda _module, _args, logits: out.append(logits.clone()))
    try:
        yield out
    finally:
        handle.remove()


GREEDY = SamplingParams(temperature=0, max_new_tokens=12)


def test_greedy_equals_argmax_of_full_forward(engine, model):
    prompt = prompt_ids(PREFILL_CHUNK + 22)  # two prefill chunks
    got = engine.generate_ids(prompt, GREEDY)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(GREEDY.max_new_tokens):
            # a fresh state and the whole sequence: the stateless forward
            logits = model(torch.tensor([seq]), model.new_state(len(seq)), last_only=True)
            seq.append(int(logits[0, -1].argmax()))
            if seq[-1] == EOS:
                break
    assert got == seq[len(prompt):]
    assert len(got) == GREEDY.max_new_tokens


def test_prompt_lengths_around_the_chunk_boundary(engine, model):
    for n in (1, PREFILL_CHUNK, PREFILL_CHUNK + 1):
        prompt = prompt_ids(n, seed=n)
        with torch.no_grad():
            ref = int(model(torch.tensor([prompt]), model.new_state(n))[0, -1].argmax())
        assert engine.generate_ids(prompt, SamplingParams(temperature=0, max_new_tokens=1)) == [ref]


def test_on_prefill_reports_each_chunk(model, tokenizer):
    eng = Engine(model, tokenizer, max_context=512)
    calls = []
    eng.on_prefill = lambda done, total: calls.append((done, total))
    first = prompt_ids(2 * PREFILL_CHUNK + 5, seed=3)
    out = eng.complete(first, GREEDY, reuse_prefix=True)
    assert calls == [(0, len(first)), (PREFILL_CHUNK, len(first)), (2 * PREFILL_CHUNK, len(first)),
                     (len(first), len(first))]
    calls.clear()  # a reused prefix: only the new tokens are counted
    second = first + out.token_ids + prompt_ids(7, seed=4)
    done = eng.complete(second, GREEDY, reuse_prefix=True)
    new = len(second) - done.cached_tokens
    assert done.cached_tokens > 0 and calls == [(0, new), (new, new)]


def test_state_is_reset_between_requests(engine):
    a = engine.generate_ids(prompt_ids(40, seed=1), GREEDY)
    engine.generate_ids(prompt_ids(200, seed=2), GREEDY)  # dirty every cache
    assert engine.generate_ids(prompt_ids(40, seed=1), GREEDY) == a


def test_seeded_sampling_is_reproducible(engine):
    p = SamplingParams(temperature=1.0, seed=123, max_new_tokens=8)
    prompt = prompt_ids(30)
    a = engine.generate_ids(prompt, p)
    assert engine.generate_ids(prompt, p) == a
    assert engine.generate_ids(prompt, SamplingParams(temperature=1.0, seed=124, max_new_tokens=8)) != a
    msgs = [{"role": "user", "content": "Hello"}]
    r1 = engine.generate(msgs, params=p)
    r2 = engine.generate(msgs, params=p)
    r3 = engine.generate(msgs, params=SamplingParams(temperature=1.0, seed=5, max_new_tokens=8))
    assert (r1.reasoning_content, r1.token_ids) == (r2.reasoning_content, r2.token_ids)
    assert r1.token_ids != r3.token_ids


def test_stop_on_eos(engine, model):
    prompt = prompt_ids(20)
    with forced(model, [EOS], start=len(prompt) + 3):
        done = engine.complete(prompt, SamplingParams(temperature=0, max_new_tokens=50))
    assert done.finish_reason == "stop"
    assert len(done.token_ids) == 4 and done.token_ids[-1] == EOS
    # EOS listed by generation_config.json (eos_ids) stops too
    other = Engine(model, engine.tokenizer, 64, eos_ids=frozenset({EOS, 7}))
    with forced(model, [7], start=len(prompt)):
        assert other.complete(prompt, GREEDY).token_ids == [7]


def test_stop_on_max_new_tokens(engine):
    done = engine.complete(prompt_ids(10), SamplingParams(temperature=1.0, seed=0, max_new_tokens=7))
    assert done.finish_reason == "length" and len(done.token_ids) == 7


def test_stop_on_context_limit(model, tokenizer):
    small = Engine(model, tokenizer, max_context=25)
    done = small.complete(prompt_ids(20), SamplingParams(temperature=0, max_new_tokens=100))
    assert done.finish_reason == "context"
    assert done.prompt_tokens + len(done.token_ids) == 25
    # max_new_tokens reached at the same token wins: it is the user's own limit
    done = small.complete(prompt_ids(20), SamplingParams(temperature=0, max_new_tokens=5))
    assert done.finish_reason == "length"


def test_prompt_longer_than_context_is_rejected(model, tokenizer):
    small = Engine(model, tokenizer, max_context=16)
    with pytest.raises(ContextLengthError, match="the prompt is 16 tokens but the context holds 16"):
        small.complete(prompt_ids(16), GREEDY)
    with pytest.raises(ContextLengthError, match="the prompt is 30 tokens"):
        small.generate([{"role": "user", "content": "word " * 25}], params=GREEDY)


def test_max_context_must_fit_the_model(model, tokenizer):
    with pytest.raises(EngineError, match=r"max context 5000 must be in \[2, 1024\]"):
        Engine(model, tokenizer, max_context=5000)


SCRIPTS = {
    "thinking": ("Let me think.</think>Hello there!<｜end▁of▁sentence｜>", "Let me think.", "Hello there!"),
    "chat": ("Hi, 世界!<｜end▁of▁sentence｜>", "", "Hi, 世界!"),
}


@pytest.mark.parametrize("mode", ["thinking", "chat"])
def test_generate_streams_and_parses(engine, model, tokenizer, mode):
    text, reasoning, content = SCRIPTS[mode]
    script = tokenizer.encode(text)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    prompt = tokenizer.encode(encode_messages(msgs, mode))
    assert prompt[-1] == tokenizer.token_id("<think>" if mode == "thinking" else "</think>")
    deltas = []
    with forced(model, script, start=len(prompt)):
        r = engine.generate(msgs, thinking_mode=mode, params=SamplingParams(temperature=1.0, seed=0),
                            on_delta=deltas.append)
    assert (r.role, r.reasoning_content, r.content, r.tool_calls) == ("assistant", reasoning, content, [])
    assert r.finish_reason == "stop" and r.token_ids == script
    assert "".join(d.reasoning for d in deltas) == reasoning
    assert "".join(d.content for d in deltas) == content
    assert r.usage == {"prompt_tokens": len(prompt), "completion_tokens": len(script),
                       "total_tokens": len(prompt) + len(script), "prompt_tokens_details": {"cached_tokens": 0}}
    assert r.unparsed == [] and r.logprobs is None
    t = r.timings
    assert t["ttft_s"] > 0 and t["prefill_tok_s"] > 0 and t["decode_tok_s"] > 0 and t["load_s"] is None


def test_generate_streams_tool_calls(engine, model, tokenizer):
    text = ("Need the weather.</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
            "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
            "</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>")
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = engine.encode(msgs)
    calls = []
    with forced(model, tokenizer.encode(text), start=len(prompt)):
        r = engine.generate(msgs, params=SamplingParams(temperature=0),
                            on_delta=lambda d: calls.extend(d.tool_calls))
    expected = [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert r.tool_calls == calls == expected
    assert (r.reasoning_content, r.content, r.finish_reason) == ("Need the weather.", "", "stop")


def test_truncated_thinking_still_returns_reasoning(engine, model, tokenizer):
    script = tokenizer.encode("I am thinking about <this")  # "<" could start a marker: held, then flushed
    msgs = [{"role": "user", "content": "Hi"}]
    deltas = []
    with forced(model, script, start=len(engine.encode(msgs))):
        r = engine.generate(msgs, params=SamplingParams(temperature=0, max_new_tokens=len(script)),
                            on_delta=deltas.append)
    assert r.finish_reason == "length"
    assert r.reasoning_content == "I am thinking about <this" == "".join(d.reasoning for d in deltas)
    assert r.content == ""


def test_random_model_stream_matches_result(engine):
    deltas = []
    r = engine.generate([{"role": "user", "content": "Hello"}], params=SamplingParams(seed=3, max_new_tokens=20),
                        on_delta=deltas.append)
    assert r.finish_reason in ("length", "stop") and r.usage["completion_tokens"] == len(r.token_ids)
    assert "".join(d.reasoning for d in deltas) == r.reasoning_content
    assert "".join(d.content for d in deltas) == r.content


def test_reasoning_effort_table_matches_encoder(engine):
    msgs = [{"role": "user", "content": "x"}]
    for release in RELEASES:
        for effort in ("low", "medium", "high", "max"):
            try:
                encode_messages(msgs, "thinking", reasoning_effort=effort, release=release)
                accepted = True
            except AssertionError:
                accepted = False
            assert accepted == (effort in REASONING_EFFORTS[release]), (release, effort)
            if accepted:  # the no-op efforts render exactly the prompt without an effort
                same = (encode_messages(msgs, "thinking", reasoning_effort=effort, release=release)
                        == encode_messages(msgs, "thinking", release=release))
                assert same == (effort in NO_OP_EFFORTS[release]), (release, effort)
    with pytest.raises(EngineError, match=r"effort 'low' is not accepted .*\(preview\); choose one of high, max"):
        engine.encode(msgs, reasoning_effort="low")
    with pytest.raises(EngineError, match="cannot encode the conversation"):
        engine.encode([{"role": "developer", "content": ""}])


def test_reference_numerics_bf16_end_to_end(tokenizer):
    # DeepSeek's quantization simulations with bf16 activations: the CLI's default numerics.
    raw = tiny_config([4, 0, 16], n_mtp=0, vocab=VOCAB, head_dim=128, rope_dim=64, index_dim=64, index_topk=4)
    eng = Engine(random_model(raw, Numerics("reference", torch.bfloat16), seed=2), tokenizer, max_context=300)
    prompt = prompt_ids(140)
    a = eng.generate_ids(prompt, GREEDY)
    assert len(a) == GREEDY.max_new_tokens and eng.generate_ids(prompt, GREEDY) == a


def test_defaults_from_generation_config():
    assert _defaults_from({"temperature": 1.0, "top_p": 1.0, "do_sample": True}) == SamplingParams()
    assert _defaults_from({"temperature": 0.6, "top_p": 0.95, "top_k": 20}) == SamplingParams(0.6, 0.95, 20)
    assert _defaults_from({"temperature": 0.6, "do_sample": False}).greedy


def test_parse_devices():
    assert parse_devices("cpu") == ["cpu"]
    assert parse_devices("cuda:0, cuda:1") == ["cuda:0", "cuda:1"]
    assert parse_devices(None) == (["cuda"] if torch.cuda.is_available() else ["cpu"])
    for bad in ("gpu", "cuda:x", "", "cpu,,cuda", "mps"):
        with pytest.raises(ValueError, match="unknown device"):
            parse_devices(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_requested_without_cuda():
    with pytest.raises(EngineError, match="device cuda:1 requested but CUDA is not available"):
        check_devices(["cpu", "cuda:1"])


def test_timings_are_finite(engine):
    t = engine.complete(prompt_ids(50), SamplingParams(temperature=0, max_new_tokens=3)).timings
    assert all(v is None or math.isfinite(v) for v in t.values())
    assert set(t) == {"load_s", "ttft_s", "prefill_tok_s", "decode_s", "decode_tok_s"}


@pytest.fixture
def race_fast():
    # the reference ops, but ops.sample_race on its Triton kernel (TokenSampler's bare-temperature draws)
    from dsv4 import ops

    ops.configure("ref", "cuda", {"sample_race": "fast"})
    saved, Engine.USE_RACE = Engine.USE_RACE, True
    yield
    Engine.USE_RACE = saved
    ops.configure("ref", "cpu")


def _graph_and_eager_engines(tokenizer, seed: int, max_context: int) -> tuple[Engine, Engine]:
    # one random tiny CSA / SWA / HCA model on cuda:0 behind an engine with CUDA graphs and one without
    raw = tiny_config([4, 0, 16], n_mtp=0, vocab=VOCAB, max_pos=1024)
    model = random_model(raw, Numerics("exact", torch.float32), seed=seed).place(["cuda:0"])
    return (Engine(model, tokenizer, max_context=max_context, graphs=True),
            Engine(model, tokenizer, max_context=max_context, graphs=False))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decode_generates_what_eager_decode_generates(tokenizer):
    # the engine decodes through per-layer CUDA graphs on CUDA; greedy output must equal eager decode
    # (the chunked path one token at a time) and the graphs must be reusable across requests
    graphs, eager = _graph_and_eager_engines(tokenizer, 1, 512)
    assert graphs.runner is not None and eager.runner is None
    greedy = SamplingParams(temperature=0.0, max_new_tokens=60)
    for seed, n in ((0, 150), (1, 7)):
        ids = prompt_ids(n, seed)
        assert graphs.generate_ids(ids, greedy) == eager.generate_ids(ids, greedy)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefill_graphs_generate_what_eager_prefill_generates(tokenizer):
    # with the fast ops the engine prefills full 128-token chunks after the first through the prefill graphs; greedy
    # output and log-probabilities equal the eager engine's, for a fresh prompt and one continuing a reused prefix
    from dsv4 import ops

    ops.configure("fast", "cuda")
    try:
        graphs, eager = _graph_and_eager_engines(tokenizer, 2, 800)
        assert graphs.prefill is not None and eager.prefill is None
        # prefill_graphs=False (--no-prefill-graphs): the decode graphs without the prefill graphs
        decode_only = Engine(graphs.model, tokenizer, max_context=800, graphs=True, prefill_graphs=False)
        assert decode_only.runner is not None and decode_only.prefill is None
        decode_only = None
        greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
        first = prompt_ids(3 * 128 + 20, 5)
        a, b = graphs.complete(first, greedy, reuse_prefix=True, logprobs=2), eager.complete(first, greedy, logprobs=2)
        # the first token comes from the prefill alone (the same bits); later ones from graph vs eager decode steps
        assert a.token_ids == b.token_ids and a.logprobs[0] == b.logprobs[0]
        assert all(abs(x["logprob"] - y["logprob"]) < 1e-3 for x, y in zip(a.logprobs, b.logprobs))
        second = first + a.token_ids + prompt_ids(2 * 128 + 3, 6)  # full chunks from an unaligned start
        c = graphs.complete(second, greedy, reuse_prefix=True, logprobs=2)
        assert c.cached_tokens == len(first) + len(a.token_ids) - 1
        d = eager.complete(second, greedy, logprobs=2)
        assert c.token_ids == d.token_ids  # (the reused prefix's last tokens came from decode steps in c)
        assert all(abs(x["logprob"] - y["logprob"]) < 1e-3 for x, y in zip(c.logprobs, d.logprobs))
    finally:
        ops.configure("ref", "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_requests_compile_no_kernel_after_load(tokenizer, monkeypatch):
    # the warm-up at load (Engine._warm_up: chunk lengths at position 0, a full chunk and a tail at each power of two,
    # one draw of the race sampler) and the unspecialized eager variants of the indexer's kernels
    # (triton_util.JitTwins) leave nothing to compile: prompts of any length, ending anywhere in the context, start at
    # once
    from dsv4 import ops
    from dsv4.testing import triton_kernels_compiled

    ops.configure("fast", "cuda")
    monkeypatch.setattr(Engine, "USE_RACE", True)  # (the default; set here so that the test keeps checking the race)
    try:
        raw = tiny_config([4, 0, 16], n_mtp=0, vocab=VOCAB, head_dim=128, rope_dim=64, index_dim=64, index_topk=4,
                          max_pos=2048)
        model = random_model(raw, Numerics("reference", torch.bfloat16), seed=3).place(["cuda:0"])
        eng = Engine(model, tokenizer, max_context=2000)
        assert eng.warm_up_positions() == [128, 256, 512, 1024]
        before = triton_kernels_compiled()
        assert sum(before.values()) > 0  # the load compiled them
        # every chunk length at position 0 and after a full chunk (a chunk's window count T is 16 or 32 for some
        # lengths only: the compressor's chunk kernels compiled there; 70th pass), then tails further on
        for n in (*range(1, 257), 777, 1000, 1411, 1900):
            eng.generate_ids(prompt_ids(n, n), SamplingParams(temperature=0, max_new_tokens=2))
        assert eng.fast_race  # temperature and top-p draw through ops.sample_race, compiled at load too
        eng.generate_ids(prompt_ids(9, 9), SamplingParams(temperature=0.8, seed=1, max_new_tokens=3))
        eng.generate_ids(prompt_ids(9, 9), SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_new_tokens=3))
        after = triton_kernels_compiled()
        assert {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)} == {}
    finally:
        ops.configure("ref", "cpu")


# ---- stop strings, log-probabilities, Ctrl-C, raw prompts, prefix reuse ------------------------------


def test_stop_strings_cut_the_stream():
    s = StopStrings(["STOP", "<end>"])
    assert s.push("Hello S") == ("Hello ", False)  # "S" may start STOP: held
    assert s.push("T") == ("", False)
    assert s.push("x <e") == ("STx ", False)
    assert s.push("nd> after") == ("", True)
    assert StopStrings([]).push("STOP") == ("STOP", False)
    t = StopStrings(["ab"])
    assert t.push("xa") == ("x", False) and t.flush() == "a"


def test_stop_string_ends_the_turn(engine, model, tokenizer):
    msgs = [{"role": "user", "content": "Hello"}]
    script = tokenizer.encode("Hello there. STOP here and more text<｜end▁of▁sentence｜>")
    deltas = []
    with forced(model, script, start=len(engine.encode(msgs, "chat"))):
        r = engine.generate(msgs, "chat", params=SamplingParams(temperature=0, max_new_tokens=40),
                            on_delta=deltas.append, stop=["STOP", "never"])
    assert (r.content, r.finish_reason) == ("Hello there. ", "stop")
    assert "".join(d.content for d in deltas) == "Hello there. "
    n = next(i for i in range(len(script)) if "STOP" in tokenizer.decode(script[:i + 1]))
    assert r.token_ids == script[:n + 1]  # generation stopped at the token completing the stop string


def test_logprobs(engine, model):
    msgs = [{"role": "user", "content": "Hi"}]
    r = engine.generate(msgs, params=SamplingParams(temperature=0, max_new_tokens=3), logprobs=4)
    assert len(r.logprobs) == 3 and "logprobs" in r.to_dict()
    seq = engine.encode(msgs)
    for i, entry in enumerate(r.logprobs):
        with torch.no_grad():
            logits = model(torch.tensor([seq]), model.new_state(len(seq)), last_only=True)[0, -1]
        lp = torch.log_softmax(logits.float(), -1)
        assert entry["id"] == r.token_ids[i] == int(lp.argmax())  # greedy: the chosen one is the best
        assert entry["logprob"] == pytest.approx(float(lp.max()), abs=1e-4)
        assert [a["id"] for a in entry["top_logprobs"]] == lp.topk(4).indices.tolist()
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"], abs=1e-6)
        assert entry["token"] == engine.tokenizer.decode([entry["id"]])
        seq.append(entry["id"])
    r0 = engine.generate(msgs, params=SamplingParams(temperature=0, max_new_tokens=2), logprobs=0)
    assert [e["top_logprobs"] for e in r0.logprobs] == [[], []]
    assert "logprobs" not in engine.generate(msgs, params=SamplingParams(max_new_tokens=1)).to_dict()
    with pytest.raises(ValueError, match=r"logprobs must be in \[0, 20\]"):
        engine.complete(seq, GREEDY, logprobs=21)


def test_ctrl_c_returns_the_partial_turn(engine):
    seen = []

    def on_token(token_id):
        seen.append(token_id)
        if len(seen) == 3:
            raise KeyboardInterrupt

    done = engine.complete(prompt_ids(12), SamplingParams(temperature=0, max_new_tokens=50), on_token=on_token)
    assert done.finish_reason == "interrupted" and done.token_ids == seen and len(seen) == 3
    assert engine.state_ids is None  # the state is not trusted for reuse after an interruption
    # the next request starts afresh and equals an uninterrupted run
    assert engine.generate_ids(prompt_ids(12), SamplingParams(temperature=0, max_new_tokens=3)) == seen


def test_raw_prompt_is_not_templated(engine):
    r = engine.generate_raw("Once upon a time", SamplingParams(temperature=0, max_new_tokens=5))
    ids = engine.tokenizer.encode("Once upon a time")
    assert r.usage["prompt_tokens"] == len(ids)
    assert r.token_ids == engine.generate_ids(ids, SamplingParams(temperature=0, max_new_tokens=5))
    assert r.content == engine.tokenizer.decode(r.token_ids) and r.reasoning_content == ""


# a user message of k words whose thinking-mode prompt less its `<think>` ends at a CSA and HCA boundary (16), inside
# a CSA window (18) and at its last row (35)
@pytest.mark.parametrize("words", [12, 14, 31])
def test_thinking_turns_continue_from_the_mark_before_the_dropped_reasoning(model, tokenizer, words):
    # thinking mode renders a reply without its reasoning in the next turn's prompt, which leaves the state after the
    # last prompt's `<｜Assistant｜>` (its `<think>` is not in the next prompt): the engine marked the state there and
    # the next turn continues from the mark, with the logits of a run that never went past it (the same chunks)
    eng = Engine(model, tokenizer, max_context=512)
    msgs = [{"role": "user", "content": "Hello " * words}]
    first = eng.encode(msgs, "thinking")
    mark = len(first) - 1
    assert mark == 16 + 2 * (words == 14) + 19 * (words == 31)
    reply = "Let me think about it. " * 8 + "</think>Hi there!<｜end▁of▁sentence｜>"  # wraps the 16-row ring
    with forced(model, tokenizer.encode(reply), start=len(first)):
        r1 = eng.generate(msgs, "thinking", params=SamplingParams(temperature=0, max_new_tokens=80),
                          reuse_prefix=True)
    assert r1.content == "Hi there!" and r1.finish_reason == "stop" and len(r1.token_ids) > 2 * 16
    assert eng.mark_ids == first[:-1] and eng.state.pos > len(first) + 32
    msgs += [r1.message(), {"role": "user", "content": "How are you?"}]
    second = eng.encode(msgs, "thinking")
    assert second[:mark] == first[:mark] and second[mark] != first[mark]  # the state cannot be extended
    params = SamplingParams(temperature=0, max_new_tokens=6)
    with recorded(model) as got:
        c = eng.complete(second, params, reuse_prefix=True)
    straight = Engine(model, tokenizer, max_context=512)  # the same chunks, never past the mark
    with recorded(model) as want:
        r = straight.complete(second, params, keep=mark)
    assert c.cached_tokens == mark and r.cached_tokens == 0 and c.token_ids == r.token_ids
    assert len(got) == len(want) == 6 and all(torch.equal(a, b) for a, b in zip(got, want))
    # the turn itself goes back to the same mark again (and marks its own prompt less its `<think>`)
    r2 = eng.generate(msgs, "thinking", params=params, reuse_prefix=True)
    assert r2.usage["prompt_tokens_details"]["cached_tokens"] == mark
    fresh = Engine(model, tokenizer, max_context=512).generate(msgs, "thinking", params=params)
    assert r2.token_ids == fresh.token_ids  # (other chunks: the same tokens)
    # the third turn continues from the second's mark
    msgs += [r2.message(), {"role": "user", "content": "Bye."}]
    assert eng.mark_ids == second[:-1]
    r3 = eng.generate(msgs, "thinking", params=params, reuse_prefix=True)
    assert r3.usage["prompt_tokens_details"]["cached_tokens"] == len(second) - 1
    # a request that does not reuse the state drops the mark, whose positions it rewrites; so does Engine.reset
    eng.generate(msgs[:1], "thinking", params=params)
    assert eng.mark_ids is None
    again = eng.generate(msgs, "thinking", params=params, reuse_prefix=True)
    assert again.usage["prompt_tokens_details"]["cached_tokens"] == 0 and again.token_ids == r3.token_ids
    assert eng.mark_ids == eng.encode(msgs, "thinking")[:-1]
    eng.state.reset()  # (a reset behind the engine's back: the mark no longer holds and is not used)
    again = eng.generate(msgs, "thinking", params=params, reuse_prefix=True)
    assert again.usage["prompt_tokens_details"]["cached_tokens"] == 0 and again.token_ids == r3.token_ids
    eng.reset()
    assert eng.mark_ids is None and eng.state_ids == []
    again = eng.generate(msgs, "thinking", params=params, reuse_prefix=True)
    assert again.usage["prompt_tokens_details"]["cached_tokens"] == 0 and again.token_ids == r3.token_ids


def test_a_turn_interrupted_after_its_mark_leaves_the_last_turns_mark(model, tokenizer):
    # `dsv4 -i` drops a turn interrupted by Ctrl-C; the next message's prompt starts with the last finished turn's
    # mark (not with the dropped turn's, which replaced it as the newest), so it continues from there; the engine
    # keeps at most MARKS marks' buffers however many turns run
    eng = Engine(model, tokenizer, max_context=1024)
    params = SamplingParams(temperature=0, max_new_tokens=20)
    msgs = [{"role": "user", "content": "Hello"}]
    r1 = eng.generate(msgs, "thinking", params=params, reuse_prefix=True)
    first = eng.encode(msgs, "thinking")
    msgs.append(r1.message())

    def interrupt(_delta):
        raise KeyboardInterrupt

    dropped = eng.generate(msgs + [{"role": "user", "content": "Tell me a long story."}], "thinking",
                           params=params, reuse_prefix=True, on_delta=interrupt)
    assert dropped.finish_reason == "interrupted"
    assert [len(m[0]) for m in eng._marks] == [len(first) - 1, dropped.usage["prompt_tokens"] - 1]
    msgs.append({"role": "user", "content": "Something else."})
    r2 = eng.generate(msgs, "thinking", params=params, reuse_prefix=True)
    assert r2.usage["prompt_tokens_details"]["cached_tokens"] == len(first) - 1
    fresh = Engine(model, tokenizer, max_context=1024)
    assert r2.token_ids == fresh.generate(msgs, "thinking", params=params).token_ids
    for k in range(4):
        msgs += [eng.generate(msgs, "thinking", params=params, reuse_prefix=True).message(),
                 {"role": "user", "content": f"Turn {k}."}]
        assert len(eng._marks) + len(eng._spare) <= Engine.MARKS


_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city.",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}]
_CALL = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]


@pytest.mark.parametrize("release", RELEASES)
def test_next_turn_prefix_equals_the_tokens_the_next_prompt_shares(tokenizer, release):
    # Engine.next_turn_prefix tokenizes only the prompt's text past where the next turn's rendering parts from it
    # (after a special token); it equals the common prefix of the two whole tokenizations for every conversation shape
    from types import SimpleNamespace

    eng = SimpleNamespace(release=release, tokenizer=tokenizer)
    shapes = {
        "user": [{"role": "user", "content": "Hello there, how are you?"}],
        "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "history": [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B.", "reasoning_content": "R"},
                    {"role": "user", "content": "C"}],
        "tools": [{"role": "system", "content": "Use tools.", "tools": _TOOLS},
                  {"role": "user", "content": "Weather in Paris?"}],
        "tool result": [{"role": "system", "content": "", "tools": _TOOLS}, {"role": "user", "content": "Paris?"},
                        {"role": "assistant", "content": "", "reasoning_content": "Call it.", "tool_calls": _CALL},
                        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
        "markers in the text": [{"role": "user", "content": "see <think>, </think>, <｜User｜> and ｜DSML｜: 日本語 😀"}],
    }
    seen = set()
    for name, msgs in shapes.items():
        for mode in ("thinking", "chat"):
            for effort in (None, *REASONING_EFFORTS[release]):
                if effort is not None and mode == "chat":
                    continue
                text = render_conversation(release, msgs, mode, effort)
                ids = tokenizer.encode(text)
                nxt = msgs + [{"role": "assistant", "content": "x", "reasoning_content": "y"},
                              {"role": "user", "content": "z"}]
                want = _common_prefix(ids, tokenizer.encode(render_conversation(release, nxt, mode, effort)))
                got = Engine.next_turn_prefix(eng, msgs, mode, effort, ids, text)
                assert got == want, (name, mode, effort)
                nxt_text = render_conversation(release, nxt, mode, effort)
                assert reencode(tokenizer, text, ids, nxt_text) == tokenizer.encode(nxt_text)
                assert Engine.next_turn_prefix(eng, msgs, mode, effort, ids) == want
                seen.add(want == len(ids))
    assert seen == {True, False}  # both kinds met: the next prompt extends this one, and it parts before its end


def test_next_turn_prefix_past_the_last_added_token(tokenizer, monkeypatch):
    # texts that part inside plain text after the last added token (no DeepSeek-V4 rendering does): the tokens from
    # that token on are compared, and where no added token precedes the point the whole texts are
    import dsv4.engine as engine_module
    from types import SimpleNamespace

    eng = SimpleNamespace(release="preview", tokenizer=tokenizer)
    for text, nxt in (("<｜User｜>Hi<｜Assistant｜>Hello wor", "<｜User｜>Hi<｜Assistant｜>Hello world<｜end▁of▁sentence｜>"),
                      ("plain text that goes on", "plain text that went on"),
                      ("<｜User｜>a<｜Assistant｜></think>", "<｜User｜>a<｜Assistant｜></think>b")):
        monkeypatch.setattr(engine_module, "render_conversation",
                            lambda release, msgs, mode, effort, text=text, nxt=nxt: nxt if len(msgs) > 1 else text)
        ids = tokenizer.encode(text)
        want = _common_prefix(ids, tokenizer.encode(nxt))
        assert Engine.next_turn_prefix(eng, [{}], "chat", None, ids, text) == want
    assert 0 < want == len(ids)


def test_split_ids_leave_out_added_tokens_inside_others(tokenizer, monkeypatch):
    # an added token inside a longer one ("</think>" in "</think>x") may not end where the text splits: the longer one
    # can match across that point in the next text; without it next_turn_prefix would say 4 where the tokens share 3
    import dsv4.engine as engine_module
    from types import SimpleNamespace

    assert len(tokenizer.split_ids) == 1283  # all of DeepSeek-V4's added tokens
    tok = load_tokenizer()
    tok._tok.add_tokens(["</think>x"])
    assert tok.token_id("</think>") not in tok.split_ids and tok.token_id("</think>x") in tok.split_ids
    text = "<｜User｜>a<｜Assistant｜></think>"
    nxt = text + "x<｜end▁of▁sentence｜><｜User｜>z"
    monkeypatch.setattr(engine_module, "render_conversation",
                        lambda release, msgs, mode, effort: nxt if len(msgs) > 1 else text)
    ids = tok.encode(text)
    want = _common_prefix(ids, tok.encode(nxt))
    assert want == 3 and Engine.next_turn_prefix(SimpleNamespace(release="preview", tokenizer=tok), [{}], "chat",
                                                  None, ids, text) == want


def test_reencode_equals_a_whole_encoding(tokenizer):
    # random text pairs that share a prefix, made of plain text (ASCII, CJK, emoji, newlines), added tokens and broken
    # pieces of them: where reencode answers it is the whole encoding, and it answers for most pairs
    import random

    rng = random.Random(0)
    added = sorted(t.content for t in tokenizer._tok.get_added_tokens_decoder().values())
    markers = ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜end▁of▁sentence｜>", "｜DSML｜"]
    plain = ["Hello", " world", ", and", " 日本語", "😀", "\n\n", " ", "x", "123", "<", "｜", "think>", "<｜Ass", "é"]

    def pieces(n):
        return "".join(rng.choice(markers) if r < 0.3 else rng.choice(added) if r < 0.4 else rng.choice(plain)
                       for r in (rng.random() for _ in range(n)))

    answered = 0
    for _ in range(1500):
        prefix = pieces(rng.randint(0, 30))
        text, new = prefix + pieces(rng.randint(0, 6)), prefix + pieces(rng.randint(0, 12))
        ids = tokenizer.encode(text)
        got = reencode(tokenizer, text, ids, new)
        if got is not None:
            answered += 1
            assert got == tokenizer.encode(new), (text, new)
    assert answered > 1000


def test_chat_prompts_are_tokenized_from_the_last_ones(model, tokenizer, monkeypatch):
    # generate() keeps its last prompt's text and ids and tokenizes only what a chat's next prompt adds
    eng = Engine(model, tokenizer, max_context=512)
    params = SamplingParams(temperature=0, max_new_tokens=4)
    msgs = [{"role": "system", "content": "Be brief. " * 40}, {"role": "user", "content": "Hello"}]
    eng.generate(msgs, "thinking", params=params, reuse_prefix=True)
    lengths = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text: lengths.append(len(text)) or encode(text))
    msgs += [{"role": "assistant", "content": "Hi.", "reasoning_content": "R"}, {"role": "user", "content": "More"}]
    r = eng.generate(msgs, "thinking", params=params, reuse_prefix=True)
    full = render_conversation(eng.release, msgs, "thinking")
    assert r.usage["prompt_tokens"] == len(encode(full)) and eng._last_prompt == (full, encode(full))
    assert lengths and max(lengths) < len(full) // 4  # (short tails only)


def test_common_prefix():
    assert [_common_prefix(a, b) for a, b in [("", ""), ("abc", "abd"), ("abc", "abc"), ("ab", "abc"), ("x", "y"),
                                              ([1, 2, 3], [1, 2]), ([], [1])]] == [0, 2, 3, 2, 0, 2, 0]


def test_a_request_drops_the_marks_past_where_it_writes(model, tokenizer):
    # marks at 30 (A's) and 70 (B's); C goes back to 30 and rewrites the positions from there, so B's mark no longer
    # holds: a prompt that starts with B's 70 tokens continues from 30, with a fresh engine's tokens
    eng = Engine(model, tokenizer, max_context=512)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    a = prompt_ids(40, 11)
    b = a[:30] + prompt_ids(50, 12)
    c = a[:30] + prompt_ids(60, 13)
    eng.complete(a, greedy, reuse_prefix=True, keep=30)
    assert eng.complete(b, greedy, reuse_prefix=True, keep=70).cached_tokens == 30
    assert [len(m[0]) for m in eng._marks] == [30, 70]
    assert eng.complete(c, greedy, reuse_prefix=True).cached_tokens == 30
    assert [len(m[0]) for m in eng._marks] == [30]
    b2 = b[:70] + prompt_ids(5, 14)
    got = eng.complete(b2, greedy, reuse_prefix=True)
    assert got.cached_tokens == 30
    assert got.token_ids == Engine(model, tokenizer, max_context=512).complete(b2, greedy).token_ids


def test_a_chat_turn_whose_reply_renders_otherwise_continues_from_the_whole_last_prompt(model, tokenizer):
    # chat mode marks the state after the whole prompt: a reply sampled as tokens that its text does not encode to
    # ("H", "i" for "Hi") is re-rendered otherwise in the next prompt, which then continues from that mark
    eng = Engine(model, tokenizer, max_context=512)
    msgs = [{"role": "user", "content": "Hello"}]
    first = eng.encode(msgs, "chat")
    script = tokenizer.encode("H") + tokenizer.encode("i") + [EOS]
    assert tokenizer.encode("Hi") != script[:2]
    with forced(model, script, start=len(first)):
        r1 = eng.generate(msgs, "chat", params=GREEDY, reuse_prefix=True)
    assert r1.content == "Hi" and eng.mark_ids == first
    msgs += [r1.message(), {"role": "user", "content": "And?"}]
    second = eng.encode(msgs, "chat")
    assert second[:len(eng.state_ids)] != eng.state_ids  # the state cannot be extended
    r2 = eng.generate(msgs, "chat", params=GREEDY, reuse_prefix=True)
    assert r2.usage["prompt_tokens_details"]["cached_tokens"] == len(first)
    assert r2.token_ids == Engine(model, tokenizer, max_context=512).generate(msgs, "chat", params=GREEDY).token_ids


def test_a_decode_runner_continues_from_a_mark(model, tokenizer):
    # the CPU twin of test_cuda_graphs_continue_from_a_mark: an eager DecodeRunner feeds the marked prompt's last
    # token and the decode steps (its CSA and HCA layers defer their compressors at the positions that close no
    # window), and the next prompt continues from the mark with the tokens of an engine that never went past it
    from dsv4.graphs import DecodeRunner

    eng = Engine(model, tokenizer, max_context=512)
    eng.runner, eng.step_ahead = DecodeRunner(model, eng.state, use_graphs=False), False
    greedy = SamplingParams(temperature=0.0, max_new_tokens=40)
    first = prompt_ids(150, 3)
    mark = len(first) - 1
    a = eng.complete(first, greedy, reuse_prefix=True, keep=mark)
    assert eng.mark_ids == first[:-1] and eng.state.pos > mark + 16
    assert any(b.lagging for b in eng.state.blocks)
    # the prompt's last token went through the runner's decode step: the tokens of a prefill without a mark
    assert a.token_ids == Engine(model, tokenizer, max_context=512).complete(first, greedy).token_ids
    second = first[:-1] + prompt_ids(30, 4)
    b = eng.complete(second, greedy, reuse_prefix=True)
    plain = Engine(model, tokenizer, max_context=512).complete(second, greedy, keep=mark)
    assert b.cached_tokens == mark and b.token_ids == plain.token_ids and plain.cached_tokens == 0


def test_an_interrupted_request_keeps_the_mark(model, tokenizer):
    # Ctrl-C after the mark leaves the state untrusted (state_ids None) but the mark whole: only positions past it
    # were written, so the next prompt that starts with the mark's tokens continues from it
    eng = Engine(model, tokenizer, max_context=512)
    first = prompt_ids(40, 5)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=30)

    def interrupt(_token_id):
        if len(seen) == 20:
            raise KeyboardInterrupt
        seen.append(_token_id)

    seen: list[int] = []
    done = eng.complete(first, greedy, on_token=interrupt, reuse_prefix=True, keep=37)
    assert done.finish_reason == "interrupted" and eng.state_ids is None and eng.mark_ids == first[:37]
    second = first[:37] + prompt_ids(9, 6)

    def broken(*_args, **_kwargs):  # Ctrl-C inside the rewind (or the reset, or a mark): nothing trusts the state then
        raise KeyboardInterrupt

    eng.state.rewind = broken
    done = eng.complete(second, greedy, reuse_prefix=True)
    assert done.finish_reason == "interrupted" and done.token_ids == [] and eng.state_ids is None
    assert eng.mark_ids == first[:37]  # (the mark's own buffers are untouched)
    del eng.state.rewind
    again = eng.complete(second, greedy, reuse_prefix=True)
    plain = Engine(model, tokenizer, max_context=512).complete(second, greedy, keep=37)
    assert again.cached_tokens == 37 and again.token_ids == plain.token_ids
    eng.state.reset = broken
    done = eng.complete(prompt_ids(9, 7), greedy, reuse_prefix=True)
    assert done.finish_reason == "interrupted" and eng.state_ids is None and eng.mark_ids is None
    del eng.state.reset
    # Ctrl-C inside the copies of a mark, two marks held: that mark's buffers are lost, the others hold
    eng.complete(first, greedy, reuse_prefix=True, keep=37)
    eng.complete(second, greedy, reuse_prefix=True, keep=40)
    assert [len(m[0]) for m in eng._marks] == [37, 40]
    eng.state.mark = broken
    third = second[:40] + prompt_ids(6, 8)
    done = eng.complete(third, greedy, reuse_prefix=True, keep=44)
    assert done.finish_reason == "interrupted" and [len(m[0]) for m in eng._marks] == [40]
    del eng.state.mark
    assert len(eng._marks) + len(eng._spare) <= Engine.MARKS
    again = eng.complete(third, greedy, reuse_prefix=True)
    assert again.cached_tokens == 40
    assert again.token_ids == Engine(model, tokenizer, max_context=512).complete(third, greedy, keep=40).token_ids


def test_a_state_reset_behind_the_engine_is_not_extended(model, tokenizer):
    # state_ids holds for the state's epoch only: after a reset the engine did not make (even with the position put
    # back) a prompt that extends state_ids is prefilled whole
    eng = Engine(model, tokenizer, max_context=512)
    first = prompt_ids(30, 15)
    out = eng.complete(first, GREEDY, reuse_prefix=True)
    second = eng.state_ids + prompt_ids(5, 16)
    eng.state.reset()
    eng.state.pos = len(eng.state_ids)
    done = eng.complete(second, GREEDY, reuse_prefix=True)
    assert out.token_ids and done.cached_tokens == 0
    assert done.token_ids == Engine(model, tokenizer, max_context=512).complete(second, GREEDY).token_ids


def test_multi_turn_reuses_the_prefix(model, tokenizer):
    eng = Engine(model, tokenizer, max_context=512)
    reply = "Hi there!<｜end▁of▁sentence｜>"
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    first = eng.encode(msgs, "chat")
    with forced(model, tokenizer.encode(reply), start=len(first)):
        r1 = eng.generate(msgs, "chat", params=GREEDY, reuse_prefix=True)
    assert r1.content == "Hi there!" and r1.usage["prompt_tokens_details"]["cached_tokens"] == 0
    # the state holds the prompt and the reply except its EOS (sampled, never fed)
    assert eng.state_ids == first + tokenizer.encode(reply)[:-1] and eng.state.pos == len(eng.state_ids)
    msgs += [r1.message(), {"role": "user", "content": "How are you?"}]
    second = eng.encode(msgs, "chat")
    assert second[:len(eng.state_ids)] == eng.state_ids  # the encoding extends what was generated
    r2 = eng.generate(msgs, "chat", params=GREEDY, reuse_prefix=True)
    assert r2.usage["prompt_tokens_details"]["cached_tokens"] == len(first) + len(tokenizer.encode(reply)) - 1
    fresh = Engine(model, tokenizer, max_context=512).generate(msgs, "chat", params=GREEDY)
    assert r2.token_ids == fresh.token_ids and fresh.usage["prompt_tokens_details"]["cached_tokens"] == 0
    # a prompt that does not extend the state (or reuse_prefix=False) starts afresh
    r3 = eng.generate(msgs[:2], "chat", params=GREEDY, reuse_prefix=True)
    assert r3.usage["prompt_tokens_details"]["cached_tokens"] == 0
    eng.reset()
    assert eng.state_ids == [] and eng.state.pos == 0


def test_default_max_context():
    assert default_max_context(["cpu"], 1 << 20) == DEFAULT_CONTEXT["cpu"] == 4096
    assert default_max_context(["cuda:0", "cuda:1"], 1 << 20) == DEFAULT_CONTEXT["cuda"] == 32768
    assert default_max_context(["cpu"], 1024) == 1024  # capped by the model


def test_inspect_model_dir_rejects_a_foreign_tokenizer(tmp_path, tokenizer):
    import json
    import shutil

    from dsv4.writer import TINY_CONFIG, checkpoint_config

    (tmp_path / "config.json").write_text(json.dumps(checkpoint_config(TINY_CONFIG, "bf16")))
    shutil.copy(tokenizer.path, tmp_path / "tokenizer.json")
    with pytest.raises(EngineError) as e:
        inspect_model_dir(tmp_path)
    assert str(e.value) == (
        f"checkpoint {tmp_path}: tokenizer.json has 129280 tokens but config.json's vocab_size is 512: the "
        "tokenizer does not belong to this model (ids >= 512 have no embedding); put the model's own "
        "tokenizer.json beside config.json")
    with pytest.raises(EngineError, match="does not exist"):
        inspect_model_dir(tmp_path / "nope")
    with pytest.raises(EngineError, match="is not a directory"):
        inspect_model_dir(tmp_path / "config.json")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_state_generates_what_a_bf16_state_generates(tokenizer):
    # reference numerics in bf16 with the fast ops, prefill graphs and decode graphs: FP4 indexer keys give the bf16
    # state's tokens and log-probabilities bit for bit; FP8 K = V rows as well give its tokens (the Triton prefill
    # attention reads packed rows through another instruction schedule, so its sums may round apart)
    from dsv4 import ops

    raw = tiny_config([4, 0, 16], n_mtp=0, vocab=VOCAB, max_pos=1024, hidden=256, head_dim=128, rope_dim=64,
                      index_dim=64, quantization_config=dict(quant_method="fp8", fmt="e4m3",
                                                             activation_scheme="dynamic", scale_fmt="ue8m0",
                                                             weight_block_size=[128, 128]))
    ops.configure("fast", "cuda")
    try:
        model = random_model(raw, Numerics("reference", torch.bfloat16), seed=2).place(["cuda:0"])
        greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
        ids = prompt_ids(3 * 128 + 20, 7)
        runs = {}
        for kw in ({}, {"keys_fp4": True}, {"kv_fp8": True, "keys_fp4": True}):
            engine = Engine(model, tokenizer, max_context=600, graphs=True, **kw)
            assert engine.prefill is not None and engine.state.keys_packed == bool(kw)
            runs[tuple(kw)] = engine.complete(ids, greedy, logprobs=2)
            engine = None
        plain, keys, both = runs[()], runs[("keys_fp4",)], runs[("kv_fp8", "keys_fp4")]
        assert keys.token_ids == plain.token_ids and keys.logprobs == plain.logprobs
        assert both.token_ids == plain.token_ids
        assert all(abs(x["logprob"] - y["logprob"]) < 1e-3 for x, y in zip(both.logprobs, plain.logprobs))
    finally:
        ops.configure("ref", "cpu")


def test_packed_state_needs_reference_numerics_in_bf16(tokenizer):
    model = random_model(tiny_config([4], n_mtp=0, vocab=VOCAB), Numerics("exact", torch.float32), seed=1)
    with pytest.raises(EngineError, match="an FP8 KV state needs reference numerics with bf16 activations"):
        Engine(model, tokenizer, max_context=64, graphs=False, kv_fp8=True)
    with pytest.raises(EngineError, match="FP4 indexer keys need reference numerics with bf16 activations"):
        Engine(model, tokenizer, max_context=64, graphs=False, keys_fp4=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decode_with_prefix_reuse_logprobs_and_stop(tokenizer):
    # the decode graphs replay over a state whose prefix came from an earlier request
    raw = tiny_config([4, 0, 16], n_mtp=0, vocab=VOCAB, max_pos=1024)
    model = random_model(raw, Numerics("exact", torch.float32), seed=1).place(["cuda:0"])
    graphs = Engine(model, tokenizer, max_context=512, graphs=True)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=20)
    first = prompt_ids(150, 3)
    a = graphs.complete(first, greedy, reuse_prefix=True)
    second = first + a.token_ids + prompt_ids(30, 4)
    b = graphs.complete(second, greedy, reuse_prefix=True, logprobs=2)
    assert b.cached_tokens == len(first) + len(a.token_ids) - 1
    fresh = Engine(model, tokenizer, max_context=512, graphs=False).complete(second, greedy, logprobs=2)
    assert b.token_ids == fresh.token_ids and fresh.cached_tokens == 0
    for x, y in zip(b.logprobs, fresh.logprobs):
        assert x["id"] == y["id"] and abs(x["logprob"] - y["logprob"]) < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_continue_from_a_mark(tokenizer):
    # a prompt marked before its last token (which then runs as a decode step of the graphs), decoded past the mark
    # by graph steps that defer their compressors, then a prompt that leaves it there: the graphs continue from the
    # mark with the tokens of an eager engine that never went past it (the same chunks)
    graphs, eager = _graph_and_eager_engines(tokenizer, 1, 512)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=40)
    first = prompt_ids(150, 3)
    mark = len(first) - 1
    a = graphs.complete(first, greedy, reuse_prefix=True, keep=mark, logprobs=2)
    assert graphs.mark_ids == first[:-1] and graphs.state.pos > mark + 16
    second = first[:-1] + prompt_ids(30, 4)
    b = graphs.complete(second, greedy, reuse_prefix=True, logprobs=2)
    assert b.cached_tokens == mark
    # the marked prompt's last token (a decode step of the graphs) and the continuation from the mark
    for got, prompt in ((a, first), (b, second)):
        want = eager.complete(prompt, greedy, logprobs=2, keep=mark)
        assert got.token_ids == want.token_ids and want.cached_tokens == 0
        for x, y in zip(got.logprobs, want.logprobs):
            assert x["id"] == y["id"] and abs(x["logprob"] - y["logprob"]) < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_steps_ahead_generate_what_host_fed_steps_generate(tokenizer, race_fast):
    # Engine.step_ahead queues each decode step on the device-side sample: the same tokens as feeding each token
    # from the host, greedy and sampled (the race kernel at a temperature, with top-p through its nucleus passes); a
    # step that ran ahead of an EOS leaves that token in the state, and a request reusing the prefix takes it from
    # there
    eng, fresh = _graph_and_eager_engines(tokenizer, 2, 512)
    assert eng.fast_race and fresh.fast_race
    first = prompt_ids(140, 8)
    bare = SamplingParams(temperature=1.0, seed=5, max_new_tokens=24)
    runs = {}
    for ahead in (True, False):
        eng.step_ahead = ahead
        runs[ahead] = [eng.complete(first, p) for p in (SamplingParams(temperature=0.0, max_new_tokens=24),
                                                        SamplingParams(temperature=0.8, top_p=0.9, seed=5,
                                                                       max_new_tokens=24), bare)]
    for a, b in zip(runs[True], runs[False]):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason == "length"
    assert runs[True][2].token_ids == fresh.complete(first, bare).token_ids  # graphs == eager, draw for draw
    greedy = runs[True][0].token_ids
    # an EOS that first appears past the first few tokens and before the last (whose step never runs ahead)
    k = next((i for i in range(4, len(greedy) - 1) if greedy[i] not in greedy[:i]), None)
    assert k is not None, f"no token first appears at 4..{len(greedy) - 2} of {greedy}: pick another seed"
    eng.eos_ids = fresh.eos_ids = frozenset({greedy[k]})
    cached = {}
    for ahead in (True, False):
        eng.step_ahead = ahead
        eng.reset()
        c = eng.complete(first, SamplingParams(temperature=0.0, max_new_tokens=24))
        assert c.token_ids == greedy[:k + 1] and c.finish_reason == "stop"
        second = first + c.token_ids + prompt_ids(20, 9)
        d = eng.complete(second, SamplingParams(temperature=0.0, max_new_tokens=6), reuse_prefix=True)
        cached[ahead] = d.cached_tokens
        assert d.token_ids == fresh.complete(second, SamplingParams(temperature=0.0, max_new_tokens=6)).token_ids
    assert cached == {True: len(first) + k + 1, False: len(first) + k}
