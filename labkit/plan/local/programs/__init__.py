"""Each axis's part of a rank's step, as the planner's programs: one module per axis, as
``labkit.parallel`` has one per axis (:mod:`..physical` builds a step from them)."""
