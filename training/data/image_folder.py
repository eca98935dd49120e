"""A labelled image folder, laid out as the ecosystem's image loaders read it.

``root/<class>/<file>``: one sub-folder per class, its name the label (torchvision's
``ImageFolder``, Keras' ``image_dataset_from_directory``). Files are PNG, JPEG or WebP
(``.png``, ``.jpg``, ``.jpeg``, ``.webp``, any case); other files and hidden ones (``.*``)
are left out and counted. Images are decoded by the service's own decoder
(:func:`service.items.decode_image`), so a bundle is trained on exactly the pixels the
service extracts from, under the same limits.

:func:`scan_folder` lists the classes and files and checks the layout; :func:`probe_sizes`
reads every file's dimensions from its header (nothing decoded) and checks each one against
the limits; :func:`load_image` decodes one file. Every problem is an
:class:`ImageFolderError` that says what was found, what is required and how to fix it,
naming the folder or file.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt
from PIL import Image, UnidentifiedImageError

from service.errors import InvalidItem, ItemTooLarge
from service.items import (
    ACCEPTED,
    IMAGE_FORMATS,
    Channels,
    decode_image,
    image_format,
    png_dimensions,
)

__all__ = [
    "IMAGE_SUFFIXES",
    "ImageFolder",
    "ImageFolderError",
    "load_image",
    "probe_sizes",
    "scan_folder",
]

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp"})
_LISTED = 5

FloatImage = npt.NDArray[np.float32]
Progress = Callable[[str, int, int], None]


class ImageFolderError(ValueError):
    """The folder cannot be trained on as it is (the message says why and what to do)."""


def _noop(stage: str, done: int, total: int) -> None:
    return None


def _shown(paths: Sequence[Path], root: Path) -> str:
    names = [str(p.relative_to(root)) if p.is_relative_to(root) else str(p) for p in paths]
    more = f" and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
    return ", ".join(names[:_LISTED]) + more


@dataclass(frozen=True)
class ImageFolder:
    """The files of a labelled folder: ``labels[i]`` is the index in ``classes`` of
    ``files[i]``'s class (classes sorted by name, as torchvision numbers them)."""

    root: Path
    classes: list[str]
    files: list[Path]
    labels: npt.NDArray[np.int64]
    ignored: list[Path] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        per_class = np.bincount(self.labels, minlength=len(self.classes))
        return {c: int(n) for c, n in zip(self.classes, per_class, strict=True)}

    def digests(self) -> list[str]:
        """Each file's content digest (to find the same picture in two places)."""
        return [hashlib.blake2b(p.read_bytes(), digest_size=16).hexdigest() for p in self.files]


def scan_folder(
    root: Path,
    *,
    classes: Sequence[str] | None = None,
    min_per_class: int = 2,
    option: str = "--data",
) -> ImageFolder:
    """The classes and image files under ``root``, checked: at least two classes (unless
    ``classes`` is given: a test folder is read with the training folder's classes and may
    hold any of them, not others), each with at least ``min_per_class`` images."""
    if not root.exists():
        raise ImageFolderError(f"{option} {root}: no such folder")
    if not root.is_dir():
        raise ImageFolderError(
            f"{option} {root} is a file; required: a folder with one sub-folder per class "
            f"({root}/<class>/<image>)"
        )
    subfolders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not subfolders:
        loose = [p for p in root.iterdir() if p.is_file() and not p.name.startswith(".")]
        raise ImageFolderError(
            f"{option} {root} has no class sub-folders (found {len(loose)} files at its top "
            f"level); required: one sub-folder per class holding that class's images, e.g. "
            f"{root}/cat/1.jpg and {root}/dog/2.png; fix: move each class's images into a "
            "folder named after the class"
        )
    names = [p.name for p in subfolders]
    if classes is not None:
        unknown = [n for n in names if n not in classes]
        if unknown:
            raise ImageFolderError(
                f"{option} {root} has class folders the training folder lacks: "
                f"{', '.join(map(repr, unknown))} (its classes: {', '.join(classes)}); fix: "
                "remove them, or add them to the training folder and rebuild"
            )
    elif len(names) < 2:
        raise ImageFolderError(
            f"{option} {root} has one class only ({names[0]!r}); required: at least 2 class "
            "sub-folders, a classifier needs something to tell apart; fix: add a folder per "
            "other class"
        )
    order = list(classes) if classes is not None else names
    files: list[Path] = []
    labels: list[int] = []
    ignored: list[Path] = []
    for folder in subfolders:
        found = sorted(p for p in folder.rglob("*") if p.is_file())
        images = [
            p
            for p in found
            if p.suffix.lower() in IMAGE_SUFFIXES
            and not any(part.startswith(".") for part in p.relative_to(folder).parts)
        ]
        kept = set(images)
        others = [p for p in found if p not in kept]
        ignored += others
        if len(images) < min_per_class and classes is None:
            seen = (
                f" (it holds {len(others)} other files: {_shown(others, root)})" if others else ""
            )
            raise ImageFolderError(
                f"class folder {folder} holds {len(images)} images{seen}; required: at least "
                f"{min_per_class} {ACCEPTED} files (.png, .jpg, .jpeg, .webp) per class; fix: "
                "add images of that class, or remove the folder"
            )
        files += images
        labels += [order.index(folder.name)] * len(images)
    if not files:
        raise ImageFolderError(
            f"{option} {root} holds no {ACCEPTED} files (.png, .jpg, .jpeg, .webp) in its "
            "class folders"
        )
    return ImageFolder(root, order, files, np.asarray(labels, dtype=np.int64), ignored)


def _header_size(raw: bytes) -> tuple[int, int]:
    """(width, height) from the file's header (Pillow opens lazily: nothing is decoded)."""
    fmt = image_format(raw)
    if fmt is None or fmt not in IMAGE_FORMATS:
        raise InvalidItem(f"not a {ACCEPTED} file (its first bytes are {raw[:8]!r})")
    declared = png_dimensions(raw) if fmt == "PNG" else None
    if declared is not None:  # as the service reads it: the IHDR bytes, before Pillow
        return declared
    with Image.open(io.BytesIO(raw), formats=[fmt]) as img:
        width, height = img.size
    return int(width), int(height)


def probe_sizes(
    folder: ImageFolder,
    *,
    max_pixels: int,
    min_side: int,
    progress: Progress = _noop,
) -> npt.NDArray[np.int64]:
    """Every file's (width, height), read from its header, as an (N, 2) array; every file
    over ``max_pixels``, under ``min_side`` or not readable as an image is named in one
    :class:`ImageFolderError` (up to five of each kind, with counts)."""
    sizes = np.zeros((len(folder.files), 2), dtype=np.int64)
    unreadable: list[tuple[Path, str]] = []
    large: list[tuple[Path, int, int]] = []
    small: list[tuple[Path, int, int]] = []
    for i, path in enumerate(folder.files):
        try:
            width, height = _header_size(path.read_bytes())
        except (InvalidItem, UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
            reason = exc.message if isinstance(exc, InvalidItem) else f"{type(exc).__name__}"
            unreadable.append((path, reason))
        except Image.DecompressionBombError:
            large.append((path, 0, 0))
        else:
            sizes[i] = (width, height)
            if width * height > max_pixels:
                large.append((path, width, height))
            elif min(width, height) < min_side:
                small.append((path, width, height))
        progress("scan", i + 1, len(folder.files))
    problems = []
    if unreadable:
        problems.append(
            f"{len(unreadable)} file(s) cannot be read as images: "
            + "; ".join(f"{p} ({why})" for p, why in unreadable[:_LISTED])
            + (" ..." if len(unreadable) > _LISTED else "")
            + "; fix: re-save them as PNG or JPEG, or delete them"
        )
    if large:
        problems.append(
            f"{len(large)} image(s) have more than {max_pixels} pixels (--max-pixels): "
            + ", ".join(f"{p} ({w}x{h})" if w else f"{p}" for p, w, h in large[:_LISTED])
            + (" ..." if len(large) > _LISTED else "")
            + "; fix: downscale them, or raise --max-pixels (the served bundle then accepts "
            "as many, up to the service's BUDGETSERVE_MAX_PIXELS)"
        )
    if small:
        problems.append(
            f"{len(small)} image(s) have a side under {min_side} pixels (--min-side): "
            + ", ".join(f"{p} ({w}x{h})" for p, w, h in small[:_LISTED])
            + (" ..." if len(small) > _LISTED else "")
            + "; fix: upscale them, or lower --min-side (at least 4, the built-in "
            "extractors' smallest side)"
        )
    if problems:
        raise ImageFolderError(f"{folder.root}: " + "\n".join(problems))
    return sizes


def load_image(path: Path, *, max_pixels: int, min_side: int, channels: Channels) -> FloatImage:
    """One file decoded as the service decodes an item; a file that does not decode is an
    :class:`ImageFolderError` naming it."""
    try:
        return decode_image(
            path.read_bytes(),
            max_pixels=max_pixels,
            min_side=min_side,
            channels=channels,
            field=str(path),
        )
    except (InvalidItem, ItemTooLarge) as exc:
        raise ImageFolderError(
            f"{path}: {exc.message}; fix: re-save it as PNG or JPEG, or delete it"
        ) from None
