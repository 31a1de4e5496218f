"""A small fake `imagenet2012` TFDS dataset, for smoke tests and benchmarks.

`build_fake_imagenet(data_dir, num_train=..., num_validation=...)` writes a
real TFDS dataset under `data_dir/imagenet2012/5.1.0/`, prepared in the
array_record format, that `tfds.data_source("imagenet2012",
data_dir=data_dir)` and `vmoe_ext.data.streaming.open_source` read exactly as
they read the real ImageNet: it is TFDS's own imagenet2012 builder (same
name, version and features: a JPEG "image", a 1000-class "label" and a
"file_name") with the ILSVRC archives replaced by generated images. Nothing
is downloaded and TensorFlow is not needed (nor imported).

Example i (train: i = 0 .. num_train - 1, validation: i = num_train ..
num_train + num_validation - 1) is a synthetic JPEG of `image_size` (a
colour gradient that depends on i, plus uniform noise drawn from `seed`
and i, so that it does not compress to nothing), with file_name
"n{i:08d}_{i}.JPEG" (a unique id: `int(file_name[1:9]) == i`) and label
(7 i + 3) mod 1000 (distinct for up to 1000 examples; i = (label - 3) * 143
mod 1000 inverts it). Each split is written as `num_shards` array_record
files.

Not for accuracy: the labels carry no information about the images.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import PIL.Image

JPEG_QUALITY = 95


def _image(i: int, height: int, width: int, seed: int) -> bytes:
  """Example i's JPEG bytes."""
  yy, xx = np.mgrid[:height, :width]
  image = np.stack([(xx * 4 + i) % 256, (yy * 4 + 3 * i) % 256,
                    np.full_like(xx, (11 * i) % 256)], -1)
  noise = np.random.default_rng([seed, i]).integers(
      -16, 17, size=image.shape)
  image = np.clip(image + noise, 0, 255).astype(np.uint8)
  buf = io.BytesIO()
  PIL.Image.fromarray(image).save(buf, format="jpeg", quality=JPEG_QUALITY)
  return buf.getvalue()


def build_fake_imagenet(data_dir: Any, *, num_train: int, num_validation: int,
                        image_size: tuple[int, int] = (64, 64),
                        num_shards: int = 4, seed: int = 0) -> None:
  """Writes a fake imagenet2012 (module docstring) under `data_dir`.

  Args:
    data_dir: the TFDS data_dir to write `imagenet2012/5.1.0/` into.
    num_train: examples of the "train" split.
    num_validation: examples of the "validation" split.
    image_size: (height, width) of every image.
    num_shards: array_record files per split.
    seed: the images' noise; ids, labels and file names do not depend on it.
  """
  import tensorflow_datasets as tfds  # Heavy optional import.
  from tensorflow_datasets.datasets.imagenet2012 import (
      imagenet2012_dataset_builder, imagenet_common)

  height, width = (int(s) for s in image_size)
  num_train, num_validation = int(num_train), int(num_validation)

  with tfds.core.registered.skip_registration():

    class FakeImagenet2012(imagenet2012_dataset_builder.Builder):
      """imagenet2012 5.1.0 with generated images instead of the archives."""

      name = "imagenet2012"

      # No code directory, hence no checksums file to look up: nothing is
      # downloaded. (TFDS would otherwise locate this module as a package
      # resource, which needs `importlib_resources`.)
      code_path = None

      def _info(self):  # The real features, without the metadata files.
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict({
                "image": tfds.features.Image(encoding_format="jpeg"),
                "label": tfds.features.ClassLabel(
                    names_file=imagenet_common.label_names_file()),
                "file_name": tfds.features.Text(),
            }),
            supervised_keys=("image", "label"))

      def _split_generators(self, dl_manager):
        del dl_manager
        return {"train": self._generate(0, num_train),
                "validation": self._generate(num_train,
                                             num_train + num_validation)}

      def _generate(self, start, stop):
        for i in range(start, stop):
          name = f"n{i:08d}_{i}.JPEG"
          yield name, {"image": _image(i, height, width, seed),
                       "label": (7 * i + 3) % 1000, "file_name": name}

  FakeImagenet2012(data_dir=str(data_dir), file_format="array_record"
                   ).download_and_prepare(download_config=(
                       tfds.download.DownloadConfig(num_shards=num_shards)))


def main(argv: Any = None) -> None:
  """`python -m vmoe_ext.data.fake_tfds --data_dir=DIR`: writes the fake
  imagenet2012 there (for a smoke test of `configs/imagenet.py`,
  docs/imagenet.md)."""
  import argparse
  parser = argparse.ArgumentParser(description=main.__doc__)
  parser.add_argument("--data_dir", required=True)
  parser.add_argument("--num_train", type=int, default=256)
  parser.add_argument("--num_validation", type=int, default=64)
  parser.add_argument("--image_size", type=int, default=256,
                      help="side of the square JPEGs")
  args = parser.parse_args(argv)
  build_fake_imagenet(args.data_dir, num_train=args.num_train,
                      num_validation=args.num_validation,
                      image_size=(args.image_size, args.image_size))
  print(f"fake imagenet2012 ({args.num_train} train, {args.num_validation} "
        f"validation images of {args.image_size} px) in {args.data_dir}")


if __name__ == "__main__":
  main()
