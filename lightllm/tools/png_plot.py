"""A scatter plot written straight to PNG (numpy raster + zlib), so benchmarks need no plotting library.

One panel per series, stacked vertically, sharing the x axis; each panel is scaled to its own y range, with a
grey frame and a light line at y = 0. The PNG's text chunks carry each panel's name and range (PNG viewers do not
draw text; `python -c "from PIL import Image; print(Image.open(f).text)"` or any PNG inspector shows them).
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

WIDTH, PANEL_HEIGHT, MARGIN = 800, 240, 12


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_png(rgb: np.ndarray, text: dict[str, str] | None = None) -> bytes:
    """`rgb [H, W, 3]` uint8 -> PNG bytes (8-bit RGB, no filtering), with optional tEXt chunks."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))
    out = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
    for key, value in (text or {}).items():
        out += _chunk(b"tEXt", key.encode("latin-1") + b"\x00" + value.encode("latin-1", "replace"))
    return out + _chunk(b"IDAT", zlib.compress(raw, 6)) + _chunk(b"IEND", b"")


def scatter_png(path: str, series: list[tuple[str, list[tuple[float, float]], tuple[int, int, int]]]) -> None:
    """Write one panel per `(name, [(x, y), ...], rgb)` to `path`."""
    n = max(len(series), 1)
    img = np.full((PANEL_HEIGHT * n, WIDTH, 3), 255, dtype=np.uint8)
    xs = [x for _, pts, _ in series for x, _ in pts]
    x0, x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
    text = {"x": f"{x0:.3f} .. {x1:.3f}"}
    for i, (name, pts, color) in enumerate(series):
        top, bottom = i * PANEL_HEIGHT + MARGIN, (i + 1) * PANEL_HEIGHT - MARGIN
        left, right = MARGIN, WIDTH - MARGIN
        img[top:bottom, [left, right - 1]] = 160
        img[[top, bottom - 1], left:right] = 160
        if not pts:
            continue
        p = np.asarray(pts, dtype=np.float64)
        y0, y1 = min(0.0, p[:, 1].min()), p[:, 1].max()
        text[name] = f"{y0:.3f} .. {y1:.3f}"
        col = left + 1 + ((p[:, 0] - x0) / ((x1 - x0) or 1.0) * (right - left - 4)).astype(int)
        row = bottom - 2 - ((p[:, 1] - y0) / ((y1 - y0) or 1.0) * (bottom - top - 4)).astype(int)
        zero = bottom - 2 - int((0 - y0) / ((y1 - y0) or 1.0) * (bottom - top - 4))
        img[zero, left + 1 : right - 1] = 225
        for dy in (-1, 0, 1):
            for dx in (-1, 0, 1):
                img[np.clip(row + dy, top, bottom - 1), np.clip(col + dx, left, right - 1)] = color
    with open(path, "wb") as f:
        f.write(encode_png(img, text))
