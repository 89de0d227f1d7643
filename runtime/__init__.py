"""The distributed runtime: launch, placement, process groups, the fixed optimiser layout and the movement of
parameter slices and gradients, the stage compute copies, the step executor, batch agreement, planning off
the critical path, calibration and checkpoints. May import passes (types and planner), codegen and torch;
never hcompile."""
