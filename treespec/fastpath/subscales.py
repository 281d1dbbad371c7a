"""Block scales as small integers times one scale per 256 k values: GGUF K-quants' own form.

A GGUF Q4_K super-block of 256 values of a row stores one fp16 scale ``D``, one fp16 ``Dmin`` and,
for each of its 8 blocks of 32, 6-bit integers ``sc`` and ``mc``: the block's values are
``(D sc) q - (Dmin mc)``. Q6_K stores one fp16 ``D`` and a signed 8-bit ``sc`` per 16 values.
:func:`treespec.fastpath.kernels.pack_blocks` finds each block's fp32 ``d = D sc`` and ``m``
from the dequantized weights and stores them as floats: 8 bytes a column and block, 2 bits a
weight, where the GGUF file spends a quarter of that. This module finds the shared form again
from those floats, so the x8 kernel's records can hold one fp32 scale per column and super-block
and one signed byte per block (``kernels.x8_records``):

- **shared scale** — for a column's 8 (Q6_K: 16) block scales ``v_j`` of one super-block, an fp32
  ``s`` and integers ``a_j`` in -128..127 with ``s a_j == v_j`` in fp32: ``s`` is the values'
  greatest common divisor (:func:`shared_scales`). The kernel forms ``d`` by that one
  multiplication: the same float, so the same arithmetic as the per-block records.
- **coarsest block** — pack_blocks may fit a fraction of GGUF's step (4/5 of it where that is an
  fp16 number and the integers are multiples of 5): each block is first taken with its
  integers over their common divisor and its scale times it.
- **divisor** — a block fitted with a multiple of its step (``c d``, ``q / c``; a block of few
  distinct values) takes ``d`` and ``c q`` where ``c d`` is more than a sub-scale holds.
- **shift** — pack_blocks takes a 4-bit block's offset ``m`` to be its smallest value; a Q4_K
  block whose integers never reach 0 has GGUF's offset ``-Dmin mc`` a few levels lower:
  ``m - t d`` with ``q + t`` (``q + t <= 15``) holds the same values and shares ``Dmin``.
- **sign** — Q6_K's super-scale is often negative (its largest sub-scale -128): a group's sign,
  and where needed a half block's, is chosen so that q stays in -32..31.

Every result is checked against the per-block floats: each block's new ``d`` times its divisor
(and sign) is its old one exactly, each offset is the old one or (shifted blocks) rebuilds the
block's weights value for value; otherwise the caller keeps the per-block floats. On
Qwen2.5-Coder-1.5B's Q4_K_M file every weight converts but two of its 4-bit ``ffn_down``
matrices (a block whose two distinct values fit no shift), which keep them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

__all__ = ["SUPER", "SubScaled", "shared_scales", "sub_scaled"]

SUPER = 8            # blocks of 32 k values a super-block (256 values, GGUF's QK_K)


@dataclass(frozen=True)
class SubScaled:
    """A weight's blocks in the shared form (P panels of 16 columns, S super-blocks of 8 blocks).

    ``d = scale_d[p, s, c] * sub_d[p, 8 s + j, h, c]`` for block ``8 s + j`` (h: the block's only
    scale, or (6 bits) its two halves of 16 k values), ``m = scale_m[p, s, c] * sub_m[p, b, c]``
    (4 bits; 6-bit blocks have none), each an exact fp32 product; ``q`` the integers those scales
    multiply (4 bits: 0..15; 6 bits: -32..31)."""

    scale_d: torch.Tensor    # [P, S, 16] float32
    sub_d: torch.Tensor      # [P, B, H, 16] int8, H = 1 (4 bits) or 2 (6 bits)
    scale_m: torch.Tensor | None   # [P, S, 16] float32 (4 bits)
    sub_m: torch.Tensor | None     # [P, B, 16] int8 (4 bits)
    q: torch.Tensor          # [P, B, 32, 16] int16: k row, column


def _bits32(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def shared_scales(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """values [G, n] float32 -> (s [G] float32, k [G, n] int64, found [G] bool): per group the
    largest ``s`` of which every value is a whole multiple, ``values = s k`` exactly (so the fp32
    product ``s * k`` is the value bit for bit while ``|k| < 2^24``, but for -0.0, which is +0.0). Each value is an integer
    times a power of two (its fp32 mantissa and exponent), so ``s`` is the greatest common divisor
    of the group's values written over its smallest power of two; a group whose values span more
    than 2^30 is not found. An all-zero group is s = k = 0."""
    bits = _bits32(values)
    exponent = ((bits >> 23) & 255).long()
    mantissa = (bits & 0x7FFFFF).long() | torch.where(exponent > 0, 1 << 23, 0)
    exponent = exponent.clamp(min=1)                   # a subnormal's scale is the smallest normal one's
    nonzero = mantissa > 0
    e_min = torch.where(nonzero, exponent, 255).amin(-1, keepdim=True)
    spread = torch.where(nonzero, exponent - e_min, 0)
    # finite values only (a -0.0 becomes s * 0 = +0.0: the same in the kernels' sums, which
    # start at +0.0 and so never hold -0.0, for which alone adding -0.0 and +0.0 differ)
    found = (spread <= 30).all(-1) & torch.isfinite(values).all(-1)
    n = torch.where(nonzero & found[:, None], mantissa << spread.clamp(max=30), 0)
    g = n[:, 0]
    for j in range(1, n.shape[1]):
        g = torch.gcd(g, n[:, j])
    k = torch.where(g[:, None] > 0, n // g.clamp(min=1)[:, None], 0)
    k = torch.where(bits < 0, -k, k)
    scale = g.double() * torch.pow(2.0, (e_min[:, 0] - 150).double())
    s = scale.float()
    found &= (s.double() == scale) & (k.abs() < 1 << 24).all(-1)
    return torch.where(found, s, 0.0), torch.where(found[:, None], k, 0), found


def _divide(k: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, qmin: int, qmax: int, amax: int,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multiples k (int64) of a shared scale -> (a = k / c, c, ok) with the smallest divisor c of k
    for which ``-128 <= a <= amax`` and a block's integers ``lo..hi`` times c stay in
    ``qmin..qmax`` (the block then holds its values as ``(s a) (c q)``)."""
    a, c_out = k.clone(), torch.ones_like(k)
    ok = (k >= -128) & (k <= amax) & (lo >= qmin) & (hi <= qmax)      # c = 1: most blocks
    left = (~ok).flatten().nonzero().squeeze(1)
    kl, lol, hil = k.flatten()[left], lo.flatten()[left], hi.flatten()[left]
    for c in range(2, qmax - qmin + 1):
        if not len(left):
            break
        fits = (kl % c == 0) & (kl // c >= -128) & (kl // c <= amax) & (lol * c >= qmin) & (hil * c <= qmax)
        hit = left[fits]
        a.view(-1)[hit], c_out.view(-1)[hit], ok.view(-1)[hit] = kl[fits] // c, c, True
        left, kl, lol, hil = left[~fits], kl[~fits], lol[~fits], hil[~fits]
    return a, c_out, ok


def _shifted_offsets(m: torch.Tensor, d: torch.Tensor, top: torch.Tensor,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Super-blocks whose offsets share no scale as they are: m, d [F, 8] float32 (the blocks'
    offsets and scales), top [F, 8] their largest integers. A block may move t levels down
    (offset ``m - t d``, integers ``q + t <= 15``). The scales tried: each ``|m - t d| / 63`` and
    ``/ 126`` (Q4_K's largest 6-bit offset integer is 63 for most super-blocks) and the common
    divisor of every two offsets as they are (over 1..4); per block the first t that the scale
    holds. Returns (s [F], a [F, 8], t [F, 8], found [F])."""
    f = len(m)
    steps = torch.arange(16)
    alts = m[..., None] - steps * d[..., None]                                # [F, 8, 16]
    exact = (alts.double() + steps.double() * d[..., None].double()) == m[..., None].double()
    valid = (top[..., None] + steps <= 15) & exact
    tops = torch.tensor((63.0, 126.0))
    by_top = torch.where(valid[..., None], alts.abs()[..., None] / tops, 0.0).reshape(f, -1)
    i, j = torch.triu_indices(8, 8, 1)
    pair, _, paired = shared_scales(torch.stack([m[:, i], m[:, j]], -1).reshape(-1, 2))
    by_pair = (torch.where(paired, pair, 0.0).reshape(f, -1, 1) / torch.arange(1.0, 5.0)).reshape(f, -1)
    cands = torch.cat([by_top, by_pair], 1)                                  # [F, C]
    s_out, a_out = torch.zeros(f), torch.zeros(f, 8, dtype=torch.int64)
    t_out, found = torch.zeros(f, 8, dtype=torch.int64), torch.zeros(f, dtype=torch.bool)
    for lo in range(0, f, 64):
        s = cands[lo:lo + 64, :, None, None]                                 # [f, C, 1, 1]
        alt = alts[lo:lo + 64, None]                                         # [f, 1, 8, 16]
        a = torch.round(alt / torch.where(s > 0, s, 1.0))
        fits = valid[lo:lo + 64, None] & (s > 0) & (a >= -128) & (a <= 127) & ((a * s) == alt)
        every = fits.any(-1).all(-1)                                         # [f, C]
        for r in every.any(-1).nonzero().squeeze(1).tolist():
            c = int(every[r].nonzero()[0])
            t = fits[r, c].int().argmax(-1)                                  # the first t that fits
            s_out[lo + r], a_out[lo + r] = s[r, c, 0, 0], a[r, c].gather(-1, t[:, None]).squeeze(-1).long()
            t_out[lo + r], found[lo + r] = t, True
    return s_out, a_out, t_out, found


_CHUNK = 1024        # panels converted at a time (the LM head of Qwen2.5-Coder-1.5B has 9496)


def sub_scaled(d: torch.Tensor, m: torch.Tensor | None, q: torch.Tensor, bits: int) -> SubScaled | None:
    """Per-block floats -> the shared form, or None where some super-block has none.

    d [P, B, H, 16] float32 (H = 1, or 2 for 6 bits: a scale per 16 k values), m [P, B, 16]
    float32 (4 bits) or None, q [P, B, 32, 16] integers (4 bits 0..15, 6 bits a signed byte);
    ``B`` a multiple of 8."""
    if d.shape[1] % SUPER or bits not in (4, 6) or (m is None) != (bits == 6):
        return None
    parts = []
    for i in range(0, d.shape[0], _CHUNK):
        part = _sub_scaled(d[i:i + _CHUNK], None if m is None else m[i:i + _CHUNK], q[i:i + _CHUNK], bits)
        if part is None:
            return None
        parts.append(part)
    if len(parts) == 1:
        return parts[0]
    joined = {f.name: [getattr(part, f.name) for part in parts] for f in fields(SubScaled)}
    return SubScaled(**{name: None if ts[0] is None else torch.cat(ts) for name, ts in joined.items()})


def _sub_scaled(d: torch.Tensor, m: torch.Tensor | None, q: torch.Tensor, bits: int) -> SubScaled | None:
    p, nb, h, cols = d.shape
    sup, rows = nb // SUPER, 32 // h
    qh = q.to(torch.int16).reshape(p, nb, h, rows, cols)
    # each block at its coarsest first: its integers over their common divisor g, its scale times
    # g (pack_blocks may have fitted a fraction of GGUF's step: 4/5 of it, say, where that is an
    # fp16 number and the block's integers are multiples of 5)
    g = qh.abs()
    while g.shape[3] > 1:
        g = torch.gcd(g[:, :, :, 0::2], g[:, :, :, 1::2])
    g = g[:, :, :, 0].clamp(min=1)                                            # [P, B, H, 16]
    coarse = d * g.float()
    exact = coarse.double() == d.double() * g.double()
    g, d = torch.where(exact, g, 1), torch.where(exact, coarse, d)
    qh = qh // g[:, :, :, None, :]

    def grouped(t: torch.Tensor) -> torch.Tensor:        # [P, B, H, 16] -> [P S 16, 8 H]
        return t.reshape(p, sup, SUPER, h, cols).permute(0, 1, 4, 2, 3).reshape(-1, SUPER * h)

    def per_block(t: torch.Tensor) -> torch.Tensor:      # the inverse
        return t.reshape(p, sup, cols, SUPER, h).permute(0, 1, 3, 4, 2).reshape(p, nb, h, cols)

    # d = s a c per block (c > 1: a block fitted with a multiple of its step), q c its integers
    # (6 bits: q c in -32..32 and a up to 128 first; the signs chosen below)
    s_d, k, ok = shared_scales(grouped(d))
    lo, hi = qh.amin(3).long(), qh.amax(3).long()                           # [P, B, H, 16]
    span = (0, 15, 127) if bits == 4 else (-32, 32, 128)
    a, c, fit = _divide(k, grouped(lo), grouped(hi), *span)
    if not (ok & fit.all(-1)).all():
        return None
    sub_d, c = per_block(a), per_block(c)
    sign = torch.ones_like(c)
    if bits == 6:
        # q in GGUF's -32..31 and a in -128..127: Q6_K's super-scale is often negative (its
        # largest sub-scale -128), so each group's sign is chosen first, then any half block
        # that fits only negated is (its sub-scale too)
        lo, hi = lo * c, hi * c

        def fits(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            keep = (a >= -128) & (a <= 127) & (lo >= -32) & (hi <= 31)
            return keep, ~keep & (a >= -127) & (a <= 128) & (hi <= 32) & (lo >= -31)

        (keep, flip), (keep_neg, flip_neg) = fits(sub_d), fits(-sub_d)
        plus, minus = grouped(keep | flip).all(-1), grouped(keep_neg | flip_neg).all(-1)
        if not (plus | minus).all():
            return None
        negative = per_block((~plus)[:, None].expand(-1, SUPER * h))
        s_d = torch.where(plus, s_d, -s_d)
        sub_d = torch.where(negative, -sub_d, sub_d)
        flip = torch.where(negative, flip_neg, flip)
        sub_d, sign = torch.where(flip, -sub_d, sub_d), torch.where(flip, -1, 1)
    scale_d = s_d.reshape(p, sup, 1, 1, cols)
    d_new = (scale_d * sub_d.reshape(p, sup, SUPER, h, cols).float()).reshape(p, nb, h, cols)   # the kernel's d
    # d' (c sign) = d exactly (a product of at most 31 bits in float64), so d' (sign c q) = d q
    if not (d_new.double() * (c * sign).double() == d.double()).all():
        return None
    q = (qh * (c * sign).to(torch.int16)[:, :, :, None, :]).reshape(p, nb, 32, cols)
    if bits == 6:
        return SubScaled(s_d.reshape(p, sup, cols), sub_d.to(torch.int8), None, None, q)

    # m: the same, without divisors; a block whose integers never reach 0 shifted t levels down
    mg = grouped(m[:, :, None, :])                                           # [P S 16, 8]
    s_m, a_m, ok = shared_scales(mg)
    ok &= ((a_m >= -128) & (a_m <= 127)).all(-1)
    shift = torch.zeros_like(a_m)
    if not ok.all():
        bad = (~ok).nonzero().squeeze(1)
        top = grouped(q.amax(2)[:, :, None, :].long())[bad]                 # [F, 8]
        s2, a2, t2, found = _shifted_offsets(mg[bad], grouped(d_new)[bad], top)
        s_m[bad], a_m[bad], shift[bad], ok[bad] = s2, a2, t2, found
        if not ok.all():
            return None
    shift, sub_m = per_block(shift)[:, :, 0], per_block(a_m)[:, :, 0]         # [P, B, 16]
    m_new = (s_m.reshape(p, sup, 1, cols) * sub_m.reshape(p, sup, SUPER, cols).float()).reshape(p, nb, cols)
    q = q + shift[:, :, None, :].to(torch.int16)
    # unshifted blocks: m' is m (bit for bit, or +0.0 for -0.0); shifted ones (a few): their
    # weights rebuilt
    same = shift == 0
    if not (m_new[same] == m[same]).all():
        return None
    moved = (~same).nonzero(as_tuple=True)
    if len(moved[0]):
        old_q = qh.reshape(p, nb, 32, cols).float()
        dq_old = old_q[moved[0], moved[1], :, moved[2]] * d[moved[0], moved[1], 0, moved[2]][:, None]
        dq_new = q[moved[0], moved[1], :, moved[2]].float() * d_new[moved[0], moved[1], 0, moved[2]][:, None]
        exact = (dq_new.double() == q[moved[0], moved[1], :, moved[2]].double()
                 * d_new[moved[0], moved[1], 0, moved[2]][:, None].double())
        old = dq_old + m[moved][:, None]
        new = dq_new + m_new[moved][:, None]
        if not (exact.all() and (old == new).all()):
            return None
    return SubScaled(s_d.reshape(p, sup, cols), sub_d.to(torch.int8), s_m.reshape(p, sup, cols),
                     sub_m.to(torch.int8), q)
