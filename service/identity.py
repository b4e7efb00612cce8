"""Who a caller is, in the cluster's words: a Unix user (name and uid) and whether they are an operator.

Why: a job belongs to the Unix user whose launcher created it, and an operator is a member of a configured
Unix group (as Slurm's operators are named by the site), so identity is read from the system's user database
(NSS: /etc/passwd, LDAP, ...) the same way on every node, never from what a caller types."""
from __future__ import annotations

import grp
import os
import pwd
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Caller:
    user: str
    uid: int
    operator: bool = False  # may see and act on every job, and preempt

    def __str__(self) -> str:
        return f"{self.user} (uid {self.uid}{', operator' if self.operator else ''})"


def user_name(uid: int) -> str:
    """The user's name, or `uid:N` for a uid the user database does not know."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid:{uid}"


def local_user() -> tuple[str, int]:
    """(name, uid) of this process's real user: what an embedded store records as a job's owner."""
    uid = os.getuid()
    return user_name(uid), uid


def in_group(user: str, gid: int | None, group: str | None) -> bool:
    """Whether `user` (primary group `gid`) belongs to Unix group `group` (None or unknown group: no)."""
    if not group:
        return False
    try:
        entry = grp.getgrnam(group)
    except KeyError:
        return False
    return user in entry.gr_mem or (gid is not None and gid == entry.gr_gid)


def caller_of(uid: int, gid: int | None, operators_group: str | None,
              slurm_operator: Callable[[str], bool] | None = None) -> Caller:
    """The caller a proven uid/gid stands for: an operator when root (as in Slurm), a member of the operators
    group, or an Operator/Administrator in Slurm's accounting (`slurm_operator`, where sacctmgr answers)."""
    name = user_name(uid)
    operator = uid == 0 or in_group(name, gid, operators_group) or bool(slurm_operator and slurm_operator(name))
    return Caller(name, uid, operator=operator)
