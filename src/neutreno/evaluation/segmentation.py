"""Semantic segmentation scores and inference (math.md §4 Segmenter protocol): confusion-matrix mIoU and
pixel accuracy, sliding-window and multi-scale + flip inference, and a saved Segmenter's single- and
multi-scale mIoU (``neutreno eval``).

mIoU and pixel accuracy come from a confusion matrix accumulated over the whole evaluation set (and
summed over processes), as mmseg computes them: a class absent from both the labels and the
predictions has no IoU and is left out of the mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from neutreno.data.augment import normalize
from neutreno.data.segmentation import rescaled_size
from neutreno.evaluation.metric import MetricSums, NonFiniteOutputs
from neutreno.models import load_model
from neutreno.progress import progress as progress_bar
from neutreno.reporting import pyplot, save_figure

# ---- scores ---------------------------------------------------------------------------------------------


def confusion_matrix(pred: Tensor, target: Tensor, num_classes: int, ignore_index: int = 255) -> Tensor:
    """Counts (K, K) int64 of (true class, predicted class) over the pixels whose target is not ignored.

    Args:
        pred: predicted classes, any shape. target: true classes, same shape; ``ignore_index`` skips.
    Raises:
        ValueError: a target or prediction outside ``0 … K − 1`` (other than the ignore index).
    """
    if pred.shape != target.shape:
        raise ValueError(f"pred {tuple(pred.shape)} and target {tuple(target.shape)} differ in shape")
    keep = target != ignore_index
    pred, target = pred[keep].long(), target[keep].long()
    if pred.numel() and (min(pred.min(), target.min()) < 0 or max(pred.max(), target.max()) >= num_classes):
        raise ValueError(f"classes must be in 0…{num_classes - 1} (or the ignore index {ignore_index})")
    counts = torch.bincount(target * num_classes + pred, minlength=num_classes * num_classes)
    return counts.view(num_classes, num_classes)


def segmentation_scores(confusion: Tensor) -> dict[str, float | list[float]]:
    """mIoU and pixel accuracy (percent) and per-class IoU (percent, NaN for a class absent from both
    labels and predictions) from a confusion matrix (K, K), rows true, columns predicted. ValueError
    when no pixel is labelled (every one ignored: pixel accuracy read 0, mIoU NaN)."""
    confusion = confusion.double()
    if confusion.sum() <= 0:
        raise ValueError(
            "no labelled pixel was scored (every pixel is ignored): mIoU and accuracy are undefined"
        )
    hits = confusion.diagonal()
    union = confusion.sum(0) + confusion.sum(1) - hits
    iou = torch.where(union > 0, hits / union.clamp_min(1), torch.full_like(hits, float("nan")))
    present = ~iou.isnan()
    return {
        "miou": 100 * iou[present].mean().item() if present.any() else float("nan"),
        "pixel_acc": 100 * (hits.sum() / confusion.sum().clamp_min(1)).item(),
        "iou": (100 * iou).tolist(),
    }


# ---- inference ------------------------------------------------------------------------------------------


def sliding_window_logits(
    model: nn.Module, images: Tensor, *, window: int, stride: int, crops_per_forward: int = 32
) -> Tensor:
    """Logits (B, K, H, W) of normalised images (B, 3, H, W) from ``window``² crops every ``stride`` pixels
    (the last crop of a row or column flush with the border), averaged where crops overlap — mmseg's
    ``slide_inference``. A side shorter than the window is one crop of that side's length; an image
    that fits is one forward of the model. The crops go through the model ``crops_per_forward`` at a
    time (at least one image's), as Segmenter's batches of windows do: all at once, a small stride's
    1,350 crops of one image took 1 GB for a tiny model, and more than a GPU holds for a real one."""
    if window < 1 or not 1 <= stride <= window:  # a stride past the window leaves pixels no crop covers
        raise ValueError(f"need 1 <= stride <= window, got window {window} and stride {stride}")
    height, width = images.shape[-2:]
    rows = max(height - window + stride - 1, 0) // stride + 1
    cols = max(width - window + stride - 1, 0) // stride + 1
    boxes = []
    for i in range(rows):
        for j in range(cols):
            bottom, right = min(i * stride + window, height), min(j * stride + window, width)
            boxes.append((max(bottom - window, 0), bottom, max(right - window, 0), right))
    if len(boxes) == 1:
        return model(images).float()
    per_forward = max(1, crops_per_forward // images.shape[0])  # boxes per forward, each B crops
    logits, counts = None, images.new_zeros(height, width, dtype=torch.float32)
    for start in range(0, len(boxes), per_forward):
        chunk = boxes[start : start + per_forward]
        crops = torch.cat([images[..., t:b, l:r] for t, b, l, r in chunk])  # all crops have one shape
        crop_logits = model(crops).float().split(images.shape[0])
        if logits is None:
            logits = images.new_zeros(
                images.shape[0], crop_logits[0].shape[1], height, width, dtype=torch.float32
            )
        for (t, b, l, r), part in zip(chunk, crop_logits, strict=True):
            logits[..., t:b, l:r] += part
            counts[t:b, l:r] += 1
    return logits / counts


def segment_probabilities(
    model: nn.Module,
    image: Tensor,
    *,
    mean: Sequence[float],
    std: Sequence[float],
    window: int,
    stride: int,
    eval_size: int | None = None,
    scales: Sequence[float] = (1.0,),
    flip: bool = False,
) -> Tensor:
    """Class probabilities (K, H, W) of one uint8 image (3, H, W), averaged over ``scales`` (and
    horizontal flips), as Segmenter's test does: at each scale the image is resized so its short side is
    ``scale × eval_size`` (:func:`~neutreno.data.segmentation.rescaled_size`, mmseg's test resize) or,
    without ``eval_size``, its own short side × ``scale``; then, where that short side is below the window,
    up to the window (Segmenter's ``inference``: the model sees only window² crops), segmented by
    :func:`sliding_window_logits`, the logits resized back to H × W and turned into probabilities.
    ``scales=(1,)`` without flip is single-scale (SS); the paper's multi-scale (MS) test uses 0.5 … 1.75
    with flips (math.md §4)."""
    height, width = image.shape[-2:]
    x = normalize(image[None], mean, std)
    total = None
    for scale in scales:
        if eval_size is None:
            size = (max(1, round(height * scale)), max(1, round(width * scale)))
        else:
            size = rescaled_size(height, width, scale * eval_size)
        scaled = x if size == (height, width) else F.interpolate(x, size=size, mode="bilinear")
        if min(size) < window:  # then Segmenter's resize(im, window_size), the long side truncated: the
            short, long = sorted(size)  # image at this scale enlarged (blurred), not the original resized
            size = (window, int(long / short * window))[:: 1 if size[0] <= size[1] else -1]
            scaled = F.interpolate(scaled, size=size, mode="bilinear")
        for flipped in (False, True) if flip else (False,):
            logits = sliding_window_logits(
                model, scaled.flip(-1) if flipped else scaled, window=window, stride=stride
            )
            if not bool(torch.isfinite(logits).all()):  # the argmax of NaN is a class: a silent score
                raise NonFiniteOutputs(
                    "the Segmenter's logits are not finite (NaN or inf): its weights overflow, so no score "
                    "of them means anything"
                )
            logits = logits.flip(-1) if flipped else logits
            if logits.shape[-2:] != (height, width):
                logits = F.interpolate(logits, size=(height, width), mode="bilinear")
            probabilities = logits.softmax(1)[0]
            total = probabilities if total is None else total + probabilities
    return total / (len(scales) * (2 if flip else 1))


MS_SCALES = (0.5, 0.75, 1.0, 1.25, 1.5, 1.75)  # the paper's multi-scale test (math.md §4), with flips


# ---- a saved Segmenter ----------------------------------------------------------------------------------


@torch.no_grad()
def evaluate_segmentation(
    checkpoint: str | Path,
    data: str | Path | None = None,
    *,
    split: str | None = None,
    scales: tuple[float, ...] = MS_SCALES,
    stride: int | None = None,
    device: str = "auto",
    overlay: Path | None = None,
    overlay_count: int = 4,
) -> dict:
    """Single-scale (SS) and multi-scale + flip (MS) mIoU, pixel accuracy and per-class IoU of a trained
    Segmenter on ``data``/``split`` (default: the dataset and validation split it was trained with; on
    other data, split ``val``), with the inference settings
    its metadata records (math.md §4 protocol); also the mean last-layer token cosine similarity of the
    encoder (math.md §3, over CLS and patch tokens) on the same images at scale 1.

    ``stride``: the sliding window's stride, 1 … window (default: the one the run validated with,
    ``data.window_stride``). Segmenter's ``segm/eval/miou.py``, behind its published SS/MS figures,
    defaults to the window − 32 (480 for 512² windows); its training-time validation to the window.

    ``overlay``: a PNG of ``overlay_count`` images spread evenly over the split (video datasets such as
    CamVid have near-identical neighbours), their labels and the MS predictions.
    """
    from neutreno.data.segmentation import open_segmentation_dataset
    from neutreno.diagnostics import capture_hidden_states, token_cosine_similarity
    from neutreno.training.checkpoint import resolve_weights
    from neutreno.training.distributed import resolve_device

    weights = resolve_weights(checkpoint)
    model, meta = load_model(weights)
    seg = meta.get("segmentation")
    if seg is None:
        raise ValueError(f"{weights} is not a segmentation model trained by neutreno (no label metadata)")
    labels = {k: seg[k] for k in ("num_classes", "ignore_index", "label_offset", "void_label")}
    if split is None:  # ADE20K's is "validation"; a run saved before the split was recorded: "val"
        trained_on = data is None or Path(data).resolve() == Path(seg["root"])
        split = seg.get("split", "val") if trained_on else "val"
    if data is None and not Path(seg["root"]).exists():
        raise FileNotFoundError(
            f"{weights} was trained on {seg['root']}, which is no longer there: pass --data with where it "
            "is now"
        )
    data = Path(data or seg["root"])
    dataset = open_segmentation_dataset(data, split, **labels)
    target = resolve_device(device)
    model.to(target)
    infer = {k: seg[k] for k in ("mean", "std", "window", "stride", "eval_size")}
    if stride is not None:
        if not 1 <= stride <= infer["window"]:  # beyond the window, pixels between windows go unscored
            raise ValueError(f"--stride must be between 1 and the window, {infer['window']}, got {stride}")
        infer["stride"] = stride
    num_classes, ignore = seg["num_classes"], seg["ignore_index"]
    confusion = {name: MetricSums() for name in ("ss", "ms")}  # {"confusion": (K, K)} on the CPU
    cosines, shown = [], []
    to_show = set(
        torch.linspace(0, len(dataset) - 1, min(overlay_count, len(dataset))).round().long().tolist()
    )
    for index in progress_bar(range(len(dataset)), desc="segment", unit="image", leave=False):
        image, truth = dataset[index]
        image = image.to(target)
        ss = segment_probabilities(model, image, **infer).argmax(0).cpu()
        ms = segment_probabilities(model, image, **infer, scales=scales, flip=True).argmax(0).cpu()
        confusion["ss"].update({"confusion": confusion_matrix(ss, truth, num_classes, ignore)})
        confusion["ms"].update({"confusion": confusion_matrix(ms, truth, num_classes, ignore)})
        with capture_hidden_states(model.encoder.blocks) as hidden:
            model.forward_features(normalize(image[None], seg["mean"], seg["std"]))
        cosines.append(token_cosine_similarity(hidden[-1]).item())
        if index in to_show:
            shown.append((image.cpu(), truth, ms))
    results: dict = {"checkpoint": str(weights), "data": str(data), "split": split}
    results |= {
        "images": len(dataset),
        "scales": list(scales),
        "window": infer["window"],
        "stride": infer["stride"],
    }
    names = seg["class_names"]
    if len(set(names)) < len(names):  # a checkpoint from before repeats were refused: keyed by name, a
        names = [f"{name} ({c})" for c, name in enumerate(names)]  # repeated one hid the other's IoU
    for name, metric in confusion.items():
        scores = segmentation_scores(metric.compute()["confusion"])
        per_class = dict(zip(names, scores.pop("iou"), strict=True))
        results[name] = {**scores, "iou": per_class}
    results["last_layer_token_cosine"] = sum(cosines) / len(cosines)
    if overlay is not None:
        save_overlays(shown, overlay, num_classes, ignore, names)
    return results


def overlay_palette(samples: list[tuple[Tensor, Tensor, Tensor]], num_classes: int, ignore: int) -> Tensor:
    """An RGB colour per class (num_classes, 3), distinct for every class the samples' labels or
    predictions show: tab20's strong colours, their light twins, then tab20b's and tab20c's, and hues
    spread evenly past 60 classes. (tab20 repeated every 20 classes drew ADE20K's wall and car alike.)"""
    plt = pyplot()
    shown = sorted(
        {
            c
            for _, truth, pred in samples
            for mask in (truth, pred)
            for c in mask[mask != ignore].clamp(0, num_classes - 1).unique().tolist()
        }
    )
    tab20 = torch.tensor(plt.get_cmap("tab20").colors)
    colours = torch.cat(
        [tab20[0::2], tab20[1::2], *(torch.tensor(plt.get_cmap(m).colors) for m in ("tab20b", "tab20c"))]
    )
    if len(shown) > len(colours):
        colours = torch.tensor(plt.get_cmap("hsv")(torch.linspace(0, 1, len(shown) + 1)[:-1].numpy())[:, :3])
    palette = torch.zeros(num_classes, 3, dtype=colours.dtype)
    palette[shown] = colours[: len(shown)]
    return palette


def save_overlays(
    samples: list[tuple[Tensor, Tensor, Tensor]],
    path: Path,
    num_classes: int,
    ignore: int,
    class_names: Sequence[str] | None = None,
) -> None:
    """A PNG with one row per (image uint8 (3, H, W), labels (H, W), prediction (H, W)): the image, then
    labels and prediction coloured over it (ignored pixels left uncoloured), and a key naming the colour
    of every class shown."""
    from matplotlib.patches import Patch

    plt = pyplot()

    palette = overlay_palette(samples, num_classes, ignore)
    fig, axes = plt.subplots(
        len(samples), 3, figsize=(9, 2.6 * len(samples) + 0.8), squeeze=False, layout="constrained"
    )
    present: set[int] = set()
    for row, (image, truth, pred) in zip(axes, samples, strict=True):
        rgb = image.permute(1, 2, 0).float() / 255
        titles = ("image", "labels (ground truth)", "prediction (multi-scale + flip)")
        for ax, mask, title in zip(row, (None, truth, pred), titles, strict=True):
            shown = rgb
            if mask is not None:
                valid = (mask != ignore)[..., None]
                colours = palette[mask.clamp(0, num_classes - 1)]
                shown = torch.where(valid, 0.35 * rgb + 0.65 * colours, rgb)
                present.update(mask[mask != ignore].clamp(0, num_classes - 1).unique().tolist())
            ax.imshow(shown.numpy())
            ax.set_title(title, fontsize=9)
            ax.axis("off")
    names = class_names or [f"class {c}" for c in range(num_classes)]
    key = [Patch(color=palette[c].tolist(), label=names[c]) for c in sorted(present)]
    key.append(Patch(facecolor="none", edgecolor="grey", label="ignored (uncoloured)"))
    fig.legend(handles=key, loc="outside lower center", ncol=min(6, len(key)), fontsize=8, frameon=False)
    save_figure(fig, path, dpi=100)
