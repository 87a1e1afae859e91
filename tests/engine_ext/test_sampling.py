from __future__ import annotations

import pytest
import torch

from engine_ext.errors import InvalidRequestError
from engine_ext.sampling import Sampler, SamplingParams
from tests.helpers import make_engine


def logits(batch: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return 3.0 * torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed))


def gens(seed: int, n: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def test_greedy_is_argmax():
    x = logits(6)
    out = Sampler().sample(x, [SamplingParams(temperature=0.0)] * 6, [None] * 6)
    assert out == x.argmax(-1).tolist()


def test_mixed_batch_greedy_rows_stay_argmax():
    x = logits(4)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.5)]
    out = Sampler(seed=0).sample(x, params, [None] * 4)
    assert out[0] == int(x[0].argmax()) and out[2] == int(x[2].argmax())
    assert all(0 <= t < 50 for t in out)


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    x = logits(1, vocab=200) / 3  # flat enough that samples vary
    p = [SamplingParams(temperature=1.0)]
    sampler = Sampler()

    def draw(seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return [sampler.sample(x, p, [g])[0] for _ in range(30)]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)
    assert len(set(draw(1))) > 3  # really sampling, not argmax


def test_sampler_default_seed_is_reproducible():
    x = logits(1, vocab=200) / 3
    p = [SamplingParams(temperature=1.0)]
    a, b = Sampler(seed=5), Sampler(seed=5)
    assert [a.sample(x, p, [None])[0] for _ in range(20)] == [b.sample(x, p, [None])[0] for _ in range(20)]


def test_sampling_follows_the_distribution():
    x = torch.log(torch.tensor([[0.7, 0.2, 0.1, 0.0]]))
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    s = Sampler()
    for _ in range(2000):
        counts[s.sample(x, [SamplingParams(temperature=1.0)], [g])[0]] += 1
    freq = counts / counts.sum()
    assert counts[3] == 0
    assert abs(freq[0] - 0.7) < 0.05 and abs(freq[1] - 0.2) < 0.05


def test_top_k_one_equals_greedy():
    x = logits(8, vocab=100, seed=3)
    params = [SamplingParams(temperature=2.0, top_k=1)] * 8
    for seed in range(5):
        assert Sampler().sample(x, params, gens(seed, 8)) == x.argmax(-1).tolist()


def test_tiny_top_p_equals_greedy():
    x = logits(8, vocab=100, seed=4)
    params = [SamplingParams(temperature=2.0, top_p=1e-6)] * 8
    for seed in range(5):
        assert Sampler().sample(x, params, gens(seed, 8)) == x.argmax(-1).tolist()


def test_top_k_restricts_support():
    x = logits(1, vocab=100, seed=5)
    top3 = set(torch.topk(x[0], 3).indices.tolist())
    g = torch.Generator().manual_seed(0)
    seen = {Sampler().sample(x, [SamplingParams(temperature=2.0, top_k=3)], [g])[0] for _ in range(300)}
    assert seen == top3


def test_top_p_keeps_smallest_prefix_reaching_mass():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = Sampler._probs(probs.log(), SamplingParams(top_p=0.8))
    torch.testing.assert_close(kept, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)
    kept = Sampler._probs(probs.log(), SamplingParams(top_p=0.81))
    torch.testing.assert_close(kept, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)


@pytest.mark.parametrize("kwargs,param", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": ("a", "b", "c", "d", "e")}, "stop"),
    ({"stop": ("",)}, "stop"),
])
def test_invalid_params_raise(kwargs, param):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param


def test_greedy_property():
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.01).greedy


def test_engine_seeded_generation(llama_dir):
    engine = make_engine(llama_dir, num_blocks=16)
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog")

    def run(seed, **kw):
        return engine.generate(ids, SamplingParams(max_tokens=20, temperature=1.5, seed=seed,
                                                   ignore_eos=True, **kw)).output_token_ids

    assert run(1) == run(1)
    assert run(1) != run(2)
    greedy = engine.generate(ids, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)).output_token_ids
    assert run(3, top_k=1) == greedy
    assert run(4, top_p=1e-6) == greedy
