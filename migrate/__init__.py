"""The migration core: pure planning (layouts, costs, pairing, instructions, placement) and, apart, execution."""
from migrate.instructions import Instruction, LostStateError, Segment
from migrate.layout import LayoutError, ModelSpec, ParallelConfig
from migrate.plan import MigrationPlan, plan
from migrate.topology import Device, RankMap, Topology

__all__ = ["Device", "Instruction", "LayoutError", "LostStateError", "MigrationPlan", "ModelSpec",
           "ParallelConfig", "RankMap", "Segment", "Topology", "plan"]
