"""A reference of block-wise FP8 (DeepSeek-V3, arXiv 2412.19437) written from the format's
definition, independent of torch's float8 cast: the e4m3fn code table decoded from its bits
(1 sign, 4 exponent bits with bias 7, 3 mantissa bits; exponent 0 = subnormals m/8 * 2^-6;
S.1111.111 = nan, no inf, max 448), a Python loop over the 128 x 128 blocks, amax per block
(floored at 1e-4) / 448 as the fp32 inverse scale, and round-to-nearest, ties-to-even, of
W / scale_inv (computed in fp32) onto the table."""

from __future__ import annotations

import torch

BLOCK, FP8_MAX, AMAX_FLOOR = 128, 448.0, 1e-4


def e4m3fn_table() -> torch.Tensor:
    """The 127 non-negative finite e4m3fn values, indexed by their code (0x00 .. 0x7E), float64."""
    vals = []
    for code in range(0x7F):
        e, m = code >> 3, code & 7
        vals.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(vals, dtype=torch.float64)


def round_to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Codes (uint8) of fp32 values `v`, round to nearest, ties to the even code; |v| > 448
    saturates to 448 (only 448 * (1 + eps) arises from x / (amax / 448))."""
    table = e4m3fn_table()
    a = v.abs().to(torch.float64).flatten()
    hi = torch.searchsorted(table, a).clamp(max=len(table) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = (a - table[lo]).abs(), (table[hi] - a).abs()
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = torch.where(pick_hi, hi, lo)
    code = torch.where(a >= FP8_MAX, torch.full_like(code, 0x7E), code)
    sign = torch.signbit(v.flatten()).to(torch.int64) << 7
    return (code | sign).to(torch.uint8).view(v.shape)


def reference_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [N, K] uint8, scale_inv [ceil(N/128), ceil(K/128)] fp32) of a 2-D weight."""
    x = w.to(torch.float32)
    n, k = x.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    codes = torch.empty((n, k), dtype=torch.uint8)
    scales = torch.empty((nb, kb), dtype=torch.float32)
    for i in range(nb):
        for j in range(kb):
            blk = x[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            amax = torch.clamp(blk.abs().max(), min=AMAX_FLOOR)  # fp32
            s = amax / torch.tensor(FP8_MAX, dtype=torch.float32)
            scales[i, j] = s
            codes[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = round_to_e4m3(blk / s)
    return codes, scales


def reference_dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 values codes * scale_inv, decoded through the table."""
    table = e4m3fn_table()
    mag = table[(codes & 0x7F).long()]
    val = torch.where((codes & 0x80) != 0, -mag, mag)
    s = scales.to(torch.float64).repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    return val * s[: codes.shape[0], : codes.shape[1]]
