"""`elastic bench-policy`: a scripted stretch of plain Slurm jobs on the testbed, run once with an elastic job on
--policy manual and once on --policy opportunistic (trace: the plain jobs, from a seed; measure: utilisation
and waits from samples of the queue; replay: the run itself)."""
