"""`python -m vmoe_ext.main`: the training binary (`vmoe_ext.app.main`).

This module only starts it; the flags, the modes and the exit statuses are
documented in `vmoe_ext.app.main`.
"""

from __future__ import annotations

from absl import app

from vmoe_ext.app.main import main, parse_flags, run  # noqa: F401

if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
