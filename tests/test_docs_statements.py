"""Statements of the docs that can go stale, checked against the code.

docs/install.md and README.md tell a user moving to a GPU or TPU to
`pip install -e ".[cuda13]"` (or `cuda12`, `tpu`): each extra a page names
must be one setup.py declares, and each accelerator extra must ask for the
JAX extra of the same name, which the installed JAX release must provide
(read from its package metadata, so a JAX that renamed or dropped an extra
fails here rather than on a user's GPU box). Error examples that list
what is registered list all of it.
"""

from __future__ import annotations

import ast
import os
import re
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACCELERATOR_EXTRAS = ("cuda13", "cuda12", "tpu")


def _extras_require() -> dict[str, list[str]]:
  """setup.py's `extras_require` literal, read without running setup."""
  tree = ast.parse(open(os.path.join(ROOT, "setup.py"),
                        encoding="utf-8").read())
  for node in ast.walk(tree):
    if isinstance(node, ast.keyword) and node.arg == "extras_require":
      return ast.literal_eval(node.value)
  raise AssertionError("setup.py has no extras_require")


def _named_extras(page: str) -> set[str]:
  text = open(os.path.join(ROOT, page), encoding="utf-8").read()
  named = set()
  for group in re.findall(r'pip install -e "\.\[([a-z0-9,]+)\]"', text):
    named.update(group.split(","))
  return named


def test_every_extra_the_pages_name_exists():
  extras = set(_extras_require())
  for page in ("README.md", "docs/install.md"):
    named = _named_extras(page)
    assert named, page
    assert named <= extras, (page, named - extras)
  assert set(ACCELERATOR_EXTRAS) <= _named_extras("docs/install.md")


def test_accelerator_extras_ask_for_jax_builds_that_exist():
  extras = _extras_require()
  provided = set(metadata.metadata("jax").get_all("Provides-Extra"))
  for name in ACCELERATOR_EXTRAS:
    (requirement,) = extras[name]
    match = re.fullmatch(r"jax\[([a-z0-9-]+)\]>=([0-9.]+)", requirement)
    assert match, requirement
    assert match.group(1) == name
    assert match.group(1) in provided, (name, sorted(provided))
    # The same lower bound as the CPU install.
    assert f"jax>={match.group(2)}" in open(
        os.path.join(ROOT, "setup.py"), encoding="utf-8").read()


def test_the_unknown_router_example_lists_every_registered_router():
  """docs/training.md prints the binary's message for an unknown router;
  its list must be the registry's (it once showed 3 of 11)."""
  from vmoe_ext.routers.registry import ROUTERS  # pylint: disable=g-import-not-at-top
  text = open(os.path.join(ROOT, "docs", "training.md"),
              encoding="utf-8").read()
  (listed,) = re.findall(r"unknown router 'switch'; registered: (\[[^\]]*\])",
                         text)
  assert ast.literal_eval(listed) == sorted(ROUTERS.names())
