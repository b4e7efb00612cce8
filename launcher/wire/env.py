"""The environment elastic-launch gives every worker it starts: the names are the contract between the
launcher's backends (which set them) and the worker side (launcher.runtime.env reads them). No torch import
here, so the launcher's command line and a worker's first checks stay fast."""
from __future__ import annotations

ENV_STORE = "ELASTIC_STORE"  # host:port of the control plane
ENV_STORE_SECRET = "ELASTIC_STORE_SECRET"  # what every key on it starts with (launcher.wire.guarded_store); never
# on a command line (`ps` shows those to every user): workers inherit it from the launcher's environment
ENV_DEVICE = "ELASTIC_DEVICE"  # this worker's device id (local backend)
ENV_NODE_INDEX = "ELASTIC_NODE_INDEX"  # index of this worker's node in the job topology (Slurm steps)
ENV_FIRST_DEVICE = "ELASTIC_FIRST_DEVICE"  # device id of the node's GPU 0 (Slurm steps; nodes may differ in size)
ENV_GPUS_PER_NODE = "ELASTIC_GPUS_PER_NODE"
ENV_LOCAL_ID = "ELASTIC_LOCAL_ID"  # local task index; Slurm steps use SLURM_LOCALID
ENV_RANK_BASE = "ELASTIC_RANK_BASE"  # RANK of the node's first worker, restart mode (nodes may run different numbers)
ENV_FIRST_EVENT = "ELASTIC_FIRST_EVENT"  # first event this worker handles
ENV_NODE = "ELASTIC_NODE"
ENV_CKPT_DIR = "ELASTIC_CHECKPOINT_DIR"  # where the job's checkpoints live (suspend and safety)
ENV_CKPT_EVERY = "ELASTIC_CHECKPOINT_EVERY"  # safety checkpoint every N steps (0: never)
ENV_RUNTIME_LOG = "ELASTIC_RUNTIME_LOG"  # live mode: the folder of the runtime's own lines (runtime-dev<D>.log) when
# the workers' output goes to elastic-launch's own (no --log-dir): the user's terminal gets the launcher's line per
# migration, not every worker's; unset, they go to the worker's stderr (its log file)
ENV_ERROR_DIR = "ELASTIC_ERROR_DIR"  # restart mode: the world's folder of per-rank error files (TORCHELASTIC_ERROR_FILE)
ENV_SRUN_PREFIX = "ELASTIC_SRUN_"  # restart mode: the world's SLURM_* variables, carried past srun (which sets its
# own step's in every task) and given their names back in each worker by launcher.runtime.torchrun_exec
