"""The decode step's attention when every row reads its own prompt slot (one sample per prompt, row r
on slot r): the products run on the rows as they are, without gathering queries to slots and scores
back to rows (archon/rollout/kv_cache.py, `rows_read_own_slots`). The same products as the gathered
ones: bitwise equal in float32, and the engine's greedy steps equal the full forward in float64."""

import pytest
import torch
from test_native_rollout import PROMPTS, _assert_greedy_steps_match_full_forward, _fp64_model

from archon.rollout.base import SamplingParams
from archon.rollout.kv_cache import KVCache, LayerKVCache
from archon.rollout.native import NativeRolloutEngine


def _decode_state(rows: int, free: tuple[int, ...]):
    """A one-layer cache of `rows` rows and slots (one sample place each), row r on slot r except the
    free rows; prompts of different lengths prefilled, suffixes filled, float32."""
    g = torch.Generator().manual_seed(0)
    H, Hkv, D, max_prompt = 4, 2, 16, 12
    cache = KVCache(1, rows, rows, 1, max_prompt, 10, torch.device("cpu"))
    layer = cache.layer(0)
    lens = torch.randint(1, max_prompt + 1, (rows,), generator=g)
    T = int(lens.sum())
    cache.begin_prefill(torch.arange(rows), lens)
    layer.attention(
        torch.randn(T, H, D, generator=g), torch.randn(T, Hkv, D, generator=g), torch.randn(T, Hkv, D), 0.25
    )
    busy = [r for r in range(rows) if r not in free]
    cache.start_rows(busy, busy, [0] * len(busy))
    layer.suffix_k.normal_(generator=g)
    layer.suffix_v.normal_(generator=g)
    positions = torch.randint(0, 8, (rows,), generator=g)
    step = (torch.randn(rows, H, D, generator=g), torch.randn(rows, Hkv, D, generator=g), torch.randn(rows, Hkv, D))
    return cache, layer, lens, positions, step, busy


@pytest.mark.parametrize("free", [(), (2, 4)])
@pytest.mark.parametrize("sinks, window", [(None, None), (torch.tensor([0.5, -1.0, 0.0, 2.0]), 3)])
def test_own_slot_products_equal_the_gathered_ones(free, sinks, window):
    cache, layer, lens, positions, step, busy = _decode_state(6, free)
    outputs = []
    for own_slots in (True, False):
        cache.begin_decode(6, 6, positions, lens, int(lens.max()), int(positions.max()) + 1)
        assert cache.rows_read_own_slots  # the step qualifies; the second pass takes the gathers instead
        cache.rows_read_own_slots = own_slots
        outputs.append(layer.attention(*step, 0.25, sinks, window)[busy])
    assert torch.equal(outputs[0], outputs[1])


def test_a_row_on_another_rows_slot_takes_the_gathers():
    cache = KVCache(1, 4, 4, 1, 4, 4, torch.device("cpu"))
    cache.start_rows([0, 1, 2], [0, 2, 1], [0, 0, 0])
    cache.begin_decode(3, 3, torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=torch.long), 1, 1)
    assert not cache.rows_read_own_slots
    cache.release_rows([1, 2], [2, 1], [0, 0])
    cache.start_rows([1], [1], [0])
    cache.begin_decode(2, 2, torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.long), 1, 1)
    assert cache.rows_read_own_slots


@pytest.mark.usefixtures("float64_math")
@pytest.mark.parametrize("model_type", ["qwen3", "deepseek_v32"])
def test_one_sample_per_prompt_decodes_as_the_full_forward(tiny_checkpoint, model_type, monkeypatch):
    """Plain attention (Qwen3) and a sparse-attention indexer's selection (DeepSeek-V3.2): the greedy
    steps of one sample per prompt, through the own-slot products, are the full forward's (sinks and
    sliding windows: the products above)."""
    model = _fp64_model(tiny_checkpoint(model_type, num_hidden_layers=2)).eval()
    own_slot_steps = []
    attention = LayerKVCache._decode_attention

    def counted(layer, *args, **kwargs):
        own_slot_steps.append(layer.cache.rows_read_own_slots)
        return attention(layer, *args, **kwargs)

    monkeypatch.setattr(LayerKVCache, "_decode_attention", counted)
    samples = NativeRolloutEngine(model).generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0))
    assert own_slot_steps and all(own_slot_steps)
    _assert_greedy_steps_match_full_forward(model, samples)
