"""Local corruption suite: contract, determinism, severity order, sanity."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.ndimage
from sklearn.datasets import load_sample_image

from vmoe_ext.data import corruptions
from vmoe_ext.data.builtin import load_mnist5k
from vmoe_ext.data.corruptions import CORRUPTIONS, SEVERITIES, corrupt
from vmoe_ext.data.preprocessing import resize
from vmoe_ext.errors import ConfigError

RANDOM = ("gaussian_noise", "shot_noise", "impulse_noise", "glass_blur",
          "motion_blur", "snow", "frost", "fog", "elastic_transform")
DETERMINISTIC = tuple(c for c in CORRUPTIONS if c not in RANDOM)


@pytest.fixture(scope="module")
def digits() -> np.ndarray:
  """40 real MNIST digits `[40, 28, 28, 1]` (4 per class)."""
  images, _ = load_mnist5k("test")
  return images[::25]


@pytest.fixture(scope="module")
def natural() -> np.ndarray:
  """24 natural RGB images `[24, 32, 32, 3]` (crops of sklearn's photos)."""
  crops = []
  for name in ("china.jpg", "flower.jpg"):
    photo = load_sample_image(name).astype(np.float32) / 255
    for y in range(0, 300, 100):
      for x in range(0, 600, 150):
        crops.append(photo[y:y + 100, x:x + 100])
  return np.clip(resize(np.stack(crops), 32), 0, 1)


@pytest.fixture(scope="module")
def smooth() -> np.ndarray:
  """8 smooth random RGB images `[8, 32, 32, 3]` spanning [0, 1]."""
  x = scipy.ndimage.gaussian_filter(
      np.random.default_rng(0).random((8, 32, 32, 3)), (0, 2, 2, 0))
  lo = x.min(axis=(1, 2, 3), keepdims=True)
  hi = x.max(axis=(1, 2, 3), keepdims=True)
  return ((x - lo) / (hi - lo)).astype(np.float32)


def test_names_follow_design_order():
  assert CORRUPTIONS == (
      "gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur",
      "glass_blur", "motion_blur", "zoom_blur", "snow", "frost", "fog",
      "brightness", "contrast", "elastic_transform", "pixelate",
      "jpeg_compression")
  assert SEVERITIES == (1, 2, 3, 4, 5)


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_shape_dtype_range_every_severity(name, digits, natural):
  for images in (digits[:4], natural[:3]):
    for severity in SEVERITIES:
      out = corrupt(images, name, severity, seed=3)
      assert out.shape == images.shape and out.dtype == np.float32
      assert np.isfinite(out).all()
      assert out.min() >= 0.0 and out.max() <= 1.0


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_float64_non_square_and_empty(name):
  x = np.random.default_rng(1).random((2, 20, 27, 3))
  out = corrupt(x, name, 3)
  assert out.shape == x.shape and out.dtype == np.float64
  assert 0.0 <= out.min() and out.max() <= 1.0
  empty = corrupt(np.zeros((0, 8, 8, 1), np.float32), name, 1)
  assert empty.shape == (0, 8, 8, 1)


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_deterministic_given_seed(name, natural):
  x = natural[:4]
  a = corrupt(x, name, 4, seed=7)
  np.testing.assert_array_equal(a, corrupt(x, name, 4, seed=7))
  other = corrupt(x, name, 4, seed=8)
  if name in RANDOM:
    assert not np.array_equal(a, other)
  else:
    np.testing.assert_array_equal(a, other)


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_mean_change_grows_with_severity(name, digits, natural, smooth):
  """Strictly increasing mean |corrupt(x) - x| on three kinds of images.

  No corruption saturates on these images (none is all-white, so brightness
  and frost still have room), so no equality is allowed.
  """
  for images in (digits, natural, smooth):
    change = [np.abs(corrupt(images, name, s) - images).mean()
              for s in SEVERITIES]
    assert all(b > a for a, b in zip(change, change[1:])), (name, change)
    assert change[0] > 0


def test_brightness_increases_mean(digits, natural):
  for images in (digits, natural):
    means = [images.mean()] + [corrupt(images, "brightness", s).mean()
                               for s in SEVERITIES]
    assert all(b > a for a, b in zip(means, means[1:]))
  # Grayscale: exactly x + 0.05 below the clip.
  x = np.full((1, 4, 4, 1), 0.5, np.float32)
  np.testing.assert_allclose(corrupt(x, "brightness", 1), 0.55, rtol=1e-6)


def test_brightness_rgb_keeps_hue_and_saturation():
  x = np.array([[[[0.4, 0.2, 0.1], [0.0, 0.0, 0.0]]]], np.float32)
  out = corrupt(x, "brightness", 5)  # V 0.4 -> 0.7: every channel * 7/4.
  np.testing.assert_allclose(out[0, 0, 0], [0.7, 0.35, 0.175], rtol=1e-6)
  np.testing.assert_allclose(out[0, 0, 1], [0.3, 0.3, 0.3], rtol=1e-6)


def test_contrast_reduces_std_keeps_mean(digits, natural):
  for images in (digits, natural):
    std = images.std(axis=(1, 2))
    for s in SEVERITIES:
      out = corrupt(images, "contrast", s)
      assert (out.std(axis=(1, 2)) < std).all()
      np.testing.assert_allclose(out.mean(axis=(1, 2)),
                                 images.mean(axis=(1, 2)), atol=1e-5)
  out = corrupt(natural, "contrast", 5)  # factor 0.15
  np.testing.assert_allclose(out.std(axis=(1, 2)),
                             0.15 * natural.std(axis=(1, 2)), rtol=1e-3)


def test_pixelate_makes_constant_block_means(digits):
  out = corrupt(digits, "pixelate", 5)  # factor 0.5: 28 -> 14 -> 28.
  blocks = out.reshape(-1, 14, 2, 14, 2, 1)
  assert np.ptp(blocks, axis=(2, 4)).max() < 1e-6
  means = digits.reshape(-1, 14, 2, 14, 2, 1).mean(axis=(2, 4))
  np.testing.assert_allclose(blocks[:, :, 0, :, 0], means, atol=1e-6)


@pytest.mark.parametrize("name", ["defocus_blur", "glass_blur", "motion_blur",
                                  "zoom_blur", "elastic_transform",
                                  "pixelate", "contrast", "jpeg_compression"])
def test_constant_images_unchanged(name):
  """Spatial filters and contrast leave a constant image as it is."""
  x = np.full((3, 28, 28, 1), 0.4, np.float32)
  np.testing.assert_allclose(corrupt(x, name, 5, seed=2), x, atol=1e-2
                             if name == "jpeg_compression" else 1e-5)


def test_gaussian_noise_statistics():
  x = np.full((50, 32, 32, 3), 0.5, np.float32)
  delta = corrupt(x, "gaussian_noise", 5) - x  # sigma 0.10, no clipping.
  assert abs(delta.mean()) < 2e-3
  assert delta.std() == pytest.approx(0.10, rel=0.02)


def test_impulse_noise_fraction():
  x = np.full((20, 32, 32, 3), 0.5, np.float32)
  out = corrupt(x, "impulse_noise", 5)
  hit = out != 0.5
  assert set(np.unique(out[hit])) <= {0.0, 1.0}
  assert hit.mean() == pytest.approx(0.07, abs=0.01)


def test_frost_texture_range_and_brightness():
  tex = corruptions.frost_texture(np.random.default_rng(0), 16, 32, 32, 3)
  assert tex.shape == (16, 32, 32, 3)
  assert tex.min() >= 0 and tex.max() <= 1
  assert 0.3 < tex.mean() < 0.5
  assert tex.std(axis=(1, 2, 3)).min() > 0.05  # Textured, not flat.


def test_defocus_kernel_normalised_and_growing():
  kernels = [corruptions.defocus_kernel(r, a)
             for r, a in ((0.3, 0.4), (1.0, 0.2), (1.5, 0.1))]
  centres = []
  for k in kernels:
    assert k.sum() == pytest.approx(1.0, rel=1e-5)
    np.testing.assert_allclose(k, k.T, atol=1e-7)
    centres.append(k[k.shape[0] // 2, k.shape[1] // 2])
  assert centres[0] > centres[1] > centres[2]


def test_unknown_name_raises():
  with pytest.raises(ConfigError) as e:
    corrupt(np.zeros((1, 8, 8, 1), np.float32), "speckle_noise", 1)
  assert e.value.field == "corruption.name"


@pytest.mark.parametrize("severity", [0, 6, -1, 2.0, True, "3"])
def test_bad_severity_raises(severity):
  with pytest.raises(ConfigError) as e:
    corrupt(np.zeros((1, 8, 8, 1), np.float32), "fog", severity)
  assert e.value.field == "corruption.severity"


@pytest.mark.parametrize("images", [np.zeros((8, 8, 1), np.float32),
                                    np.zeros((1, 8, 8, 2), np.float32),
                                    np.zeros((1, 8, 8, 3), np.uint8)])
def test_bad_images_raise(images):
  with pytest.raises(ConfigError) as e:
    corrupt(images, "fog", 1)
  assert e.value.field == "corruption.images"


def test_bad_seed_raises():
  with pytest.raises(ConfigError) as e:
    corrupt(np.zeros((1, 8, 8, 1), np.float32), "fog", 1, seed=-1)
  assert e.value.field == "corruption.seed"
