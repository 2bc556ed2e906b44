"""ImageNet-C-style corruptions (Hendrycks & Dietterich, 2019) in torch and PIL, at 5 severities.

``corrupt(images, name, severity, seed)`` takes a batch (N, C, H, W), uint8 in [0, 255] or float in
[0, 1], and returns a batch of the same shape, dtype and range. Image i draws its randomness from its
own generator seeded with ``seed + i``, so an image's corruption does not depend on the batch it is in.

Parameters follow ImageNet-C's for 224-pixel images and CIFAR-10-C's for small ones (``preset="auto"``
picks CIFAR's for sides up to 64 pixels). Two depart from them, because their published levels are not
ordered by strength (the change to the image would not grow with severity):

- ``saturate``: ImageNet-C's levels 1-2 desaturate and 3-5 over-saturate; ours over-saturate at every
  level, with their levels 3, 4, 5 as our 1, 3, 5 and the midpoints between as 2 and 4;
- ``elastic_transform``: ImageNet-C's first levels add a large affine jitter that later levels do not;
  ours keeps its levels 3-5 (displacement α = 0.05, 0.07, 0.12 × 244, smoothness σ = 0.01 × 244,
  affine jitter 0.02 × 244 pixels on a 224-pixel image, scaled with the side) and adds 0.02 and 0.035
  before them. CIFAR-10-C's levels weaken with severity; the CIFAR preset takes the same fractions
  of its 32-pixel side. Its CE is therefore left out of the mCE against AlexNet's ImageNet-C errors.

The zoom blur of the ImageNet preset is ImageNet-C's (``clipped_zoom``: crop, ``scipy.ndimage.zoom``
corner to corner, trim). Its integer rounding puts the zooms off centre by up to a pixel (towards the
top left), which at 32 pixels about doubles the change at severity 1: the CIFAR preset zooms about
the exact centre instead.

``saturate`` keeps grey pixels grey (they have no hue); ImageNet-C's skimage round trip gives them
hue 0, so its saturation turns them red. ``corrupt`` returns uint8 images truncated as the
reference's ``np.uint8`` does, after rounding where the reference computes in 8 bits (motion blur in
ImageMagick, pixelate in PIL); :func:`stored_as_imagenet_c` adds ImageNet-C's JPEG storage, which
``neutreno robustness`` applies at the ImageNet preset (AlexNet's errors were measured on its files).

``fog`` is ImageNet-C's plasma-fractal fog ("fog-like"); glass blur, snow, frost and spatter are not
implemented.
"""

from __future__ import annotations

import functools
import io
import math
import numbers
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

PRESETS = ("imagenet", "cifar")
SEVERITIES = (1, 2, 3, 4, 5)
# Raised whenever ``corrupt`` gives other images for the same input and seed, so that errors scored
# before (a saved baseline report, a stopped evaluation's sums) are not compared with today's.
# 2: motion blur and pixelate rounded to 8 bits, as the reference computes them.
CORRUPTIONS_VERSION = 2

# elastic_transform's (displacement α, smoothness σ, affine jitter) as fractions of the image side:
# ImageNet-C's levels 3-5, with two weaker levels before them (see the module docstring)
ELASTIC = [(alpha, 0.01, 0.02) for alpha in (0.02, 0.035, 0.05, 0.07, 0.12)]

# name → (imagenet parameters, cifar parameters), one entry per severity (ImageNet-C / CIFAR-10-C).
PARAMETERS: dict[str, tuple[list, list]] = {
    "gaussian_noise": ([0.08, 0.12, 0.18, 0.26, 0.38], [0.04, 0.06, 0.08, 0.09, 0.10]),
    "shot_noise": ([60, 25, 12, 5, 3], [500, 250, 100, 75, 50]),
    "impulse_noise": ([0.03, 0.06, 0.09, 0.17, 0.27], [0.01, 0.02, 0.03, 0.05, 0.07]),
    "defocus_blur": (
        [(3, 0.1), (4, 0.5), (6, 0.5), (8, 0.5), (10, 0.5)],
        [(0.3, 0.4), (0.4, 0.5), (0.5, 0.6), (1, 0.2), (1.5, 0.1)],
    ),
    "motion_blur": (
        [(10, 3), (15, 5), (15, 8), (15, 12), (20, 15)],
        [(6, 1), (6, 1.5), (6, 2), (8, 2), (9, 2.5)],
    ),
    "zoom_blur": (
        [(1.11, 0.01), (1.16, 0.01), (1.21, 0.02), (1.26, 0.02), (1.31, 0.03)],  # zooms 1, 1 + step, … < end
        [(1.06, 0.01), (1.11, 0.01), (1.16, 0.01), (1.21, 0.01), (1.26, 0.01)],
    ),
    "gaussian_blur": ([1, 2, 3, 4, 6], [0.4, 0.6, 0.7, 0.8, 1.0]),
    "brightness": ([0.1, 0.2, 0.3, 0.4, 0.5], [0.05, 0.1, 0.15, 0.2, 0.3]),
    "contrast": ([0.4, 0.3, 0.2, 0.1, 0.05], [0.75, 0.5, 0.4, 0.3, 0.15]),
    "fog": (
        [(1.5, 2), (2.0, 2), (2.5, 1.7), (2.5, 1.5), (3.0, 1.4)],
        [(0.2, 3), (0.5, 3), (0.75, 2.5), (1, 2), (1.5, 1.75)],
    ),
    "saturate": (
        [(2, 0), (3.5, 0.05), (5, 0.1), (12.5, 0.15), (20, 0.2)],
        [(1.5, 0), (1.75, 0.05), (2, 0.1), (2.25, 0.15), (2.5, 0.2)],
    ),
    "pixelate": ([0.6, 0.5, 0.4, 0.3, 0.25], [0.95, 0.9, 0.85, 0.75, 0.65]),
    "jpeg_compression": ([25, 18, 15, 10, 7], [80, 65, 58, 50, 40]),
    "elastic_transform": (
        # ImageNet-C multiplies these by 244 on its 224-pixel images ("244 should have been 224"): as
        # fractions of the side, 244/224 × its own
        [tuple(v * 244 / 224 for v in c) for c in ELASTIC],
        ELASTIC,
    ),
}
FAMILIES = {
    "noise": ("gaussian_noise", "shot_noise", "impulse_noise"),
    "blur": ("defocus_blur", "motion_blur", "zoom_blur", "gaussian_blur"),
    "weather": ("brightness", "contrast", "fog", "saturate"),
    "digital": ("pixelate", "jpeg_compression", "elastic_transform"),
}
CORRUPTIONS = tuple(name for names in FAMILIES.values() for name in names)


def check_severity(severity: object) -> None:
    """ValueError unless ``severity`` is the integer 1 … 5 (3.0 indexed a list, True passed as 1)."""
    if isinstance(severity, bool) or not isinstance(severity, numbers.Integral) or severity not in SEVERITIES:
        raise ValueError(f"severity must be 1 … 5, got {severity!r}")


def corrupt(images: Tensor, name: str, severity: int, seed: int = 0, preset: str = "auto") -> Tensor:
    """Corrupt a batch (N, C, H, W), C = 1 or 3, uint8 or float in [0, 1]; same shape, dtype and range.

    Args:
        name: one of :data:`CORRUPTIONS`. severity: 1 … 5.
        seed: image i uses a generator seeded with ``seed + i``.
        preset: ``"imagenet"``, ``"cifar"`` or ``"auto"`` (CIFAR-10-C's parameters for sides ≤ 64).

    Raises:
        ValueError: an unknown name, severity or preset, another shape, or float images outside [0, 1].
        TypeError: images neither uint8 nor float.
    """
    if name not in PARAMETERS:
        raise ValueError(f"unknown corruption {name!r}; valid: {', '.join(CORRUPTIONS)}")
    check_severity(severity)
    if images.ndim != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"expected images (N, 1 or 3, H, W), got shape {tuple(images.shape)}")
    preset = resolve_preset(images, preset)
    param = PARAMETERS[name][PRESETS.index(preset)][severity - 1]
    function = _PRESET_FUNCTIONS[preset].get(name, _FUNCTIONS[name])
    is_uint8 = images.dtype == torch.uint8
    if not is_uint8 and not images.is_floating_point():
        raise TypeError(f"expected uint8 images or float images in [0, 1], got {images.dtype}")
    if not is_uint8 and images.numel() and not (images.min() >= 0 and images.max() <= 1):
        # float images on the 0–255 scale would all come out white, and NaN would pass on
        low, high = images.min().item(), images.max().item()
        raise ValueError(f"float images must lie in [0, 1], got values in [{low:g}, {high:g}]")
    if not len(images):  # (torch.stack of nothing raised)
        return images.clone()
    x = images.float() / 255 if is_uint8 else images.float()
    out = torch.stack(
        [function(image, param, torch.Generator().manual_seed(seed + i)) for i, image in enumerate(x)]
    ).clamp(0, 1)
    if is_uint8:  # truncated, as the reference's np.uint8(…) stores its images (the epsilon: float32's error)
        return (out * 255 + 1e-3).floor().clamp(max=255).to(torch.uint8)
    return out.to(images.dtype)


def resolve_preset(images: Tensor, preset: str = "auto") -> str:
    """The parameters a batch (…, H, W) gets: ``"auto"`` is CIFAR-10-C's for sides up to 64 pixels,
    else ImageNet-C's. ValueError for an unknown preset."""
    if preset == "auto":
        preset = "cifar" if max(images.shape[-2:]) <= 64 else "imagenet"
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; valid: auto, {', '.join(PRESETS)}")
    return preset


def stored_as_imagenet_c(images: Tensor) -> Tensor:
    """uint8 corrupted images (N, C, H, W) as ImageNet-C's files hold them: saved as JPEG at quality 85,
    optimised (make_imagenet_c.py), and decoded. AlexNet's published errors, the mCE's baseline, were
    measured on those files; the storage smooths noise (Gaussian noise at severity 5: ~20% less)."""
    return torch.stack([_jpeg_round_trip(image, quality=85, optimize=True) for image in images])


def _jpeg_round_trip(image: Tensor, **save: object) -> Tensor:
    """uint8 (C, H, W), C = 1 or 3, saved by PIL as JPEG with ``save``'s options and decoded."""
    array = image.permute(1, 2, 0).numpy()
    pil = Image.fromarray(array[..., 0] if image.shape[0] == 1 else array)
    buffer = io.BytesIO()
    pil.save(buffer, "JPEG", **save)
    decoded = np.asarray(Image.open(buffer).convert(pil.mode)).reshape(*image.shape[1:], image.shape[0])
    return torch.from_numpy(decoded.copy()).permute(2, 0, 1)


# Each corruption: one float image (C, H, W) in [0, 1], its severity's parameter, a generator → (C, H, W).


def _gaussian_noise(x: Tensor, c: float, g: torch.Generator) -> Tensor:
    return x + c * torch.randn(x.shape, generator=g)


def _shot_noise(x: Tensor, c: float, g: torch.Generator) -> Tensor:
    return torch.poisson(x * c, generator=g) / c


def _impulse_noise(x: Tensor, c: float, g: torch.Generator) -> Tensor:
    # Salt and pepper on a fraction c of the values, half each (skimage's "s&p"); one uniform draw per
    # value, so a stronger level flips a superset of the values a weaker one flips.
    u = torch.rand(x.shape, generator=g)
    return torch.where(u < c / 2, 1.0, torch.where(u < c, 0.0, x))


def _gaussian_kernel1d(sigma: float, size: int | None = None) -> Tensor:
    size = size or 2 * math.ceil(4 * sigma) + 1  # skimage's gaussian truncates at 4σ
    t = torch.arange(size, dtype=torch.float32) - (size - 1) / 2
    k = torch.exp(-(t**2) / (2 * sigma**2))
    return k / k.sum()


def _filter(x: Tensor, kernel: Tensor, border: str = "reflect") -> Tensor:
    """Correlate every channel of x (C, H, W) with a kernel (kh, kw) of odd sides, at the borders
    reflecting (OpenCV's default, scipy's "mirror") or, with ``border="replicate"``, repeating the edge
    (skimage's "nearest"); replicating too where the image is smaller than the kernel."""
    ph, pw = kernel.shape[0] // 2, kernel.shape[1] // 2
    mode = border if max(ph, pw) < min(x.shape[-2:]) else "replicate"
    padded = F.pad(x[None], (pw, pw, ph, ph), mode=mode)
    return F.conv2d(padded, kernel.expand(x.shape[0], 1, *kernel.shape), groups=x.shape[0])[0]


def _separable(x: Tensor, k: Tensor, border: str = "reflect") -> Tensor:
    """x filtered by the outer product k kᵀ, as two 1-D passes."""
    return _filter(_filter(x, k[:, None], border), k[None, :], border)


def _gaussian_blur(x: Tensor, sigma: float, g: torch.Generator) -> Tensor:
    # ImageNet-C's skimage.filters.gaussian: the edge pixels repeated beyond the border (mode "nearest")
    return _separable(x, _gaussian_kernel1d(sigma), border="replicate")


@functools.cache
def disk_kernel(radius: float, alias_blur: float) -> Tensor:
    """ImageNet-C's defocus kernel: the pixels within ``radius`` of the centre (on a grid of at least
    ±8), normalised, then smoothed by a 3×3 (5×5 past radius 8) Gaussian of σ ``alias_blur``."""
    half = max(8, math.floor(radius))
    t = torch.arange(-half, half + 1, dtype=torch.float32)
    disk = ((t[:, None] ** 2 + t[None, :] ** 2) <= radius**2).float()
    disk /= disk.sum()
    return _separable(disk[None], _gaussian_kernel1d(alias_blur, 3 if radius <= 8 else 5))[0]


def _defocus_blur(x: Tensor, c: tuple[float, float], g: torch.Generator) -> Tensor:
    return _filter(x, disk_kernel(*c))


def motion_taps(radius: int, sigma: float, angle_degrees: float) -> list[tuple[float, int, int]]:
    """A one-sided motion streak (ImageNet-C's ImageMagick-style motion blur): 2·radius + 1 taps
    (weight, dy, dx), tap t at t pixels along ``angle`` rounded to a pixel, weights ∝ exp(−t²/2σ²)."""
    width = 2 * radius + 1
    weights = torch.exp(-(torch.arange(width, dtype=torch.float64) ** 2) / (2 * sigma**2))
    weights /= weights.sum()
    angle = math.radians(angle_degrees)
    return [
        (w, math.ceil(t * math.sin(angle) - 0.5), math.ceil(t * math.cos(angle) - 0.5))
        for t, w in enumerate(weights.tolist())
    ]


def _motion_blur(x: Tensor, c: tuple[int, float], g: torch.Generator) -> Tensor:
    angle = float(torch.empty(()).uniform_(-45, 45, generator=g))
    taps = motion_taps(c[0], c[1], angle)
    h, w = x.shape[-2:]
    pad = 2 * c[0] + 1
    padded = F.pad(x[None], (pad, pad, pad, pad), mode="replicate")[0]  # the streak leaves the image: edges
    blurred = sum(
        weight * padded[:, pad + dy : pad + dy + h, pad + dx : pad + dx + w] for weight, dy, dx in taps
    )
    return _rounded_to_8_bits(blurred)  # ImageMagick's output, an 8-bit PNG: rounded, not truncated


def _zoom(x: Tensor, factor: float) -> Tensor:
    """The centre 1/factor of x, scaled back up to x's size (bilinear)."""
    h, w = x.shape[-2:]
    ch, cw = math.ceil(h / factor), math.ceil(w / factor)
    top, left = (h - ch) // 2, (w - cw) // 2
    crop = x[None, :, top : top + ch, left : left + cw]
    return F.interpolate(crop, size=(h, w), mode="bilinear", align_corners=False)[0]


def _clipped_zoom(x: Tensor, factor: float) -> Tensor:
    """ImageNet-C's ``clipped_zoom``: the centre ceil(side / factor) pixels, zoomed by ``factor`` as
    ``scipy.ndimage.zoom(order=1)`` does (corner to corner, to round(crop · factor) pixels), of which the
    centre ``side`` are kept, rounding towards the top left."""
    h, w = x.shape[-2:]
    ch, cw = math.ceil(h / factor), math.ceil(w / factor)
    top, left = (h - ch) // 2, (w - cw) // 2
    crop = x[None, :, top : top + ch, left : left + cw]
    size = (round(ch * factor), round(cw * factor))
    zoomed = F.interpolate(crop, size=size, mode="bilinear", align_corners=True)[0]
    trim_top, trim_left = (size[0] - h) // 2, (size[1] - w) // 2
    return zoomed[:, trim_top : trim_top + h, trim_left : trim_left + w]


def _zoom_blur(x: Tensor, c: tuple[float, float], g: torch.Generator, zoom=_zoom) -> Tensor:
    end, step = c
    factors = np.arange(1, end, step)
    return (x + sum(zoom(x, float(f)) for f in factors)) / (len(factors) + 1)


def _brightness(x: Tensor, c: float, g: torch.Generator) -> Tensor:
    # HSV value V + c with hue and saturation kept: every channel scales by V'/V (grey pixels rise to V').
    v = x.amax(0, keepdim=True)
    v_new = (v + c).clamp(max=1)
    return torch.where(v > 0, x * v_new / v.clamp_min(1e-12), v_new.expand_as(x))


def _contrast(x: Tensor, c: float, g: torch.Generator) -> Tensor:
    mean = x.mean(dim=(-2, -1), keepdim=True)
    return (x - mean) * c + mean


def _saturate(x: Tensor, c: tuple[float, float], g: torch.Generator) -> Tensor:
    # HSV saturation S' = clip(S·a + b) with hue and value kept: x' = V − (V − x)·S'/S (grey stays grey).
    if x.shape[0] == 1:
        return x
    v = x.amax(0, keepdim=True)
    s = (v - x.amin(0, keepdim=True)) / v.clamp_min(1e-12)
    s_new = (s * c[0] + c[1]).clamp(max=1)
    return torch.where(s > 0, v - (v - x) * s_new / s.clamp_min(1e-12), x)


def plasma_fractal(size: int, decay: float, g: torch.Generator) -> Tensor:
    """A (size, size) diamond-square height map in [0, 1] (size a power of two), the wibble of each
    level divided by ``decay``: ImageNet-C's fog texture."""
    grid = torch.zeros(size, size, dtype=torch.float64)
    step, wibble = size, 100.0

    def wibbled(mean: Tensor) -> Tensor:  # ImageNet-C's: the mean plus wibble × U(−wibble, wibble)
        return mean / 4 + wibble**2 * (torch.rand(mean.shape, generator=g, dtype=torch.float64) * 2 - 1)

    while step >= 2:
        half = step // 2
        corners = grid[0:size:step, 0:size:step]
        square = corners + corners.roll(-1, 0)
        square = square + square.roll(-1, 1)
        grid[half:size:step, half:size:step] = wibbled(square)
        centres = grid[half:size:step, half:size:step]
        corners = grid[0:size:step, 0:size:step]
        grid[0:size:step, half:size:step] = wibbled(
            centres + centres.roll(1, 0) + corners + corners.roll(-1, 1)
        )
        grid[half:size:step, 0:size:step] = wibbled(
            centres + centres.roll(1, 1) + corners + corners.roll(-1, 0)
        )
        step //= 2
        wibble /= decay
    grid -= grid.min()
    return (grid / grid.max() if grid.max() > 0 else grid).float()  # one pixel: flat (0/0 gave NaN fog)


def _fog(x: Tensor, c: tuple[float, float], g: torch.Generator) -> Tensor:
    h, w = x.shape[-2:]
    size = 1 << (max(h, w) - 1).bit_length()
    peak = x.max()
    fogged = x + c[0] * plasma_fractal(size, c[1], g)[:h, :w]
    return fogged * peak / (peak + c[0])


def _pixelate(x: Tensor, c: float, g: torch.Generator) -> Tensor:
    # ImageNet-C's: PIL's box down-sampling, then up-sampling (box and nearest agree there), of an 8-bit
    # image: PIL rounds after each of its two passes (rows, then columns), which float ("F") channels did
    # not, a level apart on a third of the pixels. PIL places both on pixel centres.
    h, w = x.shape[-2:]
    small = (max(1, int(w * c)), max(1, int(h * c)))  # (a side of 1 pixel: PIL refused a size of 0)
    levels = (x * 255).round().to(torch.uint8).numpy()
    channels = [
        np.asarray(Image.fromarray(ch, "L").resize(small, Image.BOX).resize((w, h), Image.NEAREST))
        for ch in levels
    ]
    return torch.from_numpy(np.stack(channels)).float() / 255


def _rounded_to_8_bits(x: Tensor) -> Tensor:
    """x (in [0, 1]) rounded to the nearest of 256 levels, as ImageMagick's 8-bit PNG of a motion blur
    is; ``corrupt``'s truncation of the float result to uint8 then keeps it (it put half the pixels a
    level lower)."""
    return (x * 255).round() / 255


def _jpeg_compression(x: Tensor, quality: int, g: torch.Generator) -> Tensor:
    return _jpeg_round_trip((x * 255).round().byte(), quality=quality).float() / 255


def _elastic_transform(x: Tensor, c: tuple[float, float, float], g: torch.Generator) -> Tensor:
    # A random affine jitter of three points, then a displacement field of smoothed uniform noise,
    # both in pixels relative to the image side (ImageNet-C's recipe). Both are sampled in one bilinear
    # pass, where the reference resamples twice (cv2.warpAffine, then map_coordinates): our images are
    # a little sharper (≈2.4 levels apart on average at levels 3-5, more at the border).
    h, w = x.shape[-2:]
    side = min(h, w)
    alpha, sigma, jitter = c[0] * side, max(c[1] * side, 0.5), c[2] * side
    centre = torch.tensor([w / 2, h / 2])
    square = side // 3
    src = torch.stack([centre + square, centre + torch.tensor([square, -square]), centre - square])
    dst = src + (torch.rand(3, 2, generator=g) * 2 - 1) * jitter
    # The affine map dst ← src, solved exactly from the three point pairs, as a sampling grid.
    ones = torch.ones(3, 1)
    inverse = torch.linalg.solve(torch.cat([dst, ones], 1), torch.cat([src, ones], 1))[:, :2]  # 3×2
    ys, xs = torch.meshgrid(
        torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32), indexing="ij"
    )
    points = torch.stack([xs, ys, torch.ones_like(xs)], -1) @ inverse  # (H, W, 2) source pixel (x, y)
    noise = torch.rand(2, h, w, generator=g) * 2 - 1
    displacement = (
        _separable(noise, _gaussian_kernel1d(sigma, 2 * math.ceil(3 * sigma) + 1)) * alpha
    )  # dx, dy
    points = points + displacement.permute(1, 2, 0)
    grid = torch.stack([points[..., 0] / (w - 1), points[..., 1] / (h - 1)], -1) * 2 - 1
    return F.grid_sample(x[None], grid[None], mode="bilinear", padding_mode="reflection", align_corners=True)[
        0
    ]


_FUNCTIONS: dict[str, Callable[[Tensor, object, torch.Generator], Tensor]] = {
    "gaussian_noise": _gaussian_noise,
    "shot_noise": _shot_noise,
    "impulse_noise": _impulse_noise,
    "defocus_blur": _defocus_blur,
    "motion_blur": _motion_blur,
    "zoom_blur": _zoom_blur,
    "gaussian_blur": _gaussian_blur,
    "brightness": _brightness,
    "contrast": _contrast,
    "fog": _fog,
    "saturate": _saturate,
    "pixelate": _pixelate,
    "jpeg_compression": _jpeg_compression,
    "elastic_transform": _elastic_transform,
}
# ImageNet-C's own algorithm where the CIFAR preset departs from CIFAR-10-C's (see the module docstring)
_PRESET_FUNCTIONS: dict[str, dict[str, Callable[[Tensor, object, torch.Generator], Tensor]]] = {
    "imagenet": {"zoom_blur": functools.partial(_zoom_blur, zoom=_clipped_zoom)},
    "cifar": {},
}
