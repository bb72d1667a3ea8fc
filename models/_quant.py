"""Quantisation into the ggml block formats the tiny models use.

gguf.quants can write Q8_0 and Q4_0 but only *read* the k-quants, so Q4_K
is packed here from the block layout (d, dmin, 12 bytes of 6-bit scales and
mins, 128 bytes of nibbles per 256 values). Real checkpoints such as the
Gemma Q4_K_M file are mostly Q4_K, so the tiny models should exercise that
kernel too. The packer is checked against gguf.quants.dequantize in tests.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from gguf import GGMLQuantizationType as QT
from gguf import quants

F32Array = npt.NDArray[np.float32]
QK_K = 256
_SUB = 32  # values per Q4_K sub-block; 8 sub-blocks per super-block


def quantize(data: F32Array, qtype: QT) -> np.ndarray:
    """Return the array to hand to GGUFWriter.add_tensor for this type."""
    if qtype == QT.F32:
        return data.astype(np.float32)
    if qtype == QT.F16:
        return data.astype(np.float16)
    if qtype == QT.Q4_K:
        return _quantize_q4_k(data)
    return quants.quantize(data.astype(np.float32), qtype)


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
    cols = data.shape[-1]
    if cols % QK_K:
        raise ValueError(f"Q4_K needs rows that are a multiple of {QK_K}, got {cols}")
    sub = data.astype(np.float32).reshape(-1, 8, _SUB)
    lo = np.minimum(sub.min(axis=-1), 0.0)  # offsets are subtracted, so keep them >= 0
    step = (sub.max(axis=-1) - lo) / 15.0
    d = _f16_round(step.max(axis=-1) / 63.0)
    dmin = _f16_round((-lo).max(axis=-1) / 63.0)
    sc = _safe_div(step, d[:, None], 63).astype(np.uint8)
    mn = _safe_div(-lo, dmin[:, None], 63).astype(np.uint8)
    scale = (d[:, None] * sc)[..., None]
    offset = (dmin[:, None] * mn)[..., None]
    q = np.clip(np.rint(np.divide(sub + offset, scale, out=np.zeros_like(sub), where=scale > 0)), 0, 15)
    blocks = np.concatenate(
        [
            d.astype(np.float16).view(np.uint8).reshape(-1, 2),
            dmin.astype(np.float16).view(np.uint8).reshape(-1, 2),
            _pack_scales(sc, mn),
            _pack_nibbles(q.astype(np.uint8)),
        ],
        axis=1,
    )
    return blocks.reshape(*data.shape[:-1], cols // QK_K * 144)


def _safe_div(num: F32Array, den: F32Array, top: int) -> F32Array:
    out = np.divide(num, den, out=np.zeros_like(num), where=den > 0)
    return np.clip(np.rint(out), 0, top)
