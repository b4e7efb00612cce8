"""The launcher side of a job: its control loop, the ways of running it (live, restart), its workers and
the record of its migrations. Nothing here runs in a training process (that is launcher.runtime)."""
