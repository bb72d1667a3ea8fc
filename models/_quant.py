"""Quantisation into the ggml block formats the tiny models use.

All three formats are packed here, in plain float32 numpy, rather than with
gguf.quants: its encoders change between releases (Q4_0 rounding differs in
gguf 0.17 and 0.19), which would make the "same seed, same bytes" promise
depend on the installed gguf, and it cannot encode Q4_K at all. Q4_K matters
because real checkpoints such as the Gemma Q4_K_M file are mostly Q4_K.
The packers are checked against gguf.quants.dequantize (the format's
reference decoder) and, end to end, against ggml's kernels in the tests.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from gguf import GGMLQuantizationType as QT

F32Array = npt.NDArray[np.float32]
QK_K = 256
_SUB = 32  # values per Q4_K sub-block; 8 sub-blocks per super-block


def quantize(data: F32Array, qtype: QT) -> np.ndarray:
    """Return the array to hand to GGUFWriter.add_tensor for this type."""
    if qtype == QT.F32:
        return data.astype(np.float32)
    if qtype == QT.F16:
        return data.astype(np.float16)
    if qtype == QT.Q8_0:
        return _quantize_q8_0(data)
    if qtype == QT.Q4_0:
        return _quantize_q4_0(data)
    if qtype == QT.Q4_K:
        return _quantize_q4_k(data)
    raise ValueError(f"no packer for {qtype.name}")


def _blocks(data: F32Array, size: int) -> F32Array:
    if data.shape[-1] % size:
        raise ValueError(f"rows must be a multiple of {size}, got {data.shape[-1]}")
    return data.astype(np.float32).reshape(-1, size)


def _finish(data: F32Array, blocks: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """Blocks back into the tensor's shape, last axis now in bytes."""
    return blocks.reshape(*data.shape[:-1], -1)


def _f16_bytes(x: F32Array) -> npt.NDArray[np.uint8]:
    return x.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _quantize_q8_0(data: F32Array) -> npt.NDArray[np.uint8]:
    """Per 32 values: f16 scale d = max|x|/127, then int8 round(x/d)."""
    x = _blocks(data, 32)
    # Divide by the scale as stored (f16), clipping the rare rounding overshoot.
    d = _f16_round(np.abs(x).max(axis=-1, keepdims=True) / np.float32(127))
    q = np.clip(np.rint(np.divide(x, d, out=np.zeros_like(x), where=d > 0)), -127, 127)
    return _finish(data, np.concatenate([_f16_bytes(d), q.astype(np.int8).view(np.uint8)], axis=1))


def _quantize_q4_0(data: F32Array) -> npt.NDArray[np.uint8]:
    """Per 32 values: d = (signed value of largest magnitude) / -8, q = x/d + 8 in 0..15.

    Using the signed extreme lets it land exactly on q = 0 and spends the
    spare level (q = 15 has no mirror) on the other side, as ggml does.
    """
    x = _blocks(data, 32)
    extreme = np.take_along_axis(x, np.abs(x).argmax(axis=-1)[:, None], axis=-1)
    d = _f16_round(extreme / np.float32(-8))
    shifted = np.divide(x, d, out=np.zeros_like(x), where=d != 0) + np.float32(8.5)
    q = np.clip(np.trunc(shifted), 0, 15).astype(np.uint8)
    packed = q[:, :16] | (q[:, 16:] << 4)  # byte j: value j low, value j+16 high
    return _finish(data, np.concatenate([_f16_bytes(d), packed], axis=1))


def _f16_round(x: F32Array) -> F32Array:
    return x.astype(np.float16).astype(np.float32)


def _pack_scales(sc: npt.NDArray[np.uint8], mn: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """Pack 8 six-bit scales and mins per block into ggml's 12-byte layout.

    Bytes 0-3 hold scales 0-3, bytes 4-7 mins 0-3 (low 6 bits each); the two
    top bits of those bytes and the nibbles of bytes 8-11 carry scales/mins 4-7.
    """
    lo_sc, hi_sc = sc[:, :4], sc[:, 4:]
    lo_mn, hi_mn = mn[:, :4], mn[:, 4:]
    first = lo_sc | ((hi_sc >> 4) << 6)
    second = lo_mn | ((hi_mn >> 4) << 6)
    third = (hi_sc & 0x0F) | ((hi_mn & 0x0F) << 4)
    return np.concatenate([first, second, third], axis=1).astype(np.uint8)


def _pack_nibbles(q: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """Each 32-byte group holds sub-block 2c in low and 2c+1 in high nibbles."""
    pairs = q.reshape(-1, 4, 2, _SUB)
    packed = pairs[:, :, 0, :] | (pairs[:, :, 1, :] << 4)
    return packed.reshape(-1, QK_K // 2).astype(np.uint8)


def _quantize_q4_k(data: F32Array) -> npt.NDArray[np.uint8]:
    """Simple min/max Q4_K: x ~= d*sc*q - dmin*m with 4-bit q, 6-bit sc and m."""
    sub = _blocks(data, QK_K).reshape(-1, 8, _SUB)
    lo = np.minimum(sub.min(axis=-1), 0.0)  # offsets are subtracted, so keep them >= 0
    step = (sub.max(axis=-1) - lo) / 15.0
    d = _f16_round(step.max(axis=-1) / 63.0)
    dmin = _f16_round((-lo).max(axis=-1) / 63.0)
    sc = _safe_div(step, d[:, None], 63).astype(np.uint8)
    mn = _safe_div(-lo, dmin[:, None], 63).astype(np.uint8)
    scale = (d[:, None] * sc)[..., None]
    offset = (dmin[:, None] * mn)[..., None]
    q = np.clip(np.rint(np.divide(sub + offset, scale, out=np.zeros_like(sub), where=scale > 0)), 0, 15)
    parts = [_f16_bytes(d), _f16_bytes(dmin), _pack_scales(sc, mn), _pack_nibbles(q.astype(np.uint8))]
    return _finish(data, np.concatenate(parts, axis=1))


def _safe_div(num: F32Array, den: F32Array, top: int) -> F32Array:
    out = np.divide(num, den, out=np.zeros_like(num), where=den > 0)
    return np.clip(np.rint(out), 0, top)
