"""Deciding and rewriting: the typed plan IR, the cost model, the planner (strategy pool, two-stage data
assignment, baselines) and, later, the graph passes and their runner. May import codegen, torch, numpy and
networkx; never runtime or hcompile."""
