"""Deciding and rewriting, in two subpackages:

- ``passes.plan``: the planner. The typed plan IR, the cost model and its presets, length datasets, and the
  planner itself (strategy pool, two-stage data assignment, per-step strategy choice, baselines). Pure Python
  with numpy: it imports no torch and nothing of ``passes.graph`` (a test checks it).
- ``passes.graph``: the FX graph passes. Graph analysis, the pass runner, the rewrites (canonical attention,
  tensor parallel, packed attention, pipeline split) and the compiled variants they make.

May import codegen, torch, numpy and networkx; never runtime or hcompile.
"""
