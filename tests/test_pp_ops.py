"""Preprocessing ops, the preprocessing-string parser and batch mixup.

Each op is checked on small arrays against PIL or a hand computation of
big_vision's / TF's definition (see vmoe_ext/data/pp/*.py for the upstream
semantics).
"""

from __future__ import annotations

import functools
import io

import jax
import numpy as np
import pytest
from PIL import Image, ImageEnhance, ImageOps

from vmoe_ext.data import mixup as mx
from vmoe_ext.data.pp import RANDOM_OPS, parse
from vmoe_ext.data.pp import geometry as geo
from vmoe_ext.data.pp import randaugment as ra
from vmoe_ext.errors import ConfigError, InputError

NEAREST = Image.Resampling.NEAREST
GREY = (128, 128, 128)
TRAIN = ("decode_jpeg_and_inception_crop(224)|flip_lr|randaug(2, 10)|"
         "value_range(-1, 1)")
EVAL = "decode|resize_small(256)|central_crop(224)|value_range(-1, 1)"


def _image(h=17, w=23, seed=0, low=0, high=256):
  return np.random.default_rng(seed).integers(low, high, (h, w, 3), np.uint8)


def _png(array: np.ndarray, mode: str | None = None) -> bytes:
  buf = io.BytesIO()
  Image.fromarray(array, mode).save(buf, format="PNG")
  return buf.getvalue()


# --------------------------------------------------------------------------
# Parser.


def test_parse_round_trip_and_random_ops():
  p = parse(TRAIN)
  assert p.names == ("decode_jpeg_and_inception_crop", "flip_lr", "randaug",
                     "value_range")
  assert p.spec == TRAIN
  assert parse(p.spec) == p
  assert p.random_ops == ("decode_jpeg_and_inception_crop", "flip_lr",
                          "randaug")
  q = parse(" decode | resize_small(256) |central_crop(crop_size=224)| "
            "value_range(-1,1) ")
  assert q.spec == ("decode|resize_small(256)|central_crop(crop_size=224)|"
                    "value_range(-1, 1)")
  assert parse(q.spec) == q and q.random_ops == ()
  multiline = parse("decode|\n  resize_small(256) |\n  central_crop(224)")
  assert multiline.spec == "decode|resize_small(256)|central_crop(224)"
  assert parse(EVAL) != q  # crop_size given by keyword vs position.
  assert RANDOM_OPS == {"inception_crop", "decode_jpeg_and_inception_crop",
                        "flip_lr", "randaug"}


def test_random_pipeline_needs_a_generator():
  with pytest.raises(ValueError, match="np.random.Generator"):
    parse("flip_lr")(_image())
  out = parse("central_crop(8)")(_image())  # Deterministic: no rng needed.
  assert out.shape == (8, 8, 3)


@pytest.mark.parametrize("spec,needle", [
    ("decode|resize_smal(256)", "resize_smal"),
    ("decode|onehot(1000)", "label_smoothing"),
    ("__import__('os').system('true')", "__import__"),
])
def test_parse_unknown_op_names_it_and_lists_known_ops(spec, needle):
  with pytest.raises(ConfigError) as e:
    parse(spec, field="data.eval.pp")
  assert e.value.field == "data.eval.pp"
  assert needle in str(e.value)
  assert "known ops" in str(e.value) and "inception_crop" in str(e.value)


@pytest.mark.parametrize("spec,needle", [
    ("resize()", "resize()"),
    ("resize(224, 'bilinear', False, 3)", "resize(224"),
    ("resize(size=-1)", "argument size"),
    ("resize(224, method='cubic')", "argument method"),
    ("resize_small([2, 3])", "argument size"),
    ("randaug(2, 'x')", "argument magnitude"),
    ("randaug(2, 40)", "argument magnitude"),
    ("randaug(-1, 10)", "argument num_layers"),
    ("inception_crop(224, area_min=0)", "argument area_min"),
    ("inception_crop(224, ratio_min=2, ratio_max=1)", "argument ratio_min"),
    ("value_range(-1, 1, in_min=1, in_max=1)", "argument in_min"),
    ("value_range(-1, 1, in_min='a')", "value_range"),
    ("central_crop(foo)", "literal"),
    ("flip_lr(1)", "flip_lr(1)"),
    ("decode(**kw)", "**kwargs"),
    ("decode(channels=2)", "argument channels"),
    ("randaug(2, 10)(3)", "not an op"),
    ("vmoe.decode", "not an op"),
    ("decode||resize(2)", "cannot parse"),
    ("", "non-empty"),
])
def test_parse_bad_input_raises_config_error_on_the_field(spec, needle):
  with pytest.raises(ConfigError) as e:
    parse(spec)
  assert e.value.field == "data.pp"
  assert needle in str(e.value)


# --------------------------------------------------------------------------
# decode.


def test_decode_png_grey_rgba_arrays_and_jpeg():
  img = _image()
  assert np.array_equal(geo.decode_image(_png(img)), img)
  grey = img[..., 0]
  assert np.array_equal(geo.decode_image(_png(grey)),
                        np.repeat(grey[..., None], 3, -1))
  rgba = np.concatenate([img, img[..., :1]], -1)
  assert np.array_equal(geo.decode_image(_png(rgba, "RGBA")), img)
  assert geo.decode_image(img) is img
  assert np.array_equal(geo.decode_image(grey), np.repeat(grey[..., None], 3,
                                                          -1))
  buf = io.BytesIO()
  Image.fromarray(img).save(buf, format="JPEG", quality=90)
  jpeg = buf.getvalue()
  expected = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"))
  assert np.array_equal(parse("decode")(jpeg), expected)
  assert parse("decode(channels=1)")(img).shape == (17, 23, 1)
  with pytest.raises(InputError, match="start the pipeline with decode"):
    parse("resize(8)")(jpeg)


# --------------------------------------------------------------------------
# Inception crop.


class _Scripted:
  """A generator stand-in returning scripted draws (for hand cases)."""

  def __init__(self, uniforms=(), integers=()):
    self.uniforms, self.ints = list(uniforms), list(integers)
    self.int_calls = []

  def random(self):
    return self.uniforms.pop(0)

  def integers(self, low, high):
    self.int_calls.append((low, high))
    return self.ints.pop(0)


def test_sample_distorted_box_hand_cases():
  # Area fixed at 1/4 of 100x100 and aspect 1: always 50x50; y, x drawn
  # from [0, 50) (TF's Uniform(n) excludes n).
  rng = _Scripted(uniforms=[0.3], integers=[49, 7])
  assert geo.sample_distorted_box(100, 100, rng, (0.25, 0.25),
                                  (1.0, 1.0)) == (49, 7, 50, 50)
  assert rng.int_calls == [(0, 50), (0, 50)]
  # Aspect 2 at half the area: 50 rows, the full width (no x draw).
  rng = _Scripted(uniforms=[0.9], integers=[13])
  assert geo.sample_distorted_box(100, 100, rng, (0.5, 0.5),
                                  (2.0, 2.0)) == (13, 0, 50, 100)
  # Heights drawn from the closed range [round(sqrt(min/ar)), max_height]:
  # 100x100, area [0.25, 1], aspect 1: h in [50, 100] -> integers(0, 51).
  rng = _Scripted(uniforms=[0.5], integers=[10, 3, 4])
  assert geo.sample_distorted_box(100, 100, rng, (0.25, 1.0),
                                  (1.0, 1.0)) == (3, 4, 60, 60)
  assert rng.int_calls == [(0, 51), (0, 40), (0, 40)]


def test_sample_distorted_box_falls_back_to_the_whole_image():
  # A 10x40 image has no box of the full area with aspect in [0.75, 1.33].
  rng = np.random.default_rng(0)
  assert geo.sample_distorted_box(10, 40, rng, (1.0, 1.0)) == (0, 0, 10, 40)


def test_inception_crop_box_statistics_over_seeds():
  h_img, w_img = 48, 64
  rng = np.random.default_rng(1)
  boxes = np.array([geo.sample_distorted_box(h_img, w_img, rng)
                    for _ in range(3000)])
  y, x, h, w = boxes.T
  frac = h * w / (h_img * w_img)
  aspect = w / h
  assert np.all(frac >= 0.05 - 1e-6) and np.all(frac <= 1.0)
  # width = round(h * ar): the aspect is within 0.5 / h of [0.75, 1.33].
  assert np.all(aspect >= 0.75 - 0.5 / h) and np.all(aspect <= 1.33 + 0.5 / h)
  assert frac.min() < 0.08 and frac.max() > 0.85  # Covers the range.
  assert aspect.min() < 0.8 and aspect.max() > 1.28
  assert np.all(y + h <= h_img) and np.all(x + w <= w_img)
  # TF never draws the last offset: a smaller box never touches the edge.
  assert np.all((y + h < h_img) | (h == h_img))
  assert np.all((x + w < w_img) | (w == w_img))
  assert len(set(y.tolist())) > 10 and len(set(x.tolist())) > 10


def test_inception_crop_is_the_box_cropped_then_resized():
  img = _image(40, 30, seed=3)
  for seed in range(5):
    box = geo.sample_distorted_box(40, 30, np.random.default_rng(seed))
    y, x, h, w = box
    crop = img[y:y + h, x:x + w]
    out = parse("inception_crop(16)")(img, np.random.default_rng(seed))
    assert np.array_equal(out, geo.resize_image(crop, (16, 16)))
    raw = parse("inception_crop")(img, np.random.default_rng(seed))
    assert np.array_equal(raw, crop)
    fused = parse("decode_jpeg_and_inception_crop(16)")(
        _png(img), np.random.default_rng(seed))
    assert np.array_equal(fused, out)
  # Upsampling (bilinear, no antialias) agrees with PIL's float bilinear.
  # Aspect 0.75 (u = 0), height round(sqrt(0.05 * 1200 / 0.75)) = 9 (+0),
  # width round(9 * 0.75) = 7, at (5, 3).
  assert geo.sample_distorted_box(40, 30, _Scripted([0.0], [0, 5, 3])) == (
      5, 3, 9, 7)
  crop = img[5:14, 3:10]
  out = parse("inception_crop(24)")(img, _Scripted([0.0], [0, 5, 3]))
  assert out.shape == (24, 24, 3)
  ref = _pil_float_resize(crop, 24, 24)
  assert np.all(np.abs(out - ref) < 1.0 + 1e-3)


# --------------------------------------------------------------------------
# flip, resize, crops, value range.


def test_flip_lr_exact_and_about_half_the_time():
  img = _image()
  flipped = 0
  for seed in range(400):
    out = parse("flip_lr")(img, np.random.default_rng(seed))
    flip = np.random.default_rng(seed).random() < 0.5
    assert np.array_equal(out, img[:, ::-1] if flip else img)
    flipped += flip
  assert 160 < flipped < 240


def _pil_float_resize(img, h, w):
  return np.stack([np.asarray(Image.fromarray(
      img[..., c].astype(np.float32), "F").resize(
          (w, h), Image.Resampling.BILINEAR)) for c in range(3)], -1)


def test_bilinear_resize_hand_case_and_pil():
  # TF half-pixel bilinear 2x2 -> 4x4: fractions 0, 1/4, 3/4, 1 per axis.
  img = np.array([[0, 200], [100, 40]], np.uint8)[..., None].repeat(3, -1)
  expected = np.array([[0, 50, 150, 200], [25, 58, 126, 160],
                       [75, 76, 78, 80], [100, 85, 55, 40]])
  out = parse("resize(4)")(img)
  assert np.array_equal(out[..., 0], expected) and out.dtype == np.uint8
  # Upsampling equals PIL's float bilinear, truncated (float32 round-off
  # can take 1 off a value that is an integer in exact arithmetic).
  img = _image(12, 16)
  out = geo.resize_image(img, (30, 37)).astype(np.float64)
  ref = _pil_float_resize(img, 30, 37)
  assert np.all(out <= ref + 1e-3) and np.all(out > ref - 2)
  assert np.mean(out == np.floor(ref + 1e-3)) > 0.99
  # Antialiased shrinking equals PIL's (float) bilinear, truncated; PIL's
  # uint8 resize rounds, so it is at most 1 above.
  out = geo.resize_image(img, (5, 7), antialias=True)
  assert np.array_equal(out, np.floor(_pil_float_resize(img, 5, 7) + 1e-6))
  pil = np.asarray(Image.fromarray(img).resize((7, 5),
                                               Image.Resampling.BILINEAR))
  assert np.all((pil.astype(int) - out >= 0) & (pil.astype(int) - out <= 1))
  assert parse("resize([3, 5])")(img).shape == (3, 5, 3)


def test_area_resize_hand_cases():
  # TF's resize_area example: 4 -> 3, out = overlaps * 3/4.
  row = np.array([0, 30, 60, 90], np.uint8)[None, :, None].repeat(3, -1)
  out = geo.resize_image(row, (1, 3), "area")
  assert out[0, :, 0].tolist() == [7, 45, 82]  # 7.5, 45, 82.5 truncated.
  # An integer factor averages blocks (truncated).
  img = _image(12, 16)
  blocks = img.reshape(6, 2, 8, 2, 3).astype(np.float64).mean(axis=(1, 3))
  assert np.array_equal(geo.resize_image(img, (6, 8), "area"),
                        np.floor(blocks))
  flat = np.full((9, 7, 3), 100, np.uint8)
  assert np.all(geo.resize_image(flat, (4, 3), "area") == 100)


def test_resize_small_shapes_and_values():
  assert geo.resize_small_shape(375, 500, 256) == (256, 341)
  assert geo.resize_small_shape(500, 333, 256) == (384, 256)
  assert geo.resize_small_shape(4, 6, 3) == (3, 4)  # 4.5 -> 4 (half even).
  assert geo.resize_small_shape(4, 10, 3) == (3, 8)  # 7.5 -> 8.
  img = _image(24, 32)
  out = parse("resize_small(12)")(img)
  blocks = img.reshape(12, 2, 16, 2, 3).astype(np.float64).mean(axis=(1, 3))
  assert np.array_equal(out, np.floor(blocks))
  out = parse("resize_small(10, method='bilinear', antialias=True)")(img)
  assert out.shape == (10, 13, 3)
  assert np.array_equal(out, np.floor(_pil_float_resize(img, 10, 13) + 1e-6))


def test_central_crop_offsets_by_hand():
  img = _image(7, 10)
  out = parse("central_crop(4)")(img)
  assert np.array_equal(out, img[1:5, 3:7])  # (7-4)//2 = 1, (10-4)//2 = 3.
  assert np.array_equal(parse("central_crop([3, 5])")(img), img[2:5, 2:7])
  assert np.array_equal(parse("central_crop")(img), img[:, 1:8])
  with pytest.raises(InputError, match="larger than the image"):
    parse("central_crop(8)")(img)


def test_value_range_endpoints():
  img = np.array([0, 51, 255], np.uint8)[None, :, None].repeat(3, -1)
  out = parse("value_range(-1, 1)")(img)
  assert out.dtype == np.float32
  assert np.allclose(out[0, :, 0], [-1.0, 51 / 255 * 2 - 1, 1.0], atol=1e-7)
  out = parse("value_range(0, 1, in_min=[0, 0, 51], in_max=255, "
              "clip_values=True)")(img)
  assert np.allclose(out[0, :, 2], [0.0, 0.0, 1.0])
  assert np.allclose(out[0, :, 0], [0.0, 0.2, 1.0])


# --------------------------------------------------------------------------
# RandAugment ops.


@pytest.mark.parametrize("magnitude,expected", [
    (10, dict(Rotate=30.0, Posterize=4, Solarize=256, SolarizeAdd=110,
              Color=1.9, ShearX=0.3, TranslateY=100.0, Cutout=40)),
    (15, dict(Rotate=45.0, Posterize=6, Solarize=384, SolarizeAdd=165,
              Color=2.8, ShearX=0.45, TranslateY=150.0, Cutout=60)),
    (20, dict(Rotate=60.0, Posterize=8, Solarize=512, SolarizeAdd=220,
              Color=3.7, ShearX=0.6, TranslateY=200.0, Cutout=80)),
])
def test_level_to_arg_at_vmoe_magnitudes(magnitude, expected):
  for name, value in expected.items():
    (arg,) = ra.level_args(name, magnitude)
    assert arg == pytest.approx(value) and type(arg) is type(value)
  for name in ("Contrast", "Brightness", "Sharpness"):
    assert ra.level_args(name, magnitude) == ra.level_args("Color", magnitude)
  assert ra.level_args("ShearY", magnitude) == ra.level_args("ShearX",
                                                             magnitude)
  assert ra.level_args("Equalize", magnitude) == ()


def test_lut_ops_equal_pil():
  for img in (_image(), _image(seed=2, low=40, high=170)):
    pil = Image.fromarray(img)
    assert np.array_equal(ra.equalize(img), np.asarray(ImageOps.equalize(pil)))
    assert np.array_equal(ra.invert(img), np.asarray(ImageOps.invert(pil)))
    for bits in range(1, 9):
      assert np.array_equal(ra.posterize(img, bits),
                            np.asarray(ImageOps.posterize(pil, bits)))
    for t in (0, 1, 100, 128, 255):
      assert np.array_equal(ra.solarize(img, t),
                            np.asarray(ImageOps.solarize(pil, t)))
  flat = np.full((4, 4, 3), 9, np.uint8)
  assert np.array_equal(ra.equalize(flat), flat)


def test_tf_integer_quirks_posterize_and_solarize():
  img = _image()
  assert np.array_equal(ra.posterize(img, 0), img & 0x80)  # Shift clamped.
  assert np.array_equal(ra.posterize(img, 8), img)
  inverted = 255 - img
  assert np.array_equal(ra.solarize(img, 256), inverted)  # 256 % 256 = 0.
  assert np.array_equal(ra.solarize(img, 512), inverted)
  assert np.array_equal(ra.solarize(img, 384), ra.solarize(img, 128))
  added = ra.solarize_add(img, 110)
  want = np.where(img < 128, np.minimum(img.astype(int) + 110, 255), img)
  assert np.array_equal(added, want)


def test_autocontrast_hand_and_pil():
  img = _image(seed=2, low=40, high=170)
  img[..., 2] = 77  # A constant channel is left alone.
  out = ra.autocontrast(img)
  for c in range(2):
    ch = img[..., c].astype(np.float32)
    lo, hi = ch.min(), ch.max()
    scale = np.float32(255) / (hi - lo)
    want = np.clip(ch * scale - lo * scale, 0, 255).astype(np.uint8)
    assert np.array_equal(out[..., c], want)
  assert np.all(out[..., 2] == 77)
  pil = np.asarray(ImageOps.autocontrast(Image.fromarray(img)))
  assert np.abs(pil.astype(int) - out).max() <= 1


def test_enhance_ops_hand_and_pil():
  img = _image()
  pil = Image.fromarray(img)
  for f in (0.1, 0.5, 1.9, 2.8):
    assert np.array_equal(ra.brightness(img, f), np.asarray(
        ImageEnhance.Brightness(pil).enhance(f)))
  # Color: blend with TF's grey, trunc(255.5 * (0.2989 r + 0.587 g +
  # 0.114 b) / 255).
  x = img.astype(np.float32) / 255
  grey = (x @ np.float32([0.2989, 0.587, 0.114]) * np.float32(255.5)
          ).astype(np.uint8)[..., None]
  g = grey.astype(np.float32)
  want = np.clip(g + np.float32(2.8) * (img - g), 0, 255).astype(np.uint8)
  assert np.array_equal(ra.color(img, 2.8), want)
  assert np.abs(ra.color(img, 0.5).astype(int) - np.asarray(
      ImageEnhance.Color(pil).enhance(0.5))).max() <= 1
  # Contrast blends towards H * W / 256 = 17 * 23 / 256 -> 1 (TF's quirk).
  want = (1 + np.float32(0.5) * (img.astype(np.float32) - 1)).astype(np.uint8)
  assert np.array_equal(ra.contrast(img, 0.5), want)
  # Sharpness: the border is untouched, the inside close to PIL's.
  out = ra.sharpness(img, 2.8)
  assert np.array_equal(out[0], img[0]) and np.array_equal(out[:, -1],
                                                           img[:, -1])
  assert np.abs(ra.sharpness(img, 0.5).astype(int) - np.asarray(
      ImageEnhance.Sharpness(pil).enhance(0.5))).max() <= 1
  assert np.array_equal(ra.sharpness(img, 1.0), img)


def test_geometric_ops_equal_pil_with_fill_128():
  img = _image()
  pil = Image.fromarray(img)

  def affine(m):
    return np.asarray(pil.transform(pil.size, Image.Transform.AFFINE, m,
                                    resample=NEAREST, fillcolor=GREY))

  for deg in (30.0, -30.0, 45.0):
    assert np.array_equal(ra.rotate(img, deg), np.asarray(
        pil.rotate(deg, resample=NEAREST, fillcolor=GREY)))
  sq = _image(9, 9)
  assert np.array_equal(ra.rotate(sq, 90.0), np.rot90(sq))
  # PIL samples at pixel centres (+0.5): TF's index-space shear by l is
  # PIL's affine with offset -l/2. (Levels without exact .5 ties.)
  for lv in (0.37, -0.37):
    assert np.array_equal(ra.shear_x(img, lv), affine((1, lv, -lv / 2, 0, 1,
                                                       0)))
    assert np.array_equal(ra.shear_y(img, lv), affine((1, 0, 0, lv, 1,
                                                       -lv / 2)))
  for px in (3.0, -5.0, 100.0):
    assert np.array_equal(ra.translate_x(img, px), affine((1, 0, px, 0, 1,
                                                           0)))
    assert np.array_equal(ra.translate_y(img, px), affine((1, 0, 0, 0, 1,
                                                           px)))
  out = ra.translate_x(img, 3.0)  # Content moves left, grey enters right.
  assert np.array_equal(out[:, :-3], img[:, 3:]) and np.all(out[:, -3:] == 128)


def test_cutout_fills_the_square():
  img = _image(20, 20)
  out = ra.cutout(img, 4, (2, 10))
  assert np.all(out[0:6, 6:14] == 128)  # Rows clipped at the top edge.
  mask = np.ones((20, 20), bool)
  mask[0:6, 6:14] = False
  assert np.array_equal(out[mask], img[mask])
  rng = np.random.default_rng(0)
  out = ra.apply_op(img, "Cutout", 2.5, rng)  # pad int(2.5 / 10 * 40) = 10.
  cy, cx = np.random.default_rng(0).integers(0, 20, 2)
  want = ra.cutout(img, 10, (int(cy), int(cx)))
  assert np.array_equal(out, want)


def test_randaug_magnitude_zero_identity_or_not():
  img = _image()
  identity = {"Rotate", "ShearX", "ShearY", "TranslateX", "TranslateY",
              "Cutout", "SolarizeAdd"}
  for name in ra.OPS:
    out = ra.apply_op(img, name, 0.0, np.random.default_rng(0))
    assert np.array_equal(out, img) == (name in identity), name
  rng = np.random.default_rng(0)
  assert np.array_equal(ra.apply_op(img, "Posterize", 0, rng), img & 0x80)
  assert np.array_equal(ra.apply_op(img, "Solarize", 0, rng), 255 - img)
  assert np.array_equal(ra.apply_op(img, "Brightness", 0, rng),
                        ra.brightness(img, 0.1))


def test_randaug_always_applies_the_chosen_op_with_a_random_sign():
  img = _image()
  chosen = set()
  for seed in range(40):
    out = parse("randaug(1, 15)")(img, np.random.default_rng(seed))
    rng = np.random.default_rng(seed)
    name = ra.OPS[int(rng.integers(0, 16))]
    chosen.add(name)
    assert np.array_equal(out, ra.apply_op(img, name, 15.0, rng))
  assert len(chosen) >= 12
  signs = set()
  for seed in range(20):
    rng = np.random.default_rng(seed)
    flip = rng.random() < 0.5
    out = ra.apply_op(img, "Rotate", 10, np.random.default_rng(seed))
    assert np.array_equal(out, ra.rotate(img, -30.0 if flip else 30.0))
    signs.add(flip)
  assert signs == {True, False}


def test_pipelines_are_deterministic_per_seed():
  data = _png(_image(40, 50, seed=7))
  train = parse(TRAIN.replace("224", "16"))
  a = train(data, np.random.default_rng(5))
  b = train(data, np.random.default_rng(5))
  assert a.dtype == np.float32 and a.shape == (16, 16, 3)
  assert np.array_equal(a, b)
  assert any(not np.array_equal(a, train(data, np.random.default_rng(s)))
             for s in range(6, 9))
  assert np.all(a >= -1) and np.all(a <= 1)
  ev = parse(EVAL.replace("256", "20").replace("224", "16"))(data)
  assert ev.shape == (16, 16, 3) and ev.dtype == np.float32


# --------------------------------------------------------------------------
# Mixup.


def test_mixup_hand_case_numpy_and_jax():
  x = np.array([[1.0, 2.0], [10.0, 20.0]], np.float32)[:, :, None, None]
  y = np.eye(2, dtype=np.float32)
  w = np.array([[[0.7, 0.3]]], np.float32)  # One set: 'device', 1 group.
  want_x = np.array([[0.7 * 1 + 0.3 * 10, 0.7 * 2 + 0.3 * 20],
                     [0.7 * 10 + 0.3 * 1, 0.7 * 20 + 0.3 * 2]], np.float32)
  want_y = np.array([[0.7, 0.3], [0.3, 0.7]], np.float32)
  for mix in (mx.mix, mx.mix_jax):
    assert np.allclose(np.asarray(mix(x, w))[:, :, 0, 0], want_x, atol=1e-6)
    assert np.allclose(np.asarray(mix(y, w)), want_y, atol=1e-7)


def test_mixup_rolls_within_each_group():
  x = np.arange(4, dtype=np.float32)[:, None]
  w = np.array([[[0.75, 0.25]], [[0.5, 0.5]]], np.float32)  # 2 groups.
  want = [0.75 * 0 + 0.25 * 1, 0.75 * 1 + 0.25 * 0, 0.5 * 2 + 0.5 * 3,
          0.5 * 3 + 0.5 * 2]
  assert np.allclose(mx.mix(x, w)[:, 0], want)
  assert np.allclose(np.asarray(mx.mix_jax(x, w))[:, 0], want)


@pytest.mark.parametrize("granularity,shape", [
    ("batch", (1, 1, 3)), ("device", (2, 1, 3)), ("example", (2, 4, 3))])
def test_mixup_numpy_and_jax_agree(granularity, shape):
  rng = np.random.default_rng(0)
  images = rng.normal(size=(8, 4, 4, 3)).astype(np.float32)
  labels = np.eye(5, dtype=np.float32)[rng.integers(0, 5, 8)]
  assert mx.weights_shape(8, size=3, granularity=granularity,
                          groups=2) == shape
  w = mx.sample_weights(rng, shape, 0.5)
  assert w.shape == shape and np.allclose(w.sum(-1), 1, atol=1e-6)
  assert np.all(np.diff(w, axis=-1) <= 0)  # Largest weight first.
  for arr in (images, labels):
    assert np.allclose(mx.mix(arr, w), np.asarray(mx.mix_jax(arr, w)),
                       atol=1e-6)
  mixed_images, mixed_labels = mx.mixup(
      np.random.default_rng(3), images, labels, concentration=0.5, size=3,
      granularity=granularity, groups=2)
  w3 = mx.sample_weights(np.random.default_rng(3), shape, 0.5)
  assert np.array_equal(mixed_images, mx.mix(images, w3))
  assert np.allclose(mixed_labels.sum(-1), 1, atol=1e-6)


def test_mixup_jax_under_jit_and_weights():
  rng = np.random.default_rng(0)
  images = rng.normal(size=(4, 2, 2, 3)).astype(np.float32)
  labels = np.eye(3, dtype=np.float32)[[0, 1, 2, 0]]
  fn = jax.jit(functools.partial(mx.mixup_jax, concentration=0.2, size=2,
                                 granularity="device", groups=2))
  key = jax.random.PRNGKey(0)
  out_images, out_labels = fn(key, images, labels)
  w = mx.sample_weights_jax(key, (2, 1, 2), 0.2)
  assert np.all(np.asarray(w[..., 0]) >= 0.5)
  assert np.allclose(np.asarray(out_images),
                     mx.mix(images, np.asarray(w)), atol=1e-6)
  assert np.allclose(np.asarray(out_labels).sum(-1), 1, atol=1e-6)
  # vmoe's light0: concentration 0 turns mixup off.
  same = mx.mixup_jax(key, images, labels, concentration=0.0)
  assert same[0] is images and same[1] is labels
  assert mx.mixup(rng, images, labels, concentration=None)[0] is images


@pytest.mark.parametrize("kwargs,field", [
    (dict(concentration=-1.0), "concentration"),
    (dict(concentration=0.2, size=0), "size"),
    (dict(concentration=0.2, granularity="host"), "granularity"),
])
def test_mixup_config_errors(kwargs, field):
  x = np.zeros((4, 2), np.float32)
  with pytest.raises(ConfigError) as e:
    mx.mixup(np.random.default_rng(0), x, x, **kwargs)
  assert e.value.field == field


def test_mixup_batch_must_split_into_groups():
  x = np.zeros((6, 2), np.float32)
  with pytest.raises(InputError, match="does not split into 4 groups"):
    mx.mixup(np.random.default_rng(0), x, x, concentration=0.2, groups=4)
  with pytest.raises(InputError, match="same batch size"):
    mx.mixup(np.random.default_rng(0), x, x[:4], concentration=0.2)
