"""The calls that make a program a live-mode one, as the launcher's messages name them."""

JOIN_CALL = "launcher.runtime.join(...)"  # registers the worker: without it the job runs in restart mode
STEP_CALL = "job.next_step()"  # the step boundary where migrations apply
