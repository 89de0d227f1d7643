"""The planner: plan IR (``ir``), cost model and memory model (``cost_model``), length datasets
(``datasets``), rank placement (``placement``), two-stage assignment (``assign``), the strategy pool
(``pool``) and the per-step policies with their baselines (``policies``). Imports no torch."""
