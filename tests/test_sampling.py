"""logits -> probabilities: greedy, temperature, top-k, top-p, min-p against hand computation."""

from __future__ import annotations

import math

import pytest
import torch

from treespec.core.sampling import ARGMAX_CHUNK, SamplingConfig, first_argmax, logits_to_probs, process

from _tiny import one_thread  # noqa: F401  (autouse fixture)

F64 = torch.float64
# probabilities 0.1, 0.2, 0.3, 0.4 as logits
LOGITS = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=F64).log()


def close(a, b):
    return torch.allclose(a, torch.as_tensor(b, dtype=a.dtype), atol=1e-12, rtol=0)


def test_temperature_one_is_softmax():
    assert close(logits_to_probs(LOGITS, temperature=1.0), [0.1, 0.2, 0.3, 0.4])


def test_temperature_scales_logits():
    # T = 0.5 squares the odds: [1, 4, 9, 16] / 30
    assert close(logits_to_probs(LOGITS, temperature=0.5), [1 / 30, 4 / 30, 9 / 30, 16 / 30])
    # T = 2 takes square roots
    s = [math.sqrt(k) for k in (1, 2, 3, 4)]
    assert close(logits_to_probs(LOGITS, temperature=2.0), [x / sum(s) for x in s])


def test_greedy_is_one_hot_with_ties_to_lowest_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0], [0.0, -1.0, 2.0, 2.0]])
    out = logits_to_probs(logits, temperature=0.0)
    assert out.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0]]
    # top-k / top-p / min-p do not matter for greedy
    out2 = logits_to_probs(logits, temperature=0.0, top_k=2, top_p=0.5, min_p=0.5)
    assert torch.equal(out, out2)
    assert SamplingConfig().greedy and not SamplingConfig(temperature=1).greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_greedy_ties_go_to_the_lowest_id_on_a_real_vocabulary(dtype):
    """A vocabulary as wide as SmolLM2's runs the CPU's vectorized reduction: ties inside one
    vector, across vector lanes and far apart still go to the first maximal id."""
    torch.manual_seed(0)
    vocab = 49152
    pairs = [(8, 9), (15, 16), (17, 40000), (0, vocab - 1), (4097, 4096 + 64), (31, 33)]
    logits = torch.randn(len(pairs), vocab, dtype=dtype)
    for row, (a, b) in enumerate(pairs):
        logits[row, a] = logits[row, b] = 10.0
    out = logits_to_probs(logits, temperature=0.0)
    assert out.argmax(-1).tolist() == [min(p) for p in pairs]
    assert torch.equal(out.sum(-1), torch.ones(len(pairs), dtype=out.dtype))


@pytest.mark.parametrize("vocab", [49152, 151936, 8 * ARGMAX_CHUNK + 1, 8 * ARGMAX_CHUNK - 1, 40])
def test_first_argmax_is_max_indices(vocab):
    """The chunked argmax greedy decoding uses gives ``max(-1).indices`` exactly: random rows,
    ties inside a chunk, across a chunk boundary, in the padded last chunk, rows of -inf, NaN
    (the first NaN, as max), and leading dims."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=g)
    c = min(ARGMAX_CHUNK, vocab // 2)
    ties = [(1, 2), (c - 1, c), (vocab - 2, vocab - 1), (0, vocab - 1), (c + 3, vocab - 1)]
    for row, (a, b) in enumerate(ties):
        x[row, b] = x[row, a] = 50.0
    x[5] = -math.inf
    x[6, vocab // 2] = x[6, vocab - 1] = math.nan
    x[7, vocab - 1] = math.inf
    for t in (x, x[:, None].expand(9, 2, vocab), x.double()):
        assert torch.equal(first_argmax(t), t.max(-1, keepdim=True).indices)


def test_top_k():
    assert close(logits_to_probs(LOGITS, temperature=1.0, top_k=2), [0, 0, 3 / 7, 4 / 7])
    assert close(logits_to_probs(LOGITS, temperature=1.0, top_k=1), [0, 0, 0, 1])
    # k >= V and k = 0 disable it
    assert close(logits_to_probs(LOGITS, temperature=1.0, top_k=4), [0.1, 0.2, 0.3, 0.4])
    assert close(logits_to_probs(LOGITS, temperature=1.0, top_k=9), [0.1, 0.2, 0.3, 0.4])
    assert close(logits_to_probs(LOGITS, temperature=1.0, top_k=0), [0.1, 0.2, 0.3, 0.4])


def test_top_k_keeps_every_token_tied_with_the_kth():
    """Like HF's TopKLogitsWarper: tokens equal to the k-th largest logit are all kept."""
    logits = torch.tensor([1.0, 2.0, 2.0, 0.0], dtype=F64)
    assert close(logits_to_probs(logits, temperature=1.0, top_k=1), [0, 0.5, 0.5, 0])


def test_top_p():
    # sorted 0.4, 0.3, 0.2, 0.1; keep a token while the mass before it is < top_p
    assert close(logits_to_probs(LOGITS, temperature=1.0, top_p=0.3), [0, 0, 0, 1])
    assert close(logits_to_probs(LOGITS, temperature=1.0, top_p=0.65), [0, 0, 3 / 7, 4 / 7])
    assert close(logits_to_probs(LOGITS, temperature=1.0, top_p=0.75), [0, 2 / 9, 3 / 9, 4 / 9])
    assert close(logits_to_probs(LOGITS, temperature=1.0, top_p=0.95), [0.1, 0.2, 0.3, 0.4])
    assert close(logits_to_probs(LOGITS, temperature=1.0, top_p=1.0), [0.1, 0.2, 0.3, 0.4])


def test_top_p_ties_keep_the_lower_id_first():
    logits = torch.zeros(4, dtype=F64)  # uniform: mass before token j (stable order) is j / 4
    assert close(logits_to_probs(logits, temperature=1.0, top_p=0.3), [0.5, 0.5, 0, 0])


def test_min_p():
    # floor = min_p * max prob = min_p * 0.4
    assert close(logits_to_probs(LOGITS, temperature=1.0, min_p=0.6), [0, 0, 3 / 7, 4 / 7])  # floor 0.24
    assert close(logits_to_probs(LOGITS, temperature=1.0, min_p=0.4), [0, 2 / 9, 3 / 9, 4 / 9])  # floor 0.16
    assert close(logits_to_probs(LOGITS, temperature=1.0, min_p=0.2), [0.1, 0.2, 0.3, 0.4])  # floor 0.08


def test_order_is_temperature_top_k_top_p_min_p():
    # top-k first: [3/7, 4/7]; then top-p 0.5 keeps only 4/7 (top-p first would keep two)
    assert close(logits_to_probs(LOGITS, temperature=1.0, top_k=2, top_p=0.5), [0, 0, 0, 1])
    # temperature first: T = 0.5 gives [1, 4, 9, 16] / 30; top-p 0.6 keeps 16/30 and 9/30
    assert close(logits_to_probs(LOGITS, temperature=0.5, top_p=0.6), [0, 0, 9 / 25, 16 / 25])
    # top-p then min-p: top-p 0.75 -> [0, 2/9, 3/9, 4/9]; min-p 0.6 -> floor 0.267 drops 2/9
    assert close(logits_to_probs(LOGITS, temperature=1.0, top_p=0.75, min_p=0.6), [0, 0, 3 / 7, 4 / 7])


def test_batch_shapes_and_dtypes():
    x = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(0))
    out = logits_to_probs(x, temperature=0.7, top_k=5, top_p=0.9, min_p=0.05)
    assert out.shape == (2, 3, 11) and out.dtype == torch.float32
    assert torch.allclose(out.sum(-1), torch.ones(2, 3), atol=1e-6)
    assert ((out > 0).sum(-1) <= 5).all()
    assert logits_to_probs(x.double()).dtype == F64
    assert logits_to_probs(x.bfloat16()).dtype == torch.float32
    assert torch.equal(process(x, SamplingConfig(0.7, 5, 0.9, 0.05)), out)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-0.1), r"temperature must be a finite number >= 0 \(0 = greedy\), got -0.1"),
        (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
        (dict(temperature=float("inf")), "temperature must be a finite number >= 0"),
        (dict(temperature=True), "temperature must be a finite number >= 0 .*got True"),
        (dict(temperature="1"), "temperature must be a finite number >= 0"),
        (dict(top_k=-1), r"top_k must be an int >= 0 \(0 disables it\), got -1"),
        (dict(top_k=2.0), "top_k must be an int >= 0"),
        (dict(top_k=True), "top_k must be an int >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\] \(1 disables it\), got 0.0"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_p=float("nan")), r"top_p must be in \(0, 1\]"),
        (dict(min_p=-0.1), r"min_p must be in \[0, 1\) \(0 disables it\), got -0.1"),
        (dict(min_p=1.0), r"min_p must be in \[0, 1\)"),
        (dict(min_p=False), r"min_p must be in \[0, 1\)"),
    ],
)
def test_invalid_sampling_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)
    with pytest.raises(ValueError, match=match):
        logits_to_probs(LOGITS, **kwargs)


def test_integer_logits_are_rejected():
    with pytest.raises(TypeError, match="logits must be a floating-point tensor, got torch.int64"):
        logits_to_probs(torch.tensor([1, 2, 3]))
