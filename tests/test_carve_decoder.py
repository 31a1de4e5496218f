"""CMoE for decoder MLPs: the safetensors reader, the LLaMA decoder, carving
the LLaMA's SwiGLU MLPs and our language model's dense ReLU `f` layers, the
window perplexity and the command.

References: the `safetensors` library (an independent writer and reader),
a NumPy loop of Hugging Face's LLaMA forward (`naive_llama`), a NumPy loop
of the authors' LM (`naive_lm`), the naive CMoE router and experts
(`naive.cmoe_route`, `naive.mlp`), the dense models themselves (a carve
with every expert active), and hand-written window NLLs.
"""

from __future__ import annotations

import json
import math
import os

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as stn

import naive
import naive_lm
import naive_llama
from vmoe_ext.app import carve_decoder
from vmoe_ext.carving.decoder import calibration_windows
from vmoe_ext.carving.language import (carve_language_model,
                                       carved_language_model, lm_blocks)
from vmoe_ext.carving.llama import carve_llama, carved_llama
from vmoe_ext.carving.spec import CarveSpec
from vmoe_ext.errors import ConfigError
from vmoe_ext.evaluate.window_ppl import window_perplexity
from vmoe_ext.interop import safetensors as st
from vmoe_ext.models.language import LanguageModel
from vmoe_ext.models.llama import LlamaConfig, LlamaDecoder, load_llama

HERE = os.path.dirname(os.path.abspath(__file__))

HF_CONFIG = dict(model_type="llama", architectures=["LlamaForCausalLM"],
                 vocab_size=50, hidden_size=32, intermediate_size=64,
                 num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=500.0,
                 hidden_act="silu", tie_word_embeddings=False,
                 torch_dtype="float32")


def llama_tensors(config, seed=0):
  """Random weights of a LLaMA checkpoint, named as Hugging Face's."""
  rng = np.random.default_rng(seed)
  d, f, v = config["hidden_size"], config["intermediate_size"], \
      config["vocab_size"]
  hd = d // config["num_attention_heads"]
  kv = config["num_key_value_heads"] * hd
  t = {"model.embed_tokens.weight": rng.normal(size=(v, d)),
       "model.norm.weight": 1 + 0.1 * rng.normal(size=d)}
  if not config.get("tie_word_embeddings"):
    t["lm_head.weight"] = 0.2 * rng.normal(size=(v, d))
  for i in range(config["num_hidden_layers"]):
    p = f"model.layers.{i}."
    shapes = {"self_attn.q_proj": (d, d), "self_attn.k_proj": (kv, d),
              "self_attn.v_proj": (kv, d), "self_attn.o_proj": (d, d),
              "mlp.gate_proj": (f, d), "mlp.up_proj": (f, d),
              "mlp.down_proj": (d, f)}
    for name, shape in shapes.items():
      t[p + name + ".weight"] = 0.2 * rng.normal(size=shape)
      if config.get("attention_bias") and name.startswith("self_attn"):
        t[p + name + ".bias"] = 0.1 * rng.normal(size=shape[0])
      if config.get("mlp_bias") and name.startswith("mlp"):
        t[p + name + ".bias"] = 0.1 * rng.normal(size=shape[0])
    t[p + "input_layernorm.weight"] = 1 + 0.1 * rng.normal(size=d)
    t[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rng.normal(size=d)
  return {k: val.astype(np.float32) for k, val in t.items()}


def write_hf(directory, config, tensors, shards=1):
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(config, f)
  if shards == 1:
    stn.save_file(tensors, os.path.join(directory, "model.safetensors"),
                  metadata={"format": "pt"})
    return
  names = sorted(tensors)
  weight_map = {}
  for s in range(shards):
    file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
    part = {n: tensors[n] for n in names[s::shards]}
    stn.save_file(part, os.path.join(directory, file))
    weight_map.update({n: file for n in part})
  with open(os.path.join(directory, "model.safetensors.index.json"),
            "w") as f:
    json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
  """A tiny random LLaMA written as a Hugging Face directory."""
  directory = str(tmp_path_factory.mktemp("llama"))
  tensors = llama_tensors(HF_CONFIG)
  write_hf(directory, HF_CONFIG, tensors)
  config, params = load_llama(directory)
  rng = np.random.default_rng(1)
  return dict(dir=directory, tensors=tensors, config=config, params=params,
              train=rng.integers(0, 50, 400), test=rng.integers(0, 50, 40))


# ------------------------------------------------------------- safetensors


def test_reader_equals_the_library_on_every_dtype_and_on_shards(hf,
                                                                tmp_path):
  rng = np.random.default_rng(0)
  tensors = {"f32": rng.normal(size=(3, 4)).astype(np.float32),
             "f16": rng.normal(size=(5,)).astype(np.float16),
             "bf16": rng.normal(size=(2, 3)).astype(ml_dtypes.bfloat16),
             "i64": rng.integers(-9, 9, (4,)),
             "empty": np.zeros((0, 3), np.float32)}
  path = str(tmp_path / "x.safetensors")
  stn.save_file(tensors, path, metadata={"k": "v"})
  ours, theirs = st.load_file(path), stn.load_file(path)
  assert set(ours) == set(theirs) == set(tensors)
  for name, value in theirs.items():
    assert ours[name].dtype == value.dtype and ours[name].shape == value.shape
    np.testing.assert_array_equal(ours[name].view(np.uint8),
                                  value.view(np.uint8))
  sharded = str(tmp_path / "sharded")
  write_hf(sharded, HF_CONFIG, hf["tensors"], shards=3)
  assert len(st.checkpoint_files(sharded)) == 3
  loaded = st.load_checkpoint(sharded)
  assert set(loaded) == set(hf["tensors"])
  for name, value in hf["tensors"].items():
    np.testing.assert_array_equal(loaded[name], value)
  _, params = load_llama(sharded)
  jax.tree.map(np.testing.assert_array_equal, params, hf["params"])


def _raw(path, header, data=b""):
  raw = json.dumps(header).encode()
  with open(path, "wb") as f:
    f.write(len(raw).to_bytes(8, "little") + raw + data)


def test_reader_errors_name_the_field(hf, tmp_path):
  def error(fn, *args):
    with pytest.raises(ConfigError) as e:
      fn(*args)
    assert e.value.field == "checkpoint_dir"
    return e.value.reason

  assert "no directory" in error(st.load_checkpoint, str(tmp_path / "none"))
  assert "neither model.safetensors" in error(st.load_checkpoint,
                                              str(tmp_path))
  assert "no config.json" in error(st.read_config, str(tmp_path))
  bad = str(tmp_path / "bad.safetensors")
  with open(bad, "wb") as f:
    f.write((1000).to_bytes(8, "little") + b"{}")
  assert "exceeds the file" in error(st.load_file, bad)
  _raw(bad, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
       b"\0" * 8)
  assert "outside the 8-byte data buffer" in error(st.load_file, bad)
  _raw(bad, {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
       b"\0" * 8)
  assert "8 bytes for shape [3]" in error(st.load_file, bad)
  _raw(bad, {"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}},
       b"\0" * 8)
  assert "dtype 'C64' is not read" in error(st.load_file, bad)
  # The index names a tensor its shard lacks.
  sharded = tmp_path / "sharded"
  write_hf(str(sharded), HF_CONFIG, hf["tensors"], shards=2)
  index = json.loads((sharded / "model.safetensors.index.json").read_text())
  index["weight_map"]["model.extra.weight"] = next(
      iter(index["weight_map"].values()))
  (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
  assert "no tensor 'model.extra.weight'" in error(st.load_checkpoint,
                                                   str(sharded))


def test_llama_config_and_weights_errors_name_the_field(hf):
  def error(config):
    with pytest.raises(ConfigError) as e:
      LlamaConfig.from_hf(config)
    return e.value.field

  assert error({**HF_CONFIG, "model_type": "gpt2"}) == \
      "config.json:model_type"
  assert error({**HF_CONFIG, "num_key_value_heads": 3}) == \
      "config.json:num_key_value_heads"
  assert error({**HF_CONFIG, "rope_scaling": {"rope_type": "llama3"}}) == \
      "config.json:rope_scaling"
  assert error({**HF_CONFIG, "hidden_act": "gelu"}) == "config.json:hidden_act"
  del_size = {k: v for k, v in HF_CONFIG.items() if k != "hidden_size"}
  assert error(del_size) == "config.json:hidden_size"
  from vmoe_ext.models.llama import params_from_hf
  tensors = dict(hf["tensors"])
  del tensors["model.layers.1.mlp.up_proj.weight"]
  with pytest.raises(ConfigError, match="model.layers.1.mlp.up_proj"):
    params_from_hf(tensors, hf["config"])
  tensors = {**hf["tensors"], "model.layers.0.mlp.gate_proj.weight":
             np.zeros((63, 32), np.float32)}
  with pytest.raises(ConfigError, match=r"shape \(63, 32\)"):
    params_from_hf(tensors, hf["config"])


# ----------------------------------------------------------- LLaMA forward


@pytest.mark.parametrize("variant", ["gqa_untied", "tied_biases"])
def test_llama_forward_matches_the_numpy_loop(hf, variant):
  if variant == "gqa_untied":
    config, params, tensors = HF_CONFIG, hf["params"], hf["tensors"]
  else:  # MHA, tied head, attention and MLP biases, head_dim given.
    config = {**HF_CONFIG, "num_key_value_heads": 4,
              "tie_word_embeddings": True, "attention_bias": True,
              "mlp_bias": True, "head_dim": 8, "num_hidden_layers": 1}
    tensors = llama_tensors(config, seed=3)
    from vmoe_ext.models.llama import params_from_hf
    params = params_from_hf(tensors, LlamaConfig.from_hf(config))
  model = LlamaDecoder(LlamaConfig.from_hf(config))
  tokens = np.random.default_rng(2).integers(0, 50, (2, 7))
  logits, metrics = jax.jit(model.apply)({"params": params}, tokens)
  assert float(metrics["auxiliary_loss"]) == 0.0
  for row in range(2):
    ref = naive_llama.forward(tensors, config, tokens[row])
    np.testing.assert_allclose(logits[row], ref, rtol=1e-5, atol=1e-5)


def test_window_perplexity_is_the_mean_window_nll(hf):
  model = LlamaDecoder(hf["config"])
  apply = jax.jit(lambda t: model.apply({"params": hf["params"]}, t)[0])
  ids = hf["test"][:27]  # 3 windows of 8, 3 tokens left over.
  got = window_perplexity(apply, ids, sequence_length=8, batch_size=2)
  nlls = []
  for w in range(3):
    window = ids[8 * w:8 * w + 8]
    logits = naive_llama.forward(hf["tensors"], HF_CONFIG, window)
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nlls.append(-np.mean([log_p[i, window[i + 1]] for i in range(7)]))
  assert got.num_blocks == 3 and got.num_tokens == 21
  np.testing.assert_allclose(got.loss, np.mean(nlls), rtol=1e-5)
  assert got.ppl == pytest.approx(math.exp(np.mean(nlls)), rel=1e-5)
  first = window_perplexity(apply, ids, sequence_length=8, max_windows=1)
  np.testing.assert_allclose(first.loss, nlls[0], rtol=1e-5)


# ----------------------------------------------------------- LLaMA carving


def _naive_cmoe(moe, x, k, activation, bias):
  """One token through a carved layer's params, by the naive references."""
  router = moe["router"]
  idx, weights = naive.cmoe_route(x[None], router["kernel"],
                                  router.get("up_kernel"), router["scale"],
                                  bias, k, activation)
  out = np.asarray(moe["bias"], np.float64) + naive.mlp(
      moe["SharedMlp"], x, activation)
  for e, w in zip(idx[0], weights[0]):
    out += w * naive.mlp(moe["Mlp"], x, activation, expert=e)
  return out


def test_llama_carve_all_active_equals_dense_and_s1a1e8_is_cmoe(hf):
  windows = calibration_windows(hf["train"], 4, 16, seed=0)
  tokens = hf["test"][:14].reshape(2, 7)
  dense, _ = LlamaDecoder(hf["config"]).apply({"params": hf["params"]},
                                              tokens)
  spec = CarveSpec(num_experts=8, num_shared=1, num_activated=7,
                   batch_size=2)
  result = carve_llama(hf["config"], hf["params"], windows, spec)
  model = carved_llama(hf["config"], spec)
  logits, _ = model.apply({"params": result.params, **result.collections},
                          tokens)
  np.testing.assert_allclose(logits, dense, rtol=1e-5, atol=1e-5)

  spec = CarveSpec(num_experts=8, num_shared=1, num_activated=1,
                   batch_size=3)
  result = carve_llama(hf["config"], hf["params"], windows, spec)
  assert sorted(result.layers) == [0, 1]
  for layer in result.layers.values():  # 1 shared + 7 routed of m = 8.
    units = np.concatenate([layer.shared, layer.experts.ravel()])
    assert layer.experts.shape == (7, 8)
    np.testing.assert_array_equal(np.sort(units), np.arange(64))
  model = carved_llama(hf["config"], spec)
  variables = {"params": result.params, **result.collections}
  logits, metrics = jax.jit(model.apply)(variables, tokens)
  assert set(metrics) == {"layer_0", "layer_1", "auxiliary_loss"}

  def mlp(layer, x):
    moe = jax.tree.map(np.asarray, result.params[f"encoderblock_{layer}"][
        "Moe"])
    bias = np.asarray(result.collections["router_state"][
        f"encoderblock_{layer}"]["Moe"]["router"]["bias"])
    np.testing.assert_array_equal(bias, 0.0)
    return _naive_cmoe(moe, x, 1, "swiglu", bias)

  for row in range(2):
    ref = naive_llama.forward(hf["tensors"], HF_CONFIG, tokens[row], mlp=mlp)
    np.testing.assert_allclose(logits[row], ref, rtol=1e-4, atol=1e-4)
  apply = jax.jit(lambda v, t: model.apply(v, t)[0])
  carved = window_perplexity(lambda t: apply(variables, t), hf["test"],
                             sequence_length=8)
  assert math.isfinite(carved.ppl) and carved.ppl > 1.0


def test_llama_carve_errors_name_the_field(hf):
  windows = np.zeros((1, 4), np.int32)
  for spec, field in [
      (CarveSpec(num_experts=3), "carve.num_experts"),  # 64 % 3 != 0.
      (CarveSpec(num_experts=8, num_shared=8), "carve.num_shared"),
      (CarveSpec(num_experts=8, num_activated=8), "carve.num_activated"),
      (CarveSpec(layers=(2,), every=None), "carve.layers"),
      (CarveSpec(activation_markers=65), "carve.activation_markers")]:
    with pytest.raises(ConfigError) as e:
      carve_llama(hf["config"], hf["params"], windows, spec)
    assert e.value.field == field, spec
  with pytest.raises(ConfigError, match="config.json:intermediate_size=64"):
    carve_llama(hf["config"], hf["params"], windows,
                CarveSpec(num_experts=3))
  with pytest.raises(ConfigError) as e:
    calibration_windows(np.arange(10), 2, 10, 0)
  assert e.value.field == "carve.sequence_length"


# -------------------------------------------------- our language model (f)


@pytest.fixture(scope="module")
def lm():
  model = LanguageModel(vocab_size=30, hidden_size=16, inner_hidden_size=32,
                        num_heads=2, num_layers=1, attn_span=4,
                        base_arch="glam", moe={"num_experts": 4})
  tokens = np.zeros((1, 4), np.int32)
  variables = jax.jit(model.init)(jax.random.key(0), tokens,
                                  model.zero_cache(1))
  return model, variables


def _stream(model, variables, tokens, block=4):
  cache, out = model.zero_cache(len(tokens)), []
  apply = jax.jit(model.apply)
  for p in range(0, tokens.shape[1], block):
    log_probs, cache, _ = apply(variables, tokens[:, p:p + block], cache)
    out.append(np.asarray(log_probs))
  return np.concatenate(out, axis=1)


def test_lm_f_layers_carve_all_active_equals_dense_and_s1a1e4_is_cmoe(
    lm, monkeypatch):
  model, variables = lm
  assert model.architecture == "sgsf" and lm_blocks(
      model, CarveSpec()) == (1,)
  rng = np.random.default_rng(0)
  windows = calibration_windows(rng.integers(0, 30, 200), 3, 8, seed=0)
  tokens = rng.integers(0, 30, (2, 8))
  dense = _stream(model, variables, tokens)
  spec = CarveSpec(num_experts=4, num_shared=1, num_activated=3,
                   batch_size=2)
  result = carve_language_model(model, variables, windows, spec,
                                block_size=4)
  carved = carved_language_model(model, spec)
  got = _stream(carved, {"params": result.params, **result.collections},
                tokens)
  np.testing.assert_allclose(got, dense, rtol=1e-5, atol=1e-5)

  spec = CarveSpec(num_experts=4, num_shared=1, num_activated=1,
                   batch_size=2)
  result = carve_language_model(model, variables, windows, spec,
                                block_size=4)
  carved = carved_language_model(model, spec)
  params = jax.tree.map(np.asarray, result.params)
  # Everything but the carved MLP is the dense model's.
  np.testing.assert_array_equal(params["encoderblock_0"]["Moe"]["Mlp"][
      "Dense_0"]["kernel"], variables["params"]["encoderblock_0"]["Moe"][
          "Mlp"]["Dense_0"]["kernel"])
  got = _stream(carved, {"params": params, **result.collections}, tokens)
  # The naive LM with the carved layer's MLP computed by the naive CMoE.
  moe = params["encoderblock_1"]["Moe"]
  bias = np.zeros(3)
  monkeypatch.setattr(naive_lm, "ffn",
                      lambda x, p: _naive_cmoe(moe, x, 1, "relu", bias))
  reference = {**params, "encoderblock_1": {
      **params["encoderblock_1"], "Mlp": {}}}
  cache = [np.zeros((2, 4, 16))] * 2
  out = []
  for p in (0, 4):
    log_probs, cache = naive_lm.forward(reference, tokens[:, p:p + 4], cache,
                                        "gf", heads=2)
    out.append(log_probs)
  np.testing.assert_allclose(got, np.concatenate(out, 1), rtol=1e-4,
                             atol=1e-4)


def test_lm_carve_errors_name_the_field(lm):
  model, variables = lm
  windows = np.zeros((1, 8), np.int32)
  for spec, field, kwargs in [
      (CarveSpec(num_experts=3), "carve.num_experts", {}),
      (CarveSpec(layers=(0,), every=None), "carve.layers", {}),
      (CarveSpec(num_experts=4), "carve.sequence_length",
       {"block_size": 3})]:
    with pytest.raises(ConfigError) as e:
      carve_language_model(model, variables, windows, spec,
                           **{"block_size": 4, **kwargs})
    assert e.value.field == field
  switch = LanguageModel(vocab_size=30, hidden_size=16, inner_hidden_size=32,
                         num_heads=2, num_layers=1, attn_span=4)
  with pytest.raises(ConfigError) as e:
    lm_blocks(switch, CarveSpec())
  assert e.value.field == "model.base_arch"


# ------------------------------------------------------------- the command


def test_command_carves_a_llama_directory_and_reports_both_ppls(hf, tmp_path,
                                                                capsys):
  np.save(tmp_path / "train.npy", hf["train"])
  np.save(tmp_path / "test.npy", hf["test"])
  workdir = str(tmp_path / "out")
  argv = ["carve_decoder", "--family=llama", f"--checkpoint_dir={hf['dir']}",
          "--carve=S1A1E8", f"--train_ids={tmp_path / 'train.npy'}",
          f"--eval_ids=test={tmp_path / 'test.npy'}", "--sequence_length=8",
          "--num_calibration=2", f"--workdir={workdir}"]
  assert carve_decoder.main(argv) == 0
  lines = [json.loads(x) for x in open(os.path.join(workdir,
                                                    "metrics.jsonl"))]
  by_split = {x["split"]: x for x in lines}
  assert [x["block"] for x in lines if x["split"] == "carve"] == [0, 1]
  assert by_split["carved"]["final"] is True
  assert math.isfinite(by_split["carved"]["test_ppl"])
  model = LlamaDecoder(hf["config"])
  dense = window_perplexity(
      jax.jit(lambda t: model.apply({"params": hf["params"]}, t)[0]),
      hf["test"], sequence_length=8)
  assert by_split["dense"]["test_ppl"] == pytest.approx(dense.ppl, rel=1e-6)
  assert "test_ppl: dense" in capsys.readouterr().out
  assert os.path.exists(os.path.join(workdir, "report.md"))
  # Bad input: exit 2 naming the field, nothing written.
  for extra, field in [(["--carve=S1A1E7"], "carve.num_experts"),
                       ([f"--checkpoint_dir={tmp_path}"], "--checkpoint_dir"),
                       (["--eval_ids=test"], "--eval_ids")]:
    assert carve_decoder.main(argv + extra) == 2
    assert f"config error: {field}:" in capsys.readouterr().err


def test_command_carves_a_glam_run_and_scores_it_as_training_did(
    tmp_path, capsys, monkeypatch):
  """`--family=lm` end to end: a one-step GLaM run (`sgsf`) trained by the
  binary's loop, carved by the command. Its dense scores are the training
  run's final evaluation, to the bit; with every expert active the carved
  model scores as the dense one; bad input exits 2 naming the field."""
  from test_lm_training import write_corpus  # pylint: disable=import-outside-toplevel
  from vmoe_ext.app import train as loop  # pylint: disable=import-outside-toplevel
  from vmoe_ext.train.config_files import load_config  # pylint: disable=import-outside-toplevel
  write_corpus(tmp_path)
  fields = {"data.path": str(tmp_path), "data.corpus": "plain_text",
            "data.min_count": 2, "data.batch_size": 4, "data.block_size": 8,
            "model.base_arch": "glam", "model.num_layers": 1,
            "model.attn_span": 8, "train.total_steps": 1}
  config = load_config("lm", "tiny")
  for key, value in fields.items():
    section, field = key.split(".")
    config[section][field] = value
  config.train.update(dict(log_every=1, eval_every=0, checkpoint_every=1))
  run = str(tmp_path / "run")
  trained = loop.train_and_evaluate(config, run)
  base = ["carve_decoder", "--family=lm", "--config=configs/lm.py:tiny",
          *[f"--config.{k}={v}" for k, v in fields.items()],
          f"--checkpoint_dir={run}", "--sequence_length=8",
          "--num_calibration=2"]
  monkeypatch.chdir(os.path.dirname(HERE))  # configs/ is the repo's.
  out = str(tmp_path / "all_active")
  assert carve_decoder.main(base + ["--carve=S1A3E4",
                                    f"--workdir={out}"]) == 0
  lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
  by_split = {x["split"]: x for x in lines}
  for key in ("ppl", "valid_ppl", "attacked_ppl", "valid_attacked_ppl"):
    assert by_split["dense"][key] == trained[key], key
    assert by_split["carved"][key] == pytest.approx(trained[key], rel=1e-5)
  assert [x["block"] for x in lines if x["split"] == "carve"] == [1]
  assert "ppl: dense" in capsys.readouterr().out
  for extra, field in [(["--carve=S1A1E3"], "carve.num_experts"),
                       (["--config.model.num_layers=2"], "model.num_layers")]:
    assert carve_decoder.main(base + extra + [f"--workdir={out}"]) == 2
    assert f"config error: {field}" in capsys.readouterr().err
