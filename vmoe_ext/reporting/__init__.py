"""Reporting: metric writers (`metrics.jsonl`, TensorBoard, progress bars),
the markdown run report, and shared report pieces (tables, bar charts).

Neutral layer: imported by `vmoe_ext.train` and `vmoe_ext.evaluate`; imports
neither of them.
"""
