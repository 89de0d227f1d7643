"""The distributed runtime: launch, placement, process groups, the fixed optimiser layout, the step executor
and the variant cache. May import passes (types and planner), codegen and torch; never hcompile."""
