"""Reference answers for conformance checks: plain greedy decoding, the target's exact law of
its first tokens by enumeration, and a chi-square p-value (no scipy)."""

from __future__ import annotations

import itertools

import torch

from treespec.targets.loader import Target


@torch.inference_mode()
def plain_greedy(target: Target, ids: torch.Tensor, max_new_tokens: int) -> list[int]:
    """Argmax decoding of ``target`` after ``ids`` (LongTensor[P]), a full forward per token;
    stops at the target's EOS and includes it, as the engine does."""
    seq = ids.tolist()
    eos = set(target.eos_token_ids)
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = int(target.model(torch.tensor([seq], device=target.device)).logits[0, -1].argmax())
        seq.append(token)
        out.append(token)
        if token in eos:
            break
    return out


@torch.inference_mode()
def first_tokens_law(target: Target, ids: torch.Tensor, n: int = 2) -> torch.Tensor:
    """FloatTensor[V ** n] (float64): P(the first ``n`` generated tokens) under ``target`` at
    T = 1, enumerated exactly over every prefix (index = the tokens read as base-V digits).
    A sequence that reaches EOS early stops there: its remaining digits are the EOS id again,
    so the law sums to 1 for any EOS."""
    v, eos = target.vocab_size, set(target.eos_token_ids)
    law = torch.zeros(v ** n, dtype=torch.float64)
    for prefix in itertools.product(range(v), repeat=n - 1):
        prob, seq, stopped = 1.0, ids.tolist(), None
        for t in prefix:
            if stopped is not None:
                break
            p = target.model(torch.tensor([seq], device=target.device)).logits[0, -1].double().softmax(-1)
            prob *= float(p[t])
            seq.append(t)
            stopped = t if t in eos else None
        if stopped is not None:
            if all(t == stopped for t in prefix[prefix.index(stopped):]):
                index = sum(t * v ** (n - 1 - i) for i, t in enumerate(prefix + (stopped,)))
                law[index] += prob
            continue
        last = target.model(torch.tensor([seq], device=target.device)).logits[0, -1].double().softmax(-1).cpu()
        base = sum(t * v ** (n - 1 - i) for i, t in enumerate(prefix))   # the index of (prefix, 0)
        law[base: base + v] += prob * last
    return law


def chisquare_pvalue(counts: torch.Tensor, law: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """(p-value, degrees of freedom) of Pearson's chi-square test of ``counts`` (FloatTensor[K],
    observed outcomes) against ``law`` (FloatTensor[K], probabilities). Cells expected fewer
    than ``min_expected`` times are pooled into one; an outcome of probability 0 that was
    observed gives p = 0."""
    counts, law = counts.double(), law.double()
    if bool(((law <= 0) & (counts > 0)).any()):
        return 0.0, 0
    expected = law * counts.sum()
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    dof = int(obs.numel()) - 1
    if dof < 1:
        return 1.0, 0
    stat = float(((obs - exp) ** 2 / exp).sum())
    pvalue = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                           torch.tensor(stat / 2, dtype=torch.float64)))
    return pvalue, dof
