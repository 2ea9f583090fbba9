"""``ramtorch.HostCache``, the KV cache paged in host RAM: the same tokens and bitwise the same
logits as transformers' ``DynamicCache`` (greedy and beam search, ``generate`` and a hand-written
decoding loop, plain and under ``ramtorch.offload``), pages that grow one at a time, batches and
their edits, prompt reuse, chunked prefill (within 1e-5 of a one-shot prefill), clear errors, and
the ordering of the CUDA path's copies, checked on the CPU with fake streams and events. Two GPU
tests run the side stream itself and bound the device memory of a decode step."""

from __future__ import annotations

import copy
import inspect
import subprocess
import sys

import pytest
import ramtorch
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from ramtorch._kv_cache import _runs

transformers = pytest.importorskip("transformers")

VOCAB = 97


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The models are tiny: one intra-op thread runs them many times faster than several that
    contend for a busy machine's cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _config(arch: str, **overrides: object) -> object:
    common: dict = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        initializer_range=0.2,  # a random model that does not repeat one token forever
    )
    common.update(overrides)
    return {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,  # a sliding window (4096) longer than the tests
    }[arch](**common)


def tiny(arch: str = "llama", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = _config(arch)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def _cache_kw(model: torch.nn.Module, cache: object) -> dict:
    """The cache under the name this transformers' ``generate``/``forward`` takes it by
    (``cache`` from 5.24, ``past_key_values`` before)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}


def generate(model: torch.nn.Module, ids: torch.Tensor, cache: object = None, mask=None, **kw):
    extra = _cache_kw(model, cache) if cache is not None else {}
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids) if mask is None else mask,
        do_sample=False,
        return_dict_in_generate=True,
        pad_token_id=0,
        **extra,
        **kw,
    )


@pytest.mark.parametrize("offloaded", [False, True], ids=["plain", "offloaded"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_greedy_generate_is_bitwise_dynamic_cache(arch, offloaded):
    model = tiny(arch)
    if offloaded:
        ramtorch.offload(model, device="cpu")
    ids = torch.randint(1, VOCAB, (3, 7))
    want = generate(model, ids, max_new_tokens=10, output_logits=True)
    cache = ramtorch.HostCache(page_tokens=4)
    got = generate(model, ids, cache, max_new_tokens=10, output_logits=True)
    assert torch.equal(got.sequences, want.sequences)
    assert torch.equal(torch.stack(got.logits), torch.stack(want.logits))
    assert len(set(want.sequences[0, 7:].tolist())) > 1  # the check is not vacuous
    s = cache.stats()
    assert s["tokens"] == 7 + 9 and s["pages"] == 3 * 4  # 16 tokens: 4 pages of keys a layer
    assert s["prefetch_hits"] > 0 and s["passes"] == 10
    if offloaded:
        assert model._ramtorch_streamer.stats()["prefetch_hits"] > 0


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_sliding_window_layers_are_kept_whole_and_masked(arch):
    """Past a sliding window of 4 tokens DynamicCache drops old tokens where HostCache keeps them
    and the mask leaves them out: the same tokens, the logits equal up to rounding (the softmax
    runs over more, masked, positions)."""
    extra = dict(use_sliding_window=True, max_window_layers=1) if arch == "qwen2" else {}
    cfg = _config(arch, sliding_window=4, **extra)
    torch.manual_seed(10)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(1, VOCAB, (2, 7))
    ref = transformers.DynamicCache(config=model.config)  # what generate() makes by default
    want = generate(model, ids, ref, max_new_tokens=8, output_logits=True)
    cache = ramtorch.HostCache(page_tokens=3)
    got = generate(model, ids, cache, max_new_tokens=8, output_logits=True)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=1e-5, atol=1e-5)
    assert ref.layers[-1].keys.shape[-2] < cache.get_seq_length(2) == 14  # the window was in effect


def test_it_is_taken_under_the_name_past_key_values_too():
    """``past_key_values=`` (transformers before 5.24, deprecated but working from 5.24 on)."""
    import warnings

    model = tiny("llama", seed=15)
    ids = torch.randint(1, VOCAB, (2, 6))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, pad_token_id=0)
    kw.update(return_dict_in_generate=True, output_logits=True)
    want = model.generate(ids, **kw)
    cache = ramtorch.HostCache(page_tokens=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        got = model.generate(ids, past_key_values=cache, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert torch.equal(torch.stack(got.logits), torch.stack(want.logits))
    assert cache.get_seq_length() == 6 + 4


def test_beam_search_is_bitwise_dynamic_cache():
    """Beam search reorders the cache every step (``reorder_cache``) and expands it."""
    model = tiny("llama", seed=1)
    ids = torch.randint(1, VOCAB, (2, 6))
    kw = dict(max_new_tokens=6, num_beams=3, num_return_sequences=2, output_scores=True)
    want = generate(model, ids, **kw)
    got = generate(model, ids, ramtorch.HostCache(page_tokens=3), **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert torch.equal(got.sequences_scores, want.sequences_scores)


def test_left_padded_batch_is_bitwise_dynamic_cache():
    model = tiny("qwen2", seed=2)
    ids = torch.randint(1, VOCAB, (4, 8))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[3, :5] = 0
    ids[mask == 0] = 0
    want = generate(model, ids, mask=mask, max_new_tokens=6, output_logits=True)
    got = generate(
        model, ids, ramtorch.HostCache(page_tokens=5), mask=mask, max_new_tokens=6, output_logits=True
    )
    assert torch.equal(got.sequences, want.sequences)
    assert torch.equal(torch.stack(got.logits), torch.stack(want.logits))


@torch.no_grad()
def _forced(
    model: torch.nn.Module, cache: object, prompt: torch.Tensor, tokens: torch.Tensor
) -> torch.Tensor:
    """The logits of a teacher-forced decoding loop: the prompt, then one token a step."""
    out = model(prompt, use_cache=True, **_cache_kw(model, cache))
    rows = [out.logits[:, -1]]
    for k in range(tokens.shape[1]):
        out = model(tokens[:, k : k + 1], use_cache=True, **_cache_kw(model, cache))
        rows.append(out.logits[:, -1])
    return torch.stack(rows)


@pytest.mark.parametrize(("arch", "lookahead"), [("llama", 0), ("llama", 2), ("mistral", 1), ("qwen2", 5)])
def test_a_decoding_loop_is_bitwise_dynamic_cache(arch, lookahead):
    """Any lookahead: none (each layer copied when asked for), up to more than the layers."""
    model = tiny(arch, seed=3)
    prompt = torch.randint(1, VOCAB, (2, 5))
    tokens = torch.randint(1, VOCAB, (2, 9))
    ref = transformers.DynamicCache()
    want = _forced(model, ref, prompt, tokens)
    cache = ramtorch.HostCache(page_tokens=2, lookahead=lookahead)
    got = _forced(model, cache, prompt, tokens)
    assert torch.equal(got, want)
    s = cache.stats()
    assert s["prefetch_hits"] + s["prefetch_misses"] == 9 * 3  # each decode step takes 3 layers
    assert (s["prefetch_hits"] == 0) == (lookahead == 0)
    assert cache.get_seq_length() == ref.get_seq_length() == 14
    for i in range(3):
        keys, values = cache.host_tensors(i)
        assert torch.equal(keys, ref.layers[i].keys) and torch.equal(values, ref.layers[i].values)


def test_the_loop_may_start_in_inference_mode_and_go_on_outside_it():
    model = tiny("llama", seed=4)
    prompt = torch.randint(1, VOCAB, (1, 6))
    tokens = torch.randint(1, VOCAB, (1, 4))
    ref, cache = transformers.DynamicCache(), ramtorch.HostCache(page_tokens=4)
    with torch.inference_mode():
        a = model(prompt, use_cache=True, **_cache_kw(model, ref)).logits
        b = model(prompt, use_cache=True, **_cache_kw(model, cache)).logits
    assert torch.equal(a, b)
    with torch.no_grad():
        a = model(tokens, use_cache=True, **_cache_kw(model, ref)).logits
        b = model(tokens, use_cache=True, **_cache_kw(model, cache)).logits
    assert torch.equal(a, b)


def test_pages_grow_in_extents_and_stay_in_place():
    """Appends of several sizes across page boundaries: the pages fill in order, new pages are
    added without moving the old ones, carved from extents that double (so that the pages lie
    back to back and cross in few copies), each layer gets back exactly ``torch.cat``'s result,
    and the device holds the ring (two layers' tokens, a quarter more), not the cache."""
    torch.manual_seed(5)
    layers = 8
    cache = ramtorch.HostCache(page_tokens=3, lookahead=1)
    ref = [[torch.empty(2, 2, 0, 8), torch.empty(2, 2, 0, 4)] for _ in range(layers)]
    first_page = None
    for n in (1, 5, 2, 7, 3, 1):
        for layer in range(layers):
            k, v = torch.randn(2, 2, n, 8), torch.randn(2, 2, n, 4)  # values of another head dim
            ref[layer] = [torch.cat([ref[layer][0], k], dim=-2), torch.cat([ref[layer][1], v], dim=-2)]
            keys, values = cache.update(k.transpose(1, 2).contiguous().transpose(1, 2), v, layer)
            assert torch.equal(keys, ref[layer][0]) and torch.equal(values, ref[layer][1])
            assert keys.stride() == ref[layer][0].stride() and values.stride() == ref[layer][1].stride()
        if first_page is None:
            first_page = cache.layers[0].key_pages[0].data_ptr()
        tokens = ref[0][0].shape[2]
        assert cache.get_seq_length() == tokens
        assert len(cache.layers[0].key_pages) == len(cache.layers[-1].value_pages) == -(-tokens // 3)
    assert cache.layers[0].key_pages[0].data_ptr() == first_page
    s = cache.stats()
    per_token = 2 * 2 * (8 + 4) * 4  # batch 2, 2 heads, key dim 8 and value dim 4, fp32
    assert s["tokens"] == 19 and s["pages"] == layers * 7
    # extents of 1, 1, 2 and 4 pages (each as many pages as the layer held, at least those
    # needed): 8 pages carved, 7 used, one spare
    assert s["host_bytes"] == layers * 8 * 3 * per_token
    assert len(_runs(cache.layers[0].key_pages)) == len(_runs(cache.layers[-1].value_pages)) == 4
    joined = torch.cat(_runs(cache.layers[0].key_pages))
    assert torch.equal(joined, torch.cat(cache.layers[0].key_pages))
    # lookahead + 1 buffers of at most 18 old tokens + a quarter, rounded to pages (24)
    assert len(cache._slots) == 2 and s["device_bytes"] <= 2 * (24 * per_token + 256)
    assert s["device_bytes"] < layers * 19 * per_token / 2
    assert s["prefetch_hits"] > 0
    for layer in range(layers):
        keys, values = cache.host_tensors(layer)
        assert torch.equal(keys, ref[layer][0]) and torch.equal(values, ref[layer][1])


_OPS = st.one_of(
    st.tuples(st.just("append"), st.integers(0, 7)),
    st.tuples(st.just("crop"), st.integers(0, 6)),
    st.tuples(st.just("reorder"), st.permutations([0, 1, 2])),
    st.tuples(st.just("repeat"), st.integers(1, 2)),
    st.tuples(st.just("select"), st.lists(st.integers(0, 2), min_size=1, max_size=3)),
)


@settings(max_examples=80, deadline=None)
@example(page=2, lookahead=1, layers=2, ops=[("append", 3), ("crop", 6), ("repeat", 2), ("append", 1)], dev=0)
@example(page=2, lookahead=1, layers=2, ops=[("append", 5), ("reorder", [2, 0, 1]), ("append", 3)], dev=600)
@example(  # the device copies dropped by a new batch order, made again past the tokens held, refilled
    page=2,
    lookahead=0,
    layers=2,
    ops=[("append", 5), ("reorder", [2, 0, 1]), ("append", 3), ("append", 2), ("append", 1)],
    dev=10**6,
)
@example(
    page=3, lookahead=0, layers=2, ops=[("append", 4), ("crop", 3), ("append", 4), ("append", 1)], dev=2000
)
@given(
    page=st.integers(1, 5),
    lookahead=st.integers(0, 3),
    layers=st.integers(1, 4),
    ops=st.lists(_OPS, min_size=1, max_size=10),
    dev=st.sampled_from([0, 600, 2000, 10**6]),
)
def test_any_sequence_of_appends_and_edits_matches_plain_tensors(page, lookahead, layers, ops, dev):
    """Appends of any size (none included), crops, beam reorders, repeats and selections of the
    batch, in any order, with none, some or all of the first pages copied on the device
    (``device_bytes``): every layer returns, and holds, what plain tensors edited the same way
    hold (DynamicCache's own operations on them)."""
    g = torch.Generator().manual_seed(page * 100 + lookahead * 10 + layers)
    cache = ramtorch.HostCache(page_tokens=page, lookahead=lookahead, device_bytes=dev)
    ref = [(torch.empty(3, 2, 0, 4), torch.empty(3, 2, 0, 2)) for _ in range(layers)]
    for op, arg in ops:
        b = ref[0][0].shape[0]
        if op == "append":
            for i in range(layers):
                k, v = torch.randn(b, 2, arg, 4, generator=g), torch.randn(b, 2, arg, 2, generator=g)
                ref[i] = (torch.cat([ref[i][0], k], dim=-2), torch.cat([ref[i][1], v], dim=-2))
                keys, values = cache.update(k, v, i)
                assert torch.equal(keys, ref[i][0]) and torch.equal(values, ref[i][1])
            continue
        if op == "crop":
            cache.crop(-arg)
            cut = max(0, ref[0][0].shape[2] - arg)
            ref = [(k[:, :, :cut], v[:, :, :cut]) for k, v in ref]
        elif op == "reorder" and b == 3:
            cache.reorder_cache(torch.tensor(arg))
            ref = [(k[list(arg)], v[list(arg)]) for k, v in ref]
        elif op == "repeat" and b * arg <= 6:
            cache.batch_repeat_interleave(arg)
            ref = [(k.repeat_interleave(arg, 0), v.repeat_interleave(arg, 0)) for k, v in ref]
        elif op == "select" and max(arg) < b:
            cache.batch_select_indices(torch.tensor(arg))
            ref = [(k[arg], v[arg]) for k, v in ref]
    assert cache.get_seq_length() == ref[0][0].shape[2]
    assert cache.stats()["mirror_bytes"] <= dev
    for i in range(layers):
        if i < len(cache.layers) and cache.layers[i].is_initialized:
            keys, values = cache.host_tensors(i)
            assert torch.equal(keys, ref[i][0]) and torch.equal(values, ref[i][1])


def test_first_pages_kept_on_the_device_do_not_cross_again():
    """With ``device_bytes`` for every page, a decode step copies no old token to the device:
    only the new tokens cross (back, to the pages); with room for some pages, the step moves
    the tokens past them. Greedy decoding stays bitwise that of DynamicCache."""
    model = tiny("llama", seed=7)
    ids = torch.randint(3, model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(2))
    want = generate(model, ids, transformers.DynamicCache(), max_new_tokens=6).sequences
    moved = {}
    for dev in (0, 1 << 12, 1 << 30):
        cache = ramtorch.HostCache(page_tokens=4, device_bytes=dev)
        assert torch.equal(generate(model, ids, cache, max_new_tokens=6).sequences, want)
        s = cache.stats()
        assert s["mirror_bytes"] <= dev
        moved[dev] = (s["kv_bytes_per_step"], s["mirrored_tokens"], s["tokens"])
    layer = cache.layers[0]
    kb, vb = layer.token_bytes()
    new_token = len(cache.layers) * (kb + vb)
    per_step, mirrored, tokens = moved[1 << 30]
    assert mirrored == tokens and per_step == new_token  # the step's new token only
    assert moved[0][0] > moved[1 << 12][0] > per_step


def test_kv_bytes_per_step_counts_what_one_decode_step_moves():
    model = tiny("llama", seed=6)
    cache = ramtorch.HostCache(page_tokens=4)
    prompt = torch.randint(1, VOCAB, (2, 6))
    tokens = torch.randint(1, VOCAB, (2, 3))
    assert cache.kv_bytes_per_step == 0
    _forced(model, cache, prompt, tokens)
    # per layer and token: 2 (batch) x 2 (KV heads) x 16 (head dim) x 4 bytes, keys and values
    per_token = 2 * 2 * 16 * 4 * 2
    # the last step read 8 old tokens of each of the 3 layers and wrote 1 new token back; its
    # last layer also queued the next step's first layer (9 tokens)
    assert cache.kv_bytes_per_step == (2 * 8 + 9) * per_token + 3 * per_token
    assert cache.stats()["d2h_bytes"] == 3 * 9 * per_token


def test_batch_selection_and_repetition_match_dynamic_cache():
    """``batch_select_indices`` and ``batch_repeat_interleave`` (used by contrastive search and
    by callers that fork sequences) reshape the pages' batch as DynamicCache reshapes its own."""
    model = tiny("llama", seed=11)
    prompt = torch.randint(1, VOCAB, (3, 5))
    tokens = torch.randint(1, VOCAB, (3, 2))
    ref, cache = transformers.DynamicCache(), ramtorch.HostCache(page_tokens=4)
    _forced(model, ref, prompt, tokens)
    _forced(model, cache, prompt, tokens)
    for op, arg in (("batch_select_indices", torch.tensor([2, 0])), ("batch_repeat_interleave", 2)):
        getattr(ref, op)(arg)
        getattr(cache, op)(arg)
        for i in range(3):
            assert torch.equal(cache.host_tensors(i)[1], ref.layers[i].values)
    more = torch.randint(1, VOCAB, (4, 3))
    with torch.no_grad():
        a = model(more, use_cache=True, **_cache_kw(model, ref)).logits
        b = model(more, use_cache=True, **_cache_kw(model, cache)).logits
    assert torch.equal(a, b)


@pytest.mark.parametrize("device_bytes", [0, 1 << 30], ids=["pages", "device-copies"])
def test_a_prompt_cache_copied_for_several_continuations(device_bytes):
    """transformers' prompt-reuse pattern: fill a cache with a prompt once, ``copy.deepcopy`` it
    for each continuation. The copies have pages of their own (and device copies of their own,
    made anew from them) and give DynamicCache's tokens."""
    model = tiny("llama", seed=13)
    prompt = torch.randint(1, VOCAB, (1, 9))
    ours, ref = ramtorch.HostCache(page_tokens=4, device_bytes=device_bytes), transformers.DynamicCache()
    with torch.no_grad():
        model(prompt, use_cache=True, **_cache_kw(model, ours))
        model(prompt, use_cache=True, **_cache_kw(model, ref))
    for suffix in ([5, 7], [11, 13, 17]):
        ids = torch.cat([prompt, torch.tensor([suffix])], dim=1)
        mine = copy.deepcopy(ours)
        assert mine.layers[0].key_pages[0].data_ptr() != ours.layers[0].key_pages[0].data_ptr()
        got = generate(model, ids, mine, max_new_tokens=5, output_logits=True)
        want = generate(model, ids, copy.deepcopy(ref), max_new_tokens=5, output_logits=True)
        assert torch.equal(got.sequences, want.sequences)
        assert torch.equal(torch.stack(got.logits), torch.stack(want.logits))
        assert mine.get_seq_length() == ids.shape[1] + 4 and ours.get_seq_length() == 9


def test_crop_and_reset():
    model = tiny("llama", seed=7)
    prompt = torch.randint(1, VOCAB, (2, 7))
    tokens = torch.randint(1, VOCAB, (2, 3))
    ref, cache = transformers.DynamicCache(), ramtorch.HostCache(page_tokens=3)
    _forced(model, ref, prompt, tokens)
    _forced(model, cache, prompt, tokens)
    ref.crop(-4)
    cache.crop(-4)
    assert cache.get_seq_length() == 6 and len(cache.layers[0].key_pages) == 2
    for i in range(3):
        assert torch.equal(cache.host_tensors(i)[0], ref.layers[i].keys)
    # decoding goes on from the cropped cache as from the cropped DynamicCache
    more = torch.randint(1, VOCAB, (2, 4))
    with torch.no_grad():
        a = model(more, use_cache=True, **_cache_kw(model, ref)).logits
        b = model(more, use_cache=True, **_cache_kw(model, cache)).logits
    assert torch.equal(a, b)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.stats()["pages"] == 0
    with torch.no_grad():
        c = model(prompt, use_cache=True, **_cache_kw(model, cache)).logits
        d = model(prompt, use_cache=True, **_cache_kw(model, transformers.DynamicCache())).logits
    assert torch.equal(c, d)


def test_chunked_prefill_matches_one_shot_prefill():
    """Chunks of 5 tokens give the one-shot prefill's cache and logits up to rounding (the
    chunks' matrix products have other shapes); generation goes on from it."""
    model = tiny("llama", seed=8)
    ids = torch.randint(1, VOCAB, (2, 23))
    cache = ramtorch.HostCache(page_tokens=4)
    ref = transformers.DynamicCache()
    with torch.no_grad():
        want = model(ids, use_cache=True, **_cache_kw(model, ref)).logits[:, -1]
        got = ramtorch.prefill(model, ids, cache, chunk_tokens=5).logits[:, -1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert cache.get_seq_length() == 23 and cache.stats()["passes"] >= 4
    for i in range(3):
        torch.testing.assert_close(cache.host_tensors(i)[0], ref.layers[i].keys, rtol=1e-5, atol=1e-5)
    # prefill all but the last token, then generate: the tokens of a plain generate
    plain = generate(model, ids, max_new_tokens=8)
    cache = ramtorch.HostCache(page_tokens=4)
    with torch.no_grad():
        ramtorch.prefill(
            model, ids[:, :-1], cache, chunk_tokens=6, attention_mask=torch.ones_like(ids[:, :-1])
        )
    chunked = generate(model, ids, cache, max_new_tokens=8)
    assert torch.equal(chunked.sequences, plain.sequences)


def test_chunked_prefill_of_a_left_padded_batch_then_generate():
    """Positions come from the attention mask, as generate() counts them: a padded batch
    prefilled in chunks goes on to generate DynamicCache's tokens."""
    model = tiny("qwen2", seed=17)
    ids = torch.randint(1, VOCAB, (3, 14))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :9] = 0
    ids[mask == 0] = 0
    want = generate(model, ids, mask=mask, max_new_tokens=6, output_logits=True)
    cache = ramtorch.HostCache(page_tokens=4)
    with torch.no_grad():
        ramtorch.prefill(model, ids[:, :-1], cache, chunk_tokens=5, attention_mask=mask[:, :-1])
    got = generate(model, ids, cache, mask=mask, max_new_tokens=6, output_logits=True)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=1e-5, atol=1e-5)


def test_wrong_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="page_tokens must be at least 1"):
        ramtorch.HostCache(page_tokens=0)
    with pytest.raises(TypeError, match="lookahead must be an int"):
        ramtorch.HostCache(lookahead=1.5)
    cache = ramtorch.HostCache(page_tokens=2)
    k = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match=r"key_states are torch.float32 but value_states torch.float64"):
        cache.update(k, k.double(), 0)
    with pytest.raises(ValueError, match=r"value_states is on meta; HostCache serves CPU and CUDA"):
        cache.update(k, torch.empty(1, 2, 3, 8, device="meta"), 0)
    with pytest.raises(
        ValueError, match=r"must be \[batch, heads, tokens, head_dim\], got shape \(2, 3, 8\)"
    ):
        cache.update(k[0], k[0], 0)
    with pytest.raises(TypeError, match="layer_idx must be an int"):
        cache.update(k, k, "0")
    with pytest.raises(ValueError, match="layer_idx must be non-negative"):
        cache.update(k, k, -1)
    cache.update(k, k, 0)
    cache.update(k, k, 1)
    with pytest.raises(ValueError, match="layer 1 after layer 1: layers must be updated in order"):
        cache.update(k, k, 1)
    cache.update(k, k, 2)
    with pytest.raises(ValueError, match=r"key_states are torch.float64 but the layer holds torch.float32"):
        cache.update(k.double(), k.double(), 0)
    with pytest.raises(ValueError, match="states of batch 2, 2 heads.*do not match the layer's batch 1"):
        cache.update(k.repeat(2, 1, 1, 1), k.repeat(2, 1, 1, 1), 0)
    # a pass that stops midway leaves the layers unequal: the next pass says so
    cache.update(k, k, 0)  # a pass that stops after layer 0
    cache.update(k, k, 0)  # the next pass (layer 0 starts passes)
    with pytest.raises(
        RuntimeError, match="layer 1 holds 3 tokens but layer 0 held 6 when this pass began.*midway"
    ):
        cache.update(k, k, 1)
    with pytest.raises(RuntimeError, match="detached from autograd"):
        ramtorch.HostCache().update(k.requires_grad_(), k, 0)
    with pytest.raises(ValueError, match="pass a negative number"):
        cache.crop(2)
    with pytest.raises(IndexError, match="layer 7 holds nothing"):
        cache.host_tensors(7)
    model = tiny("llama")
    ids = torch.randint(1, VOCAB, (1, 4))
    with pytest.raises(ValueError, match="chunk_tokens must be a positive int"):
        ramtorch.prefill(model, ids, ramtorch.HostCache(), chunk_tokens=0)
    with pytest.raises(ValueError, match="attention_mask covers 3 tokens.*must cover 4"):
        ramtorch.prefill(model, ids, ramtorch.HostCache(), chunk_tokens=2, attention_mask=torch.ones(1, 3))
    with pytest.raises(
        ValueError, match=r"position_ids must be a tensor covering the 0 cached tokens.*\(1, 3\)"
    ):
        ramtorch.prefill(model, ids, ramtorch.HostCache(), chunk_tokens=2, position_ids=torch.zeros(1, 3))


def test_offload_takes_it_whatever_the_transformers_release(monkeypatch):
    """``offload`` refuses transformers' own host-RAM cache before 5.20 (a stream race); HostCache
    has no such race and passes on any release."""
    import sys

    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.17.0")
    model = ramtorch.offload(tiny("llama", seed=14), device="cpu")
    ids = torch.randint(1, VOCAB, (1, 5))
    with torch.no_grad():
        out = model(ids, use_cache=True, **_cache_kw(model, ramtorch.HostCache()))
    assert out.logits.shape == (1, 5, VOCAB)


def test_the_package_serves_it_lazily():
    import subprocess
    import sys

    code = "import sys, ramtorch; assert 'transformers' not in sys.modules; ramtorch.HostCache; print('ok')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stdout.strip() == "ok", r.stderr[-2000:]
    assert {"HostCache", "prefill"} <= set(dir(ramtorch))
    with pytest.raises(AttributeError, match="no attribute 'HostCach'"):
        ramtorch.HostCach  # noqa: B018


@pytest.mark.gpu
def test_side_stream_paging_is_bitwise_dynamic_cache_on_cuda():
    """On CUDA the pages are page-locked, copied ahead on a side stream, and the device holds only
    the ring: the same tokens and logits as DynamicCache, plain and under ramtorch.offload."""
    ref = tiny("llama", seed=9).to(torch.bfloat16).cuda()
    ids = torch.randint(1, VOCAB, (2, 40), device="cuda")
    want = generate(ref, ids, max_new_tokens=24, output_logits=True)
    cache = ramtorch.HostCache(page_tokens=16, lookahead=2)
    got = generate(ref, ids, cache, max_new_tokens=24, output_logits=True)
    assert torch.equal(got.sequences, want.sequences)
    assert torch.equal(torch.stack(got.logits), torch.stack(want.logits))
    assert cache.layers[0].key_pages[0].is_pinned()
    s = cache.stats()
    assert s["prefetch_hits"] >= 3 * 22 and s["prefetch_misses"] <= 2
    # the ring: lookahead + 1 buffers, each at most the largest layer's 63 old tokens and a
    # quarter, rounded to pages (80)
    per_token = 2 * 2 * 16 * 2 * 2
    assert s["device_bytes"] <= 3 * (80 * per_token + 256)
    ours = copy.deepcopy(ref).cpu()
    ramtorch.offload(ours, device="cuda")
    got = generate(ours, ids, ramtorch.HostCache(page_tokens=16), max_new_tokens=24, output_logits=True)
    assert torch.equal(got.sequences, want.sequences)
    with pytest.raises(ValueError, match="this cache computes on cuda:0"):
        cache.update(
            torch.randn(2, 2, 1, 16, dtype=torch.bfloat16), torch.randn(2, 2, 1, 16, dtype=torch.bfloat16), 0
        )


@pytest.mark.gpu
def test_first_pages_on_the_device_on_cuda():
    """On CUDA, with room for some first pages on the device (read by the side stream's copies,
    refilled after a beam reorder): the same tokens and logits as DynamicCache, in greedy
    decoding and in beam search, and in greedy decoding fewer bytes than with none."""
    ref = tiny("llama", seed=9).to(torch.bfloat16).cuda()
    ids = torch.randint(1, VOCAB, (2, 40), device="cuda")
    for kw in ({}, {"num_beams": 3}):
        want = generate(ref, ids, max_new_tokens=24, output_logits=True, **kw)
        moved = []
        for device_bytes in (0, 40_000):
            cache = ramtorch.HostCache(page_tokens=16, lookahead=2, device_bytes=device_bytes)
            got = generate(ref, ids, cache, max_new_tokens=24, output_logits=True, **kw)
            assert torch.equal(got.sequences, want.sequences)
            assert torch.equal(torch.stack(got.logits), torch.stack(want.logits))
            assert cache.stats()["mirror_bytes"] <= device_bytes
            moved.append(cache.stats()["h2d_bytes"])
        if not kw:  # (beam search reorders the batch each step: the copies are made anew each step)
            assert moved[1] < moved[0]


@pytest.mark.gpu
def test_a_decode_step_holds_the_ring_not_the_cache_on_cuda():
    """16 layers of 200 cached tokens: a decode step's peak device memory above what it started
    with (the ring, one layer's assembled keys and values, activations) stays under half the
    cache, which lives in host RAM."""
    torch.manual_seed(12)
    cfg = _config("llama", num_hidden_layers=16)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval().to(torch.bfloat16).cuda()
    ids = torch.randint(1, VOCAB, (2, 200), device="cuda")
    cache = ramtorch.HostCache(page_tokens=16)
    with torch.no_grad():
        model(ids, use_cache=True, **_cache_kw(model, cache))
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model(ids[:, :1], use_cache=True, **_cache_kw(model, cache))
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    whole = 16 * 200 * 2 * 2 * 16 * 2 * 2  # layers x tokens x batch x KV heads x dim x bf16 x (K, V)
    assert cache.stats()["host_bytes"] >= whole
    assert peak < whole / 2, (peak, whole)


class _FakeCuda:
    """Streams and events that only keep vector clocks, so that the CUDA path of HostCache runs
    on the CPU (its copies are plain ones there) and every ordering it relies on can be checked:
    an op on stream A happens before an op on stream B when B waited, directly or not, on an
    event recorded after it, or the host waited for one before queueing B. ``done`` says what a
    query of an event answers: the GPU finished everything (and the host knows), or nothing
    yet."""

    def __init__(self, done: bool) -> None:
        self.done = done
        self.clock: dict[str, dict[str, int]] = {s: {} for s in ("compute", "side", "host")}
        self.current = ["compute"]
        self.ops: list[tuple[str, str, object, dict[str, int]]] = []  # kind, stream, what, stamp

    def tick(self, stream: str) -> dict[str, int]:
        if stream != "host":  # work the host queues now starts after what the host saw finish
            self.join(stream, self.clock["host"])
        vc = self.clock[stream]
        vc[stream] = vc.get(stream, 0) + 1
        return dict(vc)

    def join(self, stream: str, other: dict[str, int]) -> None:
        vc = self.clock[stream]
        for k, v in other.items():
            vc[k] = max(vc.get(k, 0), v)

    def op(self, kind: str, what: object, stream: str | None = None) -> None:
        stream = stream or self.current[-1]
        self.ops.append((kind, stream, what, self.tick(stream)))

    @staticmethod
    def before(a: tuple, b: tuple) -> bool:
        """Whether op ``a`` happens before op ``b``."""
        return a[3][a[1]] <= b[3].get(a[1], 0)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import contextlib

        fake = self

        class Stream:
            def __init__(self, name: str) -> None:
                self.name = name

            def wait_event(self, event: Event) -> None:
                fake.join(self.name, event.stamp)

        class Event:
            def __init__(self) -> None:
                self.stamp: dict[str, int] = {}

            def record(self, stream: Stream) -> None:
                self.stamp = fake.tick(stream.name)

            def query(self) -> bool:
                if fake.done:
                    fake.join("host", self.stamp)
                return fake.done

            def synchronize(self) -> None:
                fake.join("host", self.stamp)

        streams = {"compute": Stream("compute"), "side": Stream("side")}

        @contextlib.contextmanager
        def stream(s: Stream):
            fake.current.append(s.name)
            try:
                yield
            finally:
                fake.current.pop()

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(ramtorch.HostCache, "_side_stream", lambda self: streams["side"])
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: streams[fake.current[-1]])
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)


@pytest.mark.parametrize("done", [False, True], ids=["gpu-behind", "gpu-done"])
@pytest.mark.parametrize("lookahead", [1, 2])
@pytest.mark.parametrize("device_bytes", [0, 1 << 20], ids=["host-pages", "device-pages"])
def test_the_cuda_path_orders_every_copy_by_events(monkeypatch, lookahead, done, device_bytes):
    """The CUDA path run on the CPU with fake streams and events (greedy and beam search, which
    edits the pages on the host): each read of a ring buffer happens after the copy that filled
    it; a copy into a buffer, after the reads of what it held; a copy of a layer's pages, after
    the copies of its tokens into them; a change of the pages on the host, after every copy that
    touched them. And the tokens are DynamicCache's, also with device copies of the first pages
    (which the assembly reads in place of the ring's rows)."""
    fake = _FakeCuda(done)
    fake.install(monkeypatch)
    monkeypatch.setattr(ramtorch.HostCache, "_cuda", lambda self: True)
    cache = ramtorch.HostCache(page_tokens=3, lookahead=lookahead, device_bytes=device_bytes)

    def slot_of(t: torch.Tensor) -> int:
        """The ring buffer ``t`` (a view of keys or of values) lies in."""
        p = t.data_ptr()
        inside = [s.buf is not None and 0 <= p - s.buf.data_ptr() < s.buf.numel() for s in cache._slots]
        return inside.index(True)

    copy_pages, assemble = ramtorch.HostCache._copy_pages, ramtorch.HostCache._assemble
    append, quiesce = ramtorch.HostCache._append, ramtorch.HostCache._quiesce

    def logged_copy(self, layer, keys, values, mirrored=0):
        fake.op("fill", (slot_of(keys), self.layers.index(layer)))
        return copy_pages(self, layer, keys, values, mirrored)

    mirrored_reads = []

    def logged_assemble(self, old, new, dev_pages, mirrored, n_old):
        mirrored_reads.append(mirrored)
        if old is not None:
            fake.op("read", slot_of(old))
        if mirrored:
            owner = [
                i
                for i, x in enumerate(self.layers)
                if dev_pages is x.dev_key_pages or dev_pages is x.dev_value_pages
            ]
            fake.op("device pages read", owner[0])
        return assemble(self, old, new, dev_pages, mirrored, n_old)

    refill_mirror = ramtorch.HostCache._refill_mirror

    def logged_refill(self, layer, keys, values):
        if not layer.mirrored and layer.dev_key_pages:
            fake.op("device pages refill", self.layers.index(layer))
        return refill_mirror(self, layer, keys, values)

    def logged_append(self, layer, keys, values):
        fake.op("append", self.layers.index(layer))
        return append(self, layer, keys, values)

    def logged_quiesce(self):
        quiesce(self)
        fake.op("host edit", None, stream="host")

    monkeypatch.setattr(ramtorch.HostCache, "_copy_pages", logged_copy)
    monkeypatch.setattr(ramtorch.HostCache, "_assemble", logged_assemble)
    monkeypatch.setattr(ramtorch.HostCache, "_refill_mirror", logged_refill)
    monkeypatch.setattr(ramtorch.HostCache, "_append", logged_append)
    monkeypatch.setattr(ramtorch.HostCache, "_quiesce", logged_quiesce)

    model = tiny("llama", seed=16)
    ids = torch.randint(1, VOCAB, (2, 5))
    for kw in (dict(max_new_tokens=6), dict(max_new_tokens=4, num_beams=2)):
        ref = generate(model, ids, **kw)
        got = generate(model, ids, cache, **kw)
        assert torch.equal(got.sequences, ref.sequences)
        cache.reset()
    assert (max(mirrored_reads) > 0) == bool(device_bytes)
    ops = fake.ops
    if device_bytes:  # beam search's new batch orders make the device pages anew
        assert {"device pages read", "device pages refill"} <= {k for k, *_ in ops}
    kinds = {k for k, *_ in ops}
    assert {"fill", "read", "append", "host edit"} <= kinds
    assert {s for k, s, *_ in ops if k == "fill"} == {"side"}
    for i, b in enumerate(ops):
        earlier = ops[:i]
        if b[0] == "read":  # after the copy that filled the buffer
            fill = [a for a in earlier if a[0] == "fill" and a[2][0] == b[2]][-1]
            assert fake.before(fill, b), (fill, b)
        if b[0] == "fill":  # after the reads of the buffer, and the appends to the layer
            for a in earlier:
                if (a[0] == "read" and a[2] == b[2][0]) or (a[0] == "append" and a[2] == b[2][1]):
                    assert fake.before(a, b), (a, b)
        if b[0] == "device pages read":  # after their last refill (a side-stream copy)
            refills = [a for a in earlier if a[0] == "device pages refill" and a[2] == b[2]]
            assert not refills or fake.before(refills[-1], b), (refills[-1], b)
        if b[0] == "device pages refill":  # after the reads of what they held
            for a in earlier:
                if a[0] == "device pages read" and a[2] == b[2]:
                    assert fake.before(a, b), (a, b)
        if b[0] == "host edit":  # after every copy that read or wrote the pages
            for a in earlier:
                if a[0] in ("fill", "append"):
                    assert fake.before(a, b), (a, b)


def test_generate_prefills_in_chunks_into_the_host_cache():
    """``generate(..., prefill_chunk_size=n)`` (transformers' own chunked prefill) fills a
    HostCache a chunk a pass, so that a long prompt never has its whole cache on the device;
    the tokens are DynamicCache's."""
    model = tiny("llama", seed=3)
    ids = torch.randint(3, VOCAB, (2, 23), generator=torch.Generator().manual_seed(1))
    want = generate(model, ids, transformers.DynamicCache(), max_new_tokens=5).sequences
    cache = ramtorch.HostCache(page_tokens=4)
    got = generate(model, ids, cache, max_new_tokens=5, prefill_chunk_size=8).sequences
    assert torch.equal(got, want)
    assert cache.stats()["passes"] == 3 + 4  # 23 tokens in chunks of 8, then 4 decode steps


def test_layers_the_device_pages_hold_whole_take_no_buffer_and_no_prefetch(monkeypatch):
    """A one-pass prefill gives the device pages to the first layers whole (as ``generate()``'s
    prefill does): at the next step those layers are assembled from the device pages with no
    ring buffer and no copy, and the prefetch passes over them to the next layer that needs a
    copy, so that the link works while they compute (no misses). The tokens stay
    DynamicCache's."""
    model = tiny("llama", seed=9)
    layers = model.config.num_hidden_layers
    ids = torch.randint(3, VOCAB, (1, 16), generator=torch.Generator().manual_seed(4))
    want = generate(model, ids, transformers.DynamicCache(), max_new_tokens=2).sequences
    probe = ramtorch.HostCache(page_tokens=4)
    generate(model, ids, probe, max_new_tokens=1)
    kb, vb = probe.layers[0].token_bytes()
    copied: list[int] = []
    copy_in = ramtorch.HostCache._copy_in

    def logged(self, idx, layer, exclude):
        copied.append(idx)
        return copy_in(self, idx, layer, exclude)

    monkeypatch.setattr(ramtorch.HostCache, "_copy_in", logged)
    # room for the prompt's 16 tokens of one layer: the first layer's, whole
    cache = ramtorch.HostCache(page_tokens=4, lookahead=1, device_bytes=16 * (kb + vb))
    got = generate(model, ids, cache, max_new_tokens=2).sequences  # the prefill and one step
    assert torch.equal(got, want)
    assert layers > 2 and cache.layers[0].mirror_rows() == 16 and cache.layers[1].mirror_rows() == 0
    # the step: the first layer read from the device pages, never copied; then the prefetch of
    # the next step's first layer, which now holds a token past its pages (that token only)
    assert copied == [*range(1, layers), 0]
    s = cache.stats()
    assert s["prefetch_misses"] == 0 and s["prefetch_hits"] == layers
    assert s["h2d_bytes"] == (layers - 1) * 16 * (kb + vb) + (kb + vb)


def test_the_plan_sizes_the_cache_and_what_a_step_moves(tmp_path):
    """``plan_kv_cache``: the cache's bytes from the config, the device copies the budget leaves
    room for after the weights, and the bytes a decode step moves, against a HostCache given
    those device bytes (its measured step bytes are the prediction's, or a page a layer more,
    where a copied page is not yet full)."""
    from ramtorch.plan import kv_cache_bytes_per_token, plan_kv_cache, predict

    model = tiny("llama", seed=8)
    cfg = model.config
    per_token = kv_cache_bytes_per_token(cfg, torch.float32)
    heads = cfg.num_key_value_heads
    assert per_token == 2 * cfg.num_hidden_layers * heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    ids = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(3))
    context = 14  # the last decode step's old tokens: 10 of prompt and 4 generated before it
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    page_bytes = per_token // cfg.num_hidden_layers * 4
    ring = 3 * per_token // cfg.num_hidden_layers * context  # lookahead 1: two layers, and one assembled
    for room in (None, ring + 3 * page_bytes, ring + 10 * per_token * context):
        pred = predict(model, None if room is None else weights + room + (1 << 20), 16)
        kv = plan_kv_cache(pred, model, context, page_tokens=4)
        assert kv.kv_bytes == per_token * context and kv.kv_device_bytes % page_bytes == 0
        assert (kv.kv_device_bytes > 0) == (room is not None)
        cache = ramtorch.HostCache(page_tokens=4, lookahead=0, device_bytes=kv.kv_device_bytes)
        generate(model, ids, cache, max_new_tokens=6)
        got = cache.stats()["kv_bytes_per_step"]
        assert kv.kv_bytes_per_step <= got <= kv.kv_bytes_per_step + cfg.num_hidden_layers * page_bytes
        if room is None:
            assert kv.kv_device_bytes == 0 and got == kv.kv_bytes_per_step == kv.kv_bytes + per_token
        if room is not None and room >= kv.kv_bytes:
            assert kv.kv_place == "gpu" and got == kv.kv_bytes_per_step == per_token
    with pytest.raises(ValueError, match="context must be a positive int"):
        plan_kv_cache(pred, model, 0)
    config = tmp_path / "config.json"
    cfg.to_json_file(config)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ramtorch",
            "plan",
            "--model",
            str(config),
            "--context",
            "4096",
            "--budget",
            "1GiB",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "KV cache at 4096 tokens x 1:" in out and "decode step:" in out


def test_a_cache_for_an_offloaded_model_takes_what_its_budget_leaves():
    """``HostCache.for_model``: the device bytes of a live offloaded model's budget, after its
    weights, the ring and the layer being assembled, as the plan predicts them for that model
    and budget; none without a budget; and decoding with it stays DynamicCache's."""
    from ramtorch import _kv_sizes
    from ramtorch.plan import plan_kv_cache, predict

    model = tiny("llama", seed=8)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    per_token = _kv_sizes.bytes_per_token(model.config, torch.float32)
    budget = weights + (1 << 20) + 40 * per_token
    want = plan_kv_cache(predict(copy.deepcopy(model), budget, 16), model, 30, page_tokens=4).kv_device_bytes
    ids = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(5))
    ref = generate(model, ids, transformers.DynamicCache(), max_new_tokens=6).sequences
    ours = copy.deepcopy(model)
    ramtorch.offload(ours, device="cpu", gpu_budget=budget)
    cache = ramtorch.HostCache.for_model(ours, 30, page_tokens=4)
    assert cache.device_bytes == want > 0 and cache.context == 30
    assert torch.equal(generate(ours, ids, cache, max_new_tokens=6).sequences, ref)
    # with a context, the ring's buffers are what the plan counts: the 30 tokens' keys and
    # values, no more (for_model's copies hold these layers whole: they took no buffer)
    sized = ramtorch.HostCache(page_tokens=4, context=30)
    assert torch.equal(generate(ours, ids, sized, max_new_tokens=6).sequences, ref)
    kb, vb = sized.layers[0].token_bytes()
    ring = [s.buf.numel() for s in sized._slots if s.buf is not None]
    assert ring and all(n == -(-30 * kb // 256) * 256 + 30 * vb for n in ring)
    plain = copy.deepcopy(model)
    ramtorch.offload(plain, device="cpu")
    assert ramtorch.HostCache.for_model(plain, 30).device_bytes == 0
    assert ramtorch.HostCache.for_model(model, 30).device_bytes == 0  # not offloaded
    with pytest.raises(ValueError, match="context must be a positive int"):
        ramtorch.HostCache.for_model(ours, 0)
    with pytest.raises(ValueError, match="page_tokens must be at least 1"):
        ramtorch.HostCache.for_model(ours, 30, page_tokens=0)
    with pytest.raises(ValueError, match="context must be at least 1"):
        ramtorch.HostCache(context=0)


def test_device_copy_bytes_leaves_the_ring_room_and_takes_whole_pages():
    from ramtorch._kv_sizes import device_copy_bytes

    # 2 layers, 8 bytes a token (4 a layer), 10 tokens, pages of 2 tokens (8 bytes), lookahead 1:
    # the ring and the assembled layer take 3 x 40 bytes.
    assert device_copy_bytes(120, 8, 2, 10, 2, 1) == 0
    assert device_copy_bytes(120 + 7, 8, 2, 10, 2, 1) == 0
    assert device_copy_bytes(120 + 8, 8, 2, 10, 2, 1) == 8
    assert device_copy_bytes(120 + 8 * 100, 8, 2, 10, 2, 1) == 8 * 10  # at most the whole cache
    assert device_copy_bytes(-5, 8, 2, 10, 2, 1) == 0
