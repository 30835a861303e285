"""Exit codes and the error types every layer raises. One place, so --help, docs and code agree."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1  # the operation ran and failed (a check, a launch, the acceptance gate)
EXIT_USAGE = 2  # bad usage or invalid playbook/inventory: nothing was run
EXIT_UNREACHABLE = 3  # some hosts could not be reached
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT), the shell convention 128 + 2

EXIT_CODES_HELP = """\b
Exit codes:
  0  success
  1  the operation failed (a check, the launch, the acceptance gate)
  2  bad usage or invalid playbook/inventory (nothing was run)
  3  some hosts were unreachable
  130  interrupted (Ctrl-C); what was left is said"""


class DeployError(Exception):
    """An error with a what/where/fix shape; `exit_code` says how the CLI ends."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str, *, where: str = "", fix: str = "", details: dict | None = None):
        super().__init__(message)
        self.message = message
        self.where = where
        self.fix = fix
        self.details = details or {}

    def render(self) -> str:
        head = f"{self.where}: {self.message}" if self.where else self.message
        return head + (f"\n  fix: {self.fix}" if self.fix else "")

    def as_dict(self) -> dict:
        return {"error": type(self).__name__, "message": self.message, "where": self.where,
                "fix": self.fix, **({"details": self.details} if self.details else {})}


class SpecError(DeployError):
    """A playbook or inventory is invalid. Carries every problem found, each as FILE:LINE:COL: key: message."""

    exit_code = EXIT_USAGE

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(f"{len(problems)} problem(s) found; nothing was run", fix="correct the file(s) and run again")

    def render(self) -> str:
        return "\n".join(self.problems) + f"\n{len(self.problems)} problem(s) found; nothing was run."

    def as_dict(self) -> dict:
        return {"error": "SpecError", "problems": self.problems}


class UsageError(DeployError):
    exit_code = EXIT_USAGE


class Unreachable(DeployError):
    """The host could not be reached (connect, auth, host key). `timed_out`: it did not refuse, it was too slow."""

    exit_code = EXIT_UNREACHABLE
    timed_out = False


class HostKeyError(Unreachable):
    pass


class RemoteTimeout(DeployError):
    pass


class CheckFailed(DeployError):
    """A verification found a difference between expected and actual state."""


class StepFailed(DeployError):
    """A planned step failed: which step, what, where, what to do, and what the host holds now (`state left`)."""

    def __init__(self, step: str, message: str, *, where: str = "", fix: str = "", details: dict | None = None,
                 state_left: str = ""):
        super().__init__(message, where=where, fix=fix, details=details)
        self.step = step
        self.state_left = state_left

    def render(self) -> str:
        out = f"{self.where}: {self.step}: {self.message}"
        if self.fix:
            out += f"\n  fix: {self.fix}"
        if self.state_left:
            out += f"\n  state left: {self.state_left}"
        return out

    def as_dict(self) -> dict:
        return {**super().as_dict(), "step": self.step, "state_left": self.state_left}


class Interrupted(StepFailed):
    """Ctrl-C during an operation: exit 130, with what the host holds now (`state left`)."""

    exit_code = EXIT_INTERRUPTED


class LockHeld(DeployError):
    """Another deploy holds the container lock."""


class ContainerNotRunning(DeployError):
    """`pct exec` found the container stopped."""


class AgentError(DeployError):
    """The in-container agent failed or answered something that is not its protocol."""


class OutputTooLarge(DeployError):
    """A remote command wrote more than the cap (remote.MAX_OUTPUT) to one stream."""
