"""Pure decisions: which layout a node count gets, and what a layout survives."""
