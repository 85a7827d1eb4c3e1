"""What the magics of one shell share: the group, the spec it was made from, %autodip, the
last %%dip cell's results and failure (for %dipdebug, %dippdb). One Session per shell; every
magics class holds it."""

from __future__ import annotations

from IPython.core.error import UsageError

from ..kernel.group import Group

NO_GROUP = "no group: run %makedip -n 2 (or -g all) first"


class Session:
    def __init__(self, shell):
        self.shell = shell
        self.group: Group | None = None
        self.spec = None  # the GroupSpec %makedip started the group from (-r reuses it)
        self.autodip_args: str | None = None  # the %%dip flags while %autodip is on, else None
        self.last_results = None  # RankResults of the last %%dip cell, for inspection
        self.running_local = False  # a %%dip local body must not be rewritten by %autodip
        self.last_error = None  # the RankFailedError of the last failed %%dip cell: %dipdebug's default
        self.new_error = None  # the same, until the end of the cell it failed (%dippdb's cue)
        self.auto_debug = False  # %dippdb on

    @property
    def running(self) -> bool:
        return self.group is not None and not self.group.closed

    def running_group(self) -> Group:
        """The group, or the UsageError that says how to make one."""
        if not self.running:
            raise UsageError(NO_GROUP)
        return self.group

    def note_failure(self, error):
        """A %%dip cell failed on its ranks with `error` (a RankFailedError)."""
        self.last_error = self.new_error = error

    def autodip_state(self) -> str:
        if self.autodip_args is None:
            return "autodip is off"
        return f"autodip is on (cells run as %%dip {self.autodip_args})".replace(" )", ")")

    def set_autodip(self, dip_args: str | None):
        """%%dip flags every following cell runs with; None: cells run as written."""
        transforms = self.shell.input_transformers_cleanup
        if self._autodip_transform in transforms:
            transforms.remove(self._autodip_transform)
        self.autodip_args = dip_args
        if dip_args is not None:
            # Cleanup transforms run before IPython turns %%magics into calls, so the rewritten
            # cell is an ordinary %%dip cell.
            transforms.append(self._autodip_transform)

    def _autodip_transform(self, lines: list[str]) -> list[str]:
        if self.autodip_args is None or self.running_local or not lines:
            return lines
        if lines[0].startswith("%") or not "".join(lines).strip():
            return lines
        return [f"%%dip {self.autodip_args}".rstrip() + "\n"] + lines

    def close(self):
        self.set_autodip(None)
        if self.group is not None:
            self.group.close()
            self.group = None
