"""Rich output from ranks, the kernel's side: which ranks draw in the notebook's form
(`notebook_env`), and showing their display frames in the cell's output (`RankDisplays`). The
rank's side, which sends them, is ddip.rank.displays."""

from __future__ import annotations

from ..rank.displays import NOTEBOOK_ENV


def notebook_env() -> dict:
    """The environment to give ranks started from here: DDIP_NOTEBOOK=1 when this process is a
    Jupyter kernel (whose display output a browser renders), else nothing."""
    try:
        from IPython import get_ipython
    except ImportError:
        return {}
    shell = get_ipython()
    if shell is None:
        return {}
    if type(shell).__name__ == "ZMQInteractiveShell" or "IPKernelApp" in getattr(shell, "config", {}):
        return {NOTEBOOK_ENV: "1"}
    return {}


class RankDisplays:
    """Shows ranks' display frames in the notebook as the same operations on the cell's output.
    A rank's display id becomes one of its own ("ID@rankN"), so ranks never update each
    other's displays; ids stay the same across cells, as in a plain notebook."""

    @staticmethod
    def display_id(rank: int, display_id: str) -> str:
        return f"{display_id}@rank{rank}"

    def show(self, rank: int, msg: dict) -> None:
        from IPython.display import clear_output, publish_display_data

        if msg.get("clear"):
            clear_output(wait=msg.get("wait", False))
            return
        transient = dict(msg.get("transient") or {})
        if "display_id" in transient:
            transient["display_id"] = self.display_id(rank, transient["display_id"])
        publish_display_data(msg["data"], msg.get("metadata") or {}, transient=transient,
                             update=bool(msg.get("update", False)))
