"""Image-folder datasets: `ROOT/<class name>/<image file>`, read with PIL.

This is the layout ImageNet-A, ImageNet-R and ImageNet-O are released in
(one folder per WordNet id). Classes are the sub-folders in sorted name order,
so label `j` is the `j`-th sorted class folder; for the 200-class ImageNet-A/R
folders that is position `j` of `IMAGENET_A_CLASSES` / `IMAGENET_R_CLASSES`
(see `vmoe_ext.evaluate.imagenet_subsets`). Files are taken in sorted order
within each class; hidden files and files without an image extension are
ignored. Images are decoded when read (nothing is cached), converted to RGB
(3 channels) or greyscale (1 channel) and scaled to [0, 1].
"""

from __future__ import annotations

import os

import numpy as np

from vmoe_ext.data import preprocessing
from vmoe_ext.errors import ConfigError, require

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif",
                    ".tiff", ".ppm", ".pgm")


class ImageFolderReader:
  """Random access to an image folder (`ExampleReader`)."""

  def __init__(self, path: str, *, channels: int = 3,
               max_examples: int | None = None,
               field: str = "path"):
    """Lists `path`'s class folders and image files.

    Args:
      path: the root directory; every sub-folder is a class.
      channels: 3 (RGB) or 1 (greyscale, PIL "L").
      max_examples: keep only the first N files in (class, file) order.
      field: config field named in errors.
    """
    require(isinstance(path, (str, os.PathLike)) and str(path), field,
            f"required: a directory of class folders, got {path!r}")
    path = os.fspath(path)
    require(os.path.isdir(path), field, f"directory {path!r} does not exist")
    require(channels in (1, 3), field,
            f"channels must be 1 or 3, got {channels!r}")
    classes = sorted(d for d in os.listdir(path)
                     if not d.startswith(".")
                     and os.path.isdir(os.path.join(path, d)))
    require(classes, field, f"{path!r} has no class sub-folders")
    files, labels = [], []
    for label, name in enumerate(classes):
      folder = os.path.join(path, name)
      for f in sorted(os.listdir(folder)):
        if not f.startswith(".") and f.lower().endswith(IMAGE_EXTENSIONS):
          files.append(os.path.join(folder, f))
          labels.append(label)
    require(files, field, f"{path!r} has no image files "
            f"(extensions {IMAGE_EXTENSIONS})")
    if max_examples is not None:
      require(isinstance(max_examples, (int, np.integer)) and max_examples > 0,
              field, f"max_examples must be a positive integer, got "
              f"{max_examples!r}")
      files, labels = files[:max_examples], labels[:max_examples]
    self.name = f"folder:{os.path.basename(os.path.normpath(path))}"
    self.class_names = tuple(classes)
    self.num_classes = len(classes)
    self.files = tuple(files)
    self.labels = np.asarray(labels, np.int32)
    self._channels = channels
    self._field = field

  def __len__(self) -> int:
    return len(self.files)

  def _load(self, filename: str) -> np.ndarray:
    import PIL.Image  # pylint: disable=g-import-not-at-top

    try:
      with PIL.Image.open(filename) as image:
        image = image.convert("RGB" if self._channels == 3 else "L")
        array = np.asarray(image, np.float32) / 255.0
    except (OSError, ValueError) as e:
      raise ConfigError(self._field,
                        f"cannot decode image {filename!r}: {e}") from e
    return array.reshape(array.shape[:2] + (self._channels,))

  def read(self, indices: np.ndarray, image_size: int | None
           ) -> tuple[np.ndarray, np.ndarray]:
    """`(images [n, S, S, C] float32 in [0, 1], labels [n] int32)`."""
    indices = np.asarray(indices, int).reshape(-1)
    images = [self._load(self.files[i]) for i in indices]
    return (preprocessing.stack_images(images, image_size, self.name,
                                       self._field, self._channels),
            self.labels[indices])
